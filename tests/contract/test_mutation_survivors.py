"""Behaviour the rest of the suite let a mutant change unnoticed (issue 37, docs/mutation.md).

Each test here was written against surviving mutants (``scripts/mutation``) and fails with them
applied: the scheduler must not fold rows that arrive for a request already aborted (8.1); a
replacing payload's own bookkeeping keys win over the old buffer's (4.3); a GPU-resident key's
merge stores an owned copy, never the producer's tensor (4.1); and what the mutation run found
besides (the streaming output channel, the merge rule's edge cases).
"""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from omnigen.runtime import buffers, vllm_api
from omnigen.runtime.scheduler import (
    PAYLOAD_KEY,
    STREAM_KEY,
    OmniAsyncScheduler,
    OmniScheduler,
    scheduler_cls_name,
)
from omnigen.serving.client import stage_payload
from omnigen_testing.contract_support import DeviceTensor, ids, new_request, on_device, shipped
from omnigen_testing.tiny_omni import TALKER_ARCH, write_tiny_config

from ._engine_config import engine_config
from .test_buffers import MARKER, REPLACING, admit, mirrored, replacement_step, runner_with

# -- 8.1: rows for an aborted request ------------------------------------------------------------


@pytest.fixture(scope="module")
def scheduler_config(tmp_path_factory):
    config = engine_config(write_tiny_config(tmp_path_factory.mktemp("ckpt"), TALKER_ARCH))
    config.cache_config.num_gpu_blocks = 8  # what the engine core sets from the workers' profile
    return config


def omni_scheduler(config) -> OmniScheduler:
    """omnigen's scheduler on vLLM's own ``Scheduler``, as the engine core builds it."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    kv_cache = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layers.0.attn"], attention)]
    )
    # Positionally (test_v1_runner_choice builds it by keyword): the mixin forwards both.
    return OmniScheduler(config, kv_cache, StructuredOutputManager(config), 16)


def run_step(scheduler: OmniScheduler, rows: dict[str, dict]) -> dict:
    """One engine step: schedule, every scheduled request samples one token and publishes its
    ``rows``; the step's outputs by request."""
    step = scheduler.schedule()
    req_ids = list(step.num_scheduled_tokens)
    output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=[[7] for _ in req_ids],
    )
    published = {req_id: rows[req_id] for req_id in req_ids if req_id in rows}
    outputs = scheduler.update_from_output(step, vllm_api.attach_step_payloads(output, published))
    return {out.request_id: out for batch in outputs.values() for out in batch.outputs}


def payload_of(output) -> dict | None:
    params = output.kv_transfer_params or {}
    return stage_payload(params, required=True) if PAYLOAD_KEY in params else None


def test_rows_arriving_for_an_already_aborted_request_are_not_folded(scheduler_config):
    """A request aborted while its step ran (the client went away; with async scheduling the step's
    output comes after the abort): the rows that step published for it must not be folded. The
    abort already dropped its pending payload, so a folded row would never be handed over or
    freed, one entry per aborted request for the life of the engine."""
    scheduler = omni_scheduler(scheduler_config)
    for req_id in ("gone", "kept"):
        scheduler.add_request(Request(req_id, [1, 2, 3], SamplingParams(max_tokens=8), None))
    step = scheduler.schedule()
    assert set(step.num_scheduled_tokens) == {"gone", "kept"}
    aborted = scheduler.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in aborted] == ["gone"]

    rows = {"gone": {"audio": torch.ones(3, 2)}, "kept": {"audio": torch.full((3, 2), 2.0)}}
    output = ModelRunnerOutput(
        req_ids=["gone", "kept"], req_id_to_index={"gone": 0, "kept": 1}, sampled_token_ids=[[7], [7]]
    )
    scheduler.update_from_output(step, vllm_api.attach_step_payloads(output, rows))

    assert "gone" not in scheduler.omni_pending, "an aborted request's late rows are dropped"
    assert scheduler.omni_pending.keys() == {"kept"}
    assert torch.equal(scheduler.omni_pending["kept"].chunks["audio"][0], rows["kept"]["audio"])


# -- 4.3: the payload's own bookkeeping keys win ------------------------------------------------


@pytest.mark.parametrize("path", ["new_buffer", "new_serialized"])
@pytest.mark.parametrize("variant", REPLACING, ids=ids(REPLACING))
def test_a_replacing_payloads_own_bookkeeping_keys_win_over_the_old_buffers(variant, path, target):
    """4.3, new-request path: of the old buffer only ``meta.num_processed_tokens`` and
    ``meta.resumable`` survive, and only where the payload lacks them. A payload that carries
    them (a producer restarting a request from a known point) keeps its own values, also a falsy
    0 / False against the old buffer's truthy ones."""
    old = {"codes": {"old": torch.arange(3)}, "meta": {"num_processed_tokens": 9, "resumable": True}}
    runner = runner_with(variant, "a", "b", buffers={"a": old}, target=target)
    own = {"num_processed_tokens": 0, "resumable": False}
    payload = {"codes": {"audio": torch.arange(4)}, "meta": {MARKER: True, **own}}
    admit(runner, replacement_step(path, payload), target)
    meta = runner.model_intermediate_buffer["a"]["meta"]
    assert (meta["num_processed_tokens"], meta["resumable"]) == (0, False), meta
    assert "old" not in runner.model_intermediate_buffer["a"]["codes"]
    assert mirrored(runner, "a")

    # Only one of the two carried: the other still comes from the old buffer.
    runner = runner_with(variant, "a", "b", buffers={"a": old}, target=target)
    payload = {"codes": {"audio": torch.arange(4)}, "meta": {MARKER: True, "num_processed_tokens": 4}}
    admit(runner, replacement_step(path, payload), target)
    meta = runner.model_intermediate_buffer["a"]["meta"]
    assert (meta["num_processed_tokens"], meta["resumable"]) == (4, True), meta


# -- 4.1: the owned device copy of a per-request merge -----------------------------------------

RESIDENT = shipped(lambda c: bool(c["gpu_resident_keys"]))


@pytest.mark.parametrize("variant", RESIDENT, ids=ids(RESIDENT))
def test_a_per_request_merge_stores_an_owned_copy_of_a_gpu_resident_tensor(variant, target):
    """4.1 on ``_update_intermediate_buffer`` (one request's update, outside a step's batched
    merge): a GPU-resident key keeps an owned device copy. The producer's tensor is often a view
    of a buffer it reuses (a CUDA graph's static output, replayed next step); storing that object
    would let the next step rewrite what the buffer holds."""
    kind, qualifier = next(iter(variant.caps["gpu_resident_keys"])).split(".")
    runner = runner_with(variant, "a", target=target)
    produced = on_device(torch.arange(4.0))
    runner._update_intermediate_buffer("a", {kind: {qualifier: produced}})
    stored = runner.model_intermediate_buffer["a"][kind][qualifier]
    assert type(stored) is DeviceTensor, "kept on the device"
    assert stored is not produced, "the producer's own tensor object was stored"
    assert stored.untyped_storage().data_ptr() != produced.untyped_storage().data_ptr()
    produced.fill_(-1.0)  # the producer's buffer is rewritten (the next replay)
    assert stored.tolist() == [0.0, 1.0, 2.0, 3.0]


# -- 8.1: the rest of the output channel ---------------------------------------------------------


def row(n: int) -> dict:
    return {"audio": torch.full((1, 2), float(n))}


def rows_up_to(n: int) -> torch.Tensor:
    return torch.arange(1.0, n + 1).repeat_interleave(2).reshape(n, 2)


def test_each_finished_request_of_a_step_gets_its_payload_whatever_precedes_it(scheduler_config):
    """A step's outputs in vLLM's order: an unfinished request, then a finished one that published
    nothing, then a finished one that did. Neither of the first two may stop the third getting
    its payload, and the one without rows gets none (and no error)."""
    scheduler = omni_scheduler(scheduler_config)
    for req_id, max_tokens in (("running", 5), ("silent", 1), ("done", 1)):
        scheduler.add_request(Request(req_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens), None))
    outs = run_step(scheduler, {"running": row(1), "done": row(1)})
    assert list(outs) == ["running", "silent", "done"], "the order this test is about"
    assert outs["running"].finish_reason is None and outs["done"].finish_reason is not None
    assert payload_of(outs["running"]) is None and payload_of(outs["silent"]) is None
    assert torch.equal(payload_of(outs["done"])["audio"], rows_up_to(1))
    assert scheduler.omni_pending.keys() == {"running"}


STREAMS = {
    "listed points, then every 3": ({"publish_at": [1, 2, 4], "every": 3}, [1, 2, 4, 7, 10]),
    "every 2 only": ({"every": 2}, [2, 4, 6, 8, 10]),
    "a listed point, then every token (the default)": ({"publish_at": [3]}, [3, 4, 5, 6, 7, 8, 9, 10]),
}


@pytest.mark.parametrize("case", list(STREAMS))
def test_a_streaming_request_gets_its_whole_payload_so_far_at_each_publishing_point(scheduler_config, case):
    """``omnigen_stream`` (a streaming edge): the payload so far goes out on the request's
    unfinished outputs once it has sampled each listed count of tokens, then every ``every``
    more (default 1), always whole; a request without it gets nothing until it finishes. The
    pending rows are kept as one piece after each publication (``payloads.compact``). When the
    request finishes, or is aborted, its publishing state goes with it."""
    stream, expected = STREAMS[case]
    scheduler = omni_scheduler(scheduler_config)
    requests = [("stream", stream), ("plain", None), ("cut", stream), ("quiet", stream)]
    for req_id, points in requests:  # "quiet" streams but publishes no rows: it gets nothing
        extra = {STREAM_KEY: points} if points else None
        params = SamplingParams(max_tokens=12, extra_args=extra)
        scheduler.add_request(Request(req_id, [1, 2, 3], params, None))
    published = []
    for n in range(1, 11):
        outs = run_step(scheduler, {"stream": row(n), "plain": row(n), "cut": row(n)})
        assert payload_of(outs["plain"]) is None, "no stream: nothing before it finishes"
        assert payload_of(outs["quiet"]) is None, "no rows: nothing to publish"
        payload = payload_of(outs["stream"])
        if payload is not None:
            published.append(n)
            assert torch.equal(payload["audio"], rows_up_to(n)), f"the whole payload after {n} tokens"
            assert len(scheduler.omni_pending["stream"].chunks["audio"]) == 1, "kept as one piece"
        if n == 5:
            scheduler.finish_requests("cut", RequestStatus.FINISHED_ABORTED)
            assert "cut" not in scheduler.omni_pending and "cut" not in scheduler.omni_next_publish
    assert published == expected
    for n in (11, 12):
        outs = run_step(scheduler, {"stream": row(n), "plain": row(n)})
    assert outs["stream"].finish_reason is not None
    assert torch.equal(payload_of(outs["stream"])["audio"], rows_up_to(12))
    assert torch.equal(payload_of(outs["plain"])["audio"], rows_up_to(12))
    assert scheduler.omni_pending == {} and scheduler.omni_next_publish == {}


def test_the_scheduler_cls_name_vllm_loads():
    """``scheduler_cls_name`` (benchmarks/pipeline.py): the string resolves to the class meant."""
    import importlib

    for async_scheduling, cls in ((False, OmniScheduler), (True, OmniAsyncScheduler)):
        module, _, name = scheduler_cls_name(async_scheduling).rpartition(".")
        assert getattr(importlib.import_module(module), name) is cls
    assert scheduler_cls_name() == scheduler_cls_name(False)


# -- 4.1-4.4: the merge rule's edge cases ------------------------------------------------------


class Req:
    """What ``merge_updates`` needs of a request: somewhere to mirror its buffer."""


def test_a_merge_skips_empty_non_dict_and_unknown_rows_and_goes_on_with_the_next():
    """``merge_updates`` over a step's rows: a row with no request (None), an empty update or one
    that is not a dict changes nothing, and the rows after it are still merged."""
    bufs = [{"meta": {"x": 1}} for _ in range(5)]
    reqs = [None, Req(), Req(), Req(), Req()]
    updates = [{"meta": {"x": 9}}, {}, [("meta", {"x": 9})], "meta", {"meta": {"y": 2}}]
    buffers.merge_updates(bufs, reqs, updates, frozenset())
    assert bufs[:4] == [{"meta": {"x": 1}}] * 4
    assert bufs[4] == {"meta": {"x": 1, "y": 2}} and reqs[4].additional_information_cpu is bufs[4]
    assert not any(hasattr(r, "additional_information_cpu") for r in reqs[1:4])
    with pytest.raises(ValueError):  # a row without its update is a caller's bug, never skipped
        buffers.merge_updates([{}, {}], [Req(), Req()], [{"a": 1}], frozenset())


def test_tensors_in_a_list_move_to_the_host_and_other_items_stay():
    """4.1: a list value's tensors move to the CPU like any other tensor; its other items stay."""
    device = on_device(torch.arange(3.0))
    buffer: dict = {}
    buffers.merge_updates(
        [buffer], [Req()], [{"codes": {"steps": [device, 4, "x"]}, "top": [device]}], frozenset()
    )
    for kept in (buffer["codes"]["steps"][0], buffer["top"][0]):
        assert type(kept) is torch.Tensor and kept.device.type == "cpu" and kept.tolist() == [0.0, 1.0, 2.0]
    assert buffer["codes"]["steps"][1:] == [4, "x"]


@pytest.mark.parametrize("variant", RESIDENT, ids=ids(RESIDENT))
def test_a_gpu_resident_key_keeps_a_value_that_is_no_tensor_as_it_is(variant, target):
    kind, qualifier = next(iter(variant.caps["gpu_resident_keys"])).split(".")
    runner = runner_with(variant, "a", target=target)
    runner._update_intermediate_buffer("a", {kind: {qualifier: 5}})
    runner._update_intermediate_buffer("a", {kind: {"other": "text"}})
    assert runner.model_intermediate_buffer["a"][kind] == {qualifier: 5, "other": "text"}


def test_two_rows_of_a_gpu_resident_key_are_one_device_copy():
    """``owned_copies`` joins any batch of two or more (the existing cases have three and four)."""
    sources = [torch.ones(1, 2), torch.zeros(1, 2)]
    copies = buffers.owned_copies(sources)
    assert [c.tolist() for c in copies] == [[[1.0, 1.0]], [[0.0, 0.0]]]
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1


def test_only_a_dict_payload_with_a_dict_meta_can_carry_the_marker():
    assert buffers.is_replace_marker({"meta": {MARKER: True}})
    for payload in (
        None,
        [("meta", {MARKER: True})],
        {"codes": {"a": 1}},
        {"meta": None},
        {"meta": [MARKER]},
    ):
        assert not buffers.is_replace_marker(payload), payload


@pytest.mark.parametrize("variant", REPLACING, ids=ids(REPLACING))
def test_a_payload_without_meta_merges_on_a_replacing_stage(variant, target):
    """4.3: only a true marker replaces; a payload with no ``meta`` at all carries none."""
    old = {"codes": {"old": torch.arange(3)}, "meta": {"num_processed_tokens": 2}}
    runner = runner_with(variant, "a", "b", buffers={"a": old}, target=target)
    admit(runner, replacement_step("new_buffer", {"codes": {"audio": torch.arange(2)}}), target)
    buf = runner.model_intermediate_buffer["a"]
    assert buf["codes"]["old"].tolist() == [0, 1, 2] and buf["codes"]["audio"].tolist() == [0, 1]


@pytest.mark.parametrize("variant", REPLACING, ids=ids(REPLACING))
def test_a_marked_payload_for_a_request_without_a_buffer_becomes_its_buffer(variant, target):
    """4.3, new-request path, nothing before: the buffer is the payload (no bookkeeping to keep)."""
    runner = runner_with(variant, "a", "b", target=target)
    payload = {"codes": {"audio": torch.arange(4)}, "meta": {MARKER: True, "fresh": 1}}
    admit(runner, replacement_step("new_buffer", payload), target)
    buf = runner.model_intermediate_buffer["a"]
    assert buf["meta"] == {MARKER: True, "fresh": 1} and buf["codes"]["audio"].tolist() == [0, 1, 2, 3]
    assert mirrored(runner, "a")


@pytest.mark.parametrize("variant", RESIDENT[:1] + REPLACING[:1], ids=ids(RESIDENT[:1] + REPLACING[:1]))
def test_streaming_readmission_of_a_buffer_without_meta(variant, target):
    """4.4: neither the old buffer nor the incoming payload has ``meta``: the copy gets one."""
    runner = runner_with(variant, "r", buffers={"r": {"codes": {"a": 1}}}, target=target)
    runner._update_streaming_input_additional_info(new_request("r", buffer={"codes": {"b": 2}}), "r")
    assert runner.model_intermediate_buffer["r"] == {
        "codes": {"a": 1, "b": 2},
        "meta": {"num_processed_tokens": 0, "resumable": True},
    }
