"""The generated worker and omnigen's scheduler pick vLLM's V1 model runner themselves.

vLLM decides V1 or V2 in ``VllmConfig.use_v2_model_runner``: ``VLLM_USE_V2_MODEL_RUNNER`` if
set, else V2 where it can run (on a CUDA machine: Triton present, no feature V2 lacks). Its
worker and scheduler copy the answer into ``self.use_v2_model_runner`` when built, and branch on
it: the worker for the runner class it constructs, the scheduler for the shape of each
``SchedulerOutput``. A GPU machine is simulated by giving vLLM's selection code the one thing
this CPU machine lacks (Triton); everything else is vLLM's own code on a real ``VllmConfig``.
"""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from vllm.config import vllm as vllm_config_module
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.worker.gpu_worker import Worker

from omnigen import api
from omnigen.runtime import vllm_api, worker
from omnigen.runtime.scheduler import OmniAsyncScheduler, OmniScheduler
from omnigen.testing.tiny_omni import TALKER_ARCH, write_tiny_config

from ._engine_config import engine_config

MODEL, STAGE = "omnigen_tiny", "talker"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_tiny_config(tmp_path_factory.mktemp("ckpt"), TALKER_ARCH)


@pytest.fixture
def gpu_selection(monkeypatch):
    """vLLM's V1/V2 selection as on a CUDA machine: Triton importable, no environment setting."""
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)


def _config(checkpoint: str):
    return engine_config(checkpoint)


def _gpu_worker(config):
    cls = api.worker_class(MODEL, STAGE, ["device=cuda"])
    assert issubclass(cls, worker.OmniGPUWorker)
    return cls(vllm_config=config, local_rank=0, rank=0, distributed_init_method="tcp://127.0.0.1:1")


def test_vllm_itself_would_choose_v2_here(checkpoint, gpu_selection):
    # The simulation is faithful only if vLLM's own code answers V2 for this config.
    assert _config(checkpoint).use_v2_model_runner is True


def test_the_gpu_worker_takes_v1_and_says_so(checkpoint, gpu_selection, caplog):
    config = _config(checkpoint)
    with caplog.at_level(logging.INFO, logger=vllm_api.__name__):
        built = _gpu_worker(config)
    assert built.use_v2_model_runner is False
    assert any("using vLLM's V1 model runner" in r.getMessage() for r in caplog.records)


def test_the_v1_branch_builds_the_generated_runner(checkpoint, gpu_selection):
    """What ``init_device`` constructs once ``use_v2_model_runner`` is False: vLLM 0.32 has
    ``_make_model_runner``, vLLM 0.30 the same branch inline (both import ``GPUModelRunner``
    from ``gpu_model_runner`` at call time, which the worker points at the generated class)."""
    built = _gpu_worker(_config(checkpoint))
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


@pytest.mark.parametrize("cls", [OmniScheduler, OmniAsyncScheduler])
def test_the_scheduler_schedules_for_v1(checkpoint, gpu_selection, cls):
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
    assert scheduler.use_v2_model_runner is False
    # vLLM's plain scheduler would have scheduled for V2 on this machine.
    plain = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=16,
    )
    assert plain.use_v2_model_runner is True


def test_asking_for_v2_explicitly_is_refused(checkpoint, gpu_selection, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(
        RuntimeError, match=r"VLLM_USE_V2_MODEL_RUNNER=1 asks for vLLM's V2 model runner; unset it"
    ):
        _gpu_worker(_config(checkpoint))


def test_on_this_cpu_machine_vllm_already_chooses_v1(checkpoint, monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert _config(checkpoint).use_v2_model_runner is False
