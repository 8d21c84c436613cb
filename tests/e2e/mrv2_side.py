"""One side of the Model Runner V2 differential (``tests/e2e/test_mrv2_differential.py``).

Run in a process of its own, once per side::

    python -c "import tests.e2e.mrv2_side as s; s.main()" SIDE OUT.json

``SIDE`` is ``v1`` (vLLM's V1 runner: the generated ``<stage>.py``) or ``v2`` (vLLM's Model
Runner V2 with the generated ``<stage>_v2.py`` target). Both sides run vLLM's real engine (engine
core in process) on the same tiny models (``omnigen_testing.tiny_omni``) with the same weights,
requests and scheduler settings, through the same generated worker class, which builds the
target ``vllm_api.runner_target`` picks: V1 where vLLM chose V1, V2 under
``VLLM_USE_V2_MODEL_RUNNER=1``. On this CPU vLLM's V2 runner runs with only its Triton kernels
simulated (``omnigen_testing.mrv2_cpu``); everything else is vLLM's code.

Every engine step that ran tokens is recorded by a worker subclass, after sampling: the step's
requests, what each published (the step payload, 8.1), the codes in its buffer, its buffer's
keys, and the hook calls its buffer counts. Then each request's tokens and the payload its
scheduler handed over when it finished (``kv_transfer_params["omnigen"]``). The trace is JSON.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

SIDES = ("v1", "v2")
ENGINE: dict[str, Any] = {
    "load_format": "dummy",
    "enforce_eager": True,
    "dtype": "float32",
    "max_model_len": 128,
    "max_num_seqs": 4,
    "enable_chunked_prefill": True,
    # Small enough that prompts are chunked and decodes share steps with prefills.
    "max_num_batched_tokens": 8,
    "enable_prefix_caching": False,
    "seed": 0,
    "scheduler_cls": "omnigen.runtime.scheduler.OmniScheduler",
}
PROMPT_LENS = (9, 1, 5, 3)
MAX_TOKENS = 6

# (case, tiny-model variant of omnigen_testing.tiny_omni, the omnigen model and stage, overrides)
CASES: list[tuple[str, str, str, str, tuple[str, ...]]] = [
    ("talker.mtp_batched", "mtp_batched", "omnigen_tiny", "talker", ()),
    (
        "talker.mtp_per_row",
        "mtp_per_row",
        "omnigen_tiny",
        "talker",
        (
            "model.stages.talker.preprocess.decode_batch=none",
            "model.stages.talker.mtp.per_row_generators=never",
        ),
    ),
    (
        "talker.batched_plain",
        "batched_plain",
        "omnigen_tiny",
        "talker",
        (
            "model.stages.talker.preprocess.decode_batch=plain",
            "model.stages.talker.mtp.enabled=false",
            "model.stages.talker.mtp.per_row_generators=never",
        ),
    ),
    ("code2wav", "code2wav", "omnigen_tiny", "code2wav", ()),
    ("thinker", "thinker", "omnigen_tiny_omni", "thinker", ()),
]


def environment(side: str) -> dict[str, str]:
    """The side process's environment (set before vLLM is imported)."""
    if side not in SIDES:
        raise ValueError(f"unknown side {side!r}; expected one of {SIDES}")
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_PLUGINS": "omnigen",
        "OMNIGEN_MODELS": "omnigen_tiny,omnigen_tiny_omni",
        "VLLM_USE_V2_MODEL_RUNNER": "1" if side == "v2" else "0",
        "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
    }


def normalize(value: Any) -> Any:
    """Tensors as ``{dtype, shape, data}``; dicts with sorted keys; everything else as is."""
    import torch

    if isinstance(value, torch.Tensor):
        plain = value.detach().to("cpu")
        data = plain.float().tolist() if plain.is_floating_point() else plain.tolist()
        return {"dtype": str(plain.dtype), "shape": list(plain.shape), "data": data}
    if isinstance(value, dict):
        return {str(k): normalize(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [normalize(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(type(value).__name__)


def recording_worker(base: type, steps: list[dict[str, Any]]) -> type:
    """``base`` (a generated worker) recording each step after sampling."""

    class RecordingWorker(base):  # type: ignore[misc, valid-type]
        def sample_tokens(self, grammar_output: Any) -> Any:
            output = super().sample_tokens(grammar_output)
            state = self.omni_state()
            step_payloads = dict(getattr(state, "omni_step_payloads", {}) or {})
            requests = sorted(state.model_intermediate_buffer)
            buffers = {}
            for req_id in requests:
                buffer = state.model_intermediate_buffer.get(req_id) or {}
                codes = (
                    (buffer.get("codes") or {}).get("audio")
                    if isinstance(buffer.get("codes"), dict)
                    else None
                )
                buffers[req_id] = {
                    "keys": sorted(str(k) for k in buffer),
                    "codes": normalize(codes),
                    "meta": normalize(buffer.get("meta")),
                    "prompt_len": buffer.get("_omni_prompt_len"),
                    "computed": buffer.get("_omni_num_computed_tokens"),
                    "is_prefill": buffer.get("_omni_is_prefill"),
                }
            steps.append(
                {
                    "published": normalize(step_payloads),
                    "buffers": buffers,
                    "pending": sorted(getattr(state, "_pending_full_payload_send", {})),
                }
            )
            return output

    RecordingWorker.__qualname__ = RecordingWorker.__name__ = f"Recording{base.__name__}"
    return RecordingWorker


def _prompts(case: str, talker_codes: dict[str, Any] | None) -> list[dict[str, Any]]:
    from omnigen_testing import tiny_omni

    if case == "code2wav":
        assert talker_codes, "the code2wav case needs the talker case's payloads"
        found = []
        for _req_id, payload in sorted(talker_codes.items()):
            found.append({"prompt_token_ids": tiny_omni.talker_to_code2wav(payload)})
        return found
    return [
        {"prompt_token_ids": [(i * 37 + j) % 300 + 20 for j in range(n)]} for i, n in enumerate(PROMPT_LENS)
    ]


def _params(case: str, count: int) -> list[Any]:
    from vllm import SamplingParams

    if case == "code2wav":
        return [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False) for _ in range(count)]
    # Seeded code predictors (tts_local_seed): each request's codes follow its own generator, so
    # they do not depend on the order rows share a step in (V2 orders decodes first).
    return [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            ignore_eos=True,
            detokenize=case == "thinker",
            extra_args={"tts_local_seed": 1000 + i},
        )
        for i in range(count)
    ]


def run_case(
    case: str,
    variant: str,
    model: str,
    stage: str,
    overrides: tuple[str, ...],
    work: Path,
    talker_payloads: Any,
) -> dict[str, Any]:
    import importlib

    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from omnigen import api
    from omnigen.serving.client import stage_payload
    from omnigen_testing import tiny_omni

    arch = tiny_omni.VARIANT_ARCHS[variant]
    model_dir = tiny_omni.write_tiny_config(work / case, arch=arch, variant=variant)
    plan = api.stage_plan(model, stage, overrides)
    if overrides:
        base = api.worker_class(model, stage, overrides)
    else:
        base = getattr(importlib.import_module(plan.module), plan.worker_class)
    steps: list[dict[str, Any]] = []
    worker = recording_worker(base, steps)
    name = f"Worker_{case.replace('.', '_')}"
    setattr(sys.modules[__name__], name, worker)
    worker.__qualname__ = name
    llm = LLM(
        model=model_dir,
        worker_cls=f"{__name__}.{name}",
        skip_tokenizer_init=case != "thinker",
        **ENGINE,
    )
    try:
        prompts = _prompts(case, talker_payloads)
        outputs = llm.generate(prompts, _params(case, len(prompts)), use_tqdm=False)
        llm.llm_engine.step()  # the runner learns of the last finished requests one step late
        info = llm.collective_rpc(
            lambda w: {
                "runner": type(w.worker.model_runner).__name__,
                "target": w.worker.omni_runner_choice.target,
                "reason": w.worker.omni_runner_choice.reason,
                "state": type(w.worker.omni_state()).__name__,
                "left": w.worker.omni_request_state(),
                "record_errors": w.model_runner.model.omni_record.snapshot()["errors"],
            }
        )[0]
        results = {}
        payloads = {}
        for index, out in enumerate(outputs):
            payload = stage_payload(out)
            payloads[str(index)] = payload
            results[str(index)] = {
                "tokens": list(out.outputs[0].token_ids),
                "text": out.outputs[0].text if case == "thinker" else None,
                "payload": normalize(payload),
            }
        return {"steps": steps, "requests": results, "engine": info, "payloads": payloads}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()


def main() -> None:
    side, out = sys.argv[1], Path(sys.argv[2])
    if side == "v2":
        from omnigen_testing import mrv2_cpu

        mrv2_cpu.allow_v2_without_triton()
        kernels = mrv2_cpu.install()
    else:
        kernels = {}
    work = out.parent / f"models-{side}"
    trace: dict[str, Any] = {"side": side, "cases": {}}
    talker_payloads = None
    try:
        for case, variant, model, stage, overrides in CASES:
            result = run_case(case, variant, model, stage, overrides, work, talker_payloads)
            if case == "talker.mtp_batched":
                talker_payloads = result["payloads"]
            del result["payloads"]
            trace["cases"][case] = result
        trace["kernel_launches"] = {name: kernel.launches for name, kernel in sorted(kernels.items())}
    except BaseException:
        trace["error"] = traceback.format_exc()
    out.write_text(json.dumps(trace))
    if "error" in trace:
        print(trace["error"], file=sys.stderr)
        sys.exit(1)
