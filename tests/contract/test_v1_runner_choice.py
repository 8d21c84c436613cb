"""The generated worker and omnigen's scheduler pick the stage's target: its V1 runner or its
Model Runner V2 target, by ``vllm_api.runner_target``, from vLLM's features (never its version).

vLLM decides V1 or V2 in ``VllmConfig.use_v2_model_runner``: ``VLLM_USE_V2_MODEL_RUNNER`` if
set, else V2 where it can run (on a CUDA machine: Triton present, no feature V2 lacks). Its
worker and scheduler copy the answer into ``self.use_v2_model_runner`` when built, and branch on
it: the worker for the runner class it constructs, the scheduler for the shape of each
``SchedulerOutput``. Where vLLM chose V2 and its V2 runner has every seam the V2 target uses
(``vllm_api.V2_SEAMS``: vLLM 0.32 on), the stage runs its V2 target; else (vLLM 0.30, whose V2
predates ``ModelState.capture_inner_cudagraphs``) the worker and scheduler keep V1. A GPU
machine is simulated by giving vLLM's selection code the one thing this CPU machine lacks
(Triton); everything else is vLLM's own code on a real ``VllmConfig``.
"""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.worker.gpu_worker import Worker

from omnigen import api
from omnigen.runtime import vllm_api, worker
from omnigen.runtime.scheduler import OmniAsyncScheduler, OmniScheduler

from ._engine_config import engine_config

MODEL, STAGE = "omnigen_tiny", "talker"
EXPECTED = "v1" if vllm_api.v2_missing_seams() else "v2"
"""The target this vLLM's V2 choice leads to: V2 where its V2 runner has every seam."""


def _config(checkpoint: str):
    return engine_config(checkpoint)


def _gpu_worker(config):
    cls = api.worker_class(MODEL, STAGE, ["device=cuda"])
    assert issubclass(cls, worker.OmniGPUWorker)
    return cls(vllm_config=config, local_rank=0, rank=0, distributed_init_method="tcp://127.0.0.1:1")


def test_vllm_itself_would_choose_v2_here(checkpoint, gpu_selection):
    # The simulation is faithful only if vLLM's own code answers V2 for this config.
    assert _config(checkpoint).use_v2_model_runner is True


def test_the_gpu_worker_takes_the_target_its_vllm_allows_and_says_so(checkpoint, gpu_selection, caplog):
    config = _config(checkpoint)
    with caplog.at_level(logging.INFO):
        built = _gpu_worker(config)
    assert built.omni_runner_choice.target == EXPECTED, built.omni_runner_choice.reason
    assert built.use_v2_model_runner is (EXPECTED == "v2")
    assert any(f"{EXPECTED} target" in r.getMessage() for r in caplog.records)
    if EXPECTED == "v1":
        assert any("using vLLM's V1 model runner" in r.getMessage() for r in caplog.records)
        assert "lacks what omnigen's V2 target is built on" in built.omni_runner_choice.reason


def test_the_v1_branch_builds_the_generated_runner(checkpoint, gpu_selection, monkeypatch):
    """What ``init_device`` constructs on the V1 branch: vLLM 0.32 has ``_make_model_runner``,
    vLLM 0.30 the same branch inline (both import ``GPUModelRunner`` from ``gpu_model_runner`` at
    call time, which the worker points at the generated class)."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    built = _gpu_worker(_config(checkpoint))
    assert built.omni_runner_choice.target == "v1"
    source = inspect.getsource(getattr(Worker, "_make_model_runner", Worker.init_device))
    assert "if self.use_v2_model_runner:" in source
    assert (
        "from vllm.v1.worker.gpu_model_runner import" in source
        and "GPUModelRunner as GPUModelRunnerV1" in source
    )
    if not hasattr(Worker, "_make_model_runner"):
        return
    built.device = torch.device("cpu")
    module_name, attr = built._RUNNER_LOOKUP
    with worker._module_attr(module_name, attr, built.built_runner_class()):
        runner = built._make_model_runner()
    assert type(runner) is built.runner_class


@pytest.mark.skipif(EXPECTED == "v1", reason="this vLLM's Model Runner V2 lacks seams the V2 target uses")
def test_the_v2_branch_builds_the_generated_v2_target(checkpoint, gpu_selection, monkeypatch):
    """On the V2 branch the worker's ``_make_model_runner`` (vLLM's seam) builds the stage's V2
    runner, from the worker module's ``_v2`` sibling, imported there."""
    built = _gpu_worker(_config(checkpoint))
    assert built.omni_runner_choice.target == "v2"
    target = built.runner_v2_class()
    assert target is api.runner_v2_class(MODEL, STAGE, ["device=cuda"])
    assert target.__name__ == api.stage_plan(MODEL, STAGE).v2.runner_class
    made = []

    class Recorded:
        def __init__(self, *args):
            made.append(args)

    monkeypatch.setattr(type(built), "built_runner_v2_class", classmethod(lambda cls: Recorded))
    built.device = torch.device("cpu")
    assert type(built._make_model_runner()) is Recorded
    assert made == [(built.vllm_config, built.device)]


@pytest.mark.parametrize("cls", [OmniScheduler, OmniAsyncScheduler])
def test_the_scheduler_schedules_for_the_workers_target(checkpoint, gpu_selection, cls):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config = _config(checkpoint)
    config.cache_config.num_gpu_blocks = 8  # what the engine core sets from the workers' profile
    attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    kv_cache = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layers.0.attn"], attention)]
    )
    scheduler = cls(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=16,
    )
    assert scheduler.use_v2_model_runner is (EXPECTED == "v2")
    # vLLM's plain scheduler would have scheduled for V2 on this machine.
    plain = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=16,
    )
    assert plain.use_v2_model_runner is True


def test_asking_for_v2_explicitly_is_refused_only_where_the_stage_runs_v1(
    checkpoint, gpu_selection, monkeypatch
):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    if EXPECTED == "v2":
        assert _gpu_worker(_config(checkpoint)).omni_runner_choice.target == "v2"
        return
    with pytest.raises(
        RuntimeError, match=r"VLLM_USE_V2_MODEL_RUNNER=1 asks for vLLM's V2 model runner; unset it"
    ):
        _gpu_worker(_config(checkpoint))


def test_on_this_cpu_machine_vllm_already_chooses_v1(checkpoint, monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    config = _config(checkpoint)
    assert config.use_v2_model_runner is False
    assert vllm_api.runner_target(config).target == "v1"


# -- runner_target's rules, one by one -----------------------------------------------------------


class _Config:
    def __init__(self, v2):
        self.use_v2_model_runner = v2


def test_rule_1_without_vllms_v1_runner_the_v2_target_runs(monkeypatch):
    """vLLM 0.34 deleted ``vllm.v1.worker.gpu_model_runner``: V2, whatever the config says; and if
    its V2 lacked a seam too, nothing could serve the stage: an error names vLLM's reason and the seams."""
    monkeypatch.setattr(vllm_api, "v1_runner_available", lambda: False)
    monkeypatch.setattr(vllm_api, "v2_missing_seams", lambda: ())
    choice = vllm_api.runner_target(_Config(False))
    assert choice.target == "v2" and vllm_api.V1_REMOVED in choice.reason
    monkeypatch.setattr(vllm_api, "v2_missing_seams", lambda: ("m:ModelState.x",))
    with pytest.raises(RuntimeError, match=r"Model Runner V1 has been removed.*m:ModelState.x"):
        vllm_api.runner_target(_Config(True))


def test_rules_2_to_4_follow_vllms_choice_and_its_seams(monkeypatch):
    monkeypatch.setattr(vllm_api, "v1_runner_available", lambda: True)
    monkeypatch.setattr(vllm_api, "v2_missing_seams", lambda: ())
    assert vllm_api.runner_target(_Config(False)).target == "v1"
    assert vllm_api.runner_target(None).target == "v1"
    assert vllm_api.runner_target(_Config(True)).target == "v2"
    monkeypatch.setattr(vllm_api, "v2_missing_seams", lambda: ("m:GPUModelRunner.finish_requests",))
    choice = vllm_api.runner_target(_Config(True))
    assert choice.target == "v1" and "m:GPUModelRunner.finish_requests" in choice.reason


def test_the_seams_are_read_from_the_installed_vllm():
    """Each seam is looked up with the parameter names the target passes; a name that moved is missing."""
    missing = vllm_api.v2_missing_seams()
    assert all(":" in name for name in missing)
    import vllm.v1.worker.gpu.model_states.interface as interface

    assert ("vllm.v1.worker.gpu.model_states.interface:ModelState.capture_inner_cudagraphs" in missing) is (
        not hasattr(interface.ModelState, "capture_inner_cudagraphs")
    )
