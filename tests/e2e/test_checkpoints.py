"""End to end: vLLM's REAL weight loader reads ``testing/checkpoints``' tiny Qwen3-TTS folder.

``write_qwen3_tts`` writes the CustomVoice checkpoint (one folder, both stages, as released) into
``tmp_path``; a child process (this module run as a script, so vLLM and vllm-omni are never
imported into the pytest process) builds ``vllm.LLM`` on it with ``load_format="safetensors"``,
once per stage: the talker (``Qwen3TTSTalkerForConditionalGeneration``) and the codec decoder
(``Qwen3TTSCode2Wav``), each with omnigen's generated worker and scheduler. vllm-omni's model
classes are imported without its ``__init__``/``patch.py`` (``harness.install_bare_vllm_omni``)
and registered with vLLM and transformers by hand.

What proves the weights came from the files:

* vLLM 0.30's ``DefaultModelLoader.load_weights`` is strict only in part: it raises
  ``ValueError("Following weights were not initialized from checkpoint: ...")`` for every
  parameter missing from the set the model's ``load_weights`` returns
  (``default_loader.py:447-470``), but it counts as loaded every parameter of a module that has a
  ``quant_method`` with ``process_weights_after_loading``; the unquantized linear and embedding
  methods have one, so vLLM's ``QKVParallelLinear``, ``MergedColumnParallelLinear``,
  ``RowParallelLinear``, ``VocabParallelEmbedding`` and ``ParallelLMHead`` (the talker's
  backbone, ``embed_tokens`` and ``lm_head``) pass the check even when never loaded. The talker's
  class also reports its ``speaker_encoder`` loaded when the file has none (CustomVoice).
* So the child compares EVERY parameter (and the codec encoder's codebook buffers) of both loaded
  models with the safetensors tensors, mapped as the class maps them (released names ->
  ``hf_to_vllm_mapper`` prefixes; q/k/v_proj -> ``qkv_proj`` and gate/up_proj -> ``gate_up_proj``
  concatenated in that order), exactly, in the model's dtype; the only parameters without a file
  tensor must be the talker's ``speaker_encoder.*`` (not in a CustomVoice release). The tensors
  are captured when ``DefaultModelLoader.load_weights`` returns (the child wraps it), because on
  CPU vLLM's ``process_weights_after_loading`` then repacks the linear layers' weights for its
  GEMM kernels and empties their parameters (``linear.py:205``); every parameter of the serving
  model that kept its shape is compared again through ``llm.apply_model``.
* Negative controls, through the same real loader: a copy with ``talker.model.norm.weight``
  deleted and a copy with a ``decoder.*`` tensor deleted must fail to load, with vLLM's
  "not initialized from checkpoint" error naming the tensor; a copy with a talker ``q_proj``
  deleted must still load (the check above does not cover it) but then fail the comparison.
* The loaded stages run: two CustomVoice requests through the talker (speakers ``ryan`` and
  ``dylan``, the latter with its dialect's language id; codes every step), two requests through
  code2wav (a waveform each, finite, not saturated to +-1, not silent).

Run::

    .venv/bin/python -m pytest -q -m e2e tests/e2e/test_checkpoints.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

TALKER_ARCH = "Qwen3TTSTalkerForConditionalGeneration"
CODE2WAV_ARCH = "Qwen3TTSCode2Wav"
STAGES: dict[str, dict[str, str]] = {
    "talker": {
        "arch": TALKER_ARCH,
        "class": f"vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker.{TALKER_ARCH}",
        "worker": "omnigen.generated.qwen3_tts.qwen3_tts.Qwen3TtsWorker",
    },
    "code2wav": {
        "arch": CODE2WAV_ARCH,
        "class": f"vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav.{CODE2WAV_ARCH}",
        "worker": "omnigen.generated.qwen3_tts.code2wav.Qwen3TtsCode2wavWorker",
    },
}
SCHEDULER = "omnigen.runtime.scheduler.OmniScheduler"
CONFIG_CLASS = "vllm_omni.model_executor.models.qwen3_tts.configuration_qwen3_tts.Qwen3TTSConfig"
MAX_MODEL_LEN = 128
CHILD_TIMEOUT_S = 600

# The talker's released-name prefixes and the vLLM module they load into (hf_to_vllm_mapper,
# qwen3_tts_talker.py:348), and the HF shards vLLM packs into one parameter, in packing order.
TALKER_PREFIXES = {
    "talker.model.layers.": "model.layers.",
    "talker.model.norm.": "model.norm.",
    "talker.model.codec_embedding.": "model.embed_tokens.",
    "talker.codec_head.": "lm_head.",
    "talker.model.text_embedding.": "text_embedding.",
    "talker.text_projection.": "text_projection.",
    "talker.code_predictor.": "code_predictor.",
    "speaker_encoder.": "speaker_encoder.",
}
VOCAB_PADDED = {"model.embed_tokens.weight", "lm_head.weight"}
PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

# Negative controls: (name, stage, tensor deleted, file it is deleted from, expected outcome).
NEGATIVE = [
    ("no_talker_norm", "talker", "talker.model.norm.weight", "model.safetensors", "load_error"),
    (
        "no_decoder_conv",
        "code2wav",
        "decoder.pre_conv.conv.weight",
        "speech_tokenizer/model.safetensors",
        "load_error",
    ),
    (
        "no_talker_q_proj",
        "talker",
        "talker.model.layers.0.self_attn.q_proj.weight",
        "model.safetensors",
        "loads_but_differs",
    ),
]


# =========================================================================== child process


def child_environment() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process
            "VLLM_PLUGINS": "omnigen",  # never vllm-omni's plugin (it patches vLLM)
            "VLLM_USE_V2_MODEL_RUNNER": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
        }
    )
    return env


def _resolve(qualname: str) -> Any:
    import importlib

    module, _, attr = qualname.rpartition(".")
    return getattr(importlib.import_module(module), attr)


# What the loader left in the model, captured when DefaultModelLoader.load_weights returns (after
# its strict check, before vLLM's process_weights_after_loading: on CPU that repacks the linear
# layers' weights for its GEMM kernels and leaves their parameters empty).
LOADED: dict[str, dict[str, Any]] = {}


def _snapshot_loaded_weights() -> None:
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    original = DefaultModelLoader.load_weights

    def load_weights(self: Any, model: Any, model_config: Any) -> None:
        original(self, model, model_config)
        LOADED.clear()
        LOADED["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        LOADED["buffers"] = {n: b.detach().clone() for n, b in model.named_buffers() if b is not None}

    DefaultModelLoader.load_weights = load_weights  # type: ignore[method-assign]


def _prepare() -> None:
    """vllm-omni's classes without its patch.py, registered with vLLM and transformers."""
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.transformers_utils import config as vllm_config_utils

    from omnigen_testing.real import harness

    harness.install_standins()  # torchaudio (not installable next to torch 2.13): import-only
    harness.install_bare_vllm_omni()
    # No CPU OmniPlatform: the shared code predictor asks supports_torch_inductor() on first use.
    harness._answer_torch_inductor()
    _snapshot_loaded_weights()
    for stage in STAGES.values():
        ModelRegistry.register_model(stage["arch"], _resolve(stage["class"]))
    config_class = _resolve(CONFIG_CLASS)
    AutoConfig.register("qwen3_tts", config_class, exist_ok=True)
    vllm_config_utils._CONFIG_REGISTRY["qwen3_tts"] = config_class


def engine_kwargs(stage: str, model_dir: Path) -> dict[str, Any]:
    return {
        "model": str(model_dir),
        # The stage is chosen by architecture (one folder serves both). For code2wav the config
        # class itself then drops M-RoPE and raises talker_config.max_position_embeddings to
        # 131072 (configuration_qwen3_tts.py:525-543), so no further override is needed here.
        "hf_overrides": {"architectures": [STAGES[stage]["arch"]]},
        "load_format": "safetensors",
        "dtype": "bfloat16",  # the talker's embeddings are hard-coded bf16
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 2,
        # code2wav has no KV cache: with prefix caching on, vLLM 0.30's scheduler builds a
        # HybridKVCacheCoordinator that asserts "requires at least one cacheable group".
        "enable_prefix_caching": False,
        "seed": 0,
        "worker_cls": STAGES[stage]["worker"],
        "scheduler_cls": SCHEDULER,
    }


def _files(model_dir: Path) -> dict[str, dict[str, Any]]:
    from safetensors.torch import load_file

    return {
        "model": load_file(str(model_dir / "model.safetensors")),
        "speech_tokenizer": load_file(str(model_dir / "speech_tokenizer" / "model.safetensors")),
    }


def _unpack_name(name: str) -> tuple[str, int]:
    """A released shard's vLLM parameter and its position in the packed parameter."""
    module, _, leaf = name.rpartition(".")
    parent, _, shard = module.rpartition(".")
    for packed, shards in PACKED.items():
        if shard in shards:
            return f"{parent}.{packed}.{leaf}", shards.index(shard)
    return name, 0


def expected_tensors(stage: str, files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What each model tensor must hold after loading, by vLLM name, built from the files."""
    import torch

    if stage == "code2wav":
        return {k: v for k, v in files["speech_tokenizer"].items() if k.startswith("decoder.")}
    shards: dict[str, dict[int, Any]] = {}
    for name, tensor in files["model"].items():
        prefix = next(p for p in TALKER_PREFIXES if name.startswith(p))
        target, index = _unpack_name(TALKER_PREFIXES[prefix] + name[len(prefix) :])
        shards.setdefault(target, {})[index] = tensor
    expected = {name: torch.cat([parts[i] for i in sorted(parts)], dim=0) for name, parts in shards.items()}
    expected |= {k: v for k, v in files["speech_tokenizer"].items() if k.startswith("encoder.")}
    return expected


def compare_loaded(
    params: dict[str, Any], buffers: dict[str, Any], stage: str, model_dir: Path, only: set[str] | None = None
) -> dict[str, Any]:
    """Every parameter (and every file-backed buffer) against the files, exactly, in the model's
    dtype. vLLM pads the vocabulary of ``embed_tokens``/``lm_head`` (to a multiple of 64): their
    leading rows are compared."""
    expected = expected_tensors(stage, _files(model_dir))
    if only is not None:
        expected = {k: v for k, v in expected.items() if k in only}
    mismatched, compared_buffers = [], []
    for name, tensor in sorted(expected.items()):
        actual = params.get(name, buffers.get(name))
        if actual is None:
            mismatched.append(f"{name}: in the files, not in the model")
            continue
        if name not in params:
            compared_buffers.append(name)
        want = tensor.to(dtype=actual.dtype, device=actual.device)
        if name in VOCAB_PADDED and actual.shape[1:] == want.shape[1:] and actual.shape[0] >= want.shape[0]:
            actual = actual[: want.shape[0]]
        if tuple(actual.shape) != tuple(want.shape) or not bool((actual == want).all()):
            mismatched.append(f"{name}: differs from the file ({tuple(actual.shape)} vs {tuple(want.shape)})")
    return {
        "num_params": len(params),
        "num_compared": len(expected),
        "compared_buffers": compared_buffers,
        "params_without_file_tensor": sorted(set(params) - set(expected)),
        "mismatched": mismatched,
    }


def compare_live(model: Any, stage: str, model_dir: Path) -> dict[str, Any]:
    """The serving model after vLLM's post-processing: the parameters that kept their shape
    (all but the CPU-repacked linear layers) still hold the file's values."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.numel() > 0}
    report = compare_loaded(params, {}, stage, model_dir, only=set(params))
    report["repacked"] = sorted(n for n, p in model.named_parameters() if p.numel() == 0)
    return report


def _talker_requests(model_dir: Path) -> list[tuple[str, list[int], dict[str, Any]]]:
    """CustomVoice requests, placeholder prompts as long as vllm-omni's estimator says."""
    from vllm_omni.model_executor.models.qwen3_tts.prompt_embeds_builder import Qwen3TTSPromptEmbedsBuilder

    from omnigen_testing.checkpoints import qwen3_tts

    config = json.loads((model_dir / "config.json").read_text())["talker_config"]
    tokenizer = qwen3_tts.text_tokenizer()
    requests = []
    for rid, speaker, language in (("cv-ryan", "ryan", "English"), ("cv-dylan", "dylan", "Chinese")):
        payload = {
            "task_type": ["CustomVoice"],
            "text": ["hello world the quick brown fox"],
            "language": [language],
            "speaker": [speaker],
            "non_streaming_mode": [True],
        }
        n = Qwen3TTSPromptEmbedsBuilder.estimate_prompt_len_from_additional_information(
            payload,
            task_type="CustomVoice",
            tokenize_prompt=lambda text: list(tokenizer.encode(text).ids),
            codec_language_id=config["codec_language_id"],
            spk_is_dialect=config["spk_is_dialect"],
        )
        requests.append((rid, [config["codec_pad_id"]] * n, payload))
    return requests


def _code2wav_requests() -> list[tuple[str, list[int], dict[str, Any]]]:
    from omnigen_testing.real.cases import qwen3_tts_code2wav

    return [(r.request_id, r.prompt_token_ids, r.payload) for r in qwen3_tts_code2wav.requests()[:2]]


def run_requests(llm: Any, stage: str, model_dir: Path) -> dict[str, Any]:
    from vllm import SamplingParams

    from omnigen.runtime.serialization import INLINE_PAYLOAD_KEY, serialize_additional_information
    from omnigen.serving.client import stage_payload

    requests = _talker_requests(model_dir) if stage == "talker" else _code2wav_requests()
    prompts, params = [], []
    for i, (_rid, prompt, payload) in enumerate(requests):
        prompts.append({"prompt_token_ids": prompt})
        extra = {INLINE_PAYLOAD_KEY: serialize_additional_information(payload), "tts_local_seed": 7 + i}
        max_tokens = 4 if stage == "talker" else 1
        params.append(
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False, extra_args=extra)
        )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    report: dict[str, Any] = {}
    for (rid, prompt, _payload), out in zip(requests, outputs, strict=True):
        payload = stage_payload(out)
        entry: dict[str, Any] = {"prompt_len": len(prompt), "keys": sorted(payload)}
        if stage == "talker":
            codes = payload.get("codes.audio")
            entry["codes_shape"] = list(codes.shape) if codes is not None else None
            entry["tokens"] = list(out.outputs[0].token_ids) if out.outputs else []
        else:
            audio = payload.get("model_outputs")
            if audio is not None:
                wave = audio.float().reshape(-1)
                entry |= {
                    "samples": int(wave.numel()),
                    "finite": bool(wave.isfinite().all()),
                    "max_abs": float(wave.abs().max()) if wave.numel() else 0.0,
                    "std": float(wave.std()) if wave.numel() > 1 else 0.0,
                    "saturated_fraction": float((wave.abs() >= 0.999).float().mean())
                    if wave.numel()
                    else 0.0,
                }
        report[rid] = entry
    return report


def _shutdown(llm: Any) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        del llm
        cleanup_dist_env_and_memory()


def run_one(stage: str, model_dir: Path, serve: bool) -> dict[str, Any]:
    """Build the stage's engine on the folder; never raises (a failure is the result)."""
    from vllm import LLM

    t0 = time.perf_counter()
    result: dict[str, Any] = {"stage": stage, "model": str(model_dir)}
    llm = None
    LOADED.clear()
    try:
        llm = LLM(**engine_kwargs(stage, model_dir))
        result["init_s"] = round(time.perf_counter() - t0, 2)
        result["compare"] = compare_loaded(LOADED["params"], LOADED["buffers"], stage, model_dir)
        [result["live"]] = llm.apply_model(lambda model: compare_live(model, stage, model_dir))
        if serve:
            result["requests"] = run_requests(llm, stage, model_dir)
    except Exception as exc:
        result["error"] = {"type": type(exc).__name__, "message": str(exc)[:3000]}
        result["traceback"] = "".join(traceback.format_exception(exc)[-12:])[-4000:]
    finally:
        if llm is not None:
            _shutdown(llm)
        else:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    return result


def child_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Load tiny checkpoints through vLLM's real loader.")
    parser.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="NAME:STAGE:DIR[:serve]",
        help="one engine build (repeatable; run in order, in this process)",
    )
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    _prepare()
    results: dict[str, Any] = {}
    for spec in args.run:
        name, stage, folder, *flags = spec.split(":")
        results[name] = run_one(stage, Path(folder), serve="serve" in flags)
        args.out.write_text(json.dumps(results, indent=2))
    return 0


# =========================================================================== pytest side

pytestmark = pytest.mark.e2e


def _delete_tensor(src: Path, dst: Path, file: str, name: str) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / file))
    assert name in tensors, f"{name} is not in {file}"
    del tensors[name]
    save_file(tensors, str(dst / file), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def loads(tmp_path_factory) -> dict[str, Any]:
    if importlib.util.find_spec("vllm_omni") is None:
        pytest.skip("vllm-omni (the Qwen3-TTS model classes) is not installed")
    from omnigen_testing.checkpoints import write_qwen3_tts

    root = tmp_path_factory.mktemp("qwen3_tts_checkpoints")
    folder = write_qwen3_tts(root / "custom_voice", "custom_voice", seed=0)
    runs = [f"talker:talker:{folder}:serve", f"code2wav:code2wav:{folder}:serve"]
    for name, stage, tensor, file, _outcome in NEGATIVE:
        damaged = _delete_tensor(folder, root / name, file, tensor)
        runs.append(f"{name}:{stage}:{damaged}")
    out = root / "loads.json"
    args = [sys.executable, "-m", "tests.e2e.test_checkpoints", "--out", str(out)]
    for run in runs:
        args += ["--run", run]
    t0 = time.perf_counter()
    proc = subprocess.run(
        args,
        cwd=REPO_ROOT,
        env=child_environment(),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    log = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0 and out.exists(), f"child exited {proc.returncode}:\n{log}"
    results = json.loads(out.read_text())
    results["_wall_s"] = round(time.perf_counter() - t0, 1)
    results["_log"] = log
    return results


def _ok(result: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in result, f"{result['stage']} failed to load:\n{result.get('traceback')}"
    return result


def test_talker_loads_every_tensor_from_the_files(loads):
    result = _ok(loads["talker"])
    compare = result["compare"]
    assert compare["mismatched"] == [], compare["mismatched"]
    # The CustomVoice release has no speaker encoder: the only parameters the files do not fill.
    missing = compare["params_without_file_tensor"]
    assert missing and all(name.startswith("speaker_encoder.") for name in missing), missing
    # The codec encoder's codebook buffers (loaded by the class's second pass) were compared too.
    assert any(name.endswith(".embed_sum") for name in compare["compared_buffers"]), compare
    assert compare["num_compared"] >= compare["num_params"] - len(missing)
    # After vLLM's post-processing: what kept its shape still holds the file's values.
    live = result["live"]
    assert live["mismatched"] == [] and live["num_compared"] > 0, live
    assert all(".layers." in name and "_proj." in name for name in live["repacked"]), live["repacked"]


def test_code2wav_loads_every_tensor_from_the_files(loads):
    result = _ok(loads["code2wav"])
    compare = result["compare"]
    assert compare["mismatched"] == [], compare["mismatched"]
    assert compare["params_without_file_tensor"] == []
    assert compare["num_params"] > 0
    live = result["live"]
    assert live["mismatched"] == [] and live["num_compared"] == compare["num_params"], live


def test_talker_serves_custom_voice(loads):
    requests = _ok(loads["talker"])["requests"]
    assert set(requests) == {"cv-ryan", "cv-dylan"}, requests
    for rid, entry in requests.items():
        assert "codes.audio" in entry["keys"], (rid, entry)
        assert entry["codes_shape"] and entry["codes_shape"][-1] == 4, (rid, entry)  # 4 code groups
    # dylan speaks a dialect: its language slot is beijing_dialect's, the prompt as long as ryan's.
    assert requests["cv-ryan"]["prompt_len"] == requests["cv-dylan"]["prompt_len"]


def test_code2wav_decodes_unsaturated_audio(loads):
    requests = _ok(loads["code2wav"])["requests"]
    assert len(requests) == 2, requests
    for rid, entry in requests.items():
        assert "model_outputs" in entry["keys"], (rid, entry)
        assert entry["samples"] > 0 and entry["finite"], (rid, entry)
        assert 0.0 < entry["max_abs"] < 0.999 and entry["std"] > 0.0, (rid, entry)
        assert entry["saturated_fraction"] == 0.0, (rid, entry)


@pytest.mark.parametrize("name,stage,tensor,file,outcome", NEGATIVE, ids=[n[0] for n in NEGATIVE])
def test_negative_control(loads, name, stage, tensor, file, outcome):
    result = loads[name]
    if outcome == "load_error":
        error = result.get("error")
        assert error is not None, f"{name}: loading without {tensor} succeeded"
        assert "not initialized from checkpoint" in error["message"], error
        vllm_name = (
            tensor
            if stage == "code2wav"
            else next(v + tensor[len(k) :] for k, v in TALKER_PREFIXES.items() if tensor.startswith(k))
        )
        assert vllm_name in error["message"], error
    else:
        # vLLM's check passes the packed linear layers without a file tensor...
        assert "error" not in result, result.get("traceback")
        # ...the comparison does not.
        packed = _unpack_name("model.layers." + tensor[len("talker.model.layers.") :])[0]
        assert any(m.startswith(packed) for m in result["compare"]["mismatched"]), result["compare"]


if __name__ == "__main__":
    sys.exit(child_main())
