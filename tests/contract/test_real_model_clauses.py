"""CONTRACT 7: what the real models need, on generated runner classes.

Each clause is driven on a runner class from ``omnigen.api.runner_class``, built with
``object.__new__`` plus the attributes the method reads (``_support.bare_runner``), with a
model fake that records what it was given. Variants switch one config key at a time, so each
test also shows that the path exists only where the config asks for it; the shipped values are
held by ``tests/spec_matrix.yaml``. The engine-level comparison with vllm-omni's own runner on
the real model classes is ``tests/e2e/real``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, NamedTuple

import msgspec
import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.gpu_input_batch import CachedRequestState

from omnigen.runtime import mrope, serialization, step_outputs, vllm_api
from omnigen.runtime.base import new_request_payloads
from omnigen.runtime.outputs import OmniOutput, as_omni_output, is_omni_output
from omnigen_testing.contract_support import (
    Recorder,
    bare_runner,
    query_start_loc_buffer,
    runner_class,
    stage_source,
)

H = 4


class LookalikeOmniOutput(NamedTuple):
    """vllm-omni's ``output_templates.OmniOutput`` has these fields (a different class)."""

    text_hidden_states: torch.Tensor
    multimodal_outputs: dict[str, Any] | None = None
    intermediate_tensors: Any = None
    next_token_id: torch.Tensor | None = None


class Model:
    """Records every hook call; returns what the test set."""

    def __init__(self, recorder: Recorder, **returns: Any) -> None:
        self.recorder = recorder
        self.returns = returns

    def __call__(self, **kwargs: Any) -> Any:
        self.recorder.add("forward", kwargs)
        return self.returns["forward"](**kwargs)

    def make_omni_output(self, output: Any, **kwargs: Any) -> Any:
        self.recorder.add("make_omni_output", {"output": output, **kwargs})
        return self.returns["make_omni_output"](output, **kwargs)

    def postprocess(self, hidden_states: Any, **kwargs: Any) -> Any:
        self.recorder.add("postprocess", {"hidden_states": hidden_states, **kwargs})
        return {"hidden_states": {"last": hidden_states[-1:].clone()}, "meta": {"post": 1}}

    def set_batch_req_ids(self, req_ids: Any) -> None:
        self.recorder.add("set_batch_req_ids", list(req_ids))

    def update_decode_step_metadata(self, **kwargs: Any) -> None:
        self.recorder.add("update_decode_step_metadata", kwargs)

    def on_requests_finished(self, finished_req_ids: Any) -> None:
        self.recorder.add("on_requests_finished", set(finished_req_ids))

    def sample(self, logits: Any, sampling_metadata: Any) -> Any:
        self.recorder.add("sample", {"logits": logits, "sampling_metadata": sampling_metadata})
        return self.returns["sample"]


def state(req_id: str, prompt_len: int, computed: int = 0) -> CachedRequestState:
    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=list(range(prompt_len)),
        mm_features=[],
        sampling_params=SamplingParams(),
        generator=None,
        block_ids=([],),
        num_computed_tokens=computed,
        output_token_ids=[],
    )


def forward_runner(cls: type, model: Model, bounds=(0, 3, 4), req_ids=("a", "b")) -> Any:
    runner = bare_runner(
        cls,
        model=model,
        input_batch=SimpleNamespace(req_ids=list(req_ids)),
        query_start_loc=query_start_loc_buffer(list(bounds)),
    )
    runner.requests = {r: state(r, 3) for r in req_ids}
    runner.model_intermediate_buffer = {r: {"meta": {"n": i}} for i, r in enumerate(req_ids)}
    return runner


def forward_inputs(tokens: int = 4) -> dict[str, Any]:
    return {
        "input_ids": torch.arange(tokens),
        "positions": torch.arange(tokens),
        "intermediate_tensors": None,
        "inputs_embeds": torch.ones(tokens, H),
    }


# -- 7.1 Post-forward hook ---------------------------------------------------------------------

POSTPROCESS = ("qwen3_tts", "qwen3_tts", ("model.stages.qwen3_tts.postprocess.hook=true",))
POSTPROCESS_NOTHING_USED = (
    "qwen3_tts",
    "qwen3_tts",
    (
        "model.stages.qwen3_tts.postprocess.hook=true",
        "model.stages.qwen3_tts.postprocess.uses_hidden_states=false",
        "model.stages.qwen3_tts.postprocess.uses_multimodal_outputs=false",
        "model.stages.qwen3_tts.postprocess.uses_req_infos=false",
    ),
)
NO_POSTPROCESS = ("qwen3_tts", "qwen3_tts", ("model.stages.qwen3_tts.postprocess.hook=false",))


def _step(
    hidden: torch.Tensor, payload: Any, bounds=(0, 3, 4), req_ids=("a", "b")
) -> step_outputs.StepSnapshot:
    return step_outputs.StepSnapshot(
        req_ids=tuple(req_ids), bounds=tuple(bounds), hidden=hidden, payload=payload
    )


def test_postprocess_gets_each_rows_hidden_states_the_payload_and_its_buffer():
    recorder = Recorder()
    runner = forward_runner(runner_class(*POSTPROCESS), Model(recorder))
    runner.model_intermediate_buffer["a"]["hidden_states"] = {"last": torch.zeros(1, H)}
    hidden = torch.arange(4 * H, dtype=torch.float32).reshape(4, H)
    payload = {"codes": {"audio": torch.ones(4, 2)}}
    runner._finish_step(_step(hidden, payload))
    calls = recorder.of("postprocess")
    assert [c["meta"]["n"] for c in calls] == [0, 1], "one call per row, in batch order, with its buffer"
    assert torch.equal(calls[0]["hidden_states"], hidden[0:3]) and torch.equal(
        calls[1]["hidden_states"], hidden[3:4]
    )
    assert all(c["multimodal_outputs"] is payload for c in calls), "the step's payload, by identity"
    # The buffer's hidden_states entry would collide with the positional argument: left out.
    assert set(calls[0]) == {"hidden_states", "multimodal_outputs", "meta"}
    assert isinstance(calls[0]["hidden_states"], torch.Tensor)
    assert "hidden_states" in runner.model_intermediate_buffer["a"], "and stays in the buffer"
    # The update is merged before the next step: hidden_states.last is each row's last hidden row.
    assert torch.equal(runner.model_intermediate_buffer["a"]["hidden_states"]["last"], hidden[2:3])
    assert torch.equal(runner.model_intermediate_buffer["b"]["hidden_states"]["last"], hidden[3:4])
    assert runner.model_intermediate_buffer["b"]["meta"] == {"n": 1, "post": 1}
    assert runner.requests["b"].additional_information_cpu is runner.model_intermediate_buffer["b"]


def test_postprocess_that_uses_nothing_gets_the_whole_step_and_no_infos():
    recorder = Recorder()
    runner = forward_runner(runner_class(*POSTPROCESS_NOTHING_USED), Model(recorder))
    hidden = torch.randn(4, H)
    runner._finish_step(_step(hidden, {"codes": {"audio": torch.ones(4, 2)}}))
    calls = recorder.of("postprocess")
    assert len(calls) == 2
    for call in calls:
        assert call["hidden_states"] is hidden
        assert call["multimodal_outputs"] is None
        assert set(call) == {"hidden_states", "multimodal_outputs"}


def test_no_postprocess_hook_means_no_call_and_no_code():
    recorder = Recorder()
    runner = forward_runner(runner_class(*NO_POSTPROCESS), Model(recorder))
    runner._finish_step(_step(torch.randn(4, H), None))
    assert recorder.of("postprocess") == []
    assert "self.model.postprocess" not in stage_source(*NO_POSTPROCESS)


def test_postprocess_runs_after_vllms_sampling(monkeypatch):
    """7.1: the hook sees the step once vLLM has sampled it (Higgs publishes codes it sampled)."""
    recorder = Recorder()
    runner = forward_runner(runner_class(*POSTPROCESS), Model(recorder))
    runner._omni_step = _step(torch.randn(4, H), None)
    sampled = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1})

    def vllm_sample_tokens(self, grammar_output=None):
        recorder.add("vllm_sample_tokens")
        return sampled

    monkeypatch.setattr(vllm_api.GPUModelRunner, "sample_tokens", vllm_sample_tokens)
    assert runner.sample_tokens(None) is sampled
    assert recorder.kinds() == ["vllm_sample_tokens", "postprocess", "postprocess"]
    assert runner._omni_step is None, "a step is finished once"
    assert runner.sample_tokens(None) is sampled
    assert recorder.kinds().count("postprocess") == 2


# -- 7.2 Output assembly -------------------------------------------------------------------------

MAKE = ("qwen3_tts", "code2wav", ("model.stages.code2wav.outputs.make_omni_output=true",))
NO_MAKE = ("qwen3_tts", "code2wav", ("model.stages.code2wav.outputs.make_omni_output=false",))


def test_make_omni_output_assembles_a_plain_forward_result_with_the_forward_kwargs():
    recorder = Recorder()
    raw = torch.randn(4, H)
    assembled = LookalikeOmniOutput(None, {"model_outputs": [torch.ones(3)]})
    model = Model(recorder, forward=lambda **kw: raw, make_omni_output=lambda out, **kw: assembled)
    runner = forward_runner(runner_class(*MAKE), model)
    out = runner._model_forward(**forward_inputs())
    (forward,) = recorder.of("forward")
    (make,) = recorder.of("make_omni_output")
    assert make["output"] is raw
    for name in ("model_intermediate_buffer", "runtime_additional_information", "seq_token_counts"):
        assert make[name] is forward[name], f"make_omni_output gets the forward's {name}"
    assert type(out) is OmniOutput, "vllm-omni's OmniOutput class becomes omnigen's"
    assert out.multimodal_outputs is assembled.multimodal_outputs


@pytest.mark.parametrize("cls_name", ["omnigen", "vllm_omni"])
def test_an_omni_output_of_either_class_is_not_reassembled(cls_name):
    recorder = Recorder()
    cls = OmniOutput if cls_name == "omnigen" else LookalikeOmniOutput
    returned = cls(torch.randn(4, H), {"codes": {"audio": torch.ones(4, 2)}})
    model = Model(recorder, forward=lambda **kw: returned, make_omni_output=lambda out, **kw: 1 / 0)
    out = forward_runner(runner_class(*MAKE), model)._model_forward(**forward_inputs())
    assert recorder.of("make_omni_output") == []
    assert type(out) is OmniOutput and out.multimodal_outputs is returned.multimodal_outputs
    assert out.text_hidden_states is returned.text_hidden_states


def test_without_make_omni_output_the_forward_result_is_kept():
    recorder = Recorder()
    raw = torch.randn(4, H)
    model = Model(recorder, forward=lambda **kw: raw)
    out = forward_runner(runner_class(*NO_MAKE), model)._model_forward(**forward_inputs())
    assert out is raw and recorder.of("make_omni_output") == []
    assert "self.model.make_omni_output" not in stage_source(*NO_MAKE)


def test_vllm_omnis_output_class_is_recognised_by_extract_multimodal_outputs():
    runner = object.__new__(runner_class("qwen3_tts", "code2wav"))
    text, payload = torch.randn(2, H), {"audio": torch.ones(2)}
    assert runner.extract_multimodal_outputs(LookalikeOmniOutput(text, payload)) == (text, payload)
    assert is_omni_output(LookalikeOmniOutput(text)) and not is_omni_output((text, payload))
    other = NamedTuple("Other", [("a", int), ("b", int)])(1, 2)
    assert as_omni_output(other) is other, "a NamedTuple of other fields is not an envelope"


def test_ar_request_payloads_cut_each_requests_rows():
    hidden = torch.arange(5 * H, dtype=torch.float32).reshape(5, H)
    step = _step(
        hidden,
        {
            "codes": {"audio": torch.arange(10).reshape(5, 2)},  # one row per token
            "meta": {"per_request": ["x", "y"], "shared": torch.tensor([7])},
            "flag": 3,
        },
        bounds=(0, 4, 5),
    )
    payloads = step_outputs.ar_request_payloads(step, include_hidden=True)
    a, b = payloads["a"], payloads["b"]
    assert torch.equal(a["codes.audio"], torch.arange(8).reshape(4, 2))
    assert torch.equal(b["codes.audio"], torch.tensor([[8, 9]]))
    assert (a["meta.per_request"], b["meta.per_request"]) == ("x", "y")
    assert torch.equal(a["meta.shared"], torch.tensor([7])) and a["meta.shared"] is not b["meta.shared"]
    assert a["flag"] == b["flag"] == 3
    assert torch.equal(a["hidden"], hidden[:4]) and torch.equal(b["hidden"], hidden[4:])
    assert "hidden" not in step_outputs.ar_request_payloads(step, include_hidden=False)["a"]


def test_the_finished_step_publishes_and_accumulates_per_request_payloads():
    """7.2 + 5.1: a producer keeps each request's published rows for the next stage."""
    cls = runner_class(
        "qwen3_omni", "talker", ("model.async_chunk=false", "model.stages.talker.postprocess.hook=false")
    )
    runner = forward_runner(cls, Model(Recorder()))
    codes = torch.arange(8).reshape(4, 2)
    for _ in range(2):
        runner._finish_step(_step(torch.randn(4, H), {"codes": {"audio": codes}}))
    assert torch.equal(runner.omni_step_payloads["b"]["codes.audio"], codes[3:4])
    pending, _ = runner._materialize_full_payload_entry(runner._pending_full_payload_send["a"])
    assert torch.equal(pending["codes.audio"], torch.cat([codes[:3], codes[:3]]))


# -- 7.3 Generation stages -----------------------------------------------------------------------

GEN_IDS = ("qwen3_tts", "code2wav", ("model.stages.code2wav.generation.request_ids=true",))
GEN_NO_IDS = ("qwen3_tts", "code2wav", ("model.stages.code2wav.generation.request_ids=false",))


def test_a_generation_forward_gets_each_requests_token_count_and_ids():
    recorder = Recorder()
    model = Model(
        recorder, forward=lambda **kw: OmniOutput(None, {"model_outputs": [torch.ones(2), torch.ones(3)]})
    )
    runner = forward_runner(runner_class(*GEN_IDS), model, bounds=(0, 3, 5))
    runner._model_forward(**forward_inputs(5))
    (call,) = recorder.of("forward")
    assert call["seq_token_counts"] == [3, 2]
    assert call["request_ids"] == ["a", "b"]
    recorder = Recorder()
    model = Model(recorder, forward=lambda **kw: OmniOutput(None, None))
    forward_runner(runner_class(*GEN_NO_IDS), model)._model_forward(**forward_inputs())
    assert "request_ids" not in recorder.of("forward")[0]


def test_inside_vllms_step_a_generation_stage_hands_back_one_empty_row_per_token():
    """vLLM indexes hidden states by token (and samples nothing from them here)."""
    recorder = Recorder()
    model = Model(recorder, forward=lambda **kw: OmniOutput(None, {"model_outputs": [torch.ones(2)]}))
    runner = forward_runner(runner_class(*GEN_IDS), model, bounds=(0, 5), req_ids=("a",))
    runner.device = torch.device("cpu")
    runner._omni_in_engine_step = True
    hidden = runner._model_forward(**forward_inputs(5))
    assert hidden.shape == (5, 0)
    assert runner._omni_step.req_ids == ("a",) and runner._omni_step.hidden is None


def test_a_generation_step_samples_nothing_and_finishes_requests_whose_inputs_are_in():
    runner = forward_runner(runner_class(*GEN_IDS), Model(Recorder()), bounds=(0, 3, 5))
    runner.requests = {"a": state("a", 3), "b": state("b", 6, computed=2)}
    wavs = [torch.ones(6), torch.zeros(4)]
    runner._omni_step = _step(None, {"model_outputs": wavs, "sr": [24000, 24000]}, bounds=(0, 3, 5))
    scheduler_output = SimpleNamespace(num_scheduled_tokens={"a": 3, "b": 2})
    runner.execute_model_state = SimpleNamespace(scheduler_output=scheduler_output)
    runner.kv_connector_output = kv = object()
    out = runner.sample_tokens(None)
    assert isinstance(out, ModelRunnerOutput)
    assert out.req_ids == ["a", "b"] and out.req_id_to_index == {"a": 0, "b": 1}
    # a: 0 + 3 >= 3 prompt tokens, done; b: 2 + 2 < 6, still chunking in.
    assert out.sampled_token_ids == [[vllm_api.GENERATION_DONE_TOKEN], []]
    assert out.kv_connector_output is kv and runner.kv_connector_output is None
    assert runner.execute_model_state is None
    assert torch.equal(runner.omni_step_payloads["a"]["model_outputs"], wavs[0])
    assert torch.equal(runner.omni_step_payloads["b"]["model_outputs"], wavs[1])
    assert runner.omni_step_payloads["b"]["sr"] == 24000


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (torch.arange(6).reshape(2, 3), {"a": [0, 1, 2], "b": [3, 4, 5]}),
        ([torch.tensor([1]), torch.tensor([2, 2])], {"a": [1], "b": [2, 2]}),
    ],
)
def test_generation_outputs_are_one_entry_per_request(raw, expected):
    payloads = step_outputs.generation_request_payloads(_step(None, raw))
    assert {r: p["model_outputs"].tolist() for r, p in payloads.items()} == expected


def test_generation_outputs_of_the_wrong_count_are_refused_with_what_came_back():
    with pytest.raises(ValueError, match="returned 3 model outputs for 2 requests"):
        step_outputs.generation_request_payloads(_step(None, [torch.ones(1)] * 3))
    with pytest.raises(ValueError, match="model output 'model_outputs'"):
        step_outputs.generation_request_payloads(_step(None, {"model_outputs": [torch.ones(1)]}))
    with pytest.raises(TypeError, match="got str"):
        step_outputs.generation_request_payloads(_step(None, "wav"))


FINISHED = ("qwen3_tts", "code2wav", ("model.stages.code2wav.on_requests_finished=true",))
NOT_FINISHED = ("qwen3_tts", "code2wav", ("model.stages.code2wav.on_requests_finished=false",))


@pytest.mark.parametrize("finished", [set(), {"a", "b"}])
def test_on_requests_finished_after_vllms_state_update(monkeypatch, finished):
    recorder = Recorder()

    def vllm_update_states(self, scheduler_output):
        recorder.add("vllm_update_states")
        return "deferred"

    monkeypatch.setattr(vllm_api.GPUModelRunner, "_update_states", vllm_update_states)
    runner = forward_runner(runner_class(*FINISHED), Model(recorder))
    assert runner._update_states(SimpleNamespace(finished_req_ids=finished)) == "deferred"
    expected = ["vllm_update_states"] + (["on_requests_finished"] if finished else [])
    assert recorder.kinds() == expected
    if finished:
        assert recorder.of("on_requests_finished") == [finished]
    assert "_update_states" not in vars(runner_class(*NOT_FINISHED))


# -- 7.4 The model's own sampler -----------------------------------------------------------------

MODEL_SAMPLER = ("fish_speech", "slow_ar", ("model.stages.slow_ar.sampler=model",))


@dataclass
class SamplingHistory:
    """The part of vLLM's ``SamplingMetadata`` a model sampler's history lives in."""

    output_token_ids: list[list[int]]


def _sampler_runner(recorder: Recorder, sampled: Any) -> Any:
    runner = forward_runner(runner_class(*MODEL_SAMPLER), Model(recorder, sample=sampled))
    metadata = SamplingHistory(output_token_ids=[[], []])
    runner.input_batch = SimpleNamespace(
        sampling_metadata=metadata,
        req_output_token_ids=[[5, 6], [7, -1]],
        num_reqs=2,
        update_async_output_token_ids=lambda: recorder.add("async_ids"),
    )
    return runner


def test_the_models_sampler_samples_with_each_requests_history(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(vllm_api.GPUModelRunner, "_sample", lambda self, *a: 1 / 0)
    sampled = object()
    runner = _sampler_runner(recorder, sampled)
    logits = torch.randn(2, 5)
    assert runner._sample(logits, None) is sampled
    (call,) = recorder.of("sample")
    assert call["logits"] is logits
    assert call["sampling_metadata"].output_token_ids == [[5, 6], [7]], "history without in-flight tokens"


def test_the_models_sampler_declining_falls_back_to_vllms(monkeypatch):
    recorder = Recorder()
    fallback = object()
    monkeypatch.setattr(vllm_api.GPUModelRunner, "_sample", lambda self, logits, spec: fallback)
    runner = _sampler_runner(recorder, None)
    assert runner._sample(torch.randn(2, 5), None) is fallback
    assert len(recorder.of("sample")) == 1
    assert runner._sample(torch.randn(2, 5), spec_decode_metadata=object()) is fallback
    assert len(recorder.of("sample")) == 1, "speculative steps go to vLLM's rejection sampler"
    assert "def _sample" not in stage_source("fish_speech", "slow_ar", ("model.stages.slow_ar.sampler=vllm",))


# -- 7.5 Stage selection and deployment fields ---------------------------------------------------


class _ArchModelConfig:
    def __init__(self, hf_config: Any) -> None:
        self.hf_config = hf_config
        self.hf_text_config = hf_config
        self.model_arch_config = ("arch of", hf_config)

    def get_model_arch_config(self) -> Any:
        return ("arch of", self.hf_text_config)


def test_the_worker_sets_the_deployment_fields_and_the_stages_text_config():
    talker = SimpleNamespace(get_text_config=lambda: "talker text config")
    config = _ArchModelConfig(SimpleNamespace(talker_config=talker))
    vllm_api.apply_stage_model_config(
        config, {"model_stage": "talker", "async_chunk": False}, "talker_config"
    )
    assert (config.model_stage, config.async_chunk) == ("talker", False)
    assert config.hf_text_config == "talker text config"
    assert config.model_arch_config == ("arch of", "talker text config"), "widths and vocab re-derived"


def test_a_checkpoint_without_the_stages_sub_config_is_refused_with_the_key_to_fix():
    config = _ArchModelConfig(SimpleNamespace())
    with pytest.raises(ValueError, match="no 'talker_config'.*hf_config_name"):
        vllm_api.apply_stage_model_config(config, {}, "talker_config")


def test_generated_workers_carry_the_fields_the_config_decides():
    from omnigen import api

    worker = api.worker_class(
        "qwen3_omni",
        "talker",
        [
            "model.stages.talker.model_config.model_stage=talker",
            "model.stages.talker.model_config.hf_config_name=talker_config",
        ],
    )
    assert worker.model_config_fields == {"async_chunk": False, "model_stage": "talker"}
    assert worker.text_config_name == "talker_config"


# -- 7.6 M-RoPE without get_mrope_input_positions ------------------------------------------------


def test_text_only_mrope_positions_advance_all_sections_together():
    req = state("a", 5)
    positions, delta = mrope.text_only_positions(req)
    assert positions.tolist() == [list(range(5))] * 3 and delta == 0


def test_text_only_mrope_refuses_a_request_with_multimodal_features():
    req = state("a", 5)
    req.mm_features = [SimpleNamespace(modality="image")]
    with pytest.raises(ValueError, match="request a: .*1 multimodal feature.*image"):
        mrope.text_only_positions(req)


def test_text_only_mrope_positions_are_int64_and_prompt_embeds_are_not_a_feature():
    """A prompt-embeds request is text as far as positions go (vLLM lists its embeddings as an
    ``mm_features`` entry of modality ``prompt_embeds``); positions are vLLM's int64."""
    req = state("a", 4)
    req.mm_features = [SimpleNamespace(modality="prompt_embeds")]
    positions, delta = mrope.text_only_positions(req)
    assert positions.dtype == torch.int64 and positions.tolist() == [list(range(4))] * 3 and delta == 0


def test_text_only_mrope_refusal_names_every_modality_and_the_fix():
    req = state("b", 5)
    req.mm_features = [SimpleNamespace(modality=m) for m in ("image", "audio", "prompt_embeds", "image")]
    with pytest.raises(ValueError) as refused:
        mrope.text_only_positions(req)
    assert str(refused.value) == (
        "request b: positions.mrope_fallback computes text-only M-RoPE positions, but the request has "
        "3 multimodal feature(s) (audio, image); send this stage text only, or use a model that "
        "implements get_mrope_input_positions (positions.mrope: true)"
    )


def test_mrope_kwargs_filter_drops_self_and_input_tokens_of_an_unbound_function():
    """The filter reads the function it is given: unbound, its signature names ``self`` too."""

    def get_mrope_input_positions(self, input_tokens, mm_features=None):
        raise AssertionError("only the signature is read")

    kwargs = {"self": 1, "input_tokens": [2], "mm_features": [3], "other": 4}
    assert mrope.filter_mrope_kwargs(get_mrope_input_positions, kwargs) == {"mm_features": [3]}


def test_the_fallback_replaces_vllms_mrope_initialisation_only_where_configured():
    cls = runner_class("qwen3_tts", "qwen3_tts", ("model.stages.qwen3_tts.positions.mrope_fallback=true",))
    req = state("a", 4)
    object.__new__(cls)._init_mrope_positions(req)
    assert req.mrope_positions.tolist() == [[0, 1, 2, 3]] * 3 and req.mrope_position_delta == 0
    off = runner_class("qwen3_tts", "qwen3_tts", ("model.stages.qwen3_tts.positions.mrope_fallback=false",))
    assert "_init_mrope_positions" not in vars(off)


# -- 7.7 Extra per-step calls ----------------------------------------------------------------------

QSL = (
    "higgs_audio_v3",
    "talker",
    (
        "model.stages.talker.outputs.query_start_loc=true",
        "model.stages.talker.outputs.set_batch_req_ids=true",
    ),
)


def test_query_start_loc_reaches_the_metadata_hook_and_the_forward_and_req_ids_follow_the_forward():
    recorder = Recorder()
    model = Model(
        recorder, forward=lambda **kw: torch.randn(4, H), make_omni_output=lambda out, **kw: OmniOutput(out)
    )
    runner = forward_runner(runner_class(*QSL), model)
    runner._model_forward(**forward_inputs())
    kinds = [k for k in recorder.kinds() if k != "make_omni_output"]
    assert kinds == ["update_decode_step_metadata", "forward", "set_batch_req_ids"]
    (meta,), (forward,) = recorder.of("update_decode_step_metadata"), recorder.of("forward")
    assert meta["omni_query_start_loc"].tolist() == [0, 3, 4]
    assert meta["omni_query_start_loc"] is forward["omni_query_start_loc"]
    assert recorder.of("set_batch_req_ids") == [["a", "b"]]


def test_compute_logits_gets_the_sampling_metadata_of_the_moment_and_is_restored():
    class LogitsModel:
        def compute_logits(self, hidden_states, sampling_metadata=None):
            return (hidden_states, sampling_metadata)

    model = LogitsModel()
    current = {"metadata": "early"}
    with vllm_api.compute_logits_with_sampling_metadata(model, lambda: current["metadata"]):
        current["metadata"] = "built during the step"
        assert model.compute_logits("h") == ("h", "built during the step")
    assert "compute_logits" not in vars(model)
    assert model.compute_logits("h") == ("h", None)


def test_the_logits_wrapper_exists_only_where_configured():
    on = runner_class(
        "qwen3_tts", "qwen3_tts", ("model.stages.qwen3_tts.outputs.logits_sampling_metadata=true",)
    )
    off = runner_class(
        "qwen3_tts", "qwen3_tts", ("model.stages.qwen3_tts.outputs.logits_sampling_metadata=false",)
    )
    assert "execute_model" in vars(on) and "execute_model" not in vars(off)


# -- 7.8 Payloads in both serialized forms -------------------------------------------------------


class WireEntry(msgspec.Struct):
    """vllm-omni's ``AdditionalInformationEntry`` has these fields."""

    tensor_data: bytes | None = None
    tensor_shape: list[int] | None = None
    tensor_dtype: str | None = None
    list_data: list[Any] | None = None
    scalar_data: Any | None = None


class WirePayload(msgspec.Struct):
    entries: dict[str, WireEntry]


def _wire(tensor: torch.Tensor) -> WireEntry:
    return WireEntry(
        tensor_data=tensor.contiguous().view(torch.uint8).numpy().tobytes(),
        tensor_shape=list(tensor.shape),
        tensor_dtype=str(tensor.dtype).removeprefix("torch."),
    )


@pytest.mark.parametrize("form", ["struct", "msgpack"])
def test_vllm_omnis_wire_payload_is_read(form):
    codes = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    embeds = torch.randn(1, 4).to(torch.bfloat16)
    wire = WirePayload(
        entries={
            "codes.audio": _wire(codes),
            "embed.tts_pad": _wire(embeds),
            "hidden_states.layer_3": _wire(torch.ones(2)),
            "task_type": WireEntry(list_data=["VoiceDesign"]),
            "meta.finished": WireEntry(scalar_data=True),
        }
    )
    payload = wire if form == "struct" else msgspec.msgpack.decode(msgspec.msgpack.encode(wire))
    decoded = serialization.deserialize_additional_information(payload)
    assert torch.equal(decoded["codes"]["audio"], codes)
    assert decoded["embed"]["tts_pad"].dtype == torch.bfloat16 and torch.equal(
        decoded["embed"]["tts_pad"], embeds
    )
    assert torch.equal(decoded["hidden_states"]["layers"][3], torch.ones(2))
    assert decoded["task_type"] == ["VoiceDesign"] and decoded["meta"]["finished"] is True


def test_a_dict_that_only_looks_like_a_wire_payload_stays_a_dict():
    plain = {"entries": {"a": 1}}
    assert serialization.deserialize_additional_information(plain) is plain


def test_a_request_carries_its_payload_inline_in_its_sampling_params():
    payload = {"task_type": ["VoiceDesign"], "codes": {"audio": torch.arange(3)}}
    wire = serialization.serialize_additional_information(payload)
    params = SamplingParams(extra_args={serialization.INLINE_PAYLOAD_KEY: wire})
    new_req = SimpleNamespace(req_id="a", sampling_params=params)
    (found,) = new_request_payloads(new_req)
    assert found["task_type"] == ["VoiceDesign"] and torch.equal(found["codes"]["audio"], torch.arange(3))
    assert new_request_payloads(SimpleNamespace(req_id="b", sampling_params=SamplingParams())) == []


def test_a_stage_without_multimodal_outputs_hands_vllm_the_text_of_an_envelope():
    """7.2: Qwen2.5-Omni's thinker (multimodal: false) returns vllm-omni's OmniOutput with no
    payload; inside vLLM's step vLLM gets its text hidden states, not the tuple."""
    text = torch.randn(4, H)
    model = Model(Recorder(), forward=lambda **kw: LookalikeOmniOutput(text, None))
    runner = forward_runner(runner_class("qwen2_5_omni", "thinker"), model)
    runner._omni_in_engine_step = True
    assert runner._model_forward(**forward_inputs()) is text
    assert runner._omni_step.hidden is text and runner._omni_step.payload is None
