"""End to end: vLLM's REAL weight loader reads ``testing/checkpoints``' tiny Higgs Audio v3 folder.

``write_higgs_audio_v3`` writes one folder for both stages (the codec bundled in its safetensors,
as released) into ``tmp_path``; a child process (this module run as a script, so vLLM and
vllm-omni are never imported into the pytest process) builds ``vllm.LLM`` on it with
``load_format="safetensors"``, once per stage: the talker
(``HiggsAudioV3TalkerForConditionalGeneration``) and the codec decoder
(``HiggsAudioV3Code2WavForConditionalGeneration``), each with omnigen's generated worker and
scheduler, the classes registered as ``omnigen run``/``serve`` register them
(``omnigen.models.register``: vllm-omni's modules without its ``__init__``/``patch.py``). The
generic pieces (the child's environment, the snapshot of what the loader left, the packed-name
mapping) are ``tests/e2e/test_checkpoints.py``'s.

What proves the weights came from the files: every parameter of both loaded models is compared
with the safetensors tensors, mapped as the classes map them (talker: ``tied.embedding.text_embedding.``
-> ``model.embed_tokens.``, ``body.layers.`` -> ``model.layers.`` with q/k/v_proj and gate/up_proj
packed, ``body.norm.``, ``tied.head.text_head.`` -> ``lm_head.``, the codebook embedding ->
``multimodal_embedding.``; code2wav: the bundled codec's ``quantizer.quantizers.*.codebook.embed`` ->
``.codebook.weight``, ``project_out``, ``fc2``, ``acoustic_decoder.*``), exactly, in the model's
dtype, when vLLM's ``DefaultModelLoader.load_weights`` returns, and again on the serving model
(``llm.apply_model``) for what kept its shape. Negative controls through the same loader: a copy
without ``body.norm.weight`` and one without a layer's ``q_proj`` (the talker's own required-key
check), one without a decoder convolution (the codec's strict load), and one without any codec
tensor (code2wav then looks for ``bosonai/higgs-audio-v2-tokenizer`` in the HF cache, which is not
here) must fail to load, naming what is missing.

    .venv/bin/python -m pytest -q -m e2e tests/e2e/test_checkpoints_higgs_audio_v3.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_checkpoints import (
    LOADED,
    _shutdown,
    _snapshot_loaded_weights,
    _unpack_name,
    child_environment,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests.e2e.test_checkpoints_higgs_audio_v3"
CHILD_TIMEOUT_S = 600
CODEC_PREFIX = "tied.embedding.modality_embeddings.0.model."
STAGES: dict[str, dict[str, Any]] = {
    "talker": {
        "hf_overrides": {"architectures": ["HiggsAudioV3TalkerForConditionalGeneration"]},
        "worker": "omnigen.generated.higgs_audio_v3.talker.HiggsAudioV3TalkerWorker",
        "max_model_len": 128,
    },
    "code2wav": {
        "hf_overrides": {
            "text_config": {"max_position_embeddings": 65536},
            "architectures": ["HiggsAudioV3Code2WavForConditionalGeneration"],
        },
        "worker": "omnigen.generated.higgs_audio_v3.code2wav.HiggsAudioV3Code2wavWorker",
        "max_model_len": 2048,
    },
}
SCHEDULER = "omnigen.runtime.scheduler.OmniScheduler"
# The talker's released-name prefixes and the vLLM module they load into (_map_weight_name).
TALKER_PREFIXES = {
    "tied.embedding.text_embedding.": "model.embed_tokens.",
    "body.layers.": "model.layers.",
    "body.norm.": "model.norm.",
    "tied.head.text_head.": "lm_head.",
    "tied.embedding.modality_embeddings.0.embedding.": "multimodal_embedding.",
}
VOCAB_PADDED = {"model.embed_tokens.weight", "lm_head.weight"}
# The codec's training-only tensors, which code2wav reads past (_QUANTIZER_TRAINING_SUFFIXES).
CODEC_UNUSED_SUFFIXES = (
    ".codebook.cluster_size",
    ".codebook.embed_avg",
    ".codebook.inited",
    ".project_in.weight",
    ".project_in.bias",
)

# Negative controls: (name, stage, tensors deleted (a prefix deletes every tensor under it), a
# phrase of the load error).
NEGATIVE = [
    ("no_body_norm", "talker", "body.norm.weight", "required checkpoint keys missing: ['body.norm.weight']"),
    (
        "no_q_proj",
        "talker",
        "body.layers.0.self_attn.q_proj.weight",
        "required checkpoint keys missing: ['body.layers.0.self_attn.q_proj.weight']",
    ),
    (
        "no_decoder_conv",
        "code2wav",
        CODEC_PREFIX + "acoustic_decoder.conv1.weight",
        "Bundled DAC decoder missing 1 keys: ['conv1.weight']",
    ),
    ("no_codec", "code2wav", CODEC_PREFIX, "nor is bosonai/higgs-audio-v2-tokenizer cached"),
]


# =========================================================================== child process


def engine_kwargs(stage: str, model_dir: Path) -> dict[str, Any]:
    spec = STAGES[stage]
    return {
        "model": str(model_dir),
        "hf_overrides": spec["hf_overrides"],
        "load_format": "safetensors",
        "skip_tokenizer_init": True,
        "trust_remote_code": True,
        "enforce_eager": True,
        "max_model_len": spec["max_model_len"],
        "max_num_batched_tokens": spec["max_model_len"],
        "max_num_seqs": 2,
        "enable_prefix_caching": False,
        "seed": 0,
        "worker_cls": spec["worker"],
        "scheduler_cls": SCHEDULER,
    }


def expected_tensors(stage: str, model_dir: Path) -> dict[str, Any]:
    """What each model tensor must hold after loading, by vLLM name, built from the file."""
    import torch
    from safetensors.torch import load_file

    files = load_file(str(model_dir / "model.safetensors"))
    if stage == "code2wav":
        expected = {}
        for name, tensor in files.items():
            if not name.startswith(CODEC_PREFIX) or name.endswith(CODEC_UNUSED_SUFFIXES):
                continue
            local = name[len(CODEC_PREFIX) :]
            expected[local.replace(".codebook.embed", ".codebook.weight")] = tensor
        return expected
    shards: dict[str, dict[int, Any]] = {}
    for name, tensor in files.items():
        if name.startswith(CODEC_PREFIX):
            continue
        prefix = next(p for p in TALKER_PREFIXES if name.startswith(p))
        target, index = _unpack_name(TALKER_PREFIXES[prefix] + name[len(prefix) :])
        shards.setdefault(target, {})[index] = tensor
    return {name: torch.cat([parts[i] for i in sorted(parts)], dim=0) for name, parts in shards.items()}


def compare(
    params: dict[str, Any], stage: str, model_dir: Path, only: set[str] | None = None
) -> dict[str, Any]:
    expected = expected_tensors(stage, model_dir)
    if only is not None:
        expected = {k: v for k, v in expected.items() if k in only}
    mismatched = []
    for name, tensor in sorted(expected.items()):
        actual = params.get(name)
        if actual is None:
            mismatched.append(f"{name}: in the file, not in the model")
            continue
        want = tensor.to(dtype=actual.dtype, device=actual.device)
        if name in VOCAB_PADDED and actual.shape[1:] == want.shape[1:] and actual.shape[0] >= want.shape[0]:
            actual = actual[: want.shape[0]]
        if tuple(actual.shape) != tuple(want.shape) or not bool((actual == want).all()):
            mismatched.append(f"{name}: differs from the file ({tuple(actual.shape)} vs {tuple(want.shape)})")
    return {
        "num_params": len(params),
        "num_compared": len(expected),
        "params_without_file_tensor": sorted(set(params) - set(expected)),
        "mismatched": mismatched,
    }


def run_one(stage: str, model_dir: Path) -> dict[str, Any]:
    """Build the stage's engine on the folder; never raises (a failure is the result)."""
    from vllm import LLM

    t0 = time.perf_counter()
    result: dict[str, Any] = {"stage": stage}
    llm = None
    LOADED.clear()
    try:
        llm = LLM(**engine_kwargs(stage, model_dir))
        result["compare"] = compare(LOADED["params"], stage, model_dir)

        def live(model: Any) -> dict[str, Any]:
            params = {n: p.detach() for n, p in model.named_parameters() if p.numel() > 0}
            return compare(params, stage, model_dir, only=set(params))

        [result["live"]] = llm.apply_model(live)
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
    parser = argparse.ArgumentParser(description="Load tiny Higgs checkpoints through vLLM's real loader.")
    parser.add_argument("--run", action="append", default=[], metavar="NAME:STAGE:DIR")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    import torch

    from omnigen.models import register

    torch.set_num_threads(1)
    register("higgs_audio_v3")  # as omnigen run/serve: vllm-omni's classes, its patch never runs
    _snapshot_loaded_weights()
    results: dict[str, Any] = {}
    for spec in args.run:
        name, stage, folder = spec.split(":")
        results[name] = run_one(stage, Path(folder))
        args.out.write_text(json.dumps(results, indent=2))
    return 0


# =========================================================================== pytest side

pytestmark = pytest.mark.e2e


def _delete_tensors(src: Path, dst: Path, prefix: str) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    tensors = load_file(str(path))
    doomed = [
        name for name in tensors if name == prefix or (prefix.endswith(".") and name.startswith(prefix))
    ]
    assert doomed, f"nothing named {prefix} in {path}"
    for name in doomed:
        del tensors[name]
    save_file(tensors, str(path), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def loads(tmp_path_factory) -> dict[str, Any]:
    if importlib.util.find_spec("vllm_omni") is None:
        pytest.skip("vllm-omni (the Higgs Audio v3 model classes) is not installed")
    from omnigen_testing.checkpoints import write_higgs_audio_v3

    root = tmp_path_factory.mktemp("higgs_checkpoints")
    folder = write_higgs_audio_v3(root / "higgs", seed=0)
    runs = [f"talker:talker:{folder}", f"code2wav:code2wav:{folder}"]
    for name, stage, prefix, _phrase in NEGATIVE:
        runs.append(f"{name}:{stage}:{_delete_tensors(folder, root / name, prefix)}")
    out = root / "loads.json"
    args = [sys.executable, "-m", MODULE, "--out", str(out)]
    for run in runs:
        args += ["--run", run]
    env = child_environment()
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
    )
    log = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0 and out.exists(), f"child exited {proc.returncode}:\n{log}"
    return json.loads(out.read_text())


def _ok(result: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in result, f"{result['stage']} failed to load:\n{result.get('traceback')}"
    return result


def test_talker_loads_every_tensor_from_the_file(loads):
    result = _ok(loads["talker"])
    report = result["compare"]
    assert report["mismatched"] == [], report["mismatched"]
    assert report["params_without_file_tensor"] == [], report  # the codebook head is the embedding
    assert report["num_compared"] == report["num_params"] > 0
    live = result["live"]
    assert live["mismatched"] == [] and live["num_compared"] > 0, live


def test_code2wav_loads_the_bundled_codec(loads):
    result = _ok(loads["code2wav"])
    report = result["compare"]
    assert report["mismatched"] == [], report["mismatched"]
    assert report["params_without_file_tensor"] == [], report
    # 8 quantizers (codebook, project_out weight and bias), fc2 (weight, bias), the DAC decoder's 110.
    assert report["num_compared"] == report["num_params"] == 8 * 3 + 2 + 110, report
    live = result["live"]
    assert live["mismatched"] == [] and live["num_compared"] == report["num_params"], live


@pytest.mark.parametrize("name,stage,prefix,phrase", NEGATIVE, ids=[n[0] for n in NEGATIVE])
def test_negative_control(loads, name, stage, prefix, phrase):
    error = loads[name].get("error")
    assert error is not None, f"{name}: loading without {prefix} succeeded"
    assert phrase in error["message"], error


if __name__ == "__main__":
    sys.exit(child_main())
