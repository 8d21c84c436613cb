"""CONTRACT 2.1-2.3: the talker MTP (code predictor) on every MTP stage and its config variants.

Variants cover the graph policy (safe / unsafe / auto resolved either way, graph presets),
per-row generators (never / always / eager_only), GPU-resident or host codes, another output
key, another hidden-size source and stage sampling defaults.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.config import CUDAGraphMode
from vllm.v1.utils import CpuGpuBuffer

from omnigen.runtime import mtp, vllm_api
from omnigen.runtime.v2 import OmniModelStateV2
from omnigen_testing.contract_support import (
    MTP_BUFFER_NAMES,
    MTP_VARIANTS,
    ORDERS,
    DeviceTensor,
    FakeGraphWrapper,
    FakePredictor,
    Step,
    StrictPredictor,
    expected_codes,
    freeze,
    ids,
    mtp_codes_gpu_resident,
    rig,
    rows_of,
    runner_state,
    stage_plan,
)


def relevant(*words):
    """The shipped MTP stages plus the variants whose overrides touch one of ``words``."""
    return [v for v in MTP_VARIANTS if not v.overrides or any(w in o for o in v.overrides for w in words)]


GRAPH = relevant("graph", "owns_talker_module", "per_row_generators")
INIT = relevant("hidden_size_from")
SAMPLED = relevant("sampling")
WRITE_BACK = relevant("gpu_resident", "output_key", "graph")
SAFE = [v for v in GRAPH if v.caps["mtp_graph"] == "safe"]
HIDDEN_SIZES = {
    "hf_text_config.hidden_size": 24,
    "hf_config.talker_config.hidden_size": 40,
    "hf_config.text_config.hidden_size": 56,
}
SAMPLING = ("do_sample", "temperature", "top_k", "top_p")


# -- 2.1 / 2.2: _init_talker_mtp ----------------------------------------------------------------


def init_runner(variant, *, mode, max_num_reqs=5, capture=12, dtype=torch.bfloat16, target="v1"):
    """The target's object that allocates the MTP buffers: the V1 runner, or the V2 target's model
    state (which allocates them with its own ``_make_buffer``, as vLLM's V2 runner has none)."""
    predictor = object()
    made = []
    runner = object.__new__(variant.cls() if target == "v1" else variant.state_cls())
    runner.model = SimpleNamespace(talker_mtp=predictor)
    runner.compilation_config = SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=capture)
    runner.max_num_reqs = max_num_reqs
    runner.model_config = SimpleNamespace(
        hf_text_config=SimpleNamespace(hidden_size=HIDDEN_SIZES["hf_text_config.hidden_size"]),
        hf_config=SimpleNamespace(
            talker_config=SimpleNamespace(hidden_size=HIDDEN_SIZES["hf_config.talker_config.hidden_size"]),
            text_config=SimpleNamespace(hidden_size=HIDDEN_SIZES["hf_config.text_config.hidden_size"]),
        ),
    )
    runner.dtype = dtype
    runner.device = torch.device("cpu")
    runner.vllm_config = SimpleNamespace(name="vllm_config")
    real_make = vllm_api.GPUModelRunner._make_buffer if target == "v1" else OmniModelStateV2._make_buffer

    def make_buffer(*size, dtype, numpy=True):
        made.append((size, dtype))
        return real_make(runner, *size, dtype=dtype, numpy=numpy)

    runner._make_buffer = make_buffer
    return runner, predictor, made


@pytest.mark.parametrize("variant", INIT, ids=ids(INIT))
@pytest.mark.parametrize(("max_num_reqs", "capture"), [(5, 12), (20, 8), (6, None)])
def test_init_allocates_four_buffers_of_the_declared_width(variant, max_num_reqs, capture, target, graph):
    """2.1: four persistent buffers from self._make_buffer, height max(reqs, capture), stage hidden size."""
    graph.for_policy(variant.caps["mtp_graph"])
    runner, predictor, made = init_runner(
        variant, mode=CUDAGraphMode.NONE, max_num_reqs=max_num_reqs, capture=capture, target=target
    )
    runner._init_talker_mtp()
    height = max(max_num_reqs, capture or 0)  # vLLM leaves the capture size None without CUDA graphs
    hidden = HIDDEN_SIZES[variant.caps["mtp_hidden_size_from"]]
    assert runner.has_talker_mtp is True
    assert runner.talker_mtp is predictor
    assert len(made) == 4, "allocated with self._make_buffer"
    ids_buf = runner.talker_mtp_input_ids
    assert isinstance(ids_buf, CpuGpuBuffer) and tuple(ids_buf.gpu.shape) == (height,)
    assert not ids_buf.gpu.dtype.is_floating_point and ids_buf.gpu.dtype != torch.bool
    for name in MTP_BUFFER_NAMES[1:]:
        buf = getattr(runner, name)
        assert isinstance(buf, CpuGpuBuffer), name
        assert tuple(buf.gpu.shape) == (height, hidden), name
        assert buf.gpu.dtype == torch.bfloat16, f"{name} has the runner's dtype"


@pytest.mark.parametrize("variant", GRAPH, ids=ids(GRAPH))
@pytest.mark.parametrize("mode", list(CUDAGraphMode), ids=lambda m: m.name)
def test_graph_policy_wraps_only_safe_predictors_under_full_graphs(variant, mode, target, graph):
    """2.2: safe wraps iff full CUDA graphs; unsafe never wraps and never looks the wrapper up."""
    graph.for_policy(variant.caps["mtp_graph"])
    runner, predictor, _ = init_runner(variant, mode=mode, target=target)
    runner._init_talker_mtp()
    wrapped = variant.caps["mtp_graph"] == "safe" and mode.has_full_cudagraphs()
    if wrapped:
        assert isinstance(runner.talker_mtp, FakeGraphWrapper)
        assert runner.talker_mtp.runnable is predictor
        assert runner.talker_mtp.vllm_config is runner.vllm_config
    else:
        assert runner.talker_mtp is predictor
    if variant.caps["mtp_graph"] == "unsafe":
        assert graph.lookups == 0


AUTO = [v for v in MTP_VARIANTS if v.model == "qwen3_omni" and not v.overrides] + [
    v for v in MTP_VARIANTS if any("owns_talker_module" in o or "graph=auto" in o for o in v.overrides)
]


@pytest.mark.parametrize("variant", AUTO, ids=ids(AUTO))
def test_auto_graph_policy_is_resolved_when_generating_and_says_why(variant):
    """2.2: auto -> safe for a stage owning a separate talker module, else unsafe; the plan says why."""
    plan = stage_plan(variant.model, variant.stage, variant.overrides)
    decision = next(d for d in plan.decisions if d.name == "mtp.graph")
    assert decision.value == variant.caps["mtp_graph"]
    assert decision.reason
    if "graph=full" not in variant.overrides:
        assert "auto" in decision.reason and "talker module" in decision.reason


def test_load_model_initializes_the_talker_mtp(monkeypatch, graph):
    """2.1: _init_talker_mtp runs when the model is loaded."""
    variant = MTP_VARIANTS[0]
    runner, predictor, _ = init_runner(variant, mode=CUDAGraphMode.NONE)
    model = runner.model
    del runner.model
    loads = []

    def load_model(self, *args, **kwargs):
        loads.append((args, kwargs))
        self.model = model

    monkeypatch.setattr(vllm_api.GPUModelRunner, "load_model", load_model)
    runner.load_model(eep_scale_up=False)
    assert loads == [((), {"eep_scale_up": False})]
    assert runner.has_talker_mtp is True and runner.talker_mtp is predictor


# -- 2.3: _talker_mtp_forward -------------------------------------------------------------------


def mtp_setup(
    variant,
    recorder,
    ctx,
    graph,
    *,
    wrapped=False,
    seeds=None,
    plain_seeds=None,
    predictor_cls=FakePredictor,
    model_config=None,
    kinds=None,
    buffers=None,
    target="v1",
):
    graph.for_policy(variant.caps["mtp_graph"])
    rows = rows_of(kinds or ORDERS["interleaved"])
    for row in rows:
        row.seed = (seeds or {}).get(row.tag)
        row.plain_seed = (plain_seeds or {}).get(row.tag)
    step = Step(rows)
    predictor = predictor_cls(recorder, ctx, codes_on_device=True)
    r = rig(
        variant,
        step,
        recorder,
        ctx,
        predictor=predictor,
        model_config=model_config,
        buffers=buffers,
        target=target,
    )
    if wrapped:
        r.runner.talker_mtp = FakeGraphWrapper(predictor, r.runner.vllm_config)
    mtp_rows = [row for row in rows if row.eligible]
    stage_rows(r.runner, mtp_rows)
    return r, mtp_rows


def stage_rows(runner, rows):
    for name in MTP_BUFFER_NAMES:
        getattr(runner, name).gpu.fill_(-1)
        getattr(runner, name).cpu.fill_(-3)
    for i, row in enumerate(rows):
        runner.talker_mtp_input_ids.gpu[i] = 50 + row.tag
        runner.talker_mtp_inputs_embeds.gpu[i] = 10.0 * row.tag + 1
        runner.last_talker_hidden.gpu[i] = 10.0 * row.tag + 4
        runner.text_step.gpu[i] = 10.0 * row.tag + 5


def offsets_of(step, rows):
    return [step.offsets[step.input_batch.req_id_to_index[row.req_id]] for row in rows]


def forward(r, rows, *, explicit_offsets=True):
    offsets = offsets_of(r.step, rows) if explicit_offsets else None
    r.runner._talker_mtp_forward([row.req_id for row in rows], r.step.embeds(), offsets)


@pytest.mark.parametrize("variant", GRAPH, ids=ids(GRAPH))
def test_empty_request_list_changes_nothing(variant, target, recorder, ctx, graph):
    """2.3: an empty req_ids changes nothing."""
    r, _ = mtp_setup(variant, recorder, ctx, graph, seeds={1: 3}, target=target)
    before = runner_state(r.runner)
    r.runner._talker_mtp_forward([], r.step.embeds(), [])
    r.runner._talker_mtp_forward([], r.step.embeds())
    assert recorder.events == [] and runner_state(r.runner) == before


def wrap_cases():
    return [(v, False) for v in GRAPH] + [(v, True) for v in SAFE]


@pytest.mark.parametrize(
    ("variant", "wrapped"),
    wrap_cases(),
    ids=[f"{v.id}-{'wrapped' if w else 'eager'}" for v, w in wrap_cases()],
)
def test_batch_execution_padding_and_forward_context(variant, wrapped, target, recorder, ctx, graph):
    """2.3: asks vLLM for (mode, descriptor); eager runs NONE at B, wrapped pads to descriptor.num_tokens."""
    r, rows = mtp_setup(variant, recorder, ctx, graph, wrapped=wrapped, target=target)
    forward(r, rows)
    batch = len(rows)
    if target == "v2":
        check_v2_dispatch(r, rows, wrapped, recorder)
        return
    asks = recorder.of("determine")
    assert len(asks) == 1
    ask = asks[0]
    assert set(ask) == {
        "num_tokens",
        "num_reqs",
        "num_scheduled_tokens_np",
        "max_num_scheduled_tokens",
        "use_cascade_attn",
    }
    assert ask["num_tokens"] == batch and ask["num_reqs"] == batch
    assert ask["max_num_scheduled_tokens"] == 1 and ask["use_cascade_attn"] is False
    np.testing.assert_array_equal(ask["num_scheduled_tokens_np"], np.ones(batch, dtype=np.int32))
    assert ask["num_scheduled_tokens_np"].dtype == np.int32
    descriptor = r.runner._determine_batch_execution_and_padding.returned[0]
    (call,) = recorder.of("talker_mtp")
    contexts = recorder.of("forward_context")
    assert len(contexts) == 1 and call["context"] is not None, "the predictor runs inside the forward context"
    assert call["context"]["batch_descriptor"] is descriptor
    assert call["context"]["vllm_config"] is r.runner.vllm_config
    if wrapped:
        assert call["context"]["cudagraph_runtime_mode"] == CUDAGraphMode.FULL
        assert call["input_ids"].shape[0] == descriptor.num_tokens > batch
    else:
        assert call["context"]["cudagraph_runtime_mode"] == CUDAGraphMode.NONE
        assert call["input_ids"].shape[0] == batch
    assert call["input_ids"][:batch].tolist() == [50 + row.tag for row in rows]
    assert call["last_talker_hidden"][:batch, 0].tolist() == [10.0 * row.tag + 4 for row in rows]
    assert call["text_step"][:batch, 0].tolist() == [10.0 * row.tag + 5 for row in rows]
    assert call["inputs_embeds"][:batch, 0].tolist() == [10.0 * row.tag + 1 for row in rows]


def check_v2_dispatch(r, rows, wrapped, recorder):
    """2.3 on Model Runner V2, which has no ``_determine_batch_execution_and_padding``: a wrapped
    predictor replays the smallest size its wrapper has captured that holds the rows (its
    ``concrete_cudagraph_entries``), an unwrapped one runs eager at the batch size."""
    batch = len(rows)
    assert recorder.of("determine") == []
    (call,) = recorder.of("talker_mtp")
    contexts = recorder.of("forward_context")
    assert len(contexts) == 1 and call["context"] is not None, "the predictor runs inside the forward context"
    descriptor = call["context"]["batch_descriptor"]
    assert call["context"]["vllm_config"] is r.runner.vllm_config
    if wrapped:
        padded = min(size for size in FakeGraphWrapper.CAPTURED if size >= batch)
        assert call["context"]["cudagraph_runtime_mode"] == CUDAGraphMode.FULL
        assert descriptor.num_tokens == padded == call["input_ids"].shape[0] > batch
    else:
        assert call["context"]["cudagraph_runtime_mode"] == CUDAGraphMode.NONE
        assert descriptor.num_tokens == batch == call["input_ids"].shape[0]
    assert call["input_ids"][:batch].tolist() == [50 + row.tag for row in rows]
    assert call["last_talker_hidden"][:batch, 0].tolist() == [10.0 * row.tag + 4 for row in rows]
    assert call["inputs_embeds"][:batch, 0].tolist() == [10.0 * row.tag + 1 for row in rows]


def test_v2_dispatch_replays_only_sizes_the_wrapper_captured(recorder, ctx, graph):
    """2.3/5.4 on V2: serving never captures. A batch larger than every captured size, or a
    wrapper with no captured graph yet (after V2's memory profiling cleared them), runs eager."""
    variant = next(v for v in GRAPH if v.caps["mtp_graph"] == "safe")
    r, rows = mtp_setup(variant, recorder, ctx, graph, wrapped=True, target="v2")
    wrapper = r.runner.talker_mtp
    assert r.runner._mtp_dispatch(3)[1].num_tokens == 4
    wrapper.concrete_cudagraph_entries = {
        key: entry for key, entry in wrapper.concrete_cudagraph_entries.items() if key.num_tokens <= 2
    }
    mode, descriptor = r.runner._mtp_dispatch(3)
    assert mode == CUDAGraphMode.NONE and descriptor.num_tokens == 3
    for entry in wrapper.concrete_cudagraph_entries.values():
        entry.cudagraph = None
    mode, descriptor = r.runner._mtp_dispatch(1)
    assert mode == CUDAGraphMode.NONE and descriptor.num_tokens == 1


DEPLOYMENTS = {
    "none": None,
    "unset": "unset",
    "partial": {"temperature": 0.3},
    "full": {"do_sample": False, "temperature": 0.7, "top_k": 5, "top_p": 0.8},
}


@pytest.mark.parametrize("variant", SAMPLED, ids=ids(SAMPLED))
def test_sampling_kwargs_come_from_the_deployment_else_stage_defaults_else_none(
    variant, target, recorder, ctx, graph
):
    """2.3: do_sample/temperature/top_k/top_p always passed; deployment dict, else defaults, else None."""
    seen = {}
    for name, deployment in DEPLOYMENTS.items():
        cfg = (
            SimpleNamespace()
            if deployment == "unset"
            else SimpleNamespace(subtalker_sampling_params=deployment)
        )
        recorder.events.clear()
        r, rows = mtp_setup(variant, recorder, ctx, graph, model_config=cfg, target=target)
        forward(r, rows)
        (call,) = recorder.of("talker_mtp")
        assert set(SAMPLING) <= set(call["kwargs"]), "all four are always passed"
        seen[name] = {k: call["kwargs"][k] for k in SAMPLING}
    defaults = seen["unset"]
    assert seen["none"] == defaults
    if "sampling" in variant.facts:
        assert defaults == variant.facts["sampling"]
    elif variant.caps["mtp_sampling_defaults"]:
        assert all(v is not None for v in defaults.values()), "the stage's configured defaults"
    else:
        assert defaults == dict.fromkeys(SAMPLING), "no defaults: None"
    assert seen["full"] == DEPLOYMENTS["full"]
    assert seen["partial"] == {**defaults, "temperature": 0.3}


def expected_calls(variant, wrapped, rows):
    seeded = any(row.seed is not None for row in rows)
    if seeded and len(rows) > 1 and not variant.mtp_accepts_generators_when[wrapped]:
        return [[row] for row in rows]
    return [rows]


def check_generator_kwargs(call, rows, runner):
    kwargs = call["kwargs"]
    seeded = [row for row in rows if row.seed is not None]
    if not seeded:
        assert "generator" not in kwargs and "generators" not in kwargs
    elif len(rows) == 1:
        assert kwargs["generator"] is runner._talker_mtp_generators[rows[0].req_id]
        assert isinstance(kwargs["generator"], torch.Generator)
        assert "generators" not in kwargs
    else:
        assert kwargs["generator"] is None
        gens = kwargs["generators"]
        assert len(gens) == len(rows)
        for g, row in zip(gens, rows, strict=True):
            if row.seed is None:
                assert g is None
            else:
                assert g is runner._talker_mtp_generators[row.req_id]


def nth_draw(seed, n):
    g = torch.Generator().manual_seed(seed)
    return [float(torch.rand(1, generator=g)) for _ in range(n)][-1]


SEEDINGS = {
    "unseeded": {},
    "one_seeded": {1: 11},
    "all_seeded": {1: 11, 3: 12, 5: 13, 7: 14, 9: 15},
}


def seed_cases():
    cases = []
    for v in GRAPH:
        for wrapped in [False, True] if v.caps["mtp_graph"] == "safe" else [False]:
            for seeding in SEEDINGS:
                cases.append((v, wrapped, seeding))
    return cases


@pytest.mark.parametrize(
    ("variant", "wrapped", "seeding"),
    seed_cases(),
    ids=[f"{v.id}-{'wrapped' if w else 'eager'}-{s}" for v, w, s in seed_cases()],
)
def test_generators_and_the_row_by_row_fallback(variant, wrapped, seeding, target, recorder, ctx, graph):
    """2.3: generator / generators rules, the per-row fallback, and the four buffers restored."""
    seeds = SEEDINGS[seeding]
    # A plain sampling_params.seed on row 3 (and every row when unseeded) must not seed.
    plain = {3: 99} if seeding != "unseeded" else {1: 98, 3: 99, 5: 97}
    r, rows = mtp_setup(
        variant, recorder, ctx, graph, wrapped=wrapped, seeds=seeds, plain_seeds=plain, target=target
    )
    staged = {name: freeze(getattr(r.runner, name)) for name in MTP_BUFFER_NAMES}
    embeds_before = r.step.inputs_embeds.gpu.clone()
    forward(r, rows)
    calls = recorder.of("talker_mtp")
    plan = expected_calls(variant, wrapped, rows)
    assert len(calls) == len(plan)
    for call, call_rows in zip(calls, plan, strict=True):
        check_generator_kwargs(call, call_rows, r.runner)
        n = len(call_rows)
        # The call sees its rows from slot 0 (a per-row call: that row copied into slot 0).
        assert call["input_ids"][:n].tolist() == [50 + row.tag for row in call_rows]
        assert call["inputs_embeds"][:n, 0].tolist() == [10.0 * row.tag + 1 for row in call_rows]
        assert call["last_talker_hidden"][:n, 0].tolist() == [10.0 * row.tag + 4 for row in call_rows]
        assert call["text_step"][:n, 0].tolist() == [10.0 * row.tag + 5 for row in call_rows]
        # Each seeded row draws from its own stream, seeded by tts_local_seed.
        if "generators" in call["kwargs"]:
            pairs = list(zip(call["draws"], call_rows, strict=True))
        elif call["kwargs"].get("generator") is not None:
            pairs = [(call["draws"][0], call_rows[0])]
        else:
            pairs = []
        assert [row.req_id for _, row in pairs if row.seed is not None] == [
            row.req_id for row in call_rows if row.seed is not None
        ]
        for draw, row in pairs:
            if row.seed is not None:
                assert draw == nth_draw(row.seed, 1)
    assert sorted(r.runner._talker_mtp_generators) == sorted(
        row.req_id for row in rows if row.seed is not None
    )
    # Row-by-row or not, the four MTP buffers are as staged when it returns.
    assert {name: freeze(getattr(r.runner, name)) for name in MTP_BUFFER_NAMES} == staged
    # Write-back to each row's offset, every other embedding untouched.
    expected = embeds_before.clone()
    for row, offset in zip(rows, offsets_of(r.step, rows), strict=True):
        expected[offset] = 10.0 * row.tag + 4.5
    assert torch.equal(r.step.inputs_embeds.gpu, expected)
    key0, key1 = variant.caps["mtp_output_key"]
    for row in rows:
        assert r.runner.model_intermediate_buffer[row.req_id][key0][key1].tolist() == [
            expected_codes(row.tag)
        ]


@pytest.mark.parametrize("variant", GRAPH, ids=ids(GRAPH))
def test_unseeded_traffic_works_with_a_predictor_without_generator_arguments(
    variant, target, recorder, ctx, graph
):
    """2.3: generator/generators are passed only when a row is seeded."""
    r, rows = mtp_setup(
        variant, recorder, ctx, graph, predictor_cls=StrictPredictor, plain_seeds={1: 5, 3: 6}, target=target
    )
    forward(r, rows)
    forward(r, rows[:1])
    assert len(recorder.of("talker_mtp")) == 2
    assert r.runner._talker_mtp_generators == {}


@pytest.mark.parametrize("variant", GRAPH, ids=ids(GRAPH))
def test_a_seeded_request_keeps_one_generator_across_steps_until_it_leaves(
    variant, target, recorder, ctx, graph
):
    """2.3: one torch.Generator per seeded request, kept across steps, dropped once not in self.requests."""
    r, rows = mtp_setup(variant, recorder, ctx, graph, seeds={1: 21, 5: 22}, target=target)
    seeded = [row for row in rows if row.seed is not None]
    forward(r, seeded[:1])
    gen = r.runner._talker_mtp_generators[seeded[0].req_id]
    assert recorder.of("talker_mtp")[-1]["draws"] == [nth_draw(21, 1)]
    forward(r, seeded[:1])
    assert r.runner._talker_mtp_generators[seeded[0].req_id] is gen, "kept across steps"
    assert recorder.of("talker_mtp")[-1]["draws"] == [nth_draw(21, 2)], "one random stream continues"
    # The request leaves; the next MTP step (another request) drops its generator.
    state = r.runner.requests.pop(seeded[0].req_id)
    forward(r, seeded[1:2])
    assert seeded[0].req_id not in r.runner._talker_mtp_generators
    assert seeded[1].req_id in r.runner._talker_mtp_generators
    # Re-admitted under the same id, it starts a fresh stream from its seed.
    r.runner.requests[seeded[0].req_id] = state
    forward(r, seeded[:1])
    assert r.runner._talker_mtp_generators[seeded[0].req_id] is not gen
    assert recorder.of("talker_mtp")[-1]["draws"] == [nth_draw(21, 1)]


@pytest.mark.parametrize("variant", WRITE_BACK, ids=ids(WRITE_BACK))
@pytest.mark.parametrize("explicit", [True, False], ids=["start_offsets", "offsets_from_query_start_loc"])
def test_write_back_to_offsets_and_codes_under_the_output_key(
    variant, explicit, target, recorder, ctx, graph
):
    """2.3: row i's embedding to inputs_embeds[offset_i]; codes[i:i+1] merged into its buffer."""
    kinds = ["prefill", "decode", "tail", "decode_late", "decode"]
    key0, key1 = variant.caps["mtp_output_key"]
    keep = {"meta": {"m": 1}, key0: {"other": 5}}
    buffers = {
        f"r{i + 1}-{k}": {"meta": dict(keep["meta"]), key0: dict(keep[key0])} for i, k in enumerate(kinds)
    }
    r, rows = mtp_setup(variant, recorder, ctx, graph, kinds=kinds, buffers=buffers, target=target)
    before = r.step.inputs_embeds.gpu.clone()
    forward(r, rows, explicit_offsets=explicit)
    expected = before.clone()
    for row, offset in zip(rows, offsets_of(r.step, rows), strict=True):
        expected[offset] = 10.0 * row.tag + 4.5
    assert torch.equal(r.step.inputs_embeds.gpu, expected)
    returned = r.predictor.last_codes
    for i, row in enumerate(rows):
        buf = r.runner.model_intermediate_buffer[row.req_id]
        codes = buf[key0][key1]
        assert codes.tolist() == [expected_codes(row.tag)] and tuple(codes.shape) == (1, 3)
        assert buf[key0]["other"] == 5 and buf["meta"] == {"m": 1}, "merged, not replaced"
        assert r.runner.requests[row.req_id].additional_information_cpu is buf
        if mtp_codes_gpu_resident(variant):
            assert type(codes) is DeviceTensor and codes.device.type == "cuda", "GPU-resident codes stay"
            # ... as an owned copy: the predictor's output buffer may be rewritten by the next replay.
            returned.as_subclass(torch.Tensor)[i].fill_(-1)
            assert codes.tolist() == [expected_codes(row.tag)]
        else:
            assert type(codes) is torch.Tensor and codes.device.type == "cpu", "codes move to the host"
    for row in r.step.rows:
        if not row.eligible:
            assert key1 not in r.runner.model_intermediate_buffer[row.req_id][key0]


def _request(**fields):
    return SimpleNamespace(**fields)


def test_row_generators_read_every_form_of_request():
    """Only ``extra_args["tts_local_seed"]`` seeds a row, whatever else a request carries (no
    sampling params, params without extra_args, extra_args None, empty, or not a dict); a seeded
    row keeps its generator across steps, and a finished request's is dropped."""
    requests = {
        "no_params": _request(sampling_params=None),
        "no_extra": _request(sampling_params=SimpleNamespace()),
        "none": _request(sampling_params=SimpleNamespace(extra_args=None)),
        "empty": _request(sampling_params=SimpleNamespace(extra_args={})),
        "not_a_dict": _request(sampling_params=SimpleNamespace(extra_args=["tts_local_seed", 5])),
        "plain_seed": _request(sampling_params=SimpleNamespace(extra_args=None, seed=9)),
        "seeded": _request(sampling_params=SimpleNamespace(extra_args={"tts_local_seed": "7"})),
    }
    cache: dict[str, torch.Generator] = {"finished": torch.Generator()}
    req_ids = list(requests)
    found = mtp.row_generators(cache, requests, req_ids, torch.device("cpu"))
    assert found[:-1] == [None] * (len(req_ids) - 1)
    assert isinstance(found[-1], torch.Generator)
    expected = torch.rand(1, generator=torch.Generator().manual_seed(7))
    assert torch.rand(1, generator=found[-1]).item() == expected.item(), "seeded by tts_local_seed"
    assert list(cache) == ["seeded"], "the finished request's generator was dropped"
    # The next step continues the seeded row's stream.
    again = mtp.row_generators(cache, requests, ["seeded"], torch.device("cpu"))
    assert again == [found[-1]]


def test_row_generators_of_an_unseeded_step_are_none():
    """A step whose requests all carry no extra_args (the common decode step) has no generator."""
    requests = {str(i): _request(sampling_params=SimpleNamespace(extra_args=None)) for i in range(4)}
    cache: dict[str, torch.Generator] = {}
    assert mtp.row_generators(cache, requests, list(requests), torch.device("cpu")) == [None] * 4
    assert cache == {}
