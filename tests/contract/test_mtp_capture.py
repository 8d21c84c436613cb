"""MTP graphs are captured when vLLM captures (CONTRACT 2.2), proven on CPU.

Each ``mtp.graph=safe`` stage of ``conf/model`` is built as the worker builds it on this machine
(the generated runner composed with vLLM's ``CPUModelRunner``, vLLM's own ``__init__`` on a
real ``VllmConfig``) with full decode CUDA graphs configured, and its predictor wrapped by the
generated ``_init_talker_mtp`` in ``SimulatedGraphWrapper`` (vLLM's ``CUDAGraphWrapper`` with
only the CUDA driver simulated, ``_cudagraph.py``). Then vLLM's real ``capture_model`` runs,
through vLLM's ``_capture_cudagraphs`` / ``_warmup_and_capture`` / ``_dummy_run`` and the
generated ``_dummy_run``; after it, capturing is disabled (by vLLM), and every MTP batch size a
step can have, seeded and unseeded, must only replay. Patched in vLLM's capture path, each
because it is CUDA-only: ``graph_capture`` (the capture stream), ``torch.accelerator``'s
memory query and ``lock_workspace`` (the device workspace).

The stage model is a stand-in (the checkpoints are not on this machine): a trunk returning
hidden states and a linear code predictor; ``tests/e2e`` runs real models.
"""

from __future__ import annotations

import contextlib
import functools
import socket
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.compilation.monitor import set_cudagraph_capturing_enabled, validate_cudagraph_capturing_enabled
from vllm.config import CUDAGraphMode, set_current_vllm_config
from vllm.forward_context import BatchDescriptor, set_forward_context
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.worker import gpu_model_runner

from omnigen import api, paths
from omnigen.runtime import mtp, vllm_api
from omnigen.runtime.worker import cpu_runner_class
from omnigen_testing.tiny_omni import TALKER_ARCH, write_tiny_config

from ._cudagraph import SimulatedGraphWrapper, simulated_cuda_graphs
from ._engine_config import engine_config

MAX_NUM_SEQS = 4
CAPTURE_SIZES = [1, 2, 4, 8]
NUM_CODES = 2

SAFE_STAGES = [
    (model, plan.stage)
    for model in paths.model_names()
    for plan in api.model_plan(model).stages
    if plan.mtp is not None and plan.mtp.graph == "safe"
]


def test_every_conf_model_with_a_safe_stage_is_covered():
    # The list is derived from conf/model; this pins that it is not empty by accident.
    assert {m for m, _ in SAFE_STAGES} >= {"qwen3_tts", "qwen3_omni", "fish_speech", "moss_tts_local"}


class _Predictor(nn.Module):
    """``(ids, embeds, last_hidden, text_step, **sampling) -> (embeds, codes)``, row-wise."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, input_ids, inputs_embeds, last_talker_hidden, text_step, **sampling):
        embeds = self.proj(inputs_embeds + last_talker_hidden + text_step)
        return embeds, (embeds[:, :NUM_CODES] * 100).round().long()


class _StageModel(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.talker_mtp = _Predictor(hidden)

    def forward(
        self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **kwargs
    ):
        rows = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        return torch.zeros(rows, self.hidden)


@functools.cache
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def distributed(plain_config):
    """vLLM's single-rank process groups (``capture_model`` asks for the world group's rank)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        yield
        return
    with set_current_vllm_config(plain_config):
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            backend="gloo",
        )
        parallel_state.ensure_model_parallel_initialized(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_tiny_config(tmp_path_factory.mktemp("ckpt"), TALKER_ARCH)


def _vllm_config(checkpoint: str, mode: CUDAGraphMode) -> Any:
    config = engine_config(checkpoint, dtype="float32", max_num_seqs=MAX_NUM_SEQS)
    # The CPU platform turns CUDA graphs off; configure them as a GPU deployment would.
    compilation = config.compilation_config
    compilation.cudagraph_mode = mode
    compilation.cudagraph_capture_sizes = list(CAPTURE_SIZES)
    compilation.max_cudagraph_capture_size = max(CAPTURE_SIZES)
    return config


def _give_hidden_size(model_config: Any, dotted: str, hidden: int) -> None:
    """The stand-in checkpoint is Llama-shaped; give it the sub-config the stage reads its width from."""
    node = model_config
    *path, leaf = dotted.split(".")
    for name in path:
        child = getattr(node, name, None)
        if child is None:
            child = SimpleNamespace()
            setattr(node, name, child)
        node = child
    setattr(node, leaf, hidden)


def _built_runner(model: str, stage: str, config: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The generated runner as the CPU worker builds it, with the stand-in model loaded."""
    plan = api.stage_plan(model, stage)
    hidden = int(config.model_config.hf_text_config.hidden_size)
    _give_hidden_size(config.model_config, plan.mtp.hidden_size_from, hidden)
    with set_current_vllm_config(config):
        runner = cpu_runner_class(api.runner_class(model, stage))(config, torch.device("cpu"))
    runner.model = _StageModel(hidden)
    # vLLM's capture and dummy runs build attention metadata per KV-cache group; the stand-in
    # model has no attention layers, so there are none.
    runner.kv_cache_config = KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
    runner.cudagraph_dispatcher.initialize_cudagraph_keys(
        config.compilation_config.cudagraph_mode, runner.uniform_decode_query_len
    )
    monkeypatch.setattr(vllm_api, "full_graph_wrapper_cls", lambda: SimulatedGraphWrapper)
    runner._init_talker_mtp()  # the generated code wraps the predictor (mtp.graph=safe)
    assert isinstance(runner.talker_mtp, SimulatedGraphWrapper)
    return runner


@contextlib.contextmanager
def _cuda_only_parts_of_capture(monkeypatch: pytest.MonkeyPatch):
    with monkeypatch.context() as mp:
        mp.setattr(gpu_model_runner, "graph_capture", lambda device: contextlib.nullcontext())
        mp.setattr(gpu_model_runner, "lock_workspace", lambda: None)
        mp.setattr(torch.accelerator, "get_memory_info", lambda *a: (0, 0), raising=False)
        yield


@pytest.fixture
def capture_enabled_after():
    """vLLM's capture flag is process-wide: restore its start value (enabled) after each test."""
    yield
    set_cudagraph_capturing_enabled(True)


def _requests(runner: Any, count: int, *, seeded: bool) -> list[str]:
    req_ids = [f"r{i}" for i in range(count)]
    for i, req_id in enumerate(req_ids):
        extra = {mtp.SEED_KEY: 100 + i} if seeded else None
        runner.requests[req_id] = SimpleNamespace(sampling_params=SamplingParams(extra_args=extra))
    return req_ids


def _serve_mtp_step(runner: Any, req_ids: list[str]) -> None:
    """One decode step's MTP: rows staged in the persistent buffers, then the generated forward."""
    batch = len(req_ids)
    hidden = runner.last_talker_hidden.gpu.shape[1]
    for buffer in (runner.talker_mtp_inputs_embeds, runner.last_talker_hidden, runner.text_step):
        buffer.gpu[:batch].copy_(torch.randn(batch, hidden))
    inputs_embeds = torch.zeros(batch, hidden)
    runner._talker_mtp_forward(req_ids, inputs_embeds, list(range(batch)))


CASES = [
    pytest.param(model, stage, mode, id=f"{model}-{stage}-{mode.name}")
    for model, stage in SAFE_STAGES
    for mode in (CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL)
]


@pytest.mark.parametrize(("model", "stage", "mode"), CASES)
def test_capture_model_captures_the_predictor_and_serving_only_replays(
    model, stage, mode, checkpoint, distributed, monkeypatch, capture_enabled_after
):
    log = simulated_cuda_graphs(monkeypatch)
    runner = _built_runner(model, stage, _vllm_config(checkpoint, mode), monkeypatch)
    with _cuda_only_parts_of_capture(monkeypatch):
        runner.capture_model()  # vLLM's: enables capturing, runs the dummy runs, disables it

    # A step has 1..MAX_NUM_SEQS MTP rows, padded to the capture sizes 1, 2 and 4: each is
    # captured once, inside vLLM's capture window (vLLM's capture run of size 8 replays size 4).
    assert sorted(log.of("capture")) == [1, 2, 4], log.events
    with pytest.raises(RuntimeError, match="inappropriate time"):
        validate_cudagraph_capturing_enabled()  # vLLM disabled capturing after capture_model

    served = len(log.events)
    plan = api.stage_plan(model, stage)
    for batch in range(1, MAX_NUM_SEQS + 1):
        for seeded in (False, True):
            runner.requests.clear()
            _serve_mtp_step(runner, _requests(runner, batch, seeded=seeded))
    serving = log.events[served:]
    assert serving and {event for event, _ in serving} == {"replay"}, serving
    if plan.mtp.per_row_generators != "always":
        # Seeded rows of a wrapped predictor run one by one (row-by-row fallback): each is a
        # replay of size 1, beside the unseeded batch of one.
        assert serving.count(("replay", 1)) == 1 + sum(range(1, MAX_NUM_SEQS + 1))


@pytest.mark.parametrize(("model", "stage"), SAFE_STAGES[:1])
def test_without_the_predictor_in_dummy_runs_the_first_decode_would_capture_while_serving(
    model, stage, checkpoint, distributed, monkeypatch, capture_enabled_after
):
    """The negative control: the bug this fixes, caught by the stand-in (vLLM's own refusal)."""
    simulated_cuda_graphs(monkeypatch)
    runner = _built_runner(
        model, stage, _vllm_config(checkpoint, CUDAGraphMode.FULL_DECODE_ONLY), monkeypatch
    )
    monkeypatch.setattr(runner, "_talker_mtp_dummy_run", lambda *args, **kwargs: None)
    with _cuda_only_parts_of_capture(monkeypatch):
        runner.capture_model()
    with pytest.raises(RuntimeError, match="CUDA graph capturing detected at an inappropriate time"):
        _serve_mtp_step(runner, _requests(runner, 2, seeded=False))


def test_profile_and_warmup_dummy_runs_run_the_predictor_eager(checkpoint, distributed, monkeypatch):
    model, stage = SAFE_STAGES[0]
    log = simulated_cuda_graphs(monkeypatch)
    runner = _built_runner(
        model, stage, _vllm_config(checkpoint, CUDAGraphMode.FULL_DECODE_ONLY), monkeypatch
    )
    runner._dummy_run(8, is_profile=True)
    runner._dummy_run(2, cudagraph_runtime_mode=CUDAGraphMode.NONE, uniform_decode=True)
    assert log.events == [("eager", MAX_NUM_SEQS), ("eager", 2)]


# -- the stand-in refuses what vLLM's CUDAGraphWrapper refuses ----------------------------------


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _forward(config: Any, mode: CUDAGraphMode, rows: int):
    return set_forward_context(
        None, config, cudagraph_runtime_mode=mode, batch_descriptor=BatchDescriptor(rows, rows, uniform=True)
    )


@pytest.fixture(scope="module")
def plain_config(checkpoint) -> Any:
    return _vllm_config(checkpoint, CUDAGraphMode.FULL_DECODE_ONLY)


def test_capture_outside_vllms_capture_window_is_refused_as_vllm_refuses(
    plain_config, monkeypatch, capture_enabled_after
):
    real_wrapper = CUDAGraphWrapper.__new__(CUDAGraphWrapper)
    # vLLM's own wrapper, unpatched: __init__ needs a CUDA graph pool, so only its state is set;
    # its __call__ validates before it touches CUDA.
    real_wrapper.__dict__.update(
        runnable=_identity,
        runtime_mode=CUDAGraphMode.FULL,
        concrete_cudagraph_entries={},
        cudagraph_options=SimpleNamespace(debug_log_enable=False, gc_disable=False, weak_ref_output=True),
        is_debugging_mode=False,
    )
    set_cudagraph_capturing_enabled(False)
    with _forward(plain_config, CUDAGraphMode.FULL, 2), pytest.raises(RuntimeError) as real:
        real_wrapper(torch.ones(2))
    simulated_cuda_graphs(monkeypatch)
    stand_in = SimulatedGraphWrapper(_identity, plain_config, CUDAGraphMode.FULL)
    with _forward(plain_config, CUDAGraphMode.FULL, 2), pytest.raises(RuntimeError) as simulated:
        stand_in(torch.ones(2))
    assert str(simulated.value) == str(real.value)
    assert "CUDA graph capturing detected at an inappropriate time" in str(real.value)


def test_replay_on_other_input_addresses_is_refused(plain_config, monkeypatch, capture_enabled_after):
    simulated_cuda_graphs(monkeypatch)
    stand_in = SimulatedGraphWrapper(_identity, plain_config, CUDAGraphMode.FULL)
    captured_input = torch.ones(2)
    with _forward(plain_config, CUDAGraphMode.FULL, 2):
        out = stand_in(captured_input)
    set_cudagraph_capturing_enabled(False)
    captured_input.fill_(3.0)
    with _forward(plain_config, CUDAGraphMode.FULL, 2):
        replayed = stand_in(captured_input)  # same memory: a replay, reading the new values
    assert replayed is out and replayed.tolist() == [6.0, 6.0]
    with (
        _forward(plain_config, CUDAGraphMode.FULL, 2),
        pytest.raises(AssertionError, match="Input addresses"),
    ):
        stand_in(torch.ones(2))  # vLLM's debug-mode address check


def test_replay_with_other_shapes_and_eager_modes(plain_config, monkeypatch, capture_enabled_after):
    log = simulated_cuda_graphs(monkeypatch)
    stand_in = SimulatedGraphWrapper(_identity, plain_config, CUDAGraphMode.FULL)
    buffer = torch.ones(4)
    with _forward(plain_config, CUDAGraphMode.FULL, 2):
        stand_in(buffer[:2])
    set_cudagraph_capturing_enabled(False)
    with _forward(plain_config, CUDAGraphMode.FULL, 2), pytest.raises(AssertionError, match="shapes"):
        stand_in(buffer[:3])
    # vLLM's rule: NONE or another mode than the wrapper's runs the runnable, never captures.
    for mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        with _forward(plain_config, mode, 3):
            assert stand_in(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
    assert log.events == [("capture", 2), ("eager", 3), ("eager", 3)]


# -- the same clause on the Model Runner V2 target ----------------------------------------------
#
# V2 has no dummy run the predictor can ride on: it calls the model state's
# ``capture_inner_cudagraphs`` once per ``capture_model``, after the model's graphs. The stage's
# generated model state is built by its own ``__init__`` (vLLM's ``DefaultModelState.__init__``
# on the real config), which wraps the predictor; then the hook captures, and serving, with
# vLLM's capture guard off, must only replay: V2's dispatch asks the wrapper what it captured.


def _built_state(model: str, stage: str, config: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    plan = api.stage_plan(model, stage)
    hidden = int(config.model_config.hf_text_config.hidden_size)
    _give_hidden_size(config.model_config, plan.mtp.hidden_size_from, hidden)
    monkeypatch.setattr(vllm_api, "full_graph_wrapper_cls", lambda: SimulatedGraphWrapper)
    with set_current_vllm_config(config):
        state = api.model_state_class(model, stage)(config, _StageModel(hidden), None, torch.device("cpu"))
    assert isinstance(state.talker_mtp, SimulatedGraphWrapper), "the generated __init__ wraps it (2.2)"
    return state


@pytest.mark.parametrize(("model", "stage", "mode"), CASES)
def test_v2_capture_inner_cudagraphs_captures_the_predictor_and_serving_only_replays(
    model, stage, mode, checkpoint, distributed, monkeypatch, capture_enabled_after
):
    from omnigen.runtime import vllm_api_v2

    log = simulated_cuda_graphs(monkeypatch)
    state = _built_state(model, stage, _vllm_config(checkpoint, mode), monkeypatch)
    # The capture stream is CUDA's (V2 hands its own to the hook on 0.34).
    monkeypatch.setattr(vllm_api_v2, "graph_capture", lambda device, stream=None: contextlib.nullcontext())
    state.capture_inner_cudagraphs(None, None, [], None)
    # vLLM's capture sizes 1, 2, 4, 8 hold at most MAX_NUM_SEQS MTP rows: 1, 2 and 4, each once.
    assert sorted(log.of("capture")) == [1, 2, 4], log.events
    set_cudagraph_capturing_enabled(False)  # any capture from here on is refused by vLLM

    served = len(log.events)
    plan = api.stage_plan(model, stage)
    for batch in range(1, MAX_NUM_SEQS + 1):
        for seeded in (False, True):
            state.requests.clear()
            _serve_mtp_step(state, _requests(state, batch, seeded=seeded))
    serving = log.events[served:]
    assert serving and {event for event, _ in serving} == {"replay"}, serving
    if plan.mtp.per_row_generators != "always":
        assert serving.count(("replay", 1)) == 1 + sum(range(1, MAX_NUM_SEQS + 1))

    # V2's memory profiling captures, then clears every graph (CUDAGraphWrapper.clear_all_graphs)
    # until the real capture_model: a step in between runs eager, it never captures.
    state.talker_mtp.concrete_cudagraph_entries.clear()
    cleared = len(log.events)
    _serve_mtp_step(state, _requests(state, 3, seeded=False))
    assert log.events[cleared:] == [("eager", 3)]


def test_v2_an_unwrapped_predictor_captures_nothing(checkpoint, distributed, monkeypatch):
    """2.2 on V2: without full graphs the hook captures nothing and the predictor runs eager."""
    model, stage = SAFE_STAGES[0]
    log = simulated_cuda_graphs(monkeypatch)
    config = _vllm_config(checkpoint, CUDAGraphMode.PIECEWISE)
    plan = api.stage_plan(model, stage)
    hidden = int(config.model_config.hf_text_config.hidden_size)
    _give_hidden_size(config.model_config, plan.mtp.hidden_size_from, hidden)
    with set_current_vllm_config(config):
        state = api.model_state_class(model, stage)(config, _StageModel(hidden), None, torch.device("cpu"))
    assert isinstance(state.talker_mtp, _Predictor)
    state.capture_inner_cudagraphs(None, None, [], None)
    assert log.events == []
