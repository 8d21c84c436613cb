"""CONTRACT 8.1, the output channel, piece by piece (the engine runs are tests/e2e/test_pipeline.py).

The runner publishes the rows of the keys its stage declares; they ride on the step's
``ModelRunnerOutput`` (never on vLLM's shared empty output); the scheduler mixin folds them per
request and hands a finished request's payload over in ``kv_transfer_params["omnigen"]``,
keeping other keys, and drops an aborted request's rows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from omnigen.runtime import vllm_api
from omnigen.runtime.base import OmniRunnerBase
from omnigen.runtime.scheduler import PAYLOAD_KEY, OmniOutputMixin
from omnigen.serving.client import NoStagePayload, stage_payload


class Publisher(OmniRunnerBase):
    def __init__(self, keys):
        self.PUBLISHED_KEYS = keys
        self.omni_step_payloads = {
            "a": {"audio": torch.ones(2, 3), "audio.sr": torch.tensor(16000), "hidden": torch.zeros(2, 4)},
            "b": {"hidden": torch.zeros(1, 4)},
        }


def test_a_stage_publishes_the_keys_it_declares_and_those_under_them():
    rows = Publisher(frozenset({"audio"})).published_step_payloads()
    assert rows.keys() == {"a"} and rows["a"].keys() == {"audio", "audio.sr"}
    assert Publisher(None).published_step_payloads().keys() == {"a", "b"}
    assert Publisher(frozenset()).published_step_payloads() == {}


def test_rows_ride_on_the_steps_output_never_on_vllms_shared_empty_one():
    rows = {"a": {"audio": torch.ones(1, 2)}}
    out = vllm_api.attach_step_payloads(EMPTY_MODEL_RUNNER_OUTPUT, rows)
    assert out is not EMPTY_MODEL_RUNNER_OUTPUT and vllm_api.step_payloads_of(out) == rows
    assert vllm_api.step_payloads_of(EMPTY_MODEL_RUNNER_OUTPUT) == {}
    wrapper = type("AsyncOutput", (), {})()
    wrapper._model_runner_output = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    assert vllm_api.attach_step_payloads(wrapper, rows) is wrapper
    assert vllm_api.step_payloads_of(wrapper._model_runner_output) == rows
    assert vllm_api.attach_step_payloads(None, rows) is None


def test_on_model_runner_v2_the_rows_ride_on_the_async_outputs_model_runner_output():
    """8.1 on V2: V2's sample_tokens returns an ``AsyncOutput`` whose ``model_runner_output`` the
    engine core gets (``get_output`` fills its tokens into that object): the rows go there."""
    from vllm.v1.worker.gpu.async_utils import AsyncOutput

    rows = {"a": {"audio": torch.ones(1, 2)}}
    inner = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    output = object.__new__(AsyncOutput)
    output.model_runner_output = inner
    assert vllm_api.attach_step_payloads(output, rows) is output
    assert vllm_api.step_payloads_of(inner) == rows
    # A plain ModelRunnerOutput (V2's generation step, 7.3) carries them itself.
    plain = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    assert vllm_api.step_payloads_of(vllm_api.attach_step_payloads(plain, rows)) == rows


@dataclasses.dataclass
class Request:
    request_id: str


class FakeScheduler:
    """Stands in for vLLM's scheduler: finishes the requests it is told to, each step."""

    def __init__(self):
        self.requests = {"a": Request("a"), "b": Request("b")}
        self.finishing: list[str] = []

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = [
            EngineCoreOutput(
                request_id=rid,
                new_token_ids=[1],
                finish_reason=1 if rid in self.finishing else None,
                kv_transfer_params={"remote_block_ids": [3]} if rid == "a" else None,
            )
            for rid in sorted(self.requests)
        ]
        for rid in self.finishing:
            self.requests.pop(rid, None)
        return {0: EngineCoreOutputs(outputs=outputs)}

    def finish_requests(self, request_ids, finished_status):
        found = [self.requests.pop(rid) for rid in request_ids if rid in self.requests]
        return found


class Scheduler(OmniOutputMixin, FakeScheduler):
    pass


def step(scheduler, rows):
    out = vllm_api.attach_step_payloads(ModelRunnerOutput(req_ids=list(rows), req_id_to_index={}), rows)
    return {o.request_id: o for o in scheduler.update_from_output(None, out)[0].outputs}


def test_a_finished_requests_rows_come_back_folded_and_other_keys_stay():
    scheduler = Scheduler()
    step(scheduler, {"a": {"audio": torch.full((2, 3), 1.0)}, "b": {"audio": torch.full((1, 3), 5.0)}})
    scheduler.finishing = ["a"]
    outs = step(scheduler, {"a": {"audio": torch.full((1, 3), 2.0)}, "b": {"audio": torch.full((1, 3), 6.0)}})
    assert outs["b"].kv_transfer_params is None, "an unfinished request gets nothing yet"
    params = outs["a"].kv_transfer_params
    assert params["remote_block_ids"] == [3], "a connector's keys are kept"
    assert isinstance(params[PAYLOAD_KEY], str), "text: safe in msgpack and in vllm serve's JSON"
    audio = stage_payload(params, required=True)["audio"]
    assert torch.equal(audio, torch.tensor([[1.0] * 3, [1.0] * 3, [2.0] * 3]))
    assert scheduler.omni_pending.keys() == {"b"}


def test_an_aborted_requests_rows_are_dropped():
    scheduler = Scheduler()
    step(scheduler, {"b": {"audio": torch.ones(1, 3)}})
    assert [r.request_id for r in scheduler.finish_requests(["b"], None)] == ["b"]
    assert scheduler.omni_pending == {}


def test_the_client_helper_says_why_there_is_no_payload():
    assert stage_payload({"other": 1}) == {}
    with pytest.raises(NoStagePayload, match="--scheduler-cls omnigen.runtime.scheduler.OmniScheduler"):
        stage_payload({}, required=True)
