"""Run by test_generated_code.py under ``python -O``: CONTRACT 3.5's errors are explicit raises.

Drives generated runners (a plain decode-batch variant, rendered in memory: no shipped stage of
vllm-omni 0.30 batches plain decode rows; the committed qwen3_tts talker: MTP decode batch) with
bad offsets and a short batch-hook result, and prints a marker per check.
Exit status 0 only if every check held.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))

import _support as s  # noqa: E402

CONTIGUITY = "Non-MTP batched decode preprocessing requires contiguous in-bounds token offsets"


def runner_for(module: str, cls: str, step: s.Step, **kwargs):
    runner_cls = getattr(importlib.import_module(module), cls)  # the committed module, as vLLM loads it
    model, stage = module.split(".")[-2:]
    variant = SimpleNamespace(caps=s.MATRIX[model][stage], cls=lambda: runner_cls)
    return variant_rig(variant, step, **kwargs)


def variant_rig(variant, step: s.Step, **kwargs):
    recorder = s.Recorder()
    return s.rig(variant, step, recorder, s.FakeForwardContext(recorder), **kwargs), recorder


def buffers(step: s.Step):
    return {r.req_id: {"meta": {"tag": r.tag}, "_omni_is_prefill": "stale"} for r in step.rows}


def main() -> int:
    assert sys.flags.optimize >= 1, "run me with python -O"
    try:
        exec("assert False")  # noqa: S102
    except AssertionError:
        print("assert statements are active: not optimized")
        return 1
    print("OPTIMIZED")

    step = s.Step(s.rows_of(["decode", "decode_late", "decode", "cached_prefill"]), offsets=[0, 2, 3, 3])
    rig, recorder = variant_rig(s.PLAIN_BATCH_VARIANTS[0], step, buffers=buffers(step))
    before = s.runner_state(rig.runner)
    try:
        rig.runner._preprocess_rows(step.sched, step.ids(), step.embeds())
    except RuntimeError as exc:
        if CONTIGUITY not in str(exc) or recorder.events or s.runner_state(rig.runner) != before:
            print("contiguity error raised, but wrong message, hook calls or changed buffers")
            return 1
        print("CONTIGUITY_RAISED")
    else:
        print("bad offsets did not raise under -O")
        return 1

    step = s.Step(s.rows_of(["decode", "decode_late", "decode"]))
    rig, recorder = runner_for(
        "omnigen.generated.qwen3_tts.qwen3_tts",
        "Qwen3TtsRunner",
        step,
        short="updates",
        buffers=buffers(step),
    )
    before = s.runner_state(rig.runner)
    try:
        rig.runner._preprocess_rows(step.sched, step.ids(), step.embeds())
    except ValueError as exc:
        if "decode preprocessing" not in str(exc) or recorder.of("talker_mtp"):
            print("short-output error raised, but wrong message or MTP ran")
            return 1
        if s.runner_state(rig.runner) != before:
            print("short-output error raised after a buffer write")
            return 1
        print("SHORT_OUTPUT_RAISED")
    else:
        print("a short batch-hook result did not raise under -O")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
