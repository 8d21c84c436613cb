"""CONTRACT 7 and the worker's V2 decisions on the Model Runner V2 target: what only V2 needs.

The clauses both targets share are tested on both in the other contract files (``target``
fixture). These are the seams that exist on V2 alone (docs/model-runner-v2.md, sections 3.7
and 6.4): a generation step's output without V2's sampler, the model's own sampler behind V2's
``custom_sampler``, the sampling metadata V2 lacks, the rope states, a full-graph replay's
step, and what the worker sets before V2 builds anything. V2's own code runs (``InputBatch``,
``RequestState``, ``RopeState``, ``SamplerOutput``, V2's ``postprocess_num_computed_tokens``);
where it launches a Triton kernel, only that kernel is simulated (``omnigen_testing.mrv2_cpu``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omnigen import api
from omnigen.runtime import vllm_api, vllm_api_v2
from omnigen.runtime.v2 import FilteredKwargsRopeState, TextOnlyRopeState
from omnigen_testing import mrv2_cpu
from omnigen_testing.contract_support import (
    RowSpec,
    Step,
    bare_state,
    host_uva_buffers,
    request_states,
    shipped,
    token_id,
    v2_step_of,
)

GENERATION = shipped(lambda c: c["kind"] == "generation")


@pytest.fixture(scope="module")
def kernels():
    """V2's Triton kernels, simulated (this machine has no Triton): only the device primitives."""
    return mrv2_cpu.install()


# -- 7.3 a generation step on V2 -----------------------------------------------------------------


@pytest.mark.parametrize("variant", GENERATION, ids=lambda v: v.id)
def test_v2_generation_step_finishes_requests_whose_prompt_is_in(variant, kernels):
    """7.3 on V2: no sampler; V2's own bookkeeping (its computed tokens advance, its KV connector
    finishes the step); GENERATION_DONE_TOKEN for a request whose prompt is in, nothing for one
    still chunking; each request's output published on the step's output."""
    rows = [RowSpec("done", 4, 2, 2, tag=1), RowSpec("chunking", 8, 2, 2, tag=2)]
    step = Step(rows, pad=0)
    v2 = v2_step_of(step)
    state = bare_state(variant.state_cls(), inputs_embeds=step.inputs_embeds.gpu)
    state.preprocess_state(v2.input_batch, (), None, None)
    runner = object.__new__(variant.runner_v2_cls())
    runner.model_state = state
    runner.req_states = v2.req_states
    runner.kv_connector = _KVConnector()
    audio = torch.arange(8.0).reshape(4, 2)
    state._omni_forward_pending = True
    state._omni_forward_kwargs = {}
    state._keep_step(state._assemble_output(_output(audio, [audio[:2], audio[2:]]), {}))
    runner.execute_model_state = SimpleNamespace(
        input_batch=v2.input_batch, finished_req_ids={"gone"}, hidden_states=None
    )
    computed = runner.req_states.num_computed_tokens.gpu.clone()
    output = runner.sample_tokens(None)
    assert runner.execute_model_state is None
    assert output.req_ids == ["done", "chunking"]
    assert output.sampled_token_ids == [[vllm_api.GENERATION_DONE_TOKEN], []]
    assert runner.kv_connector.finished == [{"gone"}]
    index = [v2.req_states.req_id_to_index[r] for r in ("done", "chunking")]
    assert (runner.req_states.num_computed_tokens.gpu[index] - computed[index]).tolist() == [2, 2]
    published = vllm_api.step_payloads_of(output)
    assert set(published) <= {"done", "chunking"} and published, "the step's outputs ride on it (8.1)"
    assert kernels["_post_update_num_computed_tokens_kernel"].launches > 0


def _output(audio, per_request):
    from omnigen.runtime.outputs import OmniOutput

    return OmniOutput(None, {"audio": per_request, "model_outputs": per_request})


class _KVConnector:
    def __init__(self):
        self.finished = []

    def post_forward(self, finished_req_ids, *args, **kwargs):
        self.finished.append(set(finished_req_ids))


# -- 7.4 the model's own sampler, 7.7 the sampling metadata V2 lacks ------------------------------


def _history_states(kernels):
    rows = [RowSpec("a", 3, 3, 1, tag=1), RowSpec("b", 2, 4, 1, tag=2)]
    states = request_states(rows)
    states.apply_staged_writes()  # V2's staged writes (simulated kernel)
    step = Step(rows, pad=0)
    return rows, states, v2_step_of(step).input_batch


def test_v2_sampling_metadata_has_each_rows_output_tokens(kernels):
    """7.7 on V2: V2 has no V1 SamplingMetadata; the view gives each row's tokens after its prompt
    (read from V2's request state) and names any other field a model reads."""
    rows, states, input_batch = _history_states(kernels)
    index = [states.req_id_to_index[r.req_id] for r in rows]
    states.all_token_ids.gpu[index[0], 3:5] = torch.tensor([51, 52], dtype=torch.int32)
    states.total_len.gpu[index[0]] = 5
    view = vllm_api_v2.sampling_metadata_view(states, input_batch)
    assert view.output_token_ids == [[51, 52], [token_id(2, j) for j in range(2, 5)]]
    with pytest.raises(AttributeError, match="has output_token_ids only.*'temperature'"):
        view.temperature  # noqa: B018


def test_v2_model_sampler_uses_the_models_sample_else_v2s(kernels):
    """7.4 on V2: ``custom_sampler`` hands V2 a sampler that calls ``model.sample(logits, view)``
    and turns its tokens into V2's ``SamplerOutput``; a None falls back to V2's sampler."""
    rows, states, input_batch = _history_states(kernels)
    seen = []

    class Model:
        answer = None

        def sample(self, logits, metadata):
            seen.append(metadata.output_token_ids)
            return self.answer

    def v2_sampler(logits, batch):
        return "v2's"

    model = Model()
    sampler = vllm_api_v2.ModelSampler(model, v2_sampler, lambda: states)
    logits = torch.zeros(2, 5)
    assert sampler(logits, input_batch) == "v2's"
    model.answer = SimpleNamespace(sampled_token_ids=torch.tensor([[3], [4]]))
    out = sampler(logits, input_batch)
    assert isinstance(out, vllm_api_v2.SamplerOutput)
    assert out.sampled_token_ids.tolist() == [[3], [4]]
    assert out.num_sampled.tolist() == [1, 1] and out.num_rejected.tolist() == [0, 0]
    assert len(seen) == 2


@pytest.mark.parametrize("variant", shipped(lambda c: c["sampler"] == "model"), ids=lambda v: v.id)
def test_v2_stages_with_the_models_sampler_give_v2_theirs(variant):
    state = bare_state(variant.state_cls(), model=SimpleNamespace())
    sampler, rejection = state.custom_sampler("v2 sampler")
    assert isinstance(sampler, vllm_api_v2.ModelSampler) and sampler.sampler == "v2 sampler"
    assert rejection is None


# -- 7.6 / 3.7 rope states ------------------------------------------------------------------------


def _rope(cls):
    with host_uva_buffers():
        return cls(
            num_dims=3, max_num_reqs=4, max_num_tokens=16, max_model_len=32, device=torch.device("cpu")
        )


def test_v2_text_only_rope_state_writes_text_positions_and_refuses_features(kernels):
    """7.6 on V2: a model without get_mrope_input_positions gets text positions, all three
    sections alike, no decode delta; a request with multimodal features is refused by name."""
    rope = _rope(TextOnlyRopeState)
    rope.init_prefill_positions(2, object(), [5, 6, 7, 8], [])
    rope.apply_staged_writes()
    assert rope.prefill_positions.gpu[6:9, :4].tolist() == [[0, 1, 2, 3]] * 3
    assert int(rope.prefill_delta.np[2]) == 0
    feature = SimpleNamespace(modality="image")
    with pytest.raises(ValueError, match="text-only M-RoPE positions.*image"):
        rope.init_prefill_positions(1, object(), [5, 6], [feature])


def test_v2_filtered_kwargs_rope_state_calls_the_model_with_what_it_accepts(kernels):
    """3.7 on V2: V2 calls get_mrope_input_positions(tokens, mm_features); a model that takes no
    mm_features gets the tokens only; one that requires more fails naming what V2 could give."""
    calls = []

    class Tokens:
        def get_mrope_input_positions(self, input_tokens):
            calls.append(input_tokens)
            n = len(input_tokens)
            return torch.arange(n).expand(3, n), 7

    class Required:
        def get_mrope_input_positions(self, input_tokens, mm_features, *, hf_config):
            raise AssertionError("never called")

    rope = _rope(FilteredKwargsRopeState)
    rope.init_prefill_positions(0, Tokens(), [1, 2, 3], [])
    assert calls == [[1, 2, 3]] and int(rope.prefill_delta.np[0]) == 7
    with pytest.raises(TypeError) as err:
        rope.init_prefill_positions(1, Required(), [1, 2], [])
    assert "hf_config" in str(err.value) and "docs/model-runner-v2.md" in "".join(err.value.__notes__)


@pytest.mark.parametrize(
    ("variant", "expected"),
    [(v, "text_only") for v in shipped(lambda c: c["mrope_fallback"])]
    + [(v, "filtered_kwargs") for v in shipped(lambda c: c["mrope"])],
    ids=lambda p: getattr(p, "id", p),
)
def test_v2_m_rope_stages_build_their_rope_state(variant, expected):
    cls = variant.state_cls().ROPE_STATE
    assert cls is (TextOnlyRopeState if expected == "text_only" else FilteredKwargsRopeState)
    built = []
    with vllm_api_v2.rope_state_factory(cls):
        from vllm.v1.worker.gpu.model_states import default

        with host_uva_buffers():
            config = SimpleNamespace(uses_mrope=True, mrope_num_dims=3)
            built.append(default.get_rope_state(config, object(), 2, 8, 16, torch.device("cpu")))
            built.append(default.get_rope_state(SimpleNamespace(uses_mrope=False), object(), 2, 8, 16, None))
    assert type(built[0]) is cls and built[0].num_dims == 3 and built[1] is None


# -- 1.1 / 7.1 a full-graph replay's step ---------------------------------------------------------


@pytest.mark.parametrize(
    "variant", shipped(lambda c: c["make_omni_output"] and c["kind"] == "ar"), ids=lambda v: v.id
)
def test_v2_a_full_graph_replay_still_gets_its_step(variant):
    """5.2/7.2 on V2: under a full CUDA graph replay no Python runs in the forward, so the
    adapter keeps nothing; ``sample_tokens`` then assembles the step from the replayed hidden
    states (make_omni_output: the stage's payload is built from them, the forward kwargs of the
    step given), before V2's sampling."""
    step = Step([RowSpec("a", 4, 4, 1, tag=1), RowSpec("b", 4, 5, 1, tag=2)], pad=0)
    v2 = v2_step_of(step)
    made = []

    class Model:
        def make_omni_output(self, output, **kwargs):
            made.append((output, kwargs))
            from omnigen.runtime.outputs import OmniOutput

            return OmniOutput(output, {"codes": {"audio": torch.ones(2, 3)}})

        def set_batch_req_ids(self, req_ids):
            made.append(("req_ids", list(req_ids)))

    state = bare_state(variant.state_cls(), model=Model(), inputs_embeds=step.inputs_embeds.gpu)
    state.preprocess_state(v2.input_batch, (), None, None)
    state._omni_forward_kwargs = {"model_intermediate_buffer": [{}, {}]}
    state._omni_forward_pending = True  # prepare_inputs ran; the replay ran no adapter
    hidden = torch.randn(3, 4)  # padded rows beyond the step's two tokens
    snapshot = state._omni_take_step(SimpleNamespace(hidden_states=hidden))
    assert snapshot is not None and snapshot.req_ids == ("a", "b")
    assert torch.equal(made[0][0], hidden[:2]) and made[0][1] == {"model_intermediate_buffer": [{}, {}]}
    assert snapshot.payload["codes"]["audio"].shape == (2, 3)
    assert state._omni_take_step(None) is None, "taken once"


# -- 6.4 the worker, before V2 builds anything -----------------------------------------------------


def _worker(variant, *, mode, pp=1, jit=True):
    cls = api.worker_class(variant.model, variant.stage, variant.overrides)
    built = object.__new__(cls)
    built.vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
        compilation_config=SimpleNamespace(cudagraph_mode=mode),
        kernel_config=SimpleNamespace(enable_jit_warmup=jit),
    )
    return built


@pytest.mark.parametrize("variant", shipped(), ids=lambda v: v.id)
def test_v2_worker_narrows_full_graphs_and_turns_jit_warmup_off_as_planned(variant, monkeypatch):
    """6.4: a stage whose forward returns its payload runs no full graph on V2 (FULL_AND_PIECEWISE
    becomes PIECEWISE, FULL none); V2's warm-up with synthetic requests is off where the stage
    reads payloads; each as the plan decided (v2.full_graph, v2.jit_warmup)."""
    from vllm.config import CUDAGraphMode

    monkeypatch.setattr(vllm_api_v2, "standalone_cpu_runner", lambda: False)
    caps = variant.caps
    for mode, narrowed in (
        (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.PIECEWISE),
        (CUDAGraphMode.FULL, CUDAGraphMode.NONE),
    ):
        built = _worker(variant, mode=mode)
        built._prepare_v2()
        expected = narrowed if caps["v2_full_graph"] == "narrowed" else mode
        assert built.vllm_config.compilation_config.cudagraph_mode == expected
        assert built.vllm_config.kernel_config.enable_jit_warmup is caps["v2_jit_warmup"]
    built = _worker(variant, mode=CUDAGraphMode.PIECEWISE)
    built._prepare_v2()
    assert built.vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE


def test_v2_worker_refuses_pipeline_parallelism_and_the_standalone_cpu_runner(monkeypatch):
    from vllm.config import CUDAGraphMode

    variant = shipped()[0]
    monkeypatch.setattr(vllm_api_v2, "standalone_cpu_runner", lambda: False)
    with pytest.raises(RuntimeError, match="pipeline_parallel_size=1"):
        _worker(variant, mode=CUDAGraphMode.NONE, pp=2)._prepare_v2()
    cpu = api.worker_class(variant.model, variant.stage, ["device=cpu"])
    built = object.__new__(cpu)
    built.vllm_config = _worker(variant, mode=CUDAGraphMode.NONE).vllm_config
    monkeypatch.setattr(vllm_api_v2, "standalone_cpu_runner", lambda: True)
    with pytest.raises(RuntimeError, match="standalone Model Runner V2"):
        built._prepare_v2()
