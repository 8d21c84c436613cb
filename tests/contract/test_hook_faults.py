"""Every bad hook output, on every hook path, leaves the step as it was (issue 9, item 5).

Each fault of ``_faults.FAULTS`` is armed on a hook of every stage variant that has the hook: the
per-row ``preprocess`` (on its third call, after two rows were written), ``preprocess_decode_batch``
(plain and MTP forms, on its second call, after a first batch and a per-row row were written),
and ``preprocess_batch`` (which writes into the buffers, then raises). Bad MTP decode-batch
offsets fail before any hook. Every case: the error names the hook and the request(s), and
``runner_state`` (buffers and their identity, mirrors, ids, embeddings, MTP buffers,
generators) equals what it was before the step; the MTP never ran.
"""

from __future__ import annotations

import pytest
import torch

from omnigen.runtime import phases
from omnigen_testing.contract_support import HOOK_VARIANTS, Step, Variant, ids, rig, rows_of, runner_state

from ._faults import (
    BATCH_FAULTS,
    BATCH_MTP_FAULTS,
    ROW_FAULTS,
    ROW_MTP_FAULTS,
    STEP_FAULTS,
    HookFailure,
    arm,
    hook_message,
)

# The third per-row call: the decode row on a stage without decode batching (an MTP row on an MTP
# stage), cached_prefill on a stage with it.
ROW_KINDS = ["prefill", "tail", "decode", "cached_prefill", "single_prompt", "prefill"]
# Two decode batches with a per-row row between them: the fault comes on the second batch.
BATCH_KINDS = ["decode", "decode_late", "cached_prefill", "decode", "decode_late", "decode"]

NONE_MTP = [v for v in HOOK_VARIANTS if v.caps["talker_mtp"] and v.caps["decode_batch"] == "none"]
BATCHED = [v for v in HOOK_VARIANTS if v.caps["decode_batch"] != "none"]
MTP_BATCHED = [v for v in BATCHED if v.caps["decode_batch"] == "mtp"]
STEP_HOOKED = [v for v in HOOK_VARIANTS if v.facts["batch_hook"]]


def _cases(variants: list[Variant], faults: dict) -> list:
    return [pytest.param(v, f, id=f"{v.id}-{f}") for v in variants for f in faults]


def prepared(variant: Variant, step: Step, recorder, ctx, graph, target="v1"):
    """A rig whose first two rows have buffers (with sub-dicts) and mirrors; the rest have none."""
    graph.for_policy(variant.caps["mtp_graph"] or "unsafe")
    buffers = {
        row.req_id: {
            "meta": {"tag": row.tag},
            "codes": {"audio": torch.ones(1, 2)},
            "_omni_is_prefill": "stale",
        }
        for row in step.rows[:2]
    }
    return rig(variant, step, recorder, ctx, buffers=buffers, target=target)


def run_faulty(r, hook: str, fault: str, call: int):
    arm(r.runner.model, hook, fault, call)
    before = runner_state(r.runner)
    objects = {k: id(v) for k, v in r.runner.model_intermediate_buffer.items()}
    error = HookFailure if fault.startswith("raises") else ValueError
    with pytest.raises(error) as err:
        r.run_rows()
    assert runner_state(r.runner) == before, "the step left something changed"
    assert {k: id(v) for k, v in r.runner.model_intermediate_buffer.items()} == objects, (
        "buffers restored in place"
    )
    assert r.recorder.of("talker_mtp") == [], "the MTP ran after a bad hook output"
    if hook != "preprocess_batch":
        assert len(r.recorder.of(hook)) == call + 1, "the fault came on the armed call"
    return hook_message(err.value)


@pytest.mark.parametrize(
    ("variant", "fault"), _cases(HOOK_VARIANTS, ROW_FAULTS) + _cases(NONE_MTP, ROW_MTP_FAULTS)
)
def test_a_bad_per_row_result_undoes_the_step(variant, fault, target, recorder, ctx, graph):
    r = prepared(variant, Step(rows_of(ROW_KINDS)), recorder, ctx, graph, target)
    message = run_faulty(r, "preprocess", fault, 2)
    third = recorder.of("preprocess")[2]["req_id"]
    if fault == "raises":
        assert f"raised by model.preprocess for request {third};" in message
    else:
        assert f"request {third}: model.preprocess returned" in message
        # The check that refused the result (in the generated row loop for a talker-MTP row) and
        # the message saying why agree: the message names a problem.
        assert message.split("model.preprocess returned", 1)[1].strip(" ;"), message
    if fault.startswith("arity") or fault in ("not_a_tuple", "none"):
        assert "expected a 3-tuple (ids, embeddings, update)" in message


@pytest.mark.parametrize(
    ("variant", "fault"), _cases(BATCHED, BATCH_FAULTS) + _cases(MTP_BATCHED, BATCH_MTP_FAULTS)
)
def test_a_bad_decode_batch_result_undoes_the_step(variant, fault, target, recorder, ctx, graph):
    r = prepared(variant, Step(rows_of(BATCH_KINDS)), recorder, ctx, graph, target)
    message = run_faulty(r, "preprocess_decode_batch", fault, 1)
    batch = recorder.of("preprocess_decode_batch")[1]["req_ids"]
    assert batch == [row.req_id for row in r.step.rows[3:]]
    if fault == "raises":
        assert f"raised by model.preprocess_decode_batch for requests {', '.join(batch)};" in message
        return
    assert (
        f"batched decode preprocessing: model.preprocess_decode_batch for requests {', '.join(batch)}"
        in message
    )
    if fault.startswith("update_"):
        assert f"request {batch[1]}'s update is a" in message
    if fault.startswith("arity") or fault in ("not_a_tuple", "none"):
        arity = 5 if variant.caps["talker_mtp"] else 3
        assert f"expected a {arity}-tuple" in message


@pytest.mark.parametrize(("variant", "fault"), _cases(STEP_HOOKED, STEP_FAULTS))
def test_a_raising_step_hook_undoes_what_it_wrote(variant, fault, target, recorder, ctx, graph):
    r = prepared(variant, Step(rows_of(BATCH_KINDS)), recorder, ctx, graph, target)
    message = run_faulty(r, "preprocess_batch", fault, 0)
    everyone = ", ".join(row.req_id for row in r.step.rows)
    assert f"raised by model.preprocess_batch for requests {everyone};" in message
    assert recorder.kinds() == ["preprocess_batch"], "no row hook ran after the step hook failed"


MTP_BAD_OFFSETS = {
    "duplicate": ([0, 0, 2], ["r1-decode (row 0) at 0", "r2-decode_late (row 1) at 0"]),
    "past_the_end": ([0, 1, 3], ["r3-decode (row 2) at 3"]),
    "negative": ([-1, 1, 2], ["r1-decode (row 0) at -1"]),
    "far_past_the_end": ([0, 1, 90], ["r3-decode (row 2) at 90"]),
}


@pytest.mark.parametrize("bad", sorted(MTP_BAD_OFFSETS))
@pytest.mark.parametrize("variant", MTP_BATCHED, ids=ids(MTP_BATCHED))
def test_bad_mtp_batch_offsets_fail_before_any_hook(variant, bad, target, recorder, ctx, graph):
    graph.for_policy(variant.caps["mtp_graph"] or "unsafe")
    offsets, named = MTP_BAD_OFFSETS[bad]
    step = Step(rows_of(["decode", "decode_late", "decode"]), offsets=offsets)
    r = rig(variant, step, recorder, ctx, buffers={step.rows[0].req_id: {"meta": {"tag": 1}}}, target=target)
    before = runner_state(r.runner)
    with pytest.raises(RuntimeError) as err:
        r.run_rows()
    message = str(err.value)
    assert phases.MTP_OFFSETS_ERROR in message and "no hook was called" in message
    for fragment in named:
        assert fragment in message
    assert recorder.events == [], "a hook ran before the offsets were checked"
    assert runner_state(r.runner) == before


@pytest.mark.parametrize("variant", MTP_BATCHED, ids=ids(MTP_BATCHED))
def test_distinct_in_bounds_mtp_offsets_in_any_order_are_taken(variant, target, recorder, ctx, graph):
    """The MTP batch gathers and scatters by index: distinct offsets need not be increasing."""
    graph.for_policy(variant.caps["mtp_graph"] or "unsafe")
    step = Step(rows_of(["decode", "decode_late", "decode"]), offsets=[2, 0, 1])
    r = rig(variant, step, recorder, ctx, target=target)
    r.run_rows()
    (call,) = recorder.of("preprocess_decode_batch")
    assert call["input_ids"].tolist() == [5002, 5000, 5001]
    # Each row's rewritten id (+2000) goes back to its own offset.
    assert r.runner.input_ids.gpu[:3].tolist() == [7000, 7001, 7002]
    # Row i's embedding (10*tag+2, then the predictor's 10*tag+4.5) lands at its own offset.
    embeds = step.inputs_embeds.gpu[:3, 0].tolist()
    assert embeds == [10 * 2 + 4.5, 10 * 3 + 4.5, 10 * 1 + 4.5]
