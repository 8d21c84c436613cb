"""CONTRACT 3.7 (M-RoPE kwargs filtering) and 3.8 (request-feature attachment)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omnigen_testing.contract_support import (
    ORDERS,
    Step,
    bare_runner,
    ids,
    ov,
    request_state,
    rig,
    rows_of,
    shipped,
)

MROPE = shipped(lambda c: c["mrope"])
ATTACH = shipped(lambda c: c["attach_request_features"]) + [
    ov(
        "mimo_audio",
        "fused_thinker_talker",
        ("preprocess.decode_batch", "plain"),
        changes={"decode_batch": "plain"},
    ),
    ov(
        "qwen2_5_omni",
        "talker",
        ("preprocess.attach_request_features", "true"),
        changes={"attach_request_features": True},
    ),
]

KWARGS = {
    "mm_features": [1],
    "audio_feature_lengths": 3,
    "use_audio_in_video": True,
    "input_tokens": [5],
    "self": "x",
    "unknown": 9,
}


class Model:
    def get_mrope_input_positions(
        self, input_tokens, mm_features=None, *, audio_feature_lengths=None, use_audio_in_video=False
    ):
        raise AssertionError("only the signature is read")


class VarKwModel:
    def get_mrope_input_positions(self, input_tokens, mm_features=None, **kwargs):
        raise AssertionError


class PositionalOnlyModel:
    def get_mrope_input_positions(self, input_tokens, mm_features, /, second=None):
        raise AssertionError


def unreadable():
    def get_mrope_input_positions(*args, **kwargs):
        raise AssertionError

    get_mrope_input_positions.__signature__ = "not a signature"  # inspect.signature raises TypeError
    return SimpleNamespace(get_mrope_input_positions=get_mrope_input_positions)


@pytest.mark.parametrize("variant", MROPE, ids=ids(MROPE))
def test_mrope_kwargs_are_filtered_to_what_the_model_accepts(variant):
    """3.7: keep only accepted names, never self / input_tokens; **kwargs or no signature: the same dict."""
    runner = bare_runner(variant.cls())
    kwargs = dict(KWARGS)
    got = runner._filter_mrope_kwargs_for_model(Model(), kwargs)
    assert got == {"mm_features": [1], "audio_feature_lengths": 3, "use_audio_in_video": True}
    assert got is not kwargs and kwargs == KWARGS, "the caller's dict is not mutated"
    assert runner._filter_mrope_kwargs_for_model(VarKwModel(), kwargs) is kwargs
    assert runner._filter_mrope_kwargs_for_model(unreadable(), kwargs) is kwargs
    assert runner._filter_mrope_kwargs_for_model(PositionalOnlyModel(), {"second": 2, "mm_features": 1}) == {
        "second": 2
    }


@pytest.mark.parametrize("variant", ATTACH, ids=ids(ATTACH))
def test_attach_request_features_copies_and_fills(variant):
    """3.8: a copy with mm_features filled when missing and req_id set; no request state: same object."""
    runner = bare_runner(variant.cls())
    row = rows_of(["decode"])[0]
    state = request_state(row)
    infos = {"meta": {"x": 1}, "req_id": "wrong"}
    frozen = {"meta": {"x": 1}, "req_id": "wrong"}
    got = runner._attach_request_features(state, infos, row.req_id)
    assert got is not infos and infos == frozen, "a copy; the input is not mutated"
    assert got["mm_features"] is state.mm_features and got["req_id"] == row.req_id and got["meta"] == {"x": 1}
    own = {"mm_features": ["mine"]}
    got = runner._attach_request_features(state, own, row.req_id)
    assert got["mm_features"] == ["mine"] and got["req_id"] == row.req_id and "req_id" not in own
    for infos in ({"meta": 1}, {}):
        assert runner._attach_request_features(None, infos, row.req_id) is infos


@pytest.mark.parametrize("variant", ATTACH, ids=ids(ATTACH))
def test_every_hook_call_sees_the_request_features(variant, recorder, ctx, graph):
    """3.8: each row's infos reach its hook with mm_features and req_id; the buffer itself gets neither."""
    graph.forbid()
    step = Step(rows_of(ORDERS["interleaved"]))
    r = rig(variant, step, recorder, ctx, buffers={row.req_id: {"meta": {"k": row.tag}} for row in step.rows})
    r.runner._preprocess_rows(step.sched, step.ids(), step.embeds())
    seen = {c["req_id"]: c["infos"] for c in recorder.of("preprocess")}
    for call in recorder.of("preprocess_decode_batch"):
        seen.update({infos["request_id"]: infos for infos in call["infos"]})
    assert sorted(seen) == sorted(row.req_id for row in step.rows)
    for req_id, infos in seen.items():
        assert infos["req_id"] == req_id
        assert infos["mm_features"] is r.runner.requests[req_id].mm_features
        assert infos["request_id"] == req_id, "and the runner keys (3.1)"
        buf = r.runner.model_intermediate_buffer[req_id]
        assert "mm_features" not in buf and "req_id" not in buf
        assert buf["request_id"] == req_id
