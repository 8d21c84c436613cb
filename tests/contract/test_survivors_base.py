"""The mutants of ``omnigen/runtime/base.py`` that the earlier suite let survive or never reached.

Each test drives a generated V1 runner (``object.__new__`` plus the attributes the method reads,
``contract_support.bare_runner``) through a seam of ``OmniRunnerBase``/``OmniStateBase`` with
vLLM's own method under it replaced by a recorder where the seam wraps one (``execute_model``,
``sample_tokens``, ``_on_request_state_removed``, ``_dummy_run``): the step flag and what a
forward hands vLLM inside and outside its step (1.1, 7.2), the grammar and the published rows
through sampling (7.1, 8.1), vLLM's own removal hook, the model's attributes during a dummy run,
a new request's payloads at admission, inline or behind a transport handle read once (4.2, 8.2),
streaming re-admission (4.4), the per-step host copies (5.3), what a request keeps to send
(5.1), a generation step's empty hidden rows, and the error for a forward output of no known
type. The triage is in /work/helper_notes/survivors_base.md.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.gpu_input_batch import CachedRequestState

from omnigen.runtime import step_outputs, transport, vllm_api
from omnigen.runtime.outputs import OmniOutput
from omnigen.runtime.serialization import INLINE_PAYLOAD_KEY, serialize_additional_information
from omnigen_testing.contract_support import (
    bare_runner,
    new_request,
    on_device,
    query_start_loc_buffer,
    runner_class,
    scheduler_output,
)

H = 4
AR = ("omnigen_tiny_omni", "thinker")
"""An autoregressive producer: publishes every key (``PUBLISHED_KEYS = None``), keeps a full
payload for the next stage, merges payloads at admission only; no ``execute_model``,
``sample_tokens`` or ``_dummy_run`` of its own, so ``OmniRunnerBase``'s run."""
GENERATION = ("omnigen_tiny_omni", "code2wav")


def state(req_id: str) -> CachedRequestState:
    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=[1, 2, 3],
        mm_features=[],
        sampling_params=SamplingParams(),
        generator=None,
        block_ids=([],),
        num_computed_tokens=0,
        output_token_ids=[],
    )


def runner(stage: tuple[str, str] = AR, bounds=(0, 3, 4), req_ids=("a", "b")) -> Any:
    built = bare_runner(
        runner_class(*stage),
        input_batch=SimpleNamespace(req_ids=list(req_ids)),
        query_start_loc=query_start_loc_buffer(list(bounds)),
        requests={r: state(r) for r in req_ids},
        device=torch.device("cpu"),
        omni_step_payloads={},
        _omni_step=None,
    )
    return built


def envelope(rows: int = 4) -> OmniOutput:
    return OmniOutput(torch.randn(rows, H), {"codes": {"audio": torch.arange(rows * 2).reshape(rows, 2)}})


# -- 1.1, 7.2: execute_model and the forward's hand-back -------------------------------------------


def test_inside_vllms_step_a_forward_hands_vllm_the_text_and_outside_it_the_omni_output(monkeypatch):
    """vLLM's ``execute_model`` gets the scheduler output and intermediate tensors it was given,
    and the forward inside it returns the text hidden states vLLM samples from; before and after
    it (and after a failing step) a forward called directly returns the ``OmniOutput``."""
    built = runner()
    out = envelope()
    seen = {}

    def vllm_execute_model(self, scheduler_output, intermediate_tensors=None):
        seen["args"] = (scheduler_output, intermediate_tensors)
        seen["hidden"] = self._omni_hand_back(out)
        return "vllm's output"

    monkeypatch.setattr(vllm_api.GPUModelRunner, "execute_model", vllm_execute_model)
    assert built._omni_hand_back(out) is out, "before any step"
    sched, tensors = object(), object()
    assert built.execute_model(sched, tensors) == "vllm's output"
    assert seen["args"][0] is sched and seen["args"][1] is tensors
    assert seen["hidden"] is out.text_hidden_states
    assert built._omni_hand_back(out) is out, "after vLLM's step"

    def failing_execute_model(self, scheduler_output, intermediate_tensors=None):
        raise RuntimeError("vLLM failed")

    monkeypatch.setattr(vllm_api.GPUModelRunner, "execute_model", failing_execute_model)
    with pytest.raises(RuntimeError, match="vLLM failed"):
        built.execute_model(sched)
    assert built._omni_hand_back(out) is out, "after a step that failed"


def test_a_step_without_a_forward_publishes_nothing_of_the_step_before(monkeypatch):
    """A step where vLLM runs no forward (nothing to compute) keeps nothing of the last one: its
    sampling returns vLLM's output as it is and ``omni_step_payloads`` is empty."""
    built = runner()
    built._omni_step = step_outputs.StepSnapshot(
        req_ids=("a", "b"), bounds=(0, 3, 4), hidden=torch.randn(4, H), payload=envelope().multimodal_outputs
    )
    built.omni_step_payloads = {"a": {"codes.audio": torch.ones(3, 2)}}
    sampled = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1})
    monkeypatch.setattr(vllm_api.GPUModelRunner, "execute_model", lambda self, s, i=None: None)
    monkeypatch.setattr(vllm_api.GPUModelRunner, "sample_tokens", lambda self, g=None: sampled)
    built.execute_model(scheduler_output({"a": 1, "b": 1}))
    assert built.omni_step_payloads == {}
    assert built.sample_tokens(None) is sampled
    assert vllm_api.step_payloads_of(sampled) == {}
    assert built._pending_full_payload_send == {}, "no stale step is accumulated either"


# -- 7.1, 8.1: sample_tokens -----------------------------------------------------------------------


def test_sampling_gets_the_grammar_and_the_output_carries_the_steps_rows(monkeypatch):
    """vLLM's ``sample_tokens`` gets the structured-output grammar the engine passed; the step's
    published rows ride on its output to the scheduler."""
    built = runner()
    audio = torch.arange(8).reshape(4, 2)
    built._omni_step = step_outputs.StepSnapshot(
        req_ids=("a", "b"), bounds=(0, 3, 4), hidden=torch.randn(4, H), payload={"codes": {"audio": audio}}
    )
    grammars = []
    sampled = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1})

    def vllm_sample_tokens(self, grammar_output=None):
        grammars.append(grammar_output)
        return sampled

    monkeypatch.setattr(vllm_api.GPUModelRunner, "sample_tokens", vllm_sample_tokens)
    grammar = object()
    out = built.sample_tokens(grammar)
    assert grammars == [grammar]
    rows = vllm_api.step_payloads_of(out)
    assert rows.keys() == {"a", "b"}
    assert torch.equal(rows["a"]["codes.audio"], audio[:3]) and torch.equal(
        rows["b"]["codes.audio"], audio[3:]
    )


# -- 6: vLLM's removal hook --------------------------------------------------------------------


def test_vllms_own_removal_hook_gets_the_request_and_its_state(monkeypatch):
    """vLLM's ``_on_request_state_removed`` is where a platform runner drops its request-scoped
    caches: it still runs with the request vLLM removed, and omnigen releases that request."""
    built = runner()
    built._update_intermediate_buffer("a", {"meta": {"x": 1}})
    removed = []
    monkeypatch.setattr(
        vllm_api.GPUModelRunner,
        "_on_request_state_removed",
        lambda self, req_id, req_state: removed.append((req_id, req_state)),
    )
    req_state = built.requests.pop("a")
    built._on_request_state_removed("a", req_state)
    assert removed == [("a", req_state)]
    assert "a" not in built.model_intermediate_buffer


# -- dummy runs ------------------------------------------------------------------------------------


class DummyRunModel:
    """A model whose forward returns an ``OmniOutput``, with attributes vLLM's dummy run reads."""

    hidden_size = H

    def __init__(self) -> None:
        self.text = torch.randn(5, H)

    def make_empty_intermediate_tensors(self, batch_size: int, dtype: torch.dtype, device: Any) -> dict:
        return {"hidden_states": torch.zeros(batch_size, self.hidden_size, dtype=dtype, device=device)}

    def __call__(self, **kwargs: Any) -> OmniOutput:
        return OmniOutput(self.text, {"codes": {"audio": torch.ones(5, 2)}})


def test_during_a_dummy_run_the_models_attributes_are_the_models_own(monkeypatch):
    """vLLM's ``_dummy_run`` reads attributes of ``self.model`` (``make_empty_intermediate_tensors``
    on a later pipeline rank) besides calling it: the stand-in answers with the model's own."""
    model = DummyRunModel()
    built = runner()
    built.model = model
    seen = {}

    def vllm_dummy_run(self, num_tokens, *args, **kwargs):
        seen["hidden_size"] = self.model.hidden_size
        seen["empty"] = self.model.make_empty_intermediate_tensors(2, torch.float16, "cpu")
        return self.model(input_ids=torch.arange(num_tokens), positions=torch.arange(num_tokens))

    monkeypatch.setattr(vllm_api.GPUModelRunner, "_dummy_run", vllm_dummy_run)
    assert built._dummy_run(5) is model.text
    assert seen["hidden_size"] == H
    assert seen["empty"]["hidden_states"].shape == (2, H)
    assert seen["empty"]["hidden_states"].dtype == torch.float16
    assert built.model is model


# -- 4.2, 8.2: payloads at admission ---------------------------------------------------------------


def test_a_new_requests_payloads_are_merged_at_admission():
    """A stage that merges payloads at admission only: each new request's buffer dict and infos
    land in its own buffer (mirrored on its request)."""
    built = runner()
    first = new_request("a", buffer={"meta": {"from_buffer": 1}})
    second = new_request("b", info=serialize_additional_information({"codes": {"audio": torch.arange(3)}}))
    built._admit_new_request_payloads(scheduler_output({"a": 3, "b": 1}, new=[first, second]))
    assert built.model_intermediate_buffer["a"] == {"meta": {"from_buffer": 1}}
    assert built.model_intermediate_buffer["b"]["codes"]["audio"].tolist() == [0, 1, 2]
    for req_id in ("a", "b"):
        assert built.requests[req_id].additional_information_cpu is built.model_intermediate_buffer[req_id]


@pytest.fixture
def shm_producer():
    producer = transport.ShmTransport()
    yield producer
    producer.close()


@pytest.mark.parametrize("kind", ["inline", "shm"])
def test_a_payload_behind_a_transport_handle_is_read_into_the_buffer_and_released(kind, shm_producer):
    """8.2: a new request carrying a handle in ``SamplingParams.extra_args`` gets the payload the
    handle points at; this stage is its consumer, so the handle is released once read (an
    inline handle drops its bytes, a segment is unlinked)."""
    producer = transport.InlineTransport() if kind == "inline" else shm_producer
    handle = producer.put("a", {"codes": {"audio": torch.arange(4)}, "meta": {"n": 4}})
    arriving = new_request("a")
    arriving.sampling_params = SamplingParams(extra_args={INLINE_PAYLOAD_KEY: handle})
    built = runner()
    built._admit_new_request_payloads(scheduler_output({"a": 3}, new=[arriving]))
    buffer = built.model_intermediate_buffer["a"]
    assert buffer["codes"]["audio"].tolist() == [0, 1, 2, 3] and buffer["meta"] == {"n": 4}
    with pytest.raises(transport.TransportError, match="released"):
        transport.transport_for_handle(handle).get(handle)
    if kind == "inline":
        assert "envelope" not in handle, "the released handle holds no bytes"
    else:
        assert not transport._shm_exists(handle["name"]), "the segment is unlinked"


# -- 4.4: streaming re-admission -------------------------------------------------------------------


def test_streaming_readmission_reads_the_infos_when_the_buffer_it_carries_is_empty():
    built = runner()
    built._update_intermediate_buffer("a", {"codes": {"old": 1}})
    data = new_request("a", buffer={}, info=serialize_additional_information({"codes": {"new": 2}}))
    built._update_streaming_input_additional_info(data, "a")
    assert built.model_intermediate_buffer["a"]["codes"] == {"old": 1, "new": 2}


def test_streaming_readmission_of_vllms_own_request_data_keeps_the_buffer_and_marks_it_resumable():
    """vLLM's own ``NewRequestData`` has neither payload attribute: nothing is merged, the old
    buffer stays (as a resumable copy)."""
    built = runner()
    built._update_intermediate_buffer("a", {"codes": {"old": 1}})
    data = new_request("a")
    assert not hasattr(data, "additional_information")
    built._update_streaming_input_additional_info(data, "a")
    buffer = built.model_intermediate_buffer["a"]
    assert buffer["codes"] == {"old": 1}
    assert buffer["meta"] == {"num_processed_tokens": 0, "resumable": True}
    assert built.requests["a"].additional_information_cpu is buffer


# -- 5.3: per-step host copies ---------------------------------------------------------------------


def test_the_per_step_host_copies_move_device_tensors_and_keep_other_values():
    """Each entry's device tensors come to the host; other values stay as they are; one list
    given as both the next stage's and the client's outputs is copied to the host once."""
    built = runner()
    entries = [{"audio": on_device(torch.ones(2, 3)), "sr": 24000, "names": ["x"]}, None]
    inter, client = built._build_omni_step_outputs(entries, entries, defer_full_payload_d2h=False)
    assert type(inter[0]["audio"]) is torch.Tensor and inter[0]["audio"].device.type == "cpu"
    assert inter[0]["audio"].tolist() == [[1.0] * 3] * 2
    assert inter[0]["sr"] == 24000 and inter[0]["names"] == ["x"] and inter[1] is None
    assert client is inter, "the same outputs are copied to the host once"


# -- 5.1: what a request keeps to send -------------------------------------------------------------


def test_only_a_live_requests_non_empty_payload_is_kept_for_the_next_stage_with_its_request():
    built = runner()
    rows = torch.ones(2, 2)
    built._accumulate_request_payloads({"a": {"codes.audio": rows}, "b": {}, "gone": {"codes.audio": rows}})
    assert built._pending_full_payload_send.keys() == {"a"}
    payload, request = built._materialize_full_payload_entry(built._pending_full_payload_send["a"])
    assert torch.equal(payload["codes.audio"], rows)
    assert request is built.requests["a"]


# -- 7.3: a generation step's hidden rows ----------------------------------------------------------


def test_a_generation_step_hands_vllm_one_empty_row_per_token_of_every_request_on_its_device():
    """vLLM indexes the hidden states by token on the runner's device: one empty-width row for
    each token of the step (all requests), made where the runner's tensors live."""
    built = runner(GENERATION, bounds=(0, 3, 5))
    built.device = torch.device("meta")  # a device that is not the CPU default
    hidden = built._keep_step(OmniOutput(None, {"model_outputs": [torch.ones(3), torch.ones(2)]}))
    assert hidden.shape == (5, 0)
    assert hidden.device == built.device
    assert built._omni_step.bounds == (0, 3, 5) and built._omni_step.hidden is None


# -- 1.3: a forward output of no known type ----------------------------------------------------------


def test_a_forward_output_of_no_known_type_is_refused_naming_it_and_the_types_accepted():
    built = runner()
    with pytest.raises(ValueError) as refused:
        built.extract_multimodal_outputs({"audio": torch.ones(1)})
    message = str(refused.value)
    assert "invalid hidden states type dict" in message
    assert "OmniOutput, torch.Tensor, IntermediateTensors, tuple or list" in message
