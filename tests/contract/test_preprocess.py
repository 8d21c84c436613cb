"""CONTRACT 3.1-3.6: the preprocess phase contract, row by row.

Every stage of the spec matrix with a preprocess hook, plus decode-batching variants
(none / mtp / plain), over mixed batches of decode rows, 1-token chunked-prefill tails,
single-token prompts, cached prefills and 2-token decode spans in several orders.
"""

from __future__ import annotations

import pytest
import torch

from omnigen.pipeline import ConfigError
from omnigen.runtime import vllm_api
from omnigen_testing.contract_support import (
    BATCH_VARIANTS,
    HOOK_VARIANTS,
    ORDERS,
    PLAIN_BATCH_VARIANTS,
    Step,
    Variant,
    expected_codes,
    freeze,
    ids,
    rig,
    rows_of,
    runner_state,
    shipped,
    token_id,
)

RUNNER_KEYS = ("request_id", "_omni_prompt_len", "_omni_num_computed_tokens", "_omni_is_prefill")
HOOK_EVENTS = ("preprocess", "preprocess_decode_batch", "preprocess_batch", "talker_mtp")
CONTIGUITY = "Non-MTP batched decode preprocessing requires contiguous in-bounds token offsets"


def stale_buffers(step: Step) -> dict[str, dict]:
    return {
        r.req_id: {
            "request_id": "stale",
            "_omni_prompt_len": -1,
            "_omni_num_computed_tokens": -1,
            "_omni_is_prefill": "stale",
            "meta": {"kept": r.tag},
        }
        for r in step.rows
    }


def expected_hook_calls(variant, rows) -> list[tuple[str, object]]:
    """``("preprocess", req_id)`` or ``("batch", [req_ids])`` in call order (3.3)."""
    batching = variant.caps["decode_batch"] != "none"
    calls: list[tuple[str, object]] = []
    run: list[str] = []
    for r in rows:
        if batching and r.eligible:
            run.append(r.req_id)
            continue
        if run:
            calls.append(("batch", run))
            run = []
        calls.append(("preprocess", r.req_id))
    if run:
        calls.append(("batch", run))
    return calls


def actual_hook_calls(recorder) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for kind, detail in recorder.events:
        if kind == "preprocess":
            out.append(("preprocess", detail["req_id"]))
        elif kind == "preprocess_decode_batch":
            out.append(("batch", detail["req_ids"]))
    return out


def run_rows(r) -> None:
    r.run_rows()


CASES = [(v, order) for v in HOOK_VARIANTS for order in ORDERS]
CASE_IDS = [f"{v.id}-{order}" for v, order in CASES]


@pytest.mark.parametrize(("variant", "order"), CASES, ids=CASE_IDS)
def test_each_row_gets_exactly_one_hook_call_in_row_order(variant, order, target, recorder, ctx, graph):
    """3.2-3.4: routing, one hook call per row, adjacent decode rows batched, MTP once after the rows."""
    graph.for_policy(variant.caps["mtp_graph"] or "unsafe")
    step = Step(rows_of(ORDERS[order]))
    r = rig(variant, step, recorder, ctx, buffers=stale_buffers(step), target=target)
    run_rows(r)

    assert actual_hook_calls(recorder) == expected_hook_calls(variant, step.rows)
    called = [rid for kind, d in actual_hook_calls(recorder) for rid in ([d] if kind == "preprocess" else d)]
    assert called == [row.req_id for row in step.rows], "each row exactly once, in row order"

    batch_hook = recorder.of("preprocess_batch")
    if variant.facts["batch_hook"]:
        assert len(batch_hook) == 1 and recorder.kinds()[0] == "preprocess_batch"
        assert batch_hook[0]["req_ids"] == step.input_batch.req_ids
    else:
        assert batch_hook == []

    mtp_calls = recorder.of("talker_mtp")
    eligible = [row for row in step.rows if row.eligible]
    if variant.caps["talker_mtp"] and eligible:
        assert len(mtp_calls) == 1, "MTP rows go through the predictor once"
        last_hook = max(
            i for i, k in enumerate(recorder.kinds()) if k in ("preprocess", "preprocess_decode_batch")
        )
        assert recorder.kinds().index("talker_mtp") > last_hook, "MTP runs after every row's hook (3.4)"
        got = mtp_calls[0]["last_talker_hidden"][:, 0].tolist()
        assert got == [10.0 * row.tag + 4 for row in eligible], "MTP rows: the eligible rows, in row order"
        assert mtp_calls[0]["text_step"][:, 0].tolist() == [10.0 * row.tag + 5 for row in eligible]
        batched = variant.caps["decode_batch"] == "mtp"
        assert mtp_calls[0]["inputs_embeds"][:, 0].tolist() == [
            10.0 * row.tag + (2 if batched else 1) for row in eligible
        ]
        assert mtp_calls[0]["input_ids"].tolist() == [
            token_id(row.tag, 0) + (2000 if batched else 1000) for row in eligible
        ]
    else:
        assert mtp_calls == []
    if variant.caps["decode_batch"] == "none":
        assert recorder.of("preprocess_decode_batch") == []


@pytest.mark.parametrize(("variant", "order"), CASES, ids=CASE_IDS)
def test_rows_write_back_and_update_their_buffers(variant, order, target, recorder, ctx, graph):
    """3.1 runner keys, 3.3 write-back and update merge, 3.2 MTP codes only on eligible rows."""
    graph.for_policy(variant.caps["mtp_graph"] or "unsafe")
    step = Step(rows_of(ORDERS[order]))
    r = rig(variant, step, recorder, ctx, buffers=stale_buffers(step), target=target)
    before_ids = step.input_ids.gpu.clone()
    run_rows(r)
    caps = variant.caps
    batching = caps["decode_batch"] != "none"
    buffers = r.runner.model_intermediate_buffer

    for row, offset in zip(step.rows, step.offsets, strict=True):
        buf = buffers[row.req_id]
        # 3.1: runner-owned keys, plain Python types, stale values overwritten.
        assert buf["request_id"] == row.req_id and type(buf["request_id"]) is str
        assert buf["_omni_prompt_len"] == row.prompt_len and type(buf["_omni_prompt_len"]) is int
        assert (
            buf["_omni_num_computed_tokens"] == row.computed and type(buf["_omni_num_computed_tokens"]) is int
        )
        assert buf["_omni_is_prefill"] is row.is_prefill
        # 3.3: each row's update is merged into its buffer (one level deep).
        via_batch = batching and row.eligible
        assert buf["meta"]["kept"] == row.tag
        assert buf["meta"]["hook"] == ("batch" if via_batch else "preprocess")
        assert buf["meta"]["ids"] == [token_id(row.tag, j) for j in range(row.span)], (
            "the hook saw the scheduled ids"
        )
        assert r.runner.requests[row.req_id].additional_information_cpu is buf
        # Write-back into the persistent embeddings at the row's offset.
        got = step.inputs_embeds.gpu[offset : offset + row.span, 0].tolist()
        mtp_row = caps["talker_mtp"] and row.eligible
        value = 10.0 * row.tag + (4.5 if mtp_row else 2 if via_batch else 1)
        assert got == [value] * row.span, f"{row.req_id}: embeddings at offset {offset}"
        key0, key1 = caps["mtp_output_key"] or ("codes", "audio")
        if mtp_row:
            assert buf[key0][key1].tolist() == [expected_codes(row.tag)]
        else:
            assert key1 not in buf.get(key0, {}), f"{row.req_id} is not an MTP row"
        if via_batch and caps["decode_batch"] == "plain":
            # 3.3 without MTP: the hook may rewrite ids, written in place.
            assert int(step.input_ids.gpu[offset]) == token_id(row.tag, 0) + 2000

    # Rows past the scheduled tokens stay untouched.
    assert torch.equal(step.input_ids.gpu[step.total :], before_ids[step.total :])
    assert (step.inputs_embeds.gpu[step.total :] == -99.0).all()


@pytest.mark.parametrize("variant", HOOK_VARIANTS, ids=ids(HOOK_VARIANTS))
def test_hook_sees_scheduled_inputs_and_runner_keys(variant, target, recorder, ctx, graph):
    """3.1/3.3: the hook reads the persistent buffers and sees the runner keys in its infos."""
    graph.for_policy(variant.caps["mtp_graph"] or "unsafe")
    step = Step(rows_of(ORDERS["interleaved"]))
    r = rig(variant, step, recorder, ctx, buffers=stale_buffers(step), target=target)
    run_rows(r)
    by_id = {row.req_id: row for row in step.rows}
    for call in recorder.of("preprocess"):
        row = by_id[call["req_id"]]
        assert call["input_ids"].tolist() == [token_id(row.tag, j) for j in range(row.span)]
        assert (call["input_embeds"] == -float(row.tag)).all()
        assert call["infos"]["_omni_is_prefill"] is row.is_prefill
        assert call["infos"]["_omni_num_computed_tokens"] == row.computed
        assert call["infos"]["_omni_prompt_len"] == row.prompt_len
    for call in recorder.of("preprocess_decode_batch"):
        rows = [by_id[rid] for rid in call["req_ids"]]
        assert call["input_ids"].reshape(-1).tolist() == [token_id(row.tag, 0) for row in rows]
        for infos, row in zip(call["infos"], rows, strict=True):
            assert infos["request_id"] == row.req_id and infos["_omni_is_prefill"] is False
            assert infos["_omni_num_computed_tokens"] == row.computed


@pytest.mark.parametrize("variant", HOOK_VARIANTS, ids=ids(HOOK_VARIANTS))
def test_chunked_prefill_tail_is_prefill_until_the_prompt_is_computed(variant, target, recorder, ctx, graph):
    """3.1/3.2: a 5-token prompt scheduled 4 then 1 is prefill at computed=4, decode from computed=5."""
    graph.for_policy(variant.caps["mtp_graph"] or "unsafe")
    routed = variant.caps["talker_mtp"] or variant.caps["decode_batch"] != "none"
    r = None
    for computed, span, prefill in ((0, 4, True), (4, 1, True), (5, 1, False)):
        rows = rows_of(["prefill", "decode", "decode_late"])
        rows[0].prompt_len, rows[0].computed, rows[0].span = 5, computed, span
        step = Step(rows)
        if r is None:
            r = rig(variant, step, recorder, ctx, target=target)
        else:
            r.use_step(step)
        recorder.events.clear()
        run_rows(r)
        tail = rows[0].req_id
        buf = r.runner.model_intermediate_buffer[tail]
        assert buf["_omni_is_prefill"] is prefill and buf["_omni_num_computed_tokens"] == computed
        in_mtp = [float(v) for call in recorder.of("talker_mtp") for v in call["last_talker_hidden"][:, 0]]
        in_batch = [rid for call in recorder.of("preprocess_decode_batch") for rid in call["req_ids"]]
        per_row = [call["req_id"] for call in recorder.of("preprocess")]
        if prefill or not routed:
            assert tail in per_row and tail not in in_batch
            assert 10.0 * rows[0].tag + 4 not in in_mtp
        else:
            if variant.caps["decode_batch"] != "none":
                assert in_batch == [row.req_id for row in rows], "the decode row joins its neighbours"
            if variant.caps["talker_mtp"]:
                assert in_mtp == [10.0 * row.tag + 4 for row in rows]


@pytest.mark.parametrize("variant", HOOK_VARIANTS, ids=ids(HOOK_VARIANTS))
def test_runner_keys_land_in_a_buffer_the_request_did_not_have(variant, target, recorder, ctx, graph):
    """3.1: a request with no buffer yet gets one holding the runner keys (and its mirror)."""
    graph.for_policy(variant.caps["mtp_graph"] or "unsafe")
    step = Step(rows_of(["single_prompt", "decode", "decode_late", "decode_span2"]))
    r = rig(variant, step, recorder, ctx, target=target)
    run_rows(r)
    for row in step.rows:
        buf = r.runner.model_intermediate_buffer[row.req_id]
        assert {k: buf[k] for k in RUNNER_KEYS} == {
            "request_id": row.req_id,
            "_omni_prompt_len": row.prompt_len,
            "_omni_num_computed_tokens": row.computed,
            "_omni_is_prefill": row.is_prefill,
        }
        assert r.runner.requests[row.req_id].additional_information_cpu is buf


# -- 3.5: bad input fails before anything changes ---------------------------------------------

# Rows: three single-token decode rows, then a cached prefill (2 tokens): 5 scheduled tokens.
BAD_OFFSETS = {
    "gap": [0, 2, 3, 3],
    "reversed": [2, 1, 0, 3],
    "duplicate": [0, 0, 1, 3],
    "negative_start": [-1, 0, 1, 3],
    "past_token_count": [3, 4, 5, 0],
}
BAD_CASES = [(v, name) for v in PLAIN_BATCH_VARIANTS for name in BAD_OFFSETS]


@pytest.mark.parametrize(("variant", "case"), BAD_CASES, ids=[f"{v.id}-{c}" for v, c in BAD_CASES])
def test_bad_decode_batch_offsets_raise_before_any_hook_and_change_nothing(
    variant, case, target, recorder, ctx, graph
):
    """3.5: non-contiguous / out-of-bounds offsets of a non-MTP decode batch."""
    graph.forbid()
    step = Step(rows_of(["decode", "decode_late", "decode", "cached_prefill"]), offsets=BAD_OFFSETS[case])
    r = rig(variant, step, recorder, ctx, buffers=stale_buffers(step), target=target)
    before = runner_state(r.runner)
    with pytest.raises(RuntimeError, match=CONTIGUITY):
        run_rows(r)
    assert [k for k in recorder.kinds() if k in HOOK_EVENTS] == [], "no hook was called"
    assert runner_state(r.runner) == before, "every buffer unchanged"


@pytest.mark.parametrize("variant", PLAIN_BATCH_VARIANTS, ids=ids(PLAIN_BATCH_VARIANTS))
def test_bad_offsets_after_a_prefill_row_fail_before_its_hook(variant, target, recorder, ctx, graph):
    """3.5: the check precedes every hook, including the per-row hook of an earlier row."""
    graph.forbid()
    step = Step(rows_of(["cached_prefill", "decode", "decode_late", "decode"]), offsets=[0, 1, 2, 4])
    r = rig(variant, step, recorder, ctx, buffers=stale_buffers(step), target=target)
    before = runner_state(r.runner)
    with pytest.raises(RuntimeError, match=CONTIGUITY):
        run_rows(r)
    assert [k for k in recorder.kinds() if k in HOOK_EVENTS] == []
    assert runner_state(r.runner) == before


SHORT = ("ids", "embeds", "updates")
SHORT_CASES = [
    (v, s, order) for v in BATCH_VARIANTS for s in SHORT for order in ("batch_only", "batch_then_row")
]


@pytest.mark.parametrize(
    ("variant", "short", "order"), SHORT_CASES, ids=[f"{v.id}-{s}-{o}" for v, s, o in SHORT_CASES]
)
def test_short_batch_hook_output_raises_before_any_buffer_write(
    variant, short, order, target, recorder, ctx, graph
):
    """3.5: fewer ids / embeddings / updates than rows: ValueError, nothing written, no MTP."""
    graph.for_policy(variant.caps["mtp_graph"] or "unsafe")
    kinds = ["decode", "decode_late", "decode"] + (["cached_prefill"] if order == "batch_then_row" else [])
    step = Step(rows_of(kinds))
    r = rig(variant, step, recorder, ctx, short=short, buffers=stale_buffers(step), target=target)
    before = runner_state(r.runner)
    with pytest.raises(ValueError, match="decode preprocessing"):
        run_rows(r)
    assert recorder.of("talker_mtp") == [] and recorder.of("preprocess") == []
    assert runner_state(r.runner) == before, "every buffer unchanged, including the runner keys"


@pytest.mark.parametrize("variant", BATCH_VARIANTS, ids=ids(BATCH_VARIANTS))
def test_short_batch_output_leaves_no_buffer_behind(variant, target, recorder, ctx, graph):
    """3.5: requests that had no buffer still have none after the failed step."""
    graph.for_policy(variant.caps["mtp_graph"] or "unsafe")
    step = Step(rows_of(["decode", "decode_late"]))
    r = rig(variant, step, recorder, ctx, short="updates", target=target)
    before = runner_state(r.runner)
    with pytest.raises(ValueError, match="decode preprocessing"):
        run_rows(r)
    assert runner_state(r.runner) == before


# -- 3.6: the hook reads the persistent buffers; a wrapper's input_ids=None --------------------


class BasePreprocess:
    """Stands in for vLLM's ``GPUModelRunner._preprocess``: a multimodal wrapper's outputs. Its
    embeddings are ``embeds``, or (None) the persistent buffer's slice, as vLLM's
    ``_prepare_mm_inputs`` hands them back."""

    def __init__(self, input_ids, embeds=None):
        self.input_ids = input_ids
        self.embeds = embeds
        self.positions = torch.arange(3)
        self.intermediate = object()
        self.model_kwargs = {"wrapper": 1}
        self.ec = object()
        self.calls = []

    @property
    def method(self):
        def _preprocess(runner, scheduler_output, num_input_tokens, intermediate_tensors=None):
            self.calls.append((scheduler_output, num_input_tokens, intermediate_tensors))
            embeds = runner.inputs_embeds.gpu[:num_input_tokens] if self.embeds is None else self.embeds
            return self.input_ids, embeds, self.positions, self.intermediate, self.model_kwargs, self.ec

        return _preprocess


@pytest.mark.parametrize("variant", HOOK_VARIANTS, ids=ids(HOOK_VARIANTS))
def test_preprocess_with_no_ids_from_the_wrapper_uses_the_persistent_buffers(
    variant, recorder, ctx, graph, monkeypatch
):
    """3 / 3.6: the 6-tuple; ids and embeddings are the persistent buffers; the hook sees the ids."""
    graph.for_policy(variant.caps["mtp_graph"] or "unsafe")
    step = Step(rows_of(["prefill", "decode", "tail"]))
    r = rig(variant, step, recorder, ctx)
    base = BasePreprocess(None)
    monkeypatch.setattr(vllm_api.GPUModelRunner, "_preprocess", base.method)
    n = step.total + 2
    out = r.runner._preprocess(step.sched, n, "it")
    assert len(out) == 6 and base.calls == [(step.sched, n, "it")]
    ids_out, embeds_out, positions, intermediate, kwargs, ec = out
    assert ids_out is not None and ids_out.shape == (n,)
    assert ids_out.data_ptr() == step.input_ids.gpu.data_ptr(), "returned ids are the input_ids buffer"
    assert embeds_out.data_ptr() == step.inputs_embeds.gpu.data_ptr() and embeds_out.shape[0] == n
    assert positions is base.positions and intermediate is base.intermediate
    assert kwargs is base.model_kwargs and ec is base.ec
    seen = {c["req_id"]: c["input_ids"].tolist() for c in recorder.of("preprocess")}
    for call in recorder.of("preprocess_decode_batch"):
        seen.update(
            {rid: [i] for rid, i in zip(call["req_ids"], call["input_ids"].reshape(-1).tolist(), strict=True)}
        )
    for row in step.rows:
        assert seen[row.req_id] == [token_id(row.tag, j) for j in range(row.span)]


@pytest.mark.parametrize("variant", HOOK_VARIANTS, ids=ids(HOOK_VARIANTS))
def test_preprocess_keeps_the_ids_slice_vllm_hands_back(variant, recorder, ctx, graph, monkeypatch):
    """3 / 3.6 on a text model: vLLM hands back the ids buffer's slice and no embeddings; the hooks
    read and write that slice (not a second one) and the embeddings buffer's."""
    graph.for_policy(variant.caps["mtp_graph"] or "unsafe")
    step = Step(rows_of(["prefill", "decode", "tail"]))
    r = rig(variant, step, recorder, ctx)
    n = step.total + 2
    vllm_ids = step.input_ids.gpu[:n]

    def text_model_preprocess(runner, scheduler_output, num_input_tokens, intermediate_tensors=None):
        return vllm_ids, None, None, None, {}, None

    monkeypatch.setattr(vllm_api.GPUModelRunner, "_preprocess", text_model_preprocess)
    ids_out, embeds_out, *_ = r.runner._preprocess(step.sched, n)
    assert ids_out is vllm_ids
    assert embeds_out.data_ptr() == step.inputs_embeds.gpu.data_ptr() and embeds_out.shape[0] == n
    hooked = [call["req_id"] for call in recorder.of("preprocess")]
    hooked += [req_id for call in recorder.of("preprocess_decode_batch") for req_id in call["req_ids"]]
    assert sorted(hooked) == sorted(row.req_id for row in step.rows)


NO_HOOK = shipped(lambda c: not c["preprocess_hook"])


@pytest.mark.parametrize("variant", NO_HOOK, ids=ids(NO_HOOK))
def test_preprocess_without_a_hook_returns_vllms_inputs(variant, recorder, monkeypatch):
    """3: a stage without a preprocess hook hands back vLLM's 6-tuple untouched."""
    step = Step(rows_of(["prefill", "decode"]))
    runner = rig(variant, step, recorder, None).runner
    base = BasePreprocess(torch.arange(6), torch.zeros(3, 2))
    monkeypatch.setattr(vllm_api.GPUModelRunner, "_preprocess", base.method)
    out = runner._preprocess(step.sched, 6)
    assert len(out) == 6
    expected = (base.input_ids, base.embeds, base.positions, base.intermediate, base.model_kwargs, base.ec)
    assert all(a is b for a, b in zip(out, expected, strict=True))
    assert recorder.events == []
    assert freeze(step.input_ids) == freeze(Step(rows_of(["prefill", "decode"])).input_ids)


def test_an_mtp_stage_never_batches_decode_rows_away_from_the_mtp(target, recorder, ctx, graph):
    """3.2/3.3: with MTP the batch hook is the 5-tuple one; plain batching must be refused when generating."""
    overrides = ("model.stages.qwen3_tts.preprocess.decode_batch=plain",)
    try:
        variant = Variant("qwen3_tts", "qwen3_tts", overrides, (("decode_batch", "plain"),))
        variant.cls()
    except ConfigError:
        return  # refused when generating: what the contract needs
    graph.allow()
    step = Step(rows_of(["decode", "decode_late", "tail"]))
    run_rows(rig(variant, step, recorder, ctx, target=target))
    hidden = [float(v) for call in recorder.of("talker_mtp") for v in call["last_talker_hidden"][:, 0]]
    assert hidden == [10.0 * row.tag + 4 for row in step.rows if row.eligible]
