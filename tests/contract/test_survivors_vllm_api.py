"""``vllm_api``, omnigen's one adapter to vLLM's internals, where ``scripts/mutation`` found the
suite silent (issue 37, docs/mutation.md).

Driven with vLLM's own objects: a real ``VllmConfig`` of the tiny checkpoint, vLLM's ``Worker``
and ``Scheduler`` (the two owners ``keep_v1_model_runner`` switches to V1), vLLM's
``HiSparseConfig`` and ``WatermarkConfig`` (the settings only V2 serves), vLLM's
``GPUModelRunner._dummy_run`` signature, ``CpuGpuBuffer`` and
``make_empty_intermediate_tensors_factory``. A GPU machine's V1/V2 choice is simulated as in
``test_v1_runner_choice.py`` (Triton importable); a vLLM without the V1 runner or with seams
missing is simulated by patching ``v1_runner_available`` / ``v2_missing_seams``, as the rule
tests there do.

Covered: a setting that needs V2 is refused naming the owner, the stage's reason and every
setting to unset; the switch to V1 is logged by owner; each ``runner_target`` reason says why;
a checkpoint without the stage's sub-config names its config class and the fix; a generation
step's output carries its published rows; a V1 runner where vLLM has none says what to do; the
dummy-run model wrapper feeds the embeddings and forwards every other attribute; which dummy
runs are eager. The existing cases are in ``test_v1_runner_choice.py``,
``test_real_model_clauses.py`` and ``test_output_channel.py``.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from vllm.config import CUDAGraphMode
from vllm.config.attention import HiSparseConfig
from vllm.config.watermarking import WatermarkConfig
from vllm.model_executor.models.utils import make_empty_intermediate_tensors_factory
from vllm.sequence import IntermediateTensors
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker.gpu_worker import Worker

from omnigen.runtime import vllm_api
from omnigen_testing.contract_support import bare_runner, runner_class

from ._engine_config import engine_config
from .test_real_model_clauses import GEN_IDS, Model, Recorder, _step, forward_runner, state

# Two seams of V2_SEAMS (the first is the one vLLM 0.30's Model Runner V2 lacks).
TWO_SEAMS = (
    "vllm.v1.worker.gpu.model_states.interface:ModelState.capture_inner_cudagraphs",
    "vllm.v1.worker.gpu.async_utils:AsyncOutput.get_output",
)


def _worker(config) -> Worker:
    """vLLM's own worker (not omnigen's), which copies ``use_v2_model_runner`` when built."""
    return Worker(vllm_config=config, local_rank=0, rank=0, distributed_init_method="tcp://127.0.0.1:1")


def _scheduler(config):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config.cache_config.num_gpu_blocks = 8
    attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    kv_cache = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layers.0.attn"], attention)]
    )
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=16,
    )


# -- keep_v1_model_runner -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (("hisparse",), "attention_config.hisparse_config"),
        (("watermark",), "watermark_config"),
        (
            ("env", "hisparse", "watermark"),
            "VLLM_USE_V2_MODEL_RUNNER=1, attention_config.hisparse_config, watermark_config",
        ),
    ],
    ids=["hisparse", "watermark", "all three"],
)
def test_a_setting_only_v2_serves_is_refused_naming_the_owner_the_reason_and_every_setting(
    checkpoint, gpu_selection, monkeypatch, settings, named
):
    """vLLM switches to V2 for HiSparse and watermarking whatever else it chose: switching its
    worker back to V1 would serve the stage without them, so the owner refuses, and says which
    component, why the stage runs V1 here, and each setting to unset."""
    config = engine_config(checkpoint)
    if "env" in settings:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    if "hisparse" in settings:
        config.attention_config.hisparse_config = HiSparseConfig()
    if "watermark" in settings:
        config.watermark_config = WatermarkConfig(key=7)
    assert config.use_v2_model_runner is True  # vLLM's own answer for these settings
    owner = _worker(config)
    assert owner.use_v2_model_runner is True
    with pytest.raises(RuntimeError) as refused:
        vllm_api.keep_v1_model_runner(owner)
    message = str(refused.value)
    reason = vllm_api.runner_target(config).reason
    assert message.startswith(f"Worker serves an omnigen V1 runner here ({reason}), ")
    assert f"but {named} asks for vLLM's V2 model runner; unset it" in message


@pytest.mark.parametrize("build", [_worker, _scheduler], ids=["Worker", "Scheduler"])
def test_switching_vllms_owner_to_v1_is_logged_by_owner(checkpoint, gpu_selection, caplog, build):
    config = engine_config(checkpoint)
    owner = build(config)
    assert owner.use_v2_model_runner is True  # what vLLM chose on a GPU machine
    with caplog.at_level(logging.INFO):
        vllm_api.keep_v1_model_runner(owner)
    assert owner.use_v2_model_runner is False
    said = [r.getMessage() for r in caplog.records if r.name == vllm_api.__name__]
    # The line says which of the two owners switched (both log it, in different processes).
    assert any(m.startswith(f"{type(owner).__name__}: using vLLM's V1 model runner") for m in said), said


# -- runner_target's reasons (the worker logs them; keep_v1_model_runner's refusal quotes them) --


def test_where_vllm_chose_v1_the_reason_names_its_setting(checkpoint, monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    choice = vllm_api.runner_target(engine_config(checkpoint))  # no Triton here: vLLM chose V1
    assert choice.target == "v1"
    assert "vLLM chose its V1 model runner (VllmConfig.use_v2_model_runner is false)" in choice.reason


def test_where_vllm_chose_v2_lacking_seams_the_reason_lists_each(checkpoint, gpu_selection, monkeypatch):
    monkeypatch.setattr(vllm_api, "v2_missing_seams", lambda: TWO_SEAMS)
    choice = vllm_api.runner_target(engine_config(checkpoint))
    assert choice.target == "v1"
    assert f"({TWO_SEAMS[0]}, {TWO_SEAMS[1]}); the stage runs its V1 runner" in choice.reason


def test_where_vllm_chose_v2_with_every_seam_the_reason_says_so(checkpoint, gpu_selection, monkeypatch):
    monkeypatch.setattr(vllm_api, "v2_missing_seams", lambda: ())  # vLLM 0.32's V2 has them all
    choice = vllm_api.runner_target(engine_config(checkpoint))
    assert choice.target == "v2"
    assert "vLLM chose Model Runner V2, which has every seam the V2 target uses" in choice.reason


def test_without_v1_and_with_seams_missing_the_error_lists_them_and_the_way_out(monkeypatch):
    monkeypatch.setattr(vllm_api, "v1_runner_available", lambda: False)
    monkeypatch.setattr(vllm_api, "v2_missing_seams", lambda: TWO_SEAMS)
    with pytest.raises(RuntimeError) as refused:
        vllm_api.runner_target(SimpleNamespace(use_v2_model_runner=True))
    message = str(refused.value)
    assert f"built on: {TWO_SEAMS[0]}, {TWO_SEAMS[1]}; " in message
    assert (
        "serve with a vLLM that has one of the two (tests/test_vllm_surface.py shows what moved)" in message
    )


# -- apply_stage_model_config -------------------------------------------------------------------


def test_a_checkpoint_without_the_stages_sub_config_names_its_config_class_and_the_fix(checkpoint):
    model_config = engine_config(checkpoint).model_config  # vLLM's ModelConfig of a real HF config
    assert not hasattr(model_config.hf_config, "code2wav_config")
    with pytest.raises(ValueError) as refused:
        vllm_api.apply_stage_model_config(model_config, {}, "code2wav_config")
    message = str(refused.value)
    assert (
        f"the checkpoint's config ({type(model_config.hf_config).__name__}) has no 'code2wav_config'"
        in message
    )
    assert "serve the stage with the checkpoint it was generated for, or fix the config key" in message


# -- generation_step_output -----------------------------------------------------------------------


def test_a_generation_steps_output_carries_the_rows_it_publishes():
    """7.3 and 8.1: a generation step's outputs reach the scheduler on vLLM's step output."""
    runner = forward_runner(runner_class(*GEN_IDS), Model(Recorder()), bounds=(0, 3, 5))
    runner.requests = {"a": state("a", 3), "b": state("b", 6, computed=2)}
    wavs = [torch.ones(6), torch.zeros(4)]
    runner._omni_step = _step(None, {"model_outputs": wavs}, bounds=(0, 3, 5))
    runner.execute_model_state = SimpleNamespace(
        scheduler_output=SimpleNamespace(num_scheduled_tokens={"a": 3, "b": 2})
    )
    runner.kv_connector_output = None
    rows = vllm_api.step_payloads_of(runner.sample_tokens(None))
    assert rows.keys() == {"a", "b"}
    assert torch.equal(rows["a"]["model_outputs"], wavs[0])
    assert torch.equal(rows["b"]["model_outputs"], wavs[1])


# -- V1RunnerRemoved ------------------------------------------------------------------------------


def test_a_v1_runner_on_a_vllm_without_v1_says_why_and_what_to_load_instead():
    """What a generated V1 runner class is built on where vLLM deleted its V1 runner (0.34)."""

    class Qwen3TTSRunner(vllm_api.V1RunnerRemoved):
        pass

    with pytest.raises(RuntimeError) as refused:
        Qwen3TTSRunner(vllm_config=None, device=torch.device("cpu"))
    message = str(refused.value)
    assert message.startswith("Qwen3TTSRunner is an omnigen V1 runner")
    assert f"{vllm_api.V1_REMOVED} ({vllm_api.V1_RUNNER_MODULE} does not exist)" in message
    assert (
        "Load the stage through its generated worker, which builds the stage's V2 target "
        "(<stage>_v2.py) on this vLLM" in message
    )


# -- dummy_runs_feed_embeddings -------------------------------------------------------------------


class _TextModel(nn.Module):
    """A text model as vLLM builds one: its ``make_empty_intermediate_tensors`` from vLLM's factory
    (what vLLM's ``_dummy_run`` reads on a pipeline rank after the first)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], hidden
        )
        self.calls: list[dict] = []

    def forward(self, *args, input_ids=None, positions=None, inputs_embeds=None, **kwargs):
        self.calls.append(
            {
                "args": args,
                "input_ids": input_ids,
                "positions": positions,
                "inputs_embeds": inputs_embeds,
                **kwargs,
            }
        )
        return torch.zeros(input_ids.shape[0], self.hidden)


def _embeddings_runner(hidden: int = 8):
    embeds = CpuGpuBuffer(16, hidden, dtype=torch.float32, device=torch.device("cpu"))
    embeds.gpu.copy_(torch.arange(16 * hidden, dtype=torch.float32).reshape(16, hidden))
    model = _TextModel(hidden)
    return bare_runner(runner_class("qwen3_omni", "talker"), model=model, inputs_embeds=embeds), model


def test_a_dummy_run_feeds_the_persistent_embeddings_beside_the_ids():
    runner, model = _embeddings_runner()
    ids, positions = torch.arange(5), torch.arange(5)
    with vllm_api.dummy_runs_feed_embeddings(runner):
        # vLLM's _dummy_run of a text model: ids only, by keyword.
        runner.model(input_ids=ids, positions=positions, intermediate_tensors=None, inputs_embeds=None)
        own = torch.ones(5, 8)
        runner.model(input_ids=ids, positions=positions, inputs_embeds=own)
    assert runner.model is model
    fed, kept = model.calls
    assert fed["input_ids"] is ids and fed["positions"] is positions and fed["intermediate_tensors"] is None
    assert torch.equal(fed["inputs_embeds"], runner.inputs_embeds.gpu[:5])
    assert kept["inputs_embeds"] is own and kept["input_ids"] is ids


def test_a_dummy_run_without_ids_gets_no_embeddings_and_positional_arguments_pass():
    runner, model = _embeddings_runner()
    with vllm_api.dummy_runs_feed_embeddings(runner):
        with pytest.raises(AttributeError):  # the model's own failure: it needs ids
            runner.model("positional", input_ids=None)
    (call,) = model.calls
    assert call["args"] == ("positional",) and call["inputs_embeds"] is None


def test_during_a_dummy_run_every_other_attribute_is_the_models():
    """vLLM's ``_dummy_run`` on a pipeline rank after the first asks ``self.model`` for
    ``make_empty_intermediate_tensors`` (one CPU process is never such a rank)."""
    runner, model = _embeddings_runner()
    with vllm_api.dummy_runs_feed_embeddings(runner):
        assert runner.model is not model
        assert runner.model.hidden == model.hidden
        made = runner.model.make_empty_intermediate_tensors(batch_size=3, dtype=torch.float16, device="cpu")
    assert isinstance(made, IntermediateTensors)
    assert made.tensors.keys() == {"hidden_states", "residual"}
    assert made["hidden_states"].shape == (3, 8) and made["hidden_states"].dtype == torch.float16


# -- dummy_run_forces_eager ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "eager"),
    [
        ((), {"is_profile": True}, True),  # profile_run
        ((), {"cudagraph_runtime_mode": CUDAGraphMode.NONE, "uniform_decode": True}, True),  # warm-up
        ((CUDAGraphMode.NONE,), {}, True),
        ((), {"cudagraph_runtime_mode": CUDAGraphMode.FULL, "uniform_decode": True}, False),  # capture
        ((CUDAGraphMode.PIECEWISE,), {}, False),
        ((), {}, False),  # mode left to vLLM's dispatcher
    ],
)
def test_a_dummy_run_is_eager_for_a_profile_run_or_a_none_mode(args, kwargs, eager):
    """``args``/``kwargs`` follow ``num_tokens`` in vLLM's own ``_dummy_run`` signature."""
    assert vllm_api.dummy_run_forces_eager(args, kwargs) is eager


# -- is_full_graph_wrapped ------------------------------------------------------------------------


def test_on_vllms_cpu_platform_no_module_is_full_graph_wrapped():
    """vLLM's CPU platform names a typing Protocol as its wrapper class, which ``isinstance``
    rejects: nothing is wrapped there (an ``mtp.graph=safe`` stage runs its predictor eager)."""
    from vllm.platforms import current_platform

    assert current_platform.is_cpu()
    with pytest.raises(TypeError):
        isinstance(nn.Linear(1, 1), vllm_api.full_graph_wrapper_cls())
    assert vllm_api.is_full_graph_wrapped(nn.Linear(1, 1)) is False
