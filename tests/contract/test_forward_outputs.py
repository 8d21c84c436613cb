"""CONTRACT 1.1-1.3: the forward, its outputs and decode-step metadata, on every stage."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import vllm.utils.torch_utils as torch_utils

from omnigen.runtime.outputs import OmniOutput
from omnigen_testing.contract_support import (
    CELLS,
    FakeModel,
    Recorder,
    Variant,
    bare_runner,
    ids,
    ov,
    query_start_loc_buffer,
    shipped,
)

ALL = shipped()
MULTIMODAL = shipped(lambda c: c["multimodal_outputs"])
METADATA = shipped(lambda c: c["decode_step_metadata"]) + [
    ov("higgs_audio_v3", "talker", ("outputs.has_finish_decode_step", "true"), extra={"has_finish": True}),
    ov(
        "qwen3_omni",
        "talker",
        ("outputs.decode_step_metadata", "true"),
        ("outputs.has_finish_decode_step", "true"),
        changes={"decode_step_metadata": True},
        extra={"has_finish": True},
    ),
]
NO_METADATA = shipped(lambda c: not c["decode_step_metadata"])


@pytest.fixture
def weak_ref_tensors(monkeypatch):
    """vLLM's ``weak_ref_tensors``; on a CPU build its CUDA op is missing, so the per-tensor
    reference becomes a view (same storage, new tensor object), as on a GPU."""
    try:
        torch.ops._C.weak_ref_tensor  # noqa: B018
    except (AttributeError, RuntimeError):
        monkeypatch.setattr(
            torch_utils,
            "weak_ref_tensor",
            lambda t: t.view(t.shape) if isinstance(t, torch.Tensor) and t.numel() > 0 else t,
        )
    return torch_utils.weak_ref_tensors


def forward_runner(variant: Variant, recorder: Recorder, forward=None):
    model = FakeModel(recorder, {}, forward=forward)
    runner = bare_runner(
        variant.cls(),
        model=model,
        input_batch=SimpleNamespace(req_ids=["a", "b"]),
        query_start_loc=query_start_loc_buffer([0, 2, 4]),
    )
    runner.model_intermediate_buffer = {"a": {"meta": {"x": 1}}, "b": {"meta": {"x": 2}}}
    return runner


def after_forward(variant: Variant) -> list[str]:
    """The CONTRACT 7 calls that follow the forward, in order, where the stage declares them."""
    caps = variant.caps
    return ["make_omni_output"] * caps["make_omni_output"] + ["set_batch_req_ids"] * caps["set_batch_req_ids"]


def inputs():
    return {
        "input_ids": torch.arange(4),
        "positions": torch.arange(4) + 10,
        "intermediate_tensors": None,
        "inputs_embeds": torch.ones(4, 3),
    }


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
def test_model_forward_calls_vllms_forward_with_the_stage_kwargs(variant, recorder):
    """1.1: vLLM's GPUModelRunner._model_forward (-> self.model(...)) with extra kwargs; its output back."""
    hidden = torch.randn(4, 3)
    runner = forward_runner(variant, recorder, forward=lambda **kw: hidden)
    args = inputs()
    out = runner._model_forward(**args, sampling_extra="kw")
    assert out is hidden
    (call,) = recorder.of("forward")
    for name, value in args.items():
        assert call[name] is value, name
    assert call["sampling_extra"] == "kw", "caller kwargs reach the model"


@pytest.mark.parametrize("variant", MULTIMODAL, ids=ids(MULTIMODAL))
@pytest.mark.parametrize("payload_kind", ["dict", "none"])
def test_a_flattened_omni_output_is_rebuilt(variant, payload_kind, recorder, weak_ref_tensors):
    """1.1: the CUDA-graph weak reference flattens OmniOutput to a 4-tuple; it comes back rebuilt."""
    text = torch.randn(4, 3)
    payload = {"audio": torch.randn(4, 2), "meta": {"k": 1}} if payload_kind == "dict" else None
    next_token = torch.tensor([5, 6])
    original = OmniOutput(text, payload, None, next_token)
    flattened = weak_ref_tensors(original)
    assert type(flattened) is tuple and len(flattened) == 4, "what vLLM's graph path hands back"
    runner = forward_runner(variant, recorder, forward=lambda **kw: flattened)
    out = runner._model_forward(**inputs())
    assert type(out) is OmniOutput
    assert out.multimodal_outputs is payload, "the payload dict by identity"
    assert out.text_hidden_states.data_ptr() == text.data_ptr() and torch.equal(out.text_hidden_states, text)
    assert out.intermediate_tensors is None
    assert out.next_token_id.data_ptr() == next_token.data_ptr()


@pytest.mark.parametrize("variant", MULTIMODAL, ids=ids(MULTIMODAL))
def test_an_omni_output_is_returned_as_is(variant, recorder):
    """1.1: an OmniOutput (not flattened) comes back unchanged."""
    output = OmniOutput(torch.randn(2, 3), {"audio": torch.zeros(2)})
    runner = forward_runner(variant, recorder, forward=lambda **kw: output)
    assert runner._model_forward(**inputs()) is output


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
@pytest.mark.parametrize("size", [2, 4])
def test_aux_hidden_state_tuples_come_back_as_the_same_object(variant, size, recorder, weak_ref_tensors):
    """1.1: a tuple whose second slot is a tensor (auxiliary hidden states) is returned unchanged."""
    output = weak_ref_tensors(tuple(torch.randn(4, 3) for _ in range(size)))
    runner = forward_runner(variant, recorder, forward=lambda **kw: output)
    assert runner._model_forward(**inputs()) is output


def test_omni_output_is_the_contract_namedtuple():
    """1 (OmniOutput): fields and defaults."""
    assert OmniOutput._fields == (
        "text_hidden_states",
        "multimodal_outputs",
        "intermediate_tensors",
        "next_token_id",
    )
    out = OmniOutput(torch.zeros(1))
    assert out.multimodal_outputs is None and out.intermediate_tensors is None and out.next_token_id is None
    assert isinstance(out, tuple)


# -- 1.2 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", METADATA, ids=ids(METADATA))
def test_decode_step_metadata_before_the_forward_and_finish_after(variant, recorder):
    """1.2: update_decode_step_metadata(...) before; finish_decode_step_forward() after, where the model has one."""
    runner = forward_runner(variant, recorder, forward=lambda **kw: torch.zeros(1))
    args = inputs()
    runner._model_forward(**args)
    kinds = recorder.kinds()
    if not variant.caps["decode_step_metadata"]:
        assert "update_decode_step_metadata" not in kinds and "finish_decode_step_forward" not in kinds
        return
    expected = ["update_decode_step_metadata", "forward"]
    if variant.facts["has_finish"]:
        expected.append("finish_decode_step_forward")
    assert kinds == expected + after_forward(variant)
    (meta,) = recorder.of("update_decode_step_metadata")
    assert meta["input_ids"] is args["input_ids"] and meta["positions"] is args["positions"]
    assert meta["inputs_embeds"] is args["inputs_embeds"]
    assert type(meta["req_ids"]) is list and meta["req_ids"] == ["a", "b"]
    assert meta["req_ids"] is not runner.input_batch.req_ids, "list(self.input_batch.req_ids)"


@pytest.mark.parametrize("variant", METADATA, ids=ids(METADATA))
def test_finish_decode_step_runs_even_when_the_forward_raises(variant, recorder):
    """1.2: finish_decode_step_forward() runs in a finally."""

    def boom(**kwargs):
        raise RuntimeError("forward failed")

    runner = forward_runner(variant, recorder, forward=boom)
    with pytest.raises(RuntimeError, match="forward failed"):
        runner._model_forward(**inputs())
    finished = recorder.of("finish_decode_step_forward")
    assert len(finished) == (1 if variant.caps["decode_step_metadata"] and variant.facts["has_finish"] else 0)


@pytest.mark.parametrize("variant", NO_METADATA, ids=ids(NO_METADATA))
def test_stages_without_decode_step_metadata_never_call_it(variant, recorder):
    """1.2: only a stage that declares decode-step metadata calls the hooks."""
    runner = forward_runner(variant, recorder, forward=lambda **kw: torch.zeros(1))
    runner._model_forward(**inputs())
    assert recorder.kinds() == ["forward", *after_forward(variant)]


# -- 1.3 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
def test_extract_multimodal_outputs_covers_every_branch(variant, recorder):
    """1.3: OmniOutput / tensor / tuple / list, and ValueError naming any other type."""
    runner = forward_runner(variant, recorder)
    text = torch.randn(2, 3)
    payload = {"audio": torch.zeros(2)}
    if variant.caps["multimodal_outputs"]:
        got_text, got_payload = runner.extract_multimodal_outputs(OmniOutput(text, payload))
        assert got_text is text and got_payload is payload
    got = runner.extract_multimodal_outputs(text)
    assert got[0] is text and got[1] == {}
    for container in ((text, torch.zeros(1)), [text, torch.zeros(1)]):
        got = runner.extract_multimodal_outputs(container)
        assert got[0] is text and got[1] == {}

    class Strange:
        pass

    for bad in (Strange(), {"text": text}, 3.5, None):
        with pytest.raises(ValueError, match=type(bad).__name__):
            runner.extract_multimodal_outputs(bad)


def test_every_matrix_cell_is_covered():
    assert sorted(v.id for v in ALL) == sorted(f"{m}.{s}" for m, s in CELLS)


# -- the same clauses on the Model Runner V2 target ---------------------------------------------
#
# V2 builds the model's keyword arguments itself ({input_ids, positions, inputs_embeds,
# intermediate_tensors, **model_state.prepare_inputs(...)}) and calls ``self.model(**inputs)``;
# the target's kwargs come from ``prepare_inputs`` and its output through the forward adapter on
# the model instance (``omnigen.runtime.v2.state.install_forward_adapter``).


class AdaptedModel(FakeModel):
    """A FakeModel called as V2 calls a model: ``model(**kwargs)`` runs ``self.forward``."""

    def __init__(self, recorder, forward=None):
        super().__init__(recorder, {})
        self._forward_fn = forward
        del self.forward

    def forward(self, **kwargs):
        self.recorder.add("forward", kwargs)
        return kwargs.get("inputs_embeds") if self._forward_fn is None else self._forward_fn(**kwargs)

    def __call__(self, **kwargs):
        return self.forward(**kwargs)


def v2_forward(variant: Variant, recorder: Recorder, forward=None):
    """The stage's V2 model state over a two-row step (rows a, b of two tokens), its adapter on the
    model, and V2's call: ``(state, model, run)``; ``run(inputs)`` is V2's forward of one step."""
    from omnigen.runtime.v2.state import install_forward_adapter
    from omnigen_testing.contract_support import RowSpec, Step, bare_state, v2_step_of

    step = Step([RowSpec("a", 4, 2, 2, tag=1), RowSpec("b", 4, 2, 2, tag=2)])
    model = AdaptedModel(recorder, forward)
    state = bare_state(variant.state_cls(), model=model, inputs_embeds=step.inputs_embeds.gpu)
    state.model_intermediate_buffer = {"a": {"meta": {"x": 1}}, "b": {"meta": {"x": 2}}}
    install_forward_adapter(model, state)
    v2 = v2_step_of(step)
    state.preprocess_state(v2.input_batch, (), None, None)

    def run(args):
        model_inputs = {**args, **state.prepare_inputs(v2.input_batch, v2.req_states)}
        return model(**model_inputs)

    return state, model, run


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
def test_v2_the_forward_gets_the_stage_kwargs_and_v2_gets_hidden_states(variant, recorder):
    """1.1 on V2: the forward gets each row's buffer (V2's row order) beside V2's inputs; V2 gets
    a tensor back, the step's snapshot keeps the rest."""
    hidden = torch.randn(4, 3)
    state, _model, run = v2_forward(variant, recorder, forward=lambda **kw: hidden)
    out = run(inputs())
    (call,) = recorder.of("forward")
    assert call["model_intermediate_buffer"] == [{"meta": {"x": 1}}, {"meta": {"x": 2}}]
    assert call["runtime_additional_information"] is call["model_intermediate_buffer"]
    assert isinstance(out, torch.Tensor)
    if variant.caps["make_omni_output"]:
        assert recorder.of("make_omni_output")[0]["output"] is hidden
    step = state._omni_take_step(None)
    assert step is not None and step.req_ids == ("a", "b") and step.bounds == (0, 2, 4)
    assert out is hidden and step.hidden is hidden
    # A dummy run (profile, warm-up, capture) is not a step: nothing is kept.
    assert _model(**inputs()) is hidden
    assert state._omni_take_step(None) is None


@pytest.mark.parametrize("variant", MULTIMODAL, ids=ids(MULTIMODAL))
@pytest.mark.parametrize("payload_kind", ["dict", "none"])
def test_v2_a_flattened_omni_output_is_rebuilt(variant, payload_kind, recorder, weak_ref_tensors):
    """1.1 on V2: a flattened OmniOutput is rebuilt; V2 gets the text hidden states, the step keeps
    the payload by identity."""
    text = torch.randn(4, 3)
    payload = {"audio": torch.randn(4, 2), "meta": {"k": 1}} if payload_kind == "dict" else None
    flattened = weak_ref_tensors(OmniOutput(text, payload, None, torch.tensor([5, 6])))
    state, _model, run = v2_forward(variant, recorder, forward=lambda **kw: flattened)
    out = run(inputs())
    assert out.data_ptr() == text.data_ptr() and torch.equal(out, text)
    assert state._omni_take_step(None).payload is payload


@pytest.mark.parametrize("variant", METADATA, ids=ids(METADATA))
def test_v2_decode_step_metadata_before_the_forward_and_finish_after(variant, recorder):
    """1.2 on V2: update_decode_step_metadata in prepare_inputs (V2's last call before the forward),
    finish_decode_step_forward right after it, then the output's assembly."""
    _state, _model, run = v2_forward(variant, recorder, forward=lambda **kw: torch.zeros(4, 3))
    run(inputs())
    kinds = recorder.kinds()
    if not variant.caps["decode_step_metadata"]:
        assert "update_decode_step_metadata" not in kinds and "finish_decode_step_forward" not in kinds
        return
    expected = ["update_decode_step_metadata", "forward"]
    if variant.facts["has_finish"]:
        expected.append("finish_decode_step_forward")
    assert kinds == expected + after_forward(variant)
    (meta,) = recorder.of("update_decode_step_metadata")
    assert meta["req_ids"] == ["a", "b"]


@pytest.mark.parametrize("variant", METADATA, ids=ids(METADATA))
def test_v2_finish_decode_step_runs_even_when_the_forward_raises(variant, recorder):
    """1.2 on V2: the decode step closes whatever the forward did (the adapter's finally; the V2
    runner's execute_model closes it again where a full graph replayed, once)."""

    def boom(**kwargs):
        raise RuntimeError("forward failed")

    state, _model, run = v2_forward(variant, recorder, forward=boom)
    with pytest.raises(RuntimeError, match="forward failed"):
        run(inputs())
    state._omni_close_decode_step()  # the runner's finally: nothing left to close
    finished = recorder.of("finish_decode_step_forward")
    assert len(finished) == (1 if variant.caps["decode_step_metadata"] and variant.facts["has_finish"] else 0)


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
def test_v2_extract_multimodal_outputs_covers_every_branch(variant, recorder):
    """1.3 on V2: the same method on the model state."""
    state, _model, _run = v2_forward(variant, recorder)
    text = torch.randn(2, 3)
    payload = {"audio": torch.zeros(2)}
    if variant.caps["multimodal_outputs"]:
        got_text, got_payload = state.extract_multimodal_outputs(OmniOutput(text, payload))
        assert got_text is text and got_payload is payload
    assert state.extract_multimodal_outputs(text)[0] is text
    with pytest.raises(ValueError, match="float"):
        state.extract_multimodal_outputs(3.5)
