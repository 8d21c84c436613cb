"""vllm-omni 0.30's stage runners on vLLM's CPU engine: the pieces every real-model pipeline
oracle (``omnigen_testing.qwen3_tts_chain``, ``tests/e2e/test_real_qwen3_omni.py``,
``tests/e2e/test_real_higgs_audio_v3.py``) builds its ``vllm.LLM`` engines from.

* the runners, vllm-omni's own composed onto vLLM's ``CPUModelRunner`` (as
  ``omnigen_testing/real/harness.py`` composes them), each keeping what it produced in a dict the
  caller owns (keyed by request id):

  - ``full_payload_ar_runner``: ``GPUARModelRunner`` whose full-payload producer runs as deployed
    (it accumulates each step's payload and, once a request finished, builds the next stage's
    payload with the stage's ``custom_process_next_stage_input_func``); only the hand-over to a
    connector is replaced by keeping the payload;
  - ``step_outputs_ar_runner``: ``GPUARModelRunner`` keeping each step's multimodal output (what
    the runner puts on the wire for the engine core; a stage without a full-payload producer);
  - ``generation_runner``: ``GPUGenerationModelRunner`` keeping each request's output (code2wav:
    ``model_outputs`` is the audio);

* ``engine_classes``: the ``worker_cls`` (vLLM's ``CPUWorker`` building the runner, with the
  stage's ``OmniModelConfig`` fields on vLLM's model config) and the ``scheduler_cls``
  (``harness.oracle_scheduler_cls``) of one stage's ``vllm.LLM``;
* ``generate`` (``LLM.generate`` with the request ids given: the runners key by them) and
  ``shutdown``;
* ``load_vllm_omni`` (vllm-omni imported, its model classes registered), ``flushed_payloads``
  (a full-payload runner's payloads, flushed), ``code2wav_audio`` (a generation runner's audio)
  and ``vllm_omni_wav`` (the WAV vllm-omni's serving layer writes of it);
* the oracle process: ``ORACLE_ENV``, ``oracle_answers`` and ``error_reply`` (its side),
  ``start_oracle_process`` (its parent's).

vLLM and vllm-omni are imported inside the functions only: importing vllm-omni patches vLLM
process-wide, which only the oracle processes may do (this module itself is import-light).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any, ClassVar

AR_RUNNER = "vllm_omni.worker.gpu_ar_model_runner.GPUARModelRunner"
GENERATION_RUNNER = "vllm_omni.worker.gpu_generation_model_runner.GPUGenerationModelRunner"

ORACLE_ENV = {
    # Engine cores in this process: the worker classes are built (and published) in it.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "0",  # vllm-omni's runners subclass the V1 runner
    # No plugin at all (neither vllm-omni's nor omnigen's): the classes are registered by hand.
    "VLLM_PLUGINS": "",
    # Request ids as given, so the runner's ids are the outputs' ids.
    "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


# --------------------------------------------------------------------------- the oracle process


def start_oracle_process(
    module: str, args: list[str], log: Path, repo_root: Path, *, stdin: bool = False
) -> subprocess.Popen:
    """``python -m MODULE oracle ARGS`` from the repository root: its answers on its stdout (a
    pipe), everything else in ``log``; ``stdin``: a pipe to send it commands."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root), env.get("PYTHONPATH")) if p)
    # One OpenMP thread, as vLLM's CPU worker binds each engine of ``omnigen serve`` (mp: "core
    # ids=[0]"); in-process engines are not bound. Two threads on a loaded two-core machine stall
    # at every barrier (seen: 50 times slower); the audio is the same with one or two.
    env["OMP_NUM_THREADS"] = "1"
    with log.open("w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", module, "oracle", *args],
            cwd=repo_root,
            env=env,
            stdin=subprocess.PIPE if stdin else None,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )


def oracle_answers(repo_root: Path) -> IO[str]:
    """In the oracle process, before vLLM is imported: ``ORACLE_ENV`` set, the repository
    importable, and the stream its JSON answers go to (the process's stdout); everything else
    printed from then on (vLLM's own output) goes to stderr."""
    os.environ.update(ORACLE_ENV)
    if str(repo_root) not in sys.path:
        sys.path.insert(0, str(repo_root))
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return answers


def error_reply(exc: BaseException) -> dict[str, str]:
    """An oracle's answer for a command that raised: the caller reports it (with the log)."""
    import traceback

    return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-6000:]}


def load_vllm_omni(checkpoint: Path, model_classes: dict[str, str]) -> None:
    """Import vllm-omni as its runners need it and register its model classes (architecture ->
    qualified name) for the checkpoint, by hand: never its plugin."""
    from omnigen_testing.real import harness

    harness.install_standins()  # vllm-omni imports torchaudio (and torchvision) at module level
    import vllm_omni  # noqa: F401  (its patch.py: vllm-omni's runners need the patched classes)

    harness._answer_torch_inductor()  # no CPU OmniPlatform: the code predictor runs eager
    for arch, model_class in model_classes.items():
        harness.register_case(SimpleNamespace(arch=arch, model_class=model_class), checkpoint)


# --------------------------------------------------------------------------- runners


def publish(cls: type) -> str:
    """Make a class built at run time resolvable by qualified name (vLLM's ``worker_cls`` is a
    str): it becomes an attribute of this module. Names are unique per process."""
    module = sys.modules[__name__]
    found = getattr(module, cls.__name__, None)
    if found is not None and found is not cls:
        raise ValueError(f"{__name__}.{cls.__name__} is published already: give each class its own name")
    setattr(module, cls.__name__, cls)
    cls.__module__ = __name__
    cls.__qualname__ = cls.__name__
    return f"{__name__}.{cls.__name__}"


def keep_outputs(out: Any, keep: Callable[[str, Any], None]) -> Any:
    """Hand each request's multimodal output of a runner's step (``execute_model`` or
    ``sample_tokens``, either may carry it) to ``keep(request_id, payload)``; ``out`` unchanged."""
    found = out.get_output() if out is not None and hasattr(out, "get_output") else out
    outputs = getattr(found, "multimodal_outputs", None)
    if outputs:
        for rid, payload in zip(found.req_ids, outputs, strict=False):
            if payload:
                keep(rid, payload)
    return out


def full_payload_ar_runner(name: str, flushed: dict[str, dict[str, Any]]) -> type:
    """vllm-omni's AR runner on vLLM's CPU runner. Its full-payload producer runs as in a
    deployment; only the hand-over to a connector is replaced: per finished request ``flushed``
    gets ``accumulated`` (the runner's accumulated output), ``payload`` (what the stage's
    ``custom_process_next_stage_input_func`` built from it, called the way the runner calls its
    hook) and ``output_token_ids`` (the runner's request state)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm_omni.distributed.omni_connectors.model_runner.omni_connector_runtime import (
        should_accumulate_full_payload_output,
    )
    from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner

    class FullPayloadRunner(GPUARModelRunner, CPUModelRunner):
        """vllm-omni's AR runner on vLLM's CPU runner, its full payload kept (see the factory)."""

        def _should_accumulate_full_payload_output(self) -> bool:
            # vllm-omni's own gate, without its "is there a connector" shortcut (there is none).
            return should_accumulate_full_payload_output(
                self._get_model_config(), getattr(self, "_custom_process_func", None)
            )

        def send_full_payload_outputs(self, scheduler_output: Any, outputs: dict[str, Any]) -> list[str]:
            for req_id, (accumulated, request) in outputs.items():
                flushed[req_id] = {
                    "accumulated": accumulated,
                    "payload": self._build_custom_process_payload(
                        request_id=req_id, request=request, pooling_output=accumulated, propagate_errors=True
                    ),
                    "output_token_ids": list(request.output_token_ids),
                }
            return list(outputs)

    FullPayloadRunner.__name__ = name
    publish(FullPayloadRunner)
    return FullPayloadRunner


def step_outputs_ar_runner(name: str, steps: dict[str, list[Any]]) -> type:
    """vllm-omni's AR runner on vLLM's CPU runner; appends each step's multimodal output of a
    request to ``steps[request_id]``."""
    from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner

    def keep(rid: str, payload: Any) -> None:
        steps.setdefault(rid, []).append(payload)

    return _keeping_runner(name, GPUARModelRunner, keep)


def generation_runner(name: str, outputs: dict[str, dict[str, Any]]) -> type:
    """vllm-omni's generation runner on vLLM's CPU runner; puts each request's output (a dict
    copy) in ``outputs[request_id]``."""
    from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner

    def keep(rid: str, payload: Any) -> None:
        outputs[rid] = dict(payload)

    return _keeping_runner(name, GPUGenerationModelRunner, keep)


def _keeping_runner(name: str, omni_runner: type, keep: Callable[[str, Any], None]) -> type:
    """``omni_runner`` on vLLM's CPU runner, each step's multimodal outputs handed to ``keep``."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    class KeepingRunner(omni_runner, CPUModelRunner):
        def execute_model(self, *args: Any, **kwargs: Any) -> Any:
            return keep_outputs(super().execute_model(*args, **kwargs), keep)

        def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
            return keep_outputs(super().sample_tokens(*args, **kwargs), keep)

    KeepingRunner.__name__ = name
    KeepingRunner.__doc__ = f"vllm-omni's {omni_runner.__name__} on vLLM's CPU runner, its outputs kept."
    publish(KeepingRunner)
    return KeepingRunner


# --------------------------------------------------------------------------- engines


def tts_stage_fields(
    talker_stage: str, talker_arch: str, code2wav_arch: str, **talker_own: Any
) -> dict[str, dict[str, Any]]:
    """vllm-omni's OmniModelConfig fields of a two-stage speech pipeline run sync (async_chunk
    false), over ``harness.OMNI_MODEL_CONFIG_DEFAULTS``: "talker" (stage 0, AR, latent output,
    ``model_stage`` ``talker_stage``, plus ``talker_own``) and "code2wav" (stage 1, generation,
    audio, the final output), as the models' pipeline.py state them."""
    from omnigen_testing.real.harness import OMNI_MODEL_CONFIG_DEFAULTS

    talker = {
        "stage_id": 0,
        "model_stage": talker_stage,
        "model_arch": talker_arch,
        "worker_type": "ar",
        "engine_output_type": "latent",
        "async_chunk": False,
        **talker_own,
    }
    code2wav = {
        "stage_id": 1,
        "model_stage": "code2wav",
        "model_arch": code2wav_arch,
        "worker_type": "generation",
        "engine_output_type": "audio",
        "final_output": True,
        "async_chunk": False,
    }
    return {
        "talker": {**OMNI_MODEL_CONFIG_DEFAULTS, **talker},
        "code2wav": {**OMNI_MODEL_CONFIG_DEFAULTS, **code2wav},
    }


def worker(name: str, runner: type, fields: dict[str, Any], *, set_capture_size: bool = True) -> str:
    """vLLM's CPU worker building ``runner`` (published as ``name``; its qualified name returned).

    ``fields``: the stage's OmniModelConfig fields, set on vLLM's model config (vllm-omni's runner
    reads them there). A stage naming ``hf_config_name`` also gets that sub-config's text config
    (``OmniModelConfig.draw_hf_text_config``: the stage's own widths and vocabulary).
    ``set_capture_size``: give ``compilation_config.max_cudagraph_capture_size`` the engine's
    max_num_seqs where it is unset (``_init_talker_mtp`` takes a max with it; it is None under
    enforce_eager)."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    from omnigen_testing.real import harness

    class Worker(CPUWorker):
        runner_class: ClassVar[type] = runner

        def init_device(self) -> None:
            harness.set_omni_model_config(self.vllm_config.model_config, fields)
            compilation = self.vllm_config.compilation_config
            if set_capture_size and compilation.max_cudagraph_capture_size is None:
                compilation.max_cudagraph_capture_size = self.vllm_config.scheduler_config.max_num_seqs
            with harness.cpu_worker_builds(runner):
                super().init_device()

    Worker.__name__ = name
    return publish(Worker)


def engine_classes(
    runner: type,
    fields: dict[str, Any],
    *,
    worker_name: str,
    scheduler_name: str,
    set_capture_size: bool = True,
) -> dict[str, Any]:
    """One stage's ``worker_cls`` and ``scheduler_cls`` (``vllm.LLM`` keyword arguments): the
    worker of ``worker``, and ``harness.oracle_scheduler_cls`` for the runner's kind (a generation
    runner's requests finish once their prompt ran)."""
    from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner

    from omnigen_testing.real import harness

    kind = GENERATION_RUNNER if issubclass(runner, GPUGenerationModelRunner) else AR_RUNNER
    return {
        "worker_cls": worker(worker_name, runner, fields, set_capture_size=set_capture_size),
        "scheduler_cls": harness.oracle_scheduler_cls(
            SimpleNamespace(name=scheduler_name, oracle_runner=kind)
        ),
    }


def generate(llm: Any, prompts: list[dict[str, Any]], params: list[Any], ids: list[str]) -> list[Any]:
    """``LLM.generate`` with the request ids given (the runners key their results by them): each
    request's finished output, in the order given."""
    engine = llm.llm_engine
    for rid, prompt, sp in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, sp)
    finished: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return [finished[rid] for rid in ids]


def flushed_payloads(llm: Any, flushed: dict[str, dict[str, Any]], ids: list[str]) -> list[dict[str, Any]]:
    """What a ``full_payload_ar_runner`` flushed for each of ``ids`` (taken out of ``flushed``).
    The runner flushes a finished request's payload at its next step: up to four more (empty)
    steps are run for it."""
    for _ in range(4):
        if all(rid in flushed for rid in ids):
            break
        llm.llm_engine.step()
    missing = [rid for rid in ids if rid not in flushed]
    if missing:
        raise RuntimeError(f"the runner flushed no full payload for {missing}")
    return [flushed.pop(rid) for rid in ids]


def code2wav_audio(outputs: dict[str, dict[str, Any]], rid: str) -> tuple[Any, int]:
    """A ``generation_runner``'s audio for request ``rid`` (taken out of ``outputs``): its
    ``model_outputs`` as flat float32 samples (the first, where it is a list) and its sample rate
    (``sr``, 24000 where it names none)."""
    output = outputs.pop(rid, None)
    if output is None or output.get("model_outputs") is None:
        raise RuntimeError(f"code2wav returned no audio for {rid}: {output}")
    audio = output["model_outputs"]
    audio = (audio[0] if isinstance(audio, list) else audio).float().detach().cpu().numpy().reshape(-1)
    sr = output.get("sr", 24000)
    sr = sr[0] if isinstance(sr, list) else sr
    return audio, int(sr.item() if hasattr(sr, "item") else sr)


def vllm_omni_wav(audio: Any, sample_rate: int) -> str:
    """The WAV vllm-omni's serving layer writes of the audio (``AudioMixin.create_audio``:
    soundfile, PCM_16), base64."""
    import base64

    from vllm_omni.entrypoints.openai.audio_utils_mixin import AudioMixin
    from vllm_omni.entrypoints.openai.protocol.audio import CreateAudio

    wav = AudioMixin().create_audio(
        CreateAudio(audio_tensor=audio, sample_rate=sample_rate, response_format="wav", base64_encode=False)
    )
    return base64.b64encode(wav.audio_data).decode()


def shutdown(engines: dict[str, Any]) -> None:
    """Stop the engines' cores (in process) and vLLM's distributed state; ``engines`` emptied."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    engines.clear()
    cleanup_dist_env_and_memory()
