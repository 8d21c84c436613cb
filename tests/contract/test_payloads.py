"""CONTRACT 5.1-5.3: stage-to-stage payloads, per stage of the matrix and async-chunk variants."""

from __future__ import annotations

import pytest
import torch

from omnigen_testing.contract_support import TARGETS, Variant, bare_runner, bare_state, ids, ov, shipped

ALL = shipped()
ACCUMULATING = shipped(lambda c: c["accumulates_full_payload"])


def flip_async_chunk(v: Variant) -> Variant:
    """``v`` under ``model.async_chunk`` set to the opposite of what the model ships with."""
    now = not v.caps["async_chunk"]
    accumulates = v.caps["producer"] and not now
    changes = {
        "async_chunk": now,
        "accumulates_full_payload": accumulates,
        "defers_full_payload_d2h": accumulates and v.caps["request_end_payload"],
    }
    return Variant(
        v.model, v.stage, (f"model.async_chunk={str(now).lower()}",), tuple(sorted(changes.items()))
    )


ASYNC_FLIPPED = [
    flip_async_chunk(v)
    for v in ALL
    if v.model in ("qwen3_omni", "qwen3_tts")
    or (v.model, v.stage)
    in {
        ("qwen2_5_omni", "thinker"),
        ("qwen2_5_omni", "talker"),
        ("indextts2_5", "indextts2_5_talker"),
        ("mimo_audio", "fused_thinker_talker"),
    }
]
REQUEST_END = shipped(lambda c: c["request_end_payload"]) + [
    ov(
        "qwen2_5_omni",
        "talker",
        ("outputs.request_end_payload", "true"),
        changes={"request_end_payload": True, "defers_full_payload_d2h": True},
    ),
    # The talker as shipped (full payload): its request-end payload is deferred.
    ov(
        "qwen3_omni",
        "talker",
        ("outputs.request_end_payload", "true"),
        changes={"request_end_payload": True, "defers_full_payload_d2h": True},
    ),
    # In async-chunk mode nothing accumulates, so nothing is deferred.
    ov(
        "qwen3_omni",
        "talker",
        ("outputs.request_end_payload", "true"),
        raw=("model.async_chunk=true",),
        changes={"request_end_payload": True, "async_chunk": True, "accumulates_full_payload": False},
    ),
]


# -- 5.1 -----------------------------------------------------------------------------------------


@pytest.fixture(
    params=[
        (v, target)
        for v in ACCUMULATING + shipped(lambda c: not c["accumulates_full_payload"])[:2]
        for target in TARGETS
    ],
    ids=lambda p: f"{p[1]}-{p[0].id}",
)
def runner(request):
    """The holder of the stage's pending payloads on each target (one clause, two targets)."""
    variant, target = request.param
    return bare_runner(variant.cls()) if target == "v1" else bare_state(variant.state_cls())


def test_accumulation_appends_replaces_skips_and_filters_nothing(runner):
    """5.1: 2+-dim tensors appended on dim 0, trailing-shape change restarts, others replaced, None skipped."""
    req_a, req_b = object(), object()
    zeros = torch.zeros(2, 3)  # all-zero codec rows / prefill placeholders: kept
    step1 = {
        "codes": torch.arange(6.0).reshape(2, 3),
        "hidden": torch.ones(1, 4),
        "small": torch.tensor([1, 2]),
        "scalar_t": torch.tensor(5),
        "n": 1,
        "items": [1],
        "skip": None,
        "shape": torch.ones(2, 2),
    }
    step2 = {
        "codes": zeros,
        "hidden": torch.full((3, 4), 2.0),
        "small": torch.tensor([3]),
        "scalar_t": torch.tensor(6),
        "n": 2,
        "items": [2, 3],
        "skip": None,
        "shape": torch.ones(1, 5),
    }
    step3 = {"codes": torch.full((1, 3), 9.0), "small": None, "n": None, "shape": torch.full((2, 5), 3.0)}
    runner.accumulate_full_payload_output("a", step1, req_a)
    runner.accumulate_full_payload_output("b", {"codes": torch.ones(1, 3)}, req_b)
    runner.accumulate_full_payload_output("a", step2, req_a)
    runner.accumulate_full_payload_output("a", step3, req_b)
    payload, request = runner._materialize_full_payload_entry(runner._pending_full_payload_send["a"])
    assert request is req_b, "the latest request"
    assert payload["codes"].tolist() == step1["codes"].tolist() + zeros.tolist() + [[9.0, 9.0, 9.0]]
    assert payload["hidden"].tolist() == [[1.0] * 4] + [[2.0] * 4] * 3, "misaligned row counts are kept"
    assert payload["small"].tolist() == [3], "a 1-D tensor is replaced; a later None is skipped"
    assert payload["scalar_t"].item() == 6
    assert payload["n"] == 2 and payload["items"] == [2, 3]
    assert "skip" not in payload
    # (2, 2) then (1, 5): the key restarts; then (2, 5) appends to the restarted key.
    assert payload["shape"].tolist() == [[1.0] * 5] + [[3.0] * 5] * 2, (
        "a trailing-shape change restarts the key"
    )
    other, req = runner._materialize_full_payload_entry(runner._pending_full_payload_send["b"])
    assert other["codes"].tolist() == [[1.0, 1.0, 1.0]] and req is req_b


def test_a_tensor_key_that_changes_rank_restarts(runner):
    """5.1: a key switching between per-token (2+ dims) and latest-value tensors keeps only the newest kind."""
    runner.accumulate_full_payload_output("a", {"k": torch.ones(2, 2)}, None)
    runner.accumulate_full_payload_output("a", {"k": torch.tensor([7.0])}, None)
    payload, _ = runner._materialize_full_payload_entry(runner._pending_full_payload_send["a"])
    assert payload["k"].tolist() == [7.0]
    runner.accumulate_full_payload_output("a", {"k": torch.zeros(1, 2)}, None)
    payload, _ = runner._materialize_full_payload_entry(runner._pending_full_payload_send["a"])
    assert payload["k"].tolist() == [[0.0, 0.0]]


# -- 5.2 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ASYNC_FLIPPED, ids=ids(ASYNC_FLIPPED))
def test_accumulation_is_decided_per_stage_and_async_chunk_mode(variant):
    """5.2: producer with a full-payload function and not async-chunk -> True; decided when generating."""
    bare = object.__new__(variant.cls())  # no state at all: the answer is a generated constant
    caps = variant.caps
    assert bare._should_accumulate_full_payload_output() is (caps["producer"] and not caps["async_chunk"])


def test_a_thinker_that_publishes_text_and_feeds_the_talker_accumulates():
    """5.2: qwen3_omni's thinker (final text, producer) accumulates with async chunks off (as it
    ships: conf/model/qwen3_omni.yaml), and not with them on."""
    thinker = next(v for v in ALL if (v.model, v.stage) == ("qwen3_omni", "thinker"))
    assert thinker.caps["final_output"] == "text" and thinker.caps["producer"]
    assert not thinker.caps["async_chunk"]
    assert object.__new__(thinker.cls())._should_accumulate_full_payload_output() is True
    streaming = next(v for v in ASYNC_FLIPPED if (v.model, v.stage) == ("qwen3_omni", "thinker"))
    assert object.__new__(streaming.cls())._should_accumulate_full_payload_output() is False


# -- 5.3 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant", ALL + REQUEST_END + ASYNC_FLIPPED, ids=ids(ALL + REQUEST_END + ASYNC_FLIPPED)
)
def test_defer_only_with_request_end_payload_accumulating_and_no_prefix_cache(variant):
    """5.3: true only for a request-end-payload stage that accumulates, while no prefix cache is active."""
    runner = bare_runner(variant.cls())
    caps = variant.caps
    expected = caps["request_end_payload"] and caps["producer"] and not caps["async_chunk"]
    runner.omni_prefix_cache = None
    assert runner._should_defer_full_payload_d2h() is expected
    runner.omni_prefix_cache = object()
    assert runner._should_defer_full_payload_d2h() is False


class MoveCounter(torch.Tensor):
    """Counts every device move; a deferred step must not make any."""

    moves = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.detach):
            MoveCounter.moves += 1
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("variant", REQUEST_END[:1] + ALL[:3], ids=ids(REQUEST_END[:1] + ALL[:3]))
def test_deferred_step_outputs_are_not_built(variant):
    """5.3: _build_omni_step_outputs(..., defer_full_payload_d2h=True) returns (None, None), touching nothing."""
    runner = bare_runner(variant.cls())
    entries = [{"audio": torch.ones(2, 3).as_subclass(MoveCounter)}, None]
    MoveCounter.moves = 0
    assert runner._build_omni_step_outputs(entries, entries, defer_full_payload_d2h=True) == (None, None)
    assert MoveCounter.moves == 0
    inter, client = runner._build_omni_step_outputs(entries, [None, None], defer_full_payload_d2h=False)
    assert MoveCounter.moves > 0, "not deferred: per-step host copies are built"
    assert inter[1] is None and inter[0]["audio"].tolist() == [[1.0] * 3] * 2 and client == [None, None]
