"""CONTRACT 4.1-4.5: per-request buffers, on every stage; 4.3 on stages with and without replacement."""

from __future__ import annotations

import pickle

import pytest
import torch

from omnigen.runtime.serialization import deserialize_additional_information, serialize_additional_information
from omnigen_testing.contract_support import (
    DeviceTensor,
    bare_runner,
    bare_state,
    cached_requests,
    freeze,
    ids,
    new_request,
    on_device,
    ov,
    request_state,
    rows_of,
    scheduler_output,
    shipped,
)

ALL = shipped()
MARKER = "replace_runtime_additional_information"
REPLACING = shipped(lambda c: c["replace_on_marker"]) + [
    ov("qwen3_omni", "code2wav", ("buffers.replace_on_marker", "true"), changes={"replace_on_marker": True}),
    ov("mimo_audio", "code2wav", ("buffers.replace_on_marker", "true"), changes={"replace_on_marker": True}),
]
MERGING = shipped(lambda c: not c["replace_on_marker"]) + [
    ov(
        "minicpmo_4_5",
        "code2wav",
        ("buffers.replace_on_marker", "false"),
        changes={"replace_on_marker": False},
    ),
]


def runner_with(variant, *req_ids, buffers=None, target="v1"):
    """The target's holder of the omni state (the V1 runner, or the V2 target's model state) with
    ``req_ids`` known and ``buffers`` in place (mirrored)."""
    rows = rows_of(["decode"] * len(req_ids))
    requests = {}
    for row, req_id in zip(rows, req_ids, strict=True):
        row.req_id = req_id
        requests[req_id] = request_state(row)
    if target == "v1":
        runner = bare_runner(variant.cls(), requests=requests)
    else:
        runner = bare_state(variant.state_cls(), requests=requests)
    for req_id, buf in (buffers or {}).items():
        runner.model_intermediate_buffer[req_id] = buf
        if req_id in requests:
            requests[req_id].additional_information_cpu = buf
    return runner


def admit(runner, step, target):
    """The scheduler's payloads of a step reach the target through its own seam (4.2): V1's
    ``_update_additional_information`` in its step; on V2 the model state's ``add_request`` for
    each new request (V2 admits it then) and, for cached requests, ``_merge_cached_payloads``
    (from the V2 runner's ``update_requests``)."""
    if target == "v1":
        runner._update_additional_information(step)
        return
    for index, new_req in enumerate(step.scheduled_new_reqs):
        runner.add_request(index, new_req)
    runner._merge_cached_payloads(step)


def mirrored(runner, req_id):
    return runner.requests[req_id].additional_information_cpu is runner.model_intermediate_buffer[req_id]


# -- 4.1 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
def test_update_is_a_noop_for_empty_non_dict_or_unknown_requests(variant, target):
    """4.1: empty / non-dict update, or a request not in self.requests: nothing changes."""
    runner = runner_with(variant, "a", "b", buffers={"a": {"meta": {"x": 1}}}, target=target)
    before = freeze(runner.model_intermediate_buffer)
    for update in ({}, None, [("meta", {"x": 2})], "meta", 5, torch.ones(1)):
        runner._update_intermediate_buffer("a", update)
        runner._update_intermediate_buffer("b", update)
    runner._update_intermediate_buffer("gone", {"meta": {"x": 3}})
    assert freeze(runner.model_intermediate_buffer) == before
    assert set(runner.model_intermediate_buffer) == {"a"}


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
def test_updates_merge_one_level_deep_accumulate_and_are_mirrored(variant, target):
    """4.1: per-qualifier merge, top-level scalars stored, successive updates accumulate, mirror."""
    runner = runner_with(variant, "a", "b", target=target)
    runner._update_intermediate_buffer(
        "a", {"codes": {"x": 1}, "meta": {"a": 1, "nested": {"p": 1}}, "flag": True}
    )
    buf = runner.model_intermediate_buffer["a"]
    assert mirrored(runner, "a")
    runner._update_intermediate_buffer(
        "a", {"codes": {"y": 2}, "meta": {"b": 2, "nested": {"q": 2}}, "flag": False}
    )
    runner._update_intermediate_buffer("a", {"meta": {"a": 10}, "n": 3})
    assert runner.model_intermediate_buffer["a"] is buf, "the same dict accumulates"
    assert mirrored(runner, "a")
    assert buf == {
        "codes": {"x": 1, "y": 2},
        "meta": {"a": 10, "b": 2, "nested": {"q": 2}},
        "flag": False,
        "n": 3,
    }
    assert "b" not in runner.model_intermediate_buffer


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
def test_tensors_move_to_cpu_unless_the_key_is_gpu_resident(variant, target):
    """4.1: GPU-resident (type, qualifier) keys keep device tensors; every other tensor moves to CPU."""
    resident = {tuple(k.split(".")) for k in variant.caps["gpu_resident_keys"]}
    probes = resident | {("codes", "audio"), ("hidden_states", "last"), ("probe", "host")}
    runner = runner_with(variant, "a", target=target)
    update = {t: {} for t, _ in probes}
    for t, q in probes:
        update[t][q] = on_device(torch.arange(4.0))
    update["top_level"] = on_device(torch.ones(2))
    runner._update_intermediate_buffer("a", update)
    buf = runner.model_intermediate_buffer["a"]
    for t, q in probes:
        value = buf[t][q]
        assert value.tolist() == [0.0, 1.0, 2.0, 3.0]
        if (t, q) in resident:
            assert type(value) is DeviceTensor and value.device.type == "cuda", f"{t}.{q} stays on the device"
        else:
            assert type(value) is torch.Tensor and value.device.type == "cpu", f"{t}.{q} moves to CPU"
    assert type(buf["top_level"]) is torch.Tensor and buf["top_level"].device.type == "cpu"


# -- 4.2 -----------------------------------------------------------------------------------------


def nested_payload():
    return {
        "codes": {
            "audio": torch.arange(6, dtype=torch.int64).reshape(2, 3),
            "bf16": torch.linspace(-2, 2, 5, dtype=torch.bfloat16),
            "half": torch.tensor([0.5, 1.5], dtype=torch.float16),
            "mask": torch.tensor([True, False]),
            "scalar": torch.tensor(3.25),
        },
        "meta": {
            "list": [1, 2.5, "x", None, torch.tensor([7, 8])],
            "tuple": (1, "two", torch.zeros(1, 2)),
            "nested": {"deep": {"t": torch.ones(2, 2, dtype=torch.float64)}, "empty": {}},
            "flag": True,
            "none": None,
            "text": "hello",
            "int": 42,
            "float": 0.125,
            "marker": torch.tensor(True),
        },
        "top": 7,
    }


def contains_tensor(value):
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(contains_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(contains_tensor(v) for v in value)
    return False


def test_serialization_round_trips_nested_payloads():
    """4.2: serialize/deserialize round-trip nested dicts of tensors (bfloat16 too), lists, tuples, scalars."""
    payload = nested_payload()
    wire = serialize_additional_information(payload)
    assert not contains_tensor(wire), "the transport form holds no tensors"
    back = deserialize_additional_information(pickle.loads(pickle.dumps(wire)))
    assert freeze(back) == freeze(payload)
    assert back["codes"]["bf16"].dtype == torch.bfloat16
    assert type(back["meta"]["tuple"]) is tuple and type(back["meta"]["list"]) is list
    assert deserialize_additional_information(None) == {}
    assert deserialize_additional_information(serialize_additional_information(None)) == {}
    assert freeze(deserialize_additional_information(serialize_additional_information({}))) == freeze({})


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
def test_new_and_cached_request_payloads_are_merged(variant, target):
    """4.2: new: its model_intermediate_buffer and deserialized additional_information; cached: where present."""
    runner = runner_with(
        variant, "new", "cached", "other", buffers={"cached": {"meta": {"kept": 1}}}, target=target
    )
    info = {"codes": {"audio": torch.arange(3)}, "meta": {"from_info": True}}
    new = new_request(
        "new",
        buffer={"hidden_states": {"last": torch.ones(2)}, "meta": {"from_buffer": 1}},
        info=serialize_additional_information(info),
    )
    absent = new_request("absent", buffer={"meta": {"x": 1}})
    cached = cached_requests(
        ["cached", "other"], {"cached": serialize_additional_information({"meta": {"more": 2}})}
    )
    admit(runner, scheduler_output(new=[new, absent], cached=cached), target)
    buf = runner.model_intermediate_buffer["new"]
    assert buf["meta"] == {"from_buffer": 1, "from_info": True}
    assert buf["codes"]["audio"].tolist() == [0, 1, 2]
    assert buf["hidden_states"]["last"].tolist() == [1.0, 1.0]
    assert mirrored(runner, "new")
    if target == "v2" and not variant.caps["refresh_every_step"]:
        # Payloads at admission only: a cached request's payload is not merged (as on V1, whose
        # step runs _admit_new_request_payloads for such a stage).
        assert runner.model_intermediate_buffer["cached"] == {"meta": {"kept": 1}}
    else:
        assert runner.model_intermediate_buffer["cached"] == {"meta": {"kept": 1, "more": 2}}
        assert mirrored(runner, "cached")
    assert "other" not in runner.model_intermediate_buffer
    # V1 merges into the requests vLLM has registered; on V2 a new request is registered by the
    # very hook that merges its payloads, so "absent" (unknown to V1's runner) is V2's to keep.
    assert ("absent" in runner.model_intermediate_buffer) is (target == "v2")


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
def test_scheduler_data_without_payload_attributes_changes_nothing(variant, target):
    """4.2: vLLM's own NewRequestData / CachedRequestData (no payload attributes) are fine."""
    runner = runner_with(variant, "a", "b", buffers={"b": {"meta": {"x": 1}}}, target=target)
    admit(runner, scheduler_output(new=[new_request("a")], cached=cached_requests(["b"], None)), target)
    assert runner.model_intermediate_buffer == {"b": {"meta": {"x": 1}}}


# -- 4.3 -----------------------------------------------------------------------------------------

MARKERS = {"bool": lambda: True, "tensor": lambda: torch.tensor(True)}
PATHS = ("new_buffer", "new_serialized", "cached_plain", "cached_serialized")


def replacement_step(path, payload):
    serialized = serialize_additional_information(payload)
    if path == "new_buffer":
        return scheduler_output(new=[new_request("a", buffer=payload)])
    if path == "new_serialized":
        return scheduler_output(new=[new_request("a", info=serialized)])
    raw = payload if path == "cached_plain" else serialized
    return scheduler_output(cached=cached_requests(["a", "b"], {"a": raw}))


def previous_buffers():
    return {
        "a": {
            "codes": {"old": torch.arange(3)},
            "meta": {"num_processed_tokens": 0, "resumable": True, "old_meta": 1},
            "stale_top": 1,
        },
        "b": {"codes": {"audio": torch.ones(2)}, "meta": {"x": 1}},
    }


def marker_payload(marker):
    return {"codes": {"audio": torch.arange(4) * 2}, "meta": {MARKER: marker, "fresh": 2}}


CASES_R = [(v, m, p) for v in REPLACING for m in MARKERS for p in PATHS]


@pytest.mark.parametrize(
    ("variant", "marker", "path"), CASES_R, ids=[f"{v.id}-{m}-{p}" for v, m, p in CASES_R]
)
def test_a_marked_payload_replaces_the_buffer(variant, marker, path, target):
    """4.3: replaced, not merged; new path keeps runner bookkeeping; cached path equals the marker payload."""
    runner = runner_with(variant, "a", "b", buffers=previous_buffers(), target=target)
    b_buffer = runner.model_intermediate_buffer["b"]
    b_before = freeze(b_buffer)
    payload = marker_payload(MARKERS[marker]())
    admit(runner, replacement_step(path, payload), target)
    buf = runner.model_intermediate_buffer["a"]
    if path.startswith("new"):
        expected = {
            "codes": {"audio": payload["codes"]["audio"]},
            "meta": {**payload["meta"], "num_processed_tokens": 0, "resumable": True},
        }
    else:
        expected = payload
    assert freeze(buf) == freeze(expected)
    assert mirrored(runner, "a")
    assert runner.model_intermediate_buffer["b"] is b_buffer and freeze(b_buffer) == b_before, (
        "others untouched"
    )


MERGE_CASES = [(v, m, p) for v in MERGING for m in MARKERS for p in ("new_buffer", "cached_serialized")]


@pytest.mark.parametrize(
    ("variant", "marker", "path"), MERGE_CASES, ids=[f"{v.id}-{m}-{p}" for v, m, p in MERGE_CASES]
)
def test_stages_without_replacement_always_merge(variant, marker, path, target):
    """4.3: a stage that does not declare replacement merges even a marked payload."""
    runner = runner_with(variant, "a", "b", buffers=previous_buffers(), target=target)
    payload = marker_payload(MARKERS[marker]())
    admit(runner, replacement_step(path, payload), target)
    buf = runner.model_intermediate_buffer["a"]
    if target == "v2" and path.startswith("cached") and not variant.caps["refresh_every_step"]:
        # A stage that takes payloads at admission only (V1 runs _admit_new_request_payloads there)
        # merges nothing for a cached request on V2 either.
        assert "audio" not in buf["codes"] and "fresh" not in buf["meta"]
        return
    assert buf["codes"]["old"].tolist() == [0, 1, 2] and buf["codes"]["audio"].tolist() == [0, 2, 4, 6]
    assert buf["meta"]["old_meta"] == 1 and buf["meta"]["fresh"] == 2 and buf["stale_top"] == 1


@pytest.mark.parametrize("variant", REPLACING, ids=ids(REPLACING))
@pytest.mark.parametrize("false_marker", [False, "tensor_false"])
def test_a_false_marker_merges(variant, false_marker, target):
    """4.3: only a true marker replaces."""
    marker = torch.tensor(False) if false_marker == "tensor_false" else False
    for path in PATHS:
        runner = runner_with(variant, "a", "b", buffers=previous_buffers(), target=target)
        admit(runner, replacement_step(path, marker_payload(marker)), target)
        buf = runner.model_intermediate_buffer["a"]
        assert buf["codes"]["old"].tolist() == [0, 1, 2], path
        assert buf["stale_top"] == 1, path


# -- 4.4 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
@pytest.mark.parametrize("carrier", ["buffer", "serialized"])
def test_streaming_readmission_merges_into_a_copy_and_marks_resumable(variant, carrier, target):
    """4.4: merge one level deep into a copy, num_processed_tokens=0, resumable=True, stored and mirrored."""
    old = {"codes": {"a": 1}, "meta": {"x": 1, "num_processed_tokens": 9, "resumable": False}, "top": 1}
    runner = runner_with(variant, "r", buffers={"r": old}, target=target)
    old_frozen = freeze(old)
    incoming = {"codes": {"b": 2}, "meta": {"y": 2}, "top2": 5}
    data = (
        new_request("r", buffer=incoming)
        if carrier == "buffer"
        else new_request("r", info=serialize_additional_information(incoming))
    )
    runner._update_streaming_input_additional_info(data, "r")
    buf = runner.model_intermediate_buffer["r"]
    assert buf == {
        "codes": {"a": 1, "b": 2},
        "meta": {"x": 1, "y": 2, "num_processed_tokens": 0, "resumable": True},
        "top": 1,
        "top2": 5,
    }
    assert buf is not old and freeze(old) == old_frozen, "a copy; the old buffer is not mutated"
    assert mirrored(runner, "r")


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
def test_streaming_readmission_without_a_previous_buffer(variant, target):
    """4.4: a request with no buffer yet gets the incoming payload, marked resumable."""
    runner = runner_with(variant, "r", target=target)
    runner._update_streaming_input_additional_info(new_request("r", buffer={"meta": {"y": 2}}), "r")
    assert runner.model_intermediate_buffer["r"] == {
        "meta": {"y": 2, "num_processed_tokens": 0, "resumable": True}
    }
    assert mirrored(runner, "r")


# -- 4.5 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
def test_local_stage_payloads_sync_only_into_active_not_pending_requests(variant, target):
    """4.5: active and not pending -> merged and removed; pending or not yet active -> stays cached."""
    runner = runner_with(variant, "active", "pending", buffers={"active": {"meta": {"x": 1}}}, target=target)
    runner._full_payload_pending_broadcast_req_ids = {"pending"}
    runner._local_stage_payload_cache = {
        "active": {"codes": {"audio": torch.arange(2)}, "meta": {"y": 2}},
        "pending": {"meta": {"p": 1}},
        "later": {"meta": {"l": 1}},
    }
    runner._sync_local_stage_payloads()
    assert runner.model_intermediate_buffer["active"]["meta"] == {"x": 1, "y": 2}
    assert runner.model_intermediate_buffer["active"]["codes"]["audio"].tolist() == [0, 1]
    assert mirrored(runner, "active")
    assert set(runner._local_stage_payload_cache) == {"pending", "later"}
    assert (
        "pending" not in runner.model_intermediate_buffer and "later" not in runner.model_intermediate_buffer
    )

    # "later" becomes active; "pending" stops pending: both move on the next sync.
    row = rows_of(["decode"])[0]
    row.req_id = "later"
    runner.requests["later"] = request_state(row)
    runner._full_payload_pending_broadcast_req_ids = set()
    runner._sync_local_stage_payloads()
    assert runner._local_stage_payload_cache == {}
    assert runner.model_intermediate_buffer["later"] == {"meta": {"l": 1}}
    assert runner.model_intermediate_buffer["pending"] == {"meta": {"p": 1}}
