"""Run by test_generated_code.py under ``python -O``: CONTRACT 3.5's errors are explicit raises.

Drives generated runners (a plain decode-batch variant, rendered in memory: no shipped stage of
vllm-omni 0.30 batches plain decode rows; the committed qwen3_tts talker: MTP decode batch; the
committed qwen3_omni talker: per-row hooks feeding the MTP) with bad offsets, a short batch-hook
result and the rest of issue 9's hook faults (``FAULT_CHECKS``), and prints a marker per check.
Exit status 0 only if every check held.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parents[1]))

from contract import _faults as f  # noqa: E402
from omnigen.runtime import phases  # noqa: E402
from omnigen_testing import contract_support as s  # noqa: E402

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
    for marker, *case in FAULT_CHECKS:
        if not fault_check(*case):
            return 1
        print(marker)
    return 0


BATCH = ["decode", "decode_late", "cached_prefill", "decode", "decode_late", "decode"]
ROWS = ["prefill", "tail", "decode", "cached_prefill"]
TTS = ("omnigen.generated.qwen3_tts.qwen3_tts", "Qwen3TtsRunner")
OMNI = ("omnigen.generated.qwen3_omni.talker", "Qwen3OmniTalkerRunner")
R4_6 = "model.preprocess_decode_batch for requests r4-decode, r5-decode_late, r6-decode returned"
# (marker, runner, kinds, offsets, hook, fault, call, error, message fragment)
FAULT_CHECKS = [
    (
        "MTP_OFFSETS_RAISED",
        TTS,
        ["decode", "decode_late", "decode"],
        [0, 0, 2],
        None,
        None,
        0,
        RuntimeError,
        phases.MTP_OFFSETS_ERROR + ": r1-decode (row 0) at 0, r2-decode_late (row 1) at 0",
    ),
    (
        "MTP_OFFSETS_OUT_OF_BOUNDS_RAISED",
        TTS,
        ["decode", "decode_late", "decode"],
        [0, 1, 3],
        None,
        None,
        0,
        RuntimeError,
        "r3-decode (row 2) at 3 for 3 scheduled tokens",
    ),
    (
        "BATCH_ARITY_RAISED",
        TTS,
        BATCH,
        None,
        "preprocess_decode_batch",
        "arity_2",
        1,
        ValueError,
        R4_6 + " a tuple of 2; expected a 5-tuple",
    ),
    (
        "BATCH_WIDTH_RAISED",
        TTS,
        BATCH,
        None,
        "preprocess_decode_batch",
        "wide_embeds",
        1,
        ValueError,
        "embeddings (3, 9) torch.float32, expected (3, 8)",
    ),
    (
        "BATCH_DTYPE_RAISED",
        TTS,
        BATCH,
        None,
        "preprocess_decode_batch",
        "int_embeds",
        1,
        ValueError,
        "embeddings of dtype torch.int32, expected floating point",
    ),
    (
        "BATCH_IDS_DTYPE_RAISED",
        TTS,
        BATCH,
        None,
        "preprocess_decode_batch",
        "float_ids",
        1,
        ValueError,
        "ids of dtype torch.float32, expected an integer dtype",
    ),
    (
        "BATCH_UPDATE_RAISED",
        TTS,
        BATCH,
        None,
        "preprocess_decode_batch",
        "update_list",
        1,
        ValueError,
        "request r5-decode_late's update is a list, expected a dict or None",
    ),
    (
        "BATCH_MTP_HIDDEN_RAISED",
        TTS,
        BATCH,
        None,
        "preprocess_decode_batch",
        "hidden_short",
        1,
        ValueError,
        "last_hidden (2, 8) torch.float32, expected (3, 8) floating point",
    ),
    (
        "BATCH_RAISE_UNDONE",
        TTS,
        BATCH,
        None,
        "preprocess_decode_batch",
        "raises",
        1,
        f.HookFailure,
        "raised by model.preprocess_decode_batch for requests r4-decode, r5-decode_late, r6-decode;",
    ),
    (
        "STEP_HOOK_RAISE_UNDONE",
        TTS,
        BATCH,
        None,
        "preprocess_batch",
        "raises_after_writing",
        0,
        f.HookFailure,
        "raised by model.preprocess_batch for requests r1-decode,",
    ),
    (
        "ROW_ARITY_RAISED",
        OMNI,
        ROWS,
        None,
        "preprocess",
        "arity_2",
        2,
        ValueError,
        "request r3-decode: model.preprocess returned a tuple of 2; expected a 3-tuple",
    ),
    (
        "ROW_IDS_DTYPE_RAISED",
        OMNI,
        ROWS,
        None,
        "preprocess",
        "float_ids",
        2,
        ValueError,
        "request r3-decode: model.preprocess returned 1 ids of dtype torch.float32",
    ),
    (
        "ROW_MTP_INPUTS_RAISED",
        OMNI,
        ROWS,
        None,
        "preprocess",
        "mtp_int",
        2,
        ValueError,
        "request r3-decode: model.preprocess returned no update['mtp_inputs']",
    ),
]


def fault_check(runner, kinds, offsets, hook, fault, call, error, fragment) -> bool:
    step = s.Step(s.rows_of(kinds), offsets=offsets)
    rig, recorder = runner_for(*runner, step, buffers=buffers(s.Step(s.rows_of(kinds[:2]))))
    if hook is not None:
        f.arm(rig.runner.model, hook, fault, call)
    before = s.runner_state(rig.runner)
    try:
        rig.runner._preprocess_rows(step.sched, step.ids(), step.embeds())
    except error as exc:
        message = f.hook_message(exc)
        if fragment not in message:
            print(f"{hook}/{fault}: {fragment!r} not in {message!r}")
            return False
        if s.runner_state(rig.runner) != before or recorder.of("talker_mtp"):
            print(f"{hook}/{fault}: raised after a buffer write or the MTP")
            return False
        return True
    print(f"{hook}/{fault}: did not raise {error.__name__} under -O")
    return False


if __name__ == "__main__":
    sys.exit(main())
