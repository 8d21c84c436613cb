"""CONTRACT 6 (finished-request cleanup): a finished request releases its buffer, generator and pending payload."""

from __future__ import annotations

import pytest
import torch

from omnigen.runtime import vllm_api
from omnigen_testing.contract_support import (
    bare_runner,
    ids,
    request_state,
    rows_of,
    scheduler_output,
    shipped,
)

ALL = shipped()


def loaded_runner(variant):
    rows = rows_of(["decode", "decode_late", "tail"])
    runner = bare_runner(
        variant.cls(), requests={row.req_id: request_state(row) for row in rows}, model=FinishedRecorder()
    )
    for row in rows:
        runner._update_intermediate_buffer(
            row.req_id, {"codes": {"audio": torch.ones(1, 2)}, "meta": {"t": row.tag}}
        )
        runner._talker_mtp_generators[row.req_id] = torch.Generator().manual_seed(row.tag)
        runner.accumulate_full_payload_output(
            row.req_id, {"codes": torch.ones(1, 2)}, runner.requests[row.req_id]
        )
    return runner, [row.req_id for row in rows]


class FinishedRecorder:
    """A model that only records ``on_requests_finished`` (CONTRACT 7.3)."""

    def __init__(self) -> None:
        self.finished: list[set[str]] = []

    def on_requests_finished(self, finished_req_ids):
        self.finished.append(set(finished_req_ids))


def held(runner, req_id):
    return {
        "buffer": req_id in runner.model_intermediate_buffer,
        "generator": req_id in runner._talker_mtp_generators,
        "pending": req_id in runner._pending_full_payload_send,
    }


def vllm_update_states(calls):
    """What vLLM 0.30's GPUModelRunner._update_states does with finished requests, then a record."""

    def _update_states(self, scheduler_output):
        for req_id in scheduler_output.finished_req_ids:
            req_state = self.requests.pop(req_id, None)
            self._on_request_state_removed(req_id, req_state)
        calls.append(scheduler_output)
        return "base-result"

    return _update_states


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
def test_update_states_releases_finished_requests(variant, monkeypatch):
    """6: through vLLM's _update_states, finished requests drop buffer, generator and pending payload."""
    runner, (done, also_done, running) = loaded_runner(variant)
    calls = []
    monkeypatch.setattr(vllm_api.GPUModelRunner, "_update_states", vllm_update_states(calls))
    sched = scheduler_output({running: 1}, finished=[done, also_done])
    assert runner._update_states(sched) == "base-result"
    assert calls == [sched], "vLLM's own _update_states still runs, once"
    for req_id in (done, also_done):
        assert held(runner, req_id) == {"buffer": False, "generator": False, "pending": False}
    assert held(runner, running) == {"buffer": True, "generator": True, "pending": True}
    assert runner.model_intermediate_buffer[running]["meta"]["t"] == 3
    # 7.3: a model that keeps per-request state of its own is told, after vLLM's update.
    expected = [{done, also_done}] if variant.caps["on_requests_finished"] else []
    assert runner.model.finished == expected


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
def test_release_finished_requests_directly(variant):
    """6: _release_finished_requests drops exactly the finished requests' state (unknown ids are fine)."""
    runner, (done, running, other) = loaded_runner(variant)
    runner._local_stage_payload_cache[done] = {"meta": {}}
    runner._release_finished_requests([done, "never-seen"])
    assert held(runner, done) == {"buffer": False, "generator": False, "pending": False}
    assert done not in runner._local_stage_payload_cache
    for req_id in (running, other):
        assert held(runner, req_id) == {"buffer": True, "generator": True, "pending": True}


# -- the same clause on the Model Runner V2 target ----------------------------------------------


def v2_finish_requests(calls):
    """What vLLM's V2 ``GPUModelRunner.finish_requests`` does (0.32-0.34): every finished or
    preempted request leaves V2's state, the model state's ``remove_request`` told of each."""

    def finish_requests(self, scheduler_output):
        for req_id in sorted(
            scheduler_output.finished_req_ids | set(scheduler_output.preempted_req_ids or ())
        ):
            self.model_state.remove_request(req_id)
        calls.append(scheduler_output)

    return finish_requests


def loaded_v2_runner(variant):
    """A bare V2 runner of the stage whose model state holds three requests' state."""
    state, req_ids = loaded_runner_on(variant, "v2")
    runner = object.__new__(variant.runner_v2_cls())
    runner.model_state = state
    runner.model = state.model
    return runner, req_ids


def loaded_runner_on(variant, target):
    from omnigen_testing.contract_support import bare_state

    if target == "v1":
        return loaded_runner(variant)
    rows = rows_of(["decode", "decode_late", "tail"])
    state = bare_state(
        variant.state_cls(),
        requests={row.req_id: request_state(row) for row in rows},
        model=FinishedRecorder(),
    )
    for row in rows:
        state._update_intermediate_buffer(
            row.req_id, {"codes": {"audio": torch.ones(1, 2)}, "meta": {"t": row.tag}}
        )
        state._talker_mtp_generators[row.req_id] = torch.Generator().manual_seed(row.tag)
        state.accumulate_full_payload_output(
            row.req_id, {"codes": torch.ones(1, 2)}, state.requests[row.req_id]
        )
    return state, [row.req_id for row in rows]


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
def test_v2_finish_requests_releases_finished_and_keeps_preempted(variant, monkeypatch):
    """6 on V2: V2's ``finish_requests`` removes finished and preempted requests alike (its model
    state's ``remove_request`` cannot tell them apart); the target releases the finished ones'
    buffer, generator, payload and record, and keeps a preempted one's, as V1 keeps it."""
    from omnigen.runtime import vllm_api_v2

    runner, (done, preempted, running) = loaded_v2_runner(variant)
    calls = []
    monkeypatch.setattr(vllm_api_v2.GPUModelRunner, "finish_requests", v2_finish_requests(calls))
    sched = scheduler_output({running: 1}, finished=[done])
    sched.preempted_req_ids = {preempted}
    runner.finish_requests(sched)
    assert calls == [sched], "vLLM's own finish_requests still runs, once"
    state = runner.model_state
    assert held(state, done) == {"buffer": False, "generator": False, "pending": False}
    assert done not in state.requests
    for req_id in (preempted, running):
        assert held(state, req_id) == {"buffer": True, "generator": True, "pending": True}
        assert req_id in state.requests
    assert state._omni_preempted == {preempted}
    expected = [{done}] if variant.caps["on_requests_finished"] else []
    assert runner.model.finished == expected


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
def test_v2_a_resumed_request_keeps_its_buffer_and_is_not_merged_twice(variant, monkeypatch):
    """4.2/8.2 on V2: a preempted request comes back as a new request (its payload handle already
    released); its buffer stays as it was, nothing is merged again. A request admitted again
    without a preemption (a streaming input's next chunk) merges what it brings."""
    from omnigen_testing.contract_support import new_request

    runner, (_done, preempted, running) = loaded_v2_runner(variant)
    state = runner.model_state
    state._note_preempted({preempted}, set())
    before = state.model_intermediate_buffer[preempted]
    snapshot = {k: dict(v) if isinstance(v, dict) else v for k, v in before.items()}
    state.add_request(0, new_request(preempted, buffer={"meta": {"again": 1}}))
    assert state.model_intermediate_buffer[preempted] is before
    assert {k: dict(v) if isinstance(v, dict) else v for k, v in before.items()} == snapshot
    assert preempted not in state._omni_preempted
    state.add_request(1, new_request(running, buffer={"meta": {"next_chunk": 1}}))
    assert state.model_intermediate_buffer[running]["meta"]["next_chunk"] == 1
