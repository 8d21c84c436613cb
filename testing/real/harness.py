"""Engine-level differential harness: one real vllm-omni 0.30 stage, two runners, one trace each.

A side is one process (``run_side.py``) that runs every case it is given, one ``vllm.LLM`` at a
time, and writes a JSON trace. Both sides drive the same model class from the same tiny checkpoint
with the same re-drawn weights and the same requests; they differ only in the worker:

* ``omnigen``: omnigen's generated worker (``omnigen.api.worker_cls_name``), on vLLM's plain
  scheduler. vllm-omni is NOT imported as a package: a bare ``vllm_omni`` module with the right
  ``__path__`` stands in for it (``install_bare_vllm_omni``), so ``vllm_omni/__init__.py`` (and its
  ``patch.py``, which swaps vLLM classes in every loaded ``vllm`` module) never runs. A request's
  payload reaches omnigen as ``SamplingParams.extra_args["omnigen_payload"]``.
* ``oracle``: vllm-omni's own runner class (``RealStageCase.oracle_runner``) composed onto vLLM's
  ``CPUModelRunner`` exactly as omnigen's ``omnigen/runtime/worker.py`` composes its own
  (vllm-omni's ``GPUARWorker`` refuses CPU: gpu_ar_worker.py:112). vllm-omni IS imported here (its
  runner needs the patched classes). A request's payload reaches it as vllm-omni's serialized
  ``additional_information`` on the new request (``OracleScheduler``).

Both runners get ``RecordingRunnerMixin`` (by re-classing the runner right after the worker built
it), which snapshots every engine step that ran tokens: per request the sampled token ids, the
codes in its buffer (``model_intermediate_buffer[req][codes][audio]``) and the step's published
payload, normalized (nested dicts flattened to ``a.b`` keys, tensors to ``{dtype, shape, data}``).

The pytest process imports this module for the comparison helpers at its end (pure Python); every
function that touches vLLM or vllm-omni imports them inside a side process.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

REPO_ROOT = Path(__file__).resolve().parents[2]

SIDES = ("oracle", "omnigen")

# Engine shape shared by every case (a case's engine_kwargs override it).
ENGINE_DEFAULTS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "enforce_eager": True,
    "max_model_len": 128,
    "max_num_seqs": 4,
    "enable_chunked_prefill": True,
    # Small enough that the cases' prompts are chunked and decodes share steps with prefills.
    "max_num_batched_tokens": 8,
    "enable_prefix_caching": False,
    "seed": 0,
}
WEIGHT_SEED = 20261201
# The global torch RNG is reset to this right before a case's first request, on both sides: the
# code predictors of unseeded requests sample from it.
SAMPLING_SEED = 1234
MAX_STEPS = 200
REDRAW_LOAD_FORMAT = "omnigen_redraw"

# Key under which the oracle's payload travels in SamplingParams.extra_args until its scheduler
# moves it onto the request (and removes it again, so the runner sees omnigen's extra_args shape).
ORACLE_PAYLOAD_KEY = "_oracle_additional_information"

# vllm-omni's OmniModelConfig fields (vllm_omni/config/model.py:126-163) that its runners read from
# vLLM's plain ModelConfig; a case's omni_model_config overrides them.
OMNI_MODEL_CONFIG_DEFAULTS: dict[str, Any] = {
    "stage_id": 0,
    "async_chunk": False,
    "session_mode": "turn",
    "retains_state_across_chunks": False,
    "use_v2_model_runner": False,
    "supports_native_mrv2_data_plane": False,
    "active_stream_window": 0,
    "duplex_max_sessions": 1,
    "model_stage": "thinker",
    "model_arch": None,
    "worker_type": None,
    "engine_output_type": None,
    "pooling_output_decoder": None,
    "final_output": False,
    "hf_config_name": None,
    "custom_process_next_stage_input_func": None,
    # No connector: every payload of the step is read from the runner's output.
    "stage_connector_config": None,
    "subtalker_sampling_params": None,
    "silence_ban_frames": 0,
    "omni_kv_config": None,
    "codec_frame_rate_hz": None,
    "task_type": None,
    "enable_sleep_mode": False,
    "has_sampling_extra_args": False,
    "sampling_extra_args_keys": (),
    "requires_full_payload_input": False,
}


# --------------------------------------------------------------------------- environment


def side_environment(side: str) -> dict[str, str]:
    """Environment of a side process (set before vLLM is imported)."""
    if side not in SIDES:
        raise ValueError(f"unknown side {side!r}; expected one of {SIDES}")
    root = str(REPO_ROOT)
    return {
        # Engine core and worker in this process: the worker classes below live in this module,
        # and an in-memory omnigen variant module resolves as worker_cls.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
        "VLLM_USE_V2_MODEL_RUNNER": "0",  # both runners subclass the V1 runner
        # Only omnigen's plugin (tiny test archs); never vllm-omni's.
        "VLLM_PLUGINS": "omnigen",
        # Request ids as given (no random suffix), so both traces name requests alike.
        "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # Two sides share two cores.
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    }


def install_standins() -> list[str]:
    """``torchaudio`` and ``torchvision`` are not in omnigen's CPU lock (their index builds are
    CUDA builds); vllm-omni imports torchaudio at module level (vllm_omni/utils/audio.py:8, via
    Qwen3-TTS's prompt builder), and vLLM's qwen2_vl imports torchvision through transformers'
    image processor (via Qwen3-Omni). The product's guards stand in for the missing ones (import
    works, any use raises); returns their names."""
    from omnigen.providers import vllm_omni

    vllm_omni.install_optional_guards()
    return vllm_omni.guarded_modules()


def install_bare_vllm_omni() -> None:
    """Make ``vllm_omni.*`` submodules importable without running ``vllm_omni/__init__.py``,
    whose ``patch.py`` swaps vLLM's request classes in every loaded ``vllm*`` module: the omnigen
    side runs on unpatched vLLM, as omnigen's own processes do (the product's provider)."""
    from omnigen.providers import vllm_omni

    vllm_omni.install_bare_package()


def vllm_patched() -> bool:
    """True when vllm-omni's patch.py has swapped vLLM's request class."""
    from vllm.v1.request import Request

    return Request.__module__.startswith("vllm_omni")


def prepare_side(side: str) -> None:
    """Process-wide set-up of a side, before any case (env already applied)."""
    import torch

    torch.set_num_threads(1)
    install_standins()
    if side == "omnigen":
        install_bare_vllm_omni()
    else:
        import vllm_omni  # noqa: F401  (runs patch.py: vllm-omni's runner needs it)
    _answer_torch_inductor()
    register_redraw_loader()


def _answer_torch_inductor() -> None:
    """vllm-omni has no CPU OmniPlatform: ``UnspecifiedOmniPlatform.supports_torch_inductor()``
    raises ``NotImplementedError`` (platforms/interface.py:160), and the shared Qwen3 code
    predictor asks it on its first call (common/qwen3_code_predictor.py:749). Answer False (eager)."""
    from vllm_omni.platforms.interface import UnspecifiedOmniPlatform

    UnspecifiedOmniPlatform.supports_torch_inductor = classmethod(lambda cls: False)  # type: ignore[method-assign]


# --------------------------------------------------------------------------- registration


def resolve(qualname: str) -> Any:
    module_name, _, attr = qualname.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


def _config_class(model_class: type, model_type: str) -> type | None:
    """The ``PretrainedConfig`` subclass for ``model_type`` among the modules the model class
    brought in (its own package first), or None."""
    from transformers import PretrainedConfig

    package = model_class.__module__.rpartition(".")[0]
    modules = sorted(
        (name for name in list(sys.modules) if name.startswith("vllm_omni")),
        key=lambda name: (not name.startswith(package), name),
    )
    for name in modules:
        module = sys.modules.get(name)
        for value in list(vars(module).values()) if module is not None else ():
            if (
                isinstance(value, type)
                and issubclass(value, PretrainedConfig)
                and value.__dict__.get("model_type") == model_type
            ):
                return value
    return None


def _register_sibling_archs(model_class: type) -> dict[str, str]:
    """A composite class builds its parts through vLLM's registry (Qwen3-Omni's wrapper calls
    ``init_vllm_registered_model`` with ``Qwen3OmniMoeTalkerForConditionalGeneration``, ...;
    qwen3_omni.py:191-264), so the architectures vllm-omni's registry lists in the same model
    folder (``_OMNI_MODELS``, model_executor/models/registry.py:11) are registered too, as
    classes. Unknown to vLLM they would fall back to its Transformers backend."""
    from vllm import ModelRegistry
    from vllm_omni.model_executor.models.registry import _OMNI_MODELS

    prefix = "vllm_omni.model_executor.models."
    folder = model_class.__module__.removeprefix(prefix).split(".")[0]
    supported = set(ModelRegistry.get_supported_archs())
    done: dict[str, str] = {}
    for arch, (mod_folder, mod_name, cls_name) in sorted(_OMNI_MODELS.items()):
        if mod_folder != folder or arch in supported:
            continue
        try:
            cls = getattr(importlib.import_module(f"{prefix}{mod_folder}.{mod_name}"), cls_name)
        except Exception as exc:  # a part this case does not build may need what is missing here
            done[arch] = f"not registered: {type(exc).__name__}: {str(exc)[:200]}"
            continue
        ModelRegistry.register_model(arch, cls)
        done[arch] = f"{cls.__module__}.{cls.__qualname__}"
    return done


def register_case(case: Any, model_dir: Path) -> dict[str, Any]:
    """Register the case's model class with vLLM and its config class with transformers/vLLM.

    Only the classes: never vllm-omni's plugin (``vllm_omni.plugins``), which registers every
    vllm-omni model and patches vLLM."""
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.transformers_utils import config as vllm_config_utils

    model_class = resolve(case.model_class)
    ModelRegistry.register_model(case.arch, model_class)
    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    registered: dict[str, Any] = {
        "arch": case.arch,
        "model_class": case.model_class,
        "model_type": model_type,
        "sub_archs": _register_sibling_archs(model_class),
    }
    try:
        AutoConfig.for_model(model_type)
        registered["config_class"] = "known to transformers"
        return registered
    except ValueError:
        pass
    config_class = _config_class(model_class, model_type)
    if config_class is None:
        # The class's package keeps its configs in configuration_*.py (vllm-omni's layout); a
        # class such as Qwen3TTSCode2Wav does not import its own.
        import pkgutil

        package = importlib.import_module(model_class.__module__.rpartition(".")[0])
        for info in pkgutil.iter_modules(package.__path__):
            if info.name.startswith("configuration"):
                importlib.import_module(f"{package.__name__}.{info.name}")
        config_class = _config_class(model_class, model_type)
    if config_class is None:
        raise RuntimeError(f"no config class with model_type {model_type!r} near {case.model_class}")
    AutoConfig.register(model_type, config_class, exist_ok=True)
    vllm_config_utils._CONFIG_REGISTRY[model_type] = config_class
    registered["config_class"] = f"{config_class.__module__}.{config_class.__qualname__}"
    return registered


_redraw_registered = False


def register_redraw_loader() -> None:
    """``load_format="omnigen_redraw"``: vLLM's dummy loader, then every parameter (sorted by name)
    re-drawn from N(0, std) with a fixed generator, so outputs depend on the runner's inputs.
    Afterwards the model's own weight-derived runtime buffers are recomputed where the real
    ``load_weights`` would (dummy loading bypasses it; Qwen3-TTS's ``_tts_pad_embed``)."""
    global _redraw_registered
    if _redraw_registered:
        return
    import torch
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    @register_model_loader(REDRAW_LOAD_FORMAT)
    class RedrawModelLoader(DummyModelLoader):
        def __init__(self, load_config: Any) -> None:
            extra = dict(load_config.model_loader_extra_config or {})
            BaseModelLoader.__init__(self, load_config)
            self.std = float(extra.get("std", 0.5))
            self.weight_seed = int(extra.get("seed", WEIGHT_SEED))

        def load_weights(self, model: Any, model_config: Any) -> None:
            super().load_weights(model, model_config)
            generator = torch.Generator(device="cpu").manual_seed(self.weight_seed)
            with torch.no_grad():
                for _name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
                    drawn = torch.empty(param.shape, dtype=torch.float32).normal_(
                        0.0, self.std, generator=generator
                    )
                    param.data.copy_(drawn.to(device=param.device, dtype=param.dtype))
                for hook in ("_init_runtime_buffers",):
                    if callable(getattr(model, hook, None)):
                        getattr(model, hook)()

    _redraw_registered = True


# --------------------------------------------------------------------------- normalization


def normalize(value: Any) -> Any:
    """JSON form of a payload value: tensors as ``{dtype, shape, data}``, nested dicts flattened
    to ``a.b`` keys (vllm-omni's ``flatten_payload`` convention), an empty payload as None."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu")
        return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": t.tolist()}
    if isinstance(value, np.ndarray):
        return {"dtype": str(value.dtype), "shape": list(value.shape), "data": value.tolist()}
    if isinstance(value, Mapping):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            if isinstance(item, Mapping) and not _is_leaf_dict(item):
                for sub, sub_item in (normalize(item) or {}).items():
                    flat[f"{key}.{sub}"] = sub_item
            else:
                flat[str(key)] = normalize(item)
        return dict(sorted(flat.items())) or None
    if isinstance(value, (list, tuple)):
        return [normalize(item) for item in value]
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"repr": repr(value)[:200], "type": type(value).__name__}


def _is_leaf_dict(value: Mapping) -> bool:
    return set(value) == {"dtype", "shape", "data"}


def codes_of(buffer: Any) -> Any:
    """``buffer[codes][audio]`` of one request as lists, or None."""
    if not isinstance(buffer, Mapping):
        return None
    codes = buffer.get("codes")
    audio = codes.get("audio") if isinstance(codes, Mapping) else buffer.get("codes.audio")
    if audio is None:
        return None
    try:
        return audio.detach().to("cpu").tolist()
    except AttributeError:
        return normalize(audio)


# --------------------------------------------------------------------------- recording


class Recorder:
    """What the runner of the current case did, step by step (one per process, reset per case)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self, side: str | None = None, perturb: str | None = None) -> None:
        self.side = side
        self.steps: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []
        self.runner: dict[str, Any] = {}
        self.perturb = perturb

    def error(self, where: str, exc: BaseException) -> None:
        tb = traceback.extract_tb(exc.__traceback__)
        self.errors.append(
            {
                "step": len(self.steps),
                "where": where,
                "type": type(exc).__name__,
                "message": str(exc)[:2000],
                "at": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in tb[-6:]],
            }
        )


RECORDER = Recorder()

# Deliberate damage for the negative control: the comparison must catch it.
PERTURBATIONS = {
    # What omnigen's runner did before CONTRACT 7.1: the model's post-forward hook never runs,
    # so the next decode step's code predictor gets no ``hidden_states.last``.
    "no_postprocess": lambda model: setattr(model, "postprocess", lambda hidden_states, **_: {}),
}


class RecordingRunnerMixin:
    """Snapshots the runner after every engine step that scheduled tokens (both sides)."""

    _rec_scheduler_output: Any = None
    _rec_perturbed = False

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self._rec_scheduler_output = scheduler_output
        if RECORDER.perturb and not self._rec_perturbed:
            PERTURBATIONS[RECORDER.perturb](self.model)  # type: ignore[attr-defined]
            self._rec_perturbed = True
        try:
            out = super().execute_model(scheduler_output, *args, **kwargs)  # type: ignore[misc]
        except BaseException as exc:
            RECORDER.error("execute_model", exc)
            raise
        if out is not None and hasattr(out, "req_ids"):
            self._rec_step(scheduler_output, out)
        return out

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        try:
            out = super().sample_tokens(*args, **kwargs)  # type: ignore[misc]
        except BaseException as exc:
            RECORDER.error("sample_tokens", exc)
            raise
        if out is not None:
            if not hasattr(out, "req_ids") and hasattr(out, "get_output"):
                out = out.get_output()
            if hasattr(out, "req_ids"):
                self._rec_step(self._rec_scheduler_output, out)
        return out

    def _rec_step(self, scheduler_output: Any, out: Any) -> None:
        if scheduler_output is None or int(scheduler_output.total_num_scheduled_tokens) <= 0:
            return
        try:
            RECORDER.steps.append(self._rec_snapshot(scheduler_output, out))
        except Exception as exc:  # a recording failure is the harness's, reported as such
            RECORDER.error("recorder", exc)

    def _rec_payloads(self, out: Any) -> tuple[str | None, dict[str, Any]]:
        """The step's published payload per request: omnigen's runner keeps them in
        ``omni_step_payloads`` (flat keys, reset each step); vllm-omni's runner returns them in
        its ``OmniModelRunnerOutput``, one per request in ``req_ids`` order, split into
        ``inter_stage_outputs`` (to the next stage) and ``multimodal_outputs`` (to the client):
        gpu_ar_model_runner.py:1888-1906, gpu_generation_model_runner.py:470-497 (an async-chunk
        stage partitions the keys between the two; otherwise both are the same list). Recorded:
        the union, per request."""
        if RECORDER.side == "omnigen":
            own = getattr(self, "omni_step_payloads", None)
            return ("omni_step_payloads", dict(own)) if isinstance(own, Mapping) else (None, {})
        if not hasattr(out, "multimodal_outputs"):
            return None, {}
        inter = getattr(out, "inter_stage_outputs", None) or []
        client = getattr(out, "multimodal_outputs", None) or []
        payloads: dict[str, Any] = {}
        for i, rid in enumerate(out.req_ids):
            merged: dict[str, Any] = {}
            for part in (client[i] if i < len(client) else None, inter[i] if i < len(inter) else None):
                if isinstance(part, Mapping):
                    merged.update(part)
            payloads[rid] = merged or None
        return "runner_output", payloads

    def _rec_snapshot(self, scheduler_output: Any, out: Any) -> dict[str, Any]:
        index = {rid: i for i, rid in enumerate(out.req_ids)}
        sampled = out.sampled_token_ids or []
        source, payloads = self._rec_payloads(out)
        buffers = getattr(self, "model_intermediate_buffer", {}) or {}
        requests: dict[str, Any] = {}
        for rid in sorted(scheduler_output.num_scheduled_tokens):
            i = index.get(rid)
            tokens = sampled[i] if i is not None and i < len(sampled) else []
            requests[rid] = {
                "scheduled": int(scheduler_output.num_scheduled_tokens[rid]),
                "tokens": [int(t) for t in (tokens.tolist() if hasattr(tokens, "tolist") else tokens)],
                "codes": codes_of(buffers.get(rid)),
                "payload": normalize(payloads.get(rid)) if source is not None else None,
            }
        return {
            "step": len(RECORDER.steps),
            "payload_source": source,
            "finished_req_ids": sorted(scheduler_output.finished_req_ids),
            "requests": requests,
        }


def attach_recorder(runner: Any) -> None:
    """Re-class a built runner so ``RecordingRunnerMixin`` comes first in its MRO."""
    cls = type(runner)
    if not issubclass(cls, RecordingRunnerMixin):
        runner.__class__ = type(
            f"Recording{cls.__name__}", (RecordingRunnerMixin, cls), {"__module__": __name__}
        )
    RECORDER.runner = {
        "class": cls.__name__,
        "mro": [c.__name__ for c in cls.__mro__],
        "vllm_patched": vllm_patched(),
    }


# --------------------------------------------------------------------------- workers


def _publish(cls: type) -> str:
    """Make a dynamically built class resolvable by qualified name (vLLM's worker_cls is a str)."""
    module = sys.modules[__name__]
    setattr(module, cls.__name__, cls)
    cls.__module__ = __name__
    cls.__qualname__ = cls.__name__
    return f"{__name__}.{cls.__name__}"


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def omnigen_worker_cls(case: Any) -> str:
    """omnigen's generated worker for the case's stage, plus the recorder on its runner."""
    from omnigen import api

    generated = resolve(api.worker_cls_name(case.omnigen_model, case.omnigen_stage))

    def init_device(self: Any) -> None:
        generated.init_device(self)
        attach_recorder(self.model_runner)

    cls = type(
        f"Recording_{_safe(case.name)}_{generated.__name__}", (generated,), {"init_device": init_device}
    )
    return _publish(cls)


def deployed_async_chunk(case: Any) -> bool:
    """The async-chunk mode both sides run: the one omnigen's config fixes when generating (its
    worker sets ``model_config.async_chunk``). A case stating another would compare two
    deployments, so that is refused."""
    from omnigen import api

    generated = api.stage_plan(case.omnigen_model, case.omnigen_stage).async_chunk
    stated = case.omni_model_config.get("async_chunk", generated)
    if stated != generated:
        raise ValueError(
            f"case {case.name}: omni_model_config async_chunk={stated}, but conf/model/"
            f"{case.omnigen_model}.yaml generates async_chunk={generated}; state the same deployment"
        )
    return generated


def set_omni_model_config(model_config: Any, fields: Mapping[str, Any]) -> None:
    """vLLM's ``model_config`` as vllm-omni's ``OmniModelConfig`` would be: its fields set on it
    (vllm-omni's runner reads them there: gpu_ar_model_runner.py:383 async_chunk, :506
    engine_output_type, ...), and, for a stage naming ``hf_config_name``, that sub-config's text
    config (``OmniModelConfig.draw_hf_text_config``, vllm_omni/config/model.py:221), so the runner's
    persistent inputs and MTP buffers get the stage's width."""
    for key, value in fields.items():
        setattr(model_config, key, value)
    if fields.get("hf_config_name"):
        stage_config = getattr(model_config.hf_config, fields["hf_config_name"])
        model_config.hf_text_config = stage_config.get_text_config()
        model_config.model_arch_config = model_config.get_model_arch_config()


@contextlib.contextmanager
def cpu_worker_builds(runner: type) -> Any:
    """Within it, vLLM's ``CPUWorker.init_device`` builds ``runner``: it builds the runner class
    its module names (``vllm.v1.worker.cpu_worker.CPUModelRunner``), swapped for this call only."""
    import vllm.v1.worker.cpu_worker as cpu_worker

    original = cpu_worker.CPUModelRunner
    cpu_worker.CPUModelRunner = runner
    try:
        yield
    finally:
        cpu_worker.CPUModelRunner = original


def oracle_worker_cls(case: Any) -> str:
    """vLLM's CPU worker building vllm-omni's runner composed onto ``CPUModelRunner``."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    oracle_runner = resolve(case.oracle_runner)
    composed = type(
        f"{oracle_runner.__name__}OnCPU",
        (oracle_runner, CPUModelRunner),
        {"__module__": __name__, "__qualname__": f"{oracle_runner.__name__}OnCPU"},
    )
    omni_fields = {
        **OMNI_MODEL_CONFIG_DEFAULTS,
        **case.omni_model_config,
        "async_chunk": deployed_async_chunk(case),
    }

    class OracleWorker(CPUWorker):
        runner_class: ClassVar[type] = composed

        def init_device(self) -> None:
            set_omni_model_config(self.vllm_config.model_config, omni_fields)
            # _init_talker_mtp does max(max_num_reqs, max_cudagraph_capture_size), which is None
            # under enforce_eager (vllm_omni/worker/gpu_model_runner.py:287).
            compilation = self.vllm_config.compilation_config
            if compilation.max_cudagraph_capture_size is None:
                compilation.max_cudagraph_capture_size = self.vllm_config.scheduler_config.max_num_seqs
            with cpu_worker_builds(composed):
                super().init_device()
            attach_recorder(self.model_runner)

    OracleWorker.__name__ = f"Oracle_{_safe(case.name)}_Worker"
    return _publish(OracleWorker)


def is_generation(case: Any) -> bool:
    return case.oracle_runner.rpartition(".")[2] == "GPUGenerationModelRunner"


def oracle_scheduler_cls(case: Any) -> type:
    """vLLM's scheduler plus what vllm-omni's schedulers do that the oracle runner relies on:

    * a new request's payload (``extra_args[ORACLE_PAYLOAD_KEY]``) becomes its
      ``additional_information`` in vllm-omni's serialized form, and the scheduled new request
      is handed to the runner as vllm-omni's ``OmniNewRequestData`` carrying it
      (core/sched/output.py:36, read at vllm_omni/worker/gpu_model_runner.py:670);
    * for a generation stage, a request finishes once its prompt has run, with no token
      (``OmniGenerationScheduler.update_from_output``'s one-shot rule,
      core/sched/omni_generation_scheduler.py:657-672): vllm-omni's generation runner returns
      no sampled tokens, so under vLLM's rules such a request would never finish.
    """
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import RequestStatus
    from vllm_omni.core.sched.output import OmniNewRequestData
    from vllm_omni.engine.serialization import serialize_additional_information

    one_shot = is_generation(case)

    class OracleScheduler(Scheduler):
        def add_request(self, request: Any) -> None:
            extra = getattr(request.sampling_params, "extra_args", None)
            if isinstance(extra, dict) and ORACLE_PAYLOAD_KEY in extra:
                payload = extra.pop(ORACLE_PAYLOAD_KEY)
                request.additional_information = serialize_additional_information(payload)
            super().add_request(request)

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            output = super().schedule(*args, **kwargs)
            output.scheduled_new_reqs[:] = [
                OmniNewRequestData.from_base(data, self.requests.get(data.req_id))
                for data in output.scheduled_new_reqs
            ]
            return output

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
            if not one_shot:
                return outputs
            done = [
                request
                for rid in scheduler_output.num_scheduled_tokens
                if (request := self.requests.get(rid)) is not None
                and not request.is_finished()
                and request.num_computed_tokens >= request.num_prompt_tokens
            ]
            if not done:
                return outputs
            self.finish_requests([r.request_id for r in done], RequestStatus.FINISHED_STOPPED)
            for request in done:
                engine_output = EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                )
                if request.client_index in outputs:
                    outputs[request.client_index].outputs.append(engine_output)
                else:
                    outputs[request.client_index] = EngineCoreOutputs(outputs=[engine_output])
            return outputs

    OracleScheduler.__name__ = f"OracleScheduler_{_safe(case.name)}"
    return OracleScheduler


# --------------------------------------------------------------------------- one case


def sampling_params(side: str, request: Any) -> Any:
    from vllm import SamplingParams

    extra: dict[str, Any] = {}
    if request.seed is not None:
        extra["tts_local_seed"] = int(request.seed)
    if request.payload is not None:
        if side == "omnigen":
            from omnigen.runtime.serialization import INLINE_PAYLOAD_KEY, serialize_additional_information

            extra[INLINE_PAYLOAD_KEY] = serialize_additional_information(request.payload)
        else:
            extra[ORACLE_PAYLOAD_KEY] = request.payload
    return SamplingParams(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        seed=request.sampling_seed,
        ignore_eos=True,
        detokenize=False,
        extra_args=extra or None,
    )


def engine_kwargs(side: str, case: Any, model_dir: Path) -> dict[str, Any]:
    kwargs = dict(ENGINE_DEFAULTS)
    kwargs.update(case.engine_kwargs)
    kwargs["model"] = str(model_dir)
    if case.redraw_weights_std is None:
        kwargs["load_format"] = "dummy"
    else:
        kwargs["load_format"] = REDRAW_LOAD_FORMAT
        kwargs["model_loader_extra_config"] = {"std": case.redraw_weights_std, "seed": WEIGHT_SEED}
    if side == "omnigen":
        kwargs["worker_cls"] = omnigen_worker_cls(case)
    else:
        kwargs["worker_cls"] = oracle_worker_cls(case)
        kwargs["scheduler_cls"] = oracle_scheduler_cls(case)
    return kwargs


def _summarize_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (v if isinstance(v, (bool, int, float, str, type(None))) else repr(v)) for k, v in kwargs.items()
    }


def run_case(side: str, case: Any, work_dir: Path, perturb: str | None = None) -> dict[str, Any]:
    """Run one case on this side; never raises (a failure is part of the trace)."""
    import time

    result: dict[str, Any] = {
        "side": side,
        "case": case.name,
        "not_on_cpu": case.not_on_cpu,
        "perturb": perturb,
        "generation": is_generation(case),
    }
    if case.not_on_cpu:
        return result
    if perturb is not None and perturb not in PERTURBATIONS:
        raise ValueError(f"unknown perturbation {perturb!r}; expected one of {sorted(PERTURBATIONS)}")
    RECORDER.reset(side, perturb)
    llm = None
    t0 = time.perf_counter()
    stage = "setup"
    try:
        model_dir = Path(case.write_checkpoint(work_dir / (case.name + (f"~{perturb}" if perturb else ""))))
        result["registered"] = register_case(case, model_dir)
        requests = list(case.requests())
        kwargs = engine_kwargs(side, case, model_dir)
        result["engine_kwargs"] = _summarize_kwargs(kwargs)
        stage = "engine init"
        from vllm import LLM

        llm = LLM(**kwargs)
        result["init_s"] = round(time.perf_counter() - t0, 2)
        stage = "generate"
        result.update(_drive(llm, side, requests))
    except BaseException as exc:  # recorded: the comparison reports it
        if isinstance(exc, KeyboardInterrupt):
            raise
        result["error"] = {
            "stage": stage,
            "step": len(RECORDER.steps),
            "type": type(exc).__name__,
            "message": str(exc)[:2000],
            "traceback": "".join(traceback.format_tb(exc.__traceback__)[-25:])
            + f"{type(exc).__name__}: {str(exc)[:1000]}",
        }
    finally:
        result["steps"] = RECORDER.steps
        result["runner_errors"] = RECORDER.errors
        result["runner"] = RECORDER.runner
        result["wall_s"] = round(time.perf_counter() - t0, 2)
        if llm is not None:
            _shutdown(llm)
    return result


def _drive(llm: Any, side: str, requests: list[Any]) -> dict[str, Any]:
    import torch

    engine = llm.llm_engine
    torch.manual_seed(SAMPLING_SEED)
    for request in requests:
        engine.add_request(
            request.request_id,
            {"prompt_token_ids": list(request.prompt_token_ids)},
            sampling_params(side, request),
        )
    finished: dict[str, Any] = {}
    engine_steps = 0
    while engine.has_unfinished_requests() and engine_steps < MAX_STEPS:
        engine_steps += 1
        for out in engine.step():
            if out.finished:
                completion = out.outputs[0] if out.outputs else None
                finished[out.request_id] = {
                    "recorded_step": len(RECORDER.steps) - 1,
                    "finish_reason": getattr(completion, "finish_reason", None),
                    "token_ids": list(getattr(completion, "token_ids", []) or []),
                }
    unfinished = sorted({r.request_id for r in requests} - set(finished))
    if unfinished:
        engine.abort_request(unfinished)
    return {"engine_steps": engine_steps, "finished": finished, "unfinished": unfinished}


def _shutdown(llm: Any) -> None:
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()
    except Exception:  # the next case starts its own engine either way
        traceback.print_exc()


# --------------------------------------------------------------------------- comparison
# Pure Python: the pytest process compares the two JSON traces with these (it never imports vLLM).

STEP_FIELDS = ("tokens", "codes", "payload")


def same(a: Any, b: Any) -> bool:
    """Equality of trace values, NaN equal to NaN."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _short(value: Any, limit: int = 400) -> str:
    text = json.dumps(value, allow_nan=True) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 20] + f"... ({len(text)} chars)"


def where_differ(a: Any, b: Any, path: str = "") -> str:
    """The first place two unequal trace values differ, e.g. ``['codes.audio'].data[0][2]: 10 vs 31``."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
            return f"{path or 'keys'}: only in oracle {only_a}, only in omnigen {only_b}"
        for key in a:
            if not same(a[key], b[key]):
                return where_differ(a[key], b[key], f"{path}[{key!r}]")
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path or 'value'}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if not same(x, y):
                return where_differ(x, y, f"{path}[{i}]")
    return f"{path or 'value'}: {_short(a, 120)} vs {_short(b, 120)}"


def first_mismatch(oracle: dict[str, Any], other: dict[str, Any]) -> dict[str, Any] | None:
    """The first difference between two traces of one case, step by step, or None.

    Per step: which requests ran how many tokens, then per request (sorted by id) the sampled
    tokens (not for a generation stage, whose sampler output is not its output), the codes in
    its buffer and the published payload; then the number of steps; then when each request
    finished."""
    fields = STEP_FIELDS[1:] if oracle.get("generation") else STEP_FIELDS
    a_steps, b_steps = oracle.get("steps") or [], other.get("steps") or []
    for i, (sa, sb) in enumerate(zip(a_steps, b_steps, strict=False)):
        ra, rb = sa["requests"], sb["requests"]
        sched_a = {r: v["scheduled"] for r, v in ra.items()}
        sched_b = {r: v["scheduled"] for r, v in rb.items()}
        if sched_a != sched_b:
            return {
                "step": i,
                "request": None,
                "field": "scheduled",
                "where": where_differ(sched_a, sched_b),
                "oracle": sched_a,
                "omnigen": sched_b,
            }
        for rid in sorted(ra):
            for field in fields:
                va, vb = ra[rid][field], rb[rid][field]
                if not same(va, vb):
                    note = ""
                    if field == "payload" and sb.get("payload_source") is None:
                        note = " (the omnigen runner exposes no omni_step_payloads)"
                    return {
                        "step": i,
                        "request": rid,
                        "field": field,
                        "where": where_differ(va, vb) + note,
                        "oracle": va,
                        "omnigen": vb,
                    }
    if len(a_steps) != len(b_steps):
        return {
            "step": min(len(a_steps), len(b_steps)),
            "request": None,
            "field": "steps",
            "where": f"oracle recorded {len(a_steps)} steps, omnigen {len(b_steps)}",
            "oracle": len(a_steps),
            "omnigen": len(b_steps),
        }
    done_a = {r: f.get("recorded_step") for r, f in (oracle.get("finished") or {}).items()}
    done_b = {r: f.get("recorded_step") for r, f in (other.get("finished") or {}).items()}
    if done_a != done_b or (oracle.get("unfinished") or []) != (other.get("unfinished") or []):
        return {
            "step": None,
            "request": None,
            "field": "finished",
            "where": where_differ(done_a, done_b),
            "oracle": {"finished_at_step": done_a, "unfinished": oracle.get("unfinished")},
            "omnigen": {"finished_at_step": done_b, "unfinished": other.get("unfinished")},
        }
    return None


def describe_error(trace: dict[str, Any]) -> str | None:
    """One paragraph on how a side's run of a case failed, or None."""
    lines = []
    for err in trace.get("runner_errors") or []:
        lines.append(
            f"runner raised {err['type']}: {err['message'][:600]} at step {err['step']} ({err['where']}: {' <- '.join(reversed(err['at']))})"
        )
    error = trace.get("error")
    if error and not lines:
        lines.append(f"{error.get('stage')} failed: {error.get('type')}: {error.get('message', '')[:600]}")
        if error.get("traceback"):
            lines.append("\n".join(error["traceback"].rstrip().splitlines()[-14:]))
    elif error:
        lines.append(f"(the engine stopped at step {error.get('step')}: {error.get('type')})")
    if trace.get("unfinished"):
        lines.append(f"unfinished after {trace.get('engine_steps')} engine steps: {trace['unfinished']}")
    return "\n".join(lines) or None


def format_mismatch(case: str, mismatch: dict[str, Any]) -> str:
    at = "at the end" if mismatch["step"] is None else f"at step {mismatch['step']}"
    who = f", request {mismatch['request']}" if mismatch["request"] else ""
    return (
        f"{case}: first mismatch {at}{who}, field {mismatch['field']}: {mismatch['where']}\n"
        f"  oracle:  {_short(mismatch['oracle'])}\n"
        f"  omnigen: {_short(mismatch['omnigen'])}"
    )
