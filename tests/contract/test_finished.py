"""CONTRACT 6 (finished-request cleanup): a finished request releases its buffer, generator and pending payload."""

from __future__ import annotations

import pytest
import torch

from omnigen.runtime import vllm_api

from ._support import bare_runner, ids, request_state, rows_of, scheduler_output, shipped

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
