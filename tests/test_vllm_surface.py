"""Every vLLM name omnigen relies on, checked against the installed vLLM in seconds.

The list is what ``templates/stage.py.j2``, ``omnigen/runtime/*.py`` and ``omnigen/serving/*.py``
use (their imports, the runner methods the template overrides or calls through ``super()``,
the runner, input-batch, scheduler-output and request-state attributes they read, the worker
and scheduler hooks ``runtime/worker.py`` and ``runtime/scheduler.py`` build on), plus the
capture machinery a ``mtp.graph=safe`` stage depends on. A vLLM bump that moves one of them
fails here, one test per name, saying which name and what it found instead; the engine tests
would fail much later and deeper. docs/vllm-versions.md says how to add a vLLM version.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

import pytest
import torch

from omnigen import api
from omnigen.runtime import vllm_api
from omnigen.runtime.worker import cpu_runner_class
from omnigen_testing.tiny_omni import TALKER_ARCH, write_tiny_config
from tests.contract._engine_config import engine_config

if not vllm_api.v1_runner_available():
    # The names below are the V1 target's (the generated V1 runner's): where vLLM deleted its V1
    # runner, tests/test_vllm_surface_versions.py checks the V2 target's names instead.
    pytest.skip(
        f"the V1 side's surface on this vLLM: {vllm_api.V1_REMOVED} ({vllm_api.V1_RUNNER_MODULE} is gone)",
        allow_module_level=True,
    )


def _resolve(dotted: str) -> Any:
    """``package.module:attr.attr`` -> the object."""
    module_name, _, attrs = dotted.partition(":")
    obj = importlib.import_module(module_name)
    for name in attrs.split(".") if attrs else ():
        if not hasattr(obj, name):
            raise AssertionError(f"vLLM moved {dotted}: {type(obj).__name__} {obj!r} has no {name!r}")
        obj = getattr(obj, name)
    return obj


# -- names: (dotted name, the parameters omnigen passes or overrides by name) -------------------

CALLABLES: dict[str, tuple[str, ...]] = {
    # runtime/vllm_api.py imports
    "vllm.forward_context:set_forward_context": (
        "attn_metadata",
        "vllm_config",
        "cudagraph_runtime_mode",
        "batch_descriptor",
    ),
    "vllm.utils.import_utils:resolve_obj_by_qualname": ("qualname",),
    "vllm.logger:init_logger": ("name",),
    # The runner methods the template and runtime/base.py override or call through super()
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__": ("vllm_config", "device"),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model": (),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._make_buffer": ("dtype", "numpy"),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward": (
        "input_ids",
        "positions",
        "intermediate_tensors",
        "inputs_embeds",
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._preprocess": (
        "scheduler_output",
        "num_input_tokens",
        "intermediate_tensors",
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._determine_batch_execution_and_padding": (
        "num_tokens",
        "num_reqs",
        "num_scheduled_tokens_np",
        "max_num_scheduled_tokens",
        "use_cascade_attn",
        "force_eager",
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._dummy_run": (
        "num_tokens",
        "cudagraph_runtime_mode",
        "uniform_decode",
        "is_profile",
        "is_graph_capturing",
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._dummy_sampler_run": ("hidden_states",),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.capture_model": (),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model": (
        "scheduler_output",
        "intermediate_tensors",
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens": ("grammar_output",),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample": ("logits", "spec_decode_metadata"),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states": ("scheduler_output",),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._on_request_state_removed": ("req_id", "req_state"),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._init_mrope_positions": ("req_state",),
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner.__init__": ("vllm_config", "device"),
    # The input batch (phases.py, step_outputs.py, vllm_api.model_sampler_metadata)
    "vllm.v1.worker.gpu_input_batch:InputBatch.update_async_output_token_ids": (),
    # The workers (runtime/worker.py)
    "vllm.v1.worker.gpu_worker:Worker.__init__": (
        "vllm_config",
        "local_rank",
        "rank",
        "distributed_init_method",
    ),
    "vllm.v1.worker.gpu_worker:Worker.init_device": (),
    "vllm.v1.worker.cpu_worker:CPUWorker.init_device": (),
    # The schedulers (runtime/scheduler.py)
    "vllm.v1.core.sched.scheduler:Scheduler.__init__": (
        "vllm_config",
        "kv_cache_config",
        "structured_output_manager",
    ),
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output": ("scheduler_output", "model_runner_output"),
    "vllm.v1.core.sched.scheduler:Scheduler.finish_requests": ("request_ids", "finished_status"),
    # Full-graph wrapping and capture (mtp.graph=safe)
    "vllm.compilation.cuda_graph:CUDAGraphWrapper.__init__": ("runnable", "vllm_config", "runtime_mode"),
    "vllm.compilation.cuda_graph:CUDAGraphWrapper.__call__": (),
    "vllm.compilation.monitor:validate_cudagraph_capturing_enabled": (),
    "vllm.compilation.monitor:set_cudagraph_capturing_enabled": ("enabled",),
    "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher.dispatch": ("num_tokens", "uniform_decode"),
    # omnigen/serving
    "vllm.engine.arg_utils:AsyncEngineArgs": (),
    "vllm.v1.engine.async_llm:AsyncLLM.from_engine_args": ("engine_args",),
    "vllm.v1.engine.async_llm:AsyncLLM.generate": ("prompt", "sampling_params", "request_id"),
    "vllm.v1.engine.async_llm:AsyncLLM.abort": ("request_id",),
    "vllm.v1.engine.async_llm:AsyncLLM.collective_rpc": ("method",),
    "vllm.v1.engine.async_llm:AsyncLLM.shutdown": (),
    "vllm.entrypoints.llm:LLM.generate": ("use_tqdm",),
    "vllm.entrypoints.llm:LLM.collective_rpc": ("method",),
    "vllm.model_executor.models.registry:_ModelRegistry.register_model": ("model_arch", "model_cls"),
}

FIELDS: dict[str, tuple[str, ...]] = {
    "vllm.v1.core.sched.output:SchedulerOutput": (
        "scheduled_new_reqs",
        "scheduled_cached_reqs",
        "num_scheduled_tokens",
        "finished_req_ids",
    ),
    "vllm.v1.core.sched.output:NewRequestData": ("req_id", "sampling_params"),
    # The contract tests build it; runtime/base.py reads an optional additional_information.
    "vllm.v1.core.sched.output:CachedRequestData": (
        "req_ids",
        "resumed_req_ids",
        "new_token_ids",
        "all_token_ids",
        "new_block_ids",
        "num_computed_tokens",
        "num_output_tokens",
    ),
    "vllm.v1.worker.gpu_input_batch:CachedRequestState": (
        "req_id",
        "sampling_params",
        "num_computed_tokens",
        "mm_features",
        "mrope_positions",
        "mrope_position_delta",
    ),
    "vllm.v1.outputs:ModelRunnerOutput": (
        "req_ids",
        "req_id_to_index",
        "sampled_token_ids",
        "kv_connector_output",
    ),
    "vllm.v1.sample.metadata:SamplingMetadata": ("output_token_ids",),
    # A generation stage's sample_tokens takes the step vLLM's execute_model kept.
    "vllm.v1.worker.gpu_model_runner:ExecuteModelState": ("scheduler_output",),
    "vllm.forward_context:BatchDescriptor": ("num_tokens", "num_reqs", "uniform"),
    "vllm.v1.engine:EngineCoreOutput": ("request_id", "finish_reason", "kv_transfer_params"),
    "vllm.engine.arg_utils:EngineArgs": ("worker_cls", "scheduler_cls"),
    "vllm.outputs:RequestOutput": ("kv_transfer_params", "outputs", "prompt_token_ids"),
    "vllm.outputs:CompletionOutput": ("token_ids", "text"),
    "vllm.sampling_params:SamplingParams": ("extra_args", "seed", "max_tokens"),
}

NAMES = [
    "vllm:envs.VLLM_USE_V2_MODEL_RUNNER",
    "vllm:ModelRegistry",
    "vllm:SamplingParams",
    "vllm:LLM",
    "vllm.config:CUDAGraphMode.NONE",
    "vllm.config:CUDAGraphMode.FULL",
    "vllm.config:CUDAGraphMode.has_full_cudagraphs",
    "vllm.config:VllmConfig.use_v2_model_runner",
    "vllm.sequence:IntermediateTensors",
    "vllm.v1.outputs:EMPTY_MODEL_RUNNER_OUTPUT",
    "vllm.v1.worker.gpu_model_runner:AsyncGPUModelRunnerOutput.get_output",
    "vllm.v1.core.sched.async_scheduler:AsyncScheduler",
    "vllm.platforms:current_platform",
    "vllm.platforms.interface:Platform.is_cpu",
    # Looked up by name when vLLM's workers build their runner (worker.py points them at ours).
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner",
    "vllm.v1.worker.cpu_worker:CPUModelRunner",
    "vllm.model_executor.models.utils:maybe_prefix",
    "vllm.model_executor.models.utils:AutoWeightsLoader",
    "vllm.model_executor.models.llama:LlamaModel",
    "vllm.model_executor.layers.vocab_parallel_embedding:ParallelLMHead",
    "vllm.model_executor.layers.logits_processor:LogitsProcessor",
]

# What vLLM's own code must say for omnigen's hooks to take effect: (function, source fragments).
SOURCES: dict[str, tuple[str, ...]] = {
    # keep_v1_model_runner: both copy the choice at construction and branch on the copy.
    "vllm.v1.worker.gpu_worker:Worker.__init__": (
        "self.use_v2_model_runner = vllm_config.use_v2_model_runner",
    ),
    "vllm.v1.core.sched.scheduler:Scheduler.__init__": (
        "self.use_v2_model_runner = vllm_config.use_v2_model_runner",
    ),
    # worker.py: vLLM's GPU worker imports GPUModelRunner when it builds the runner (0.32 moved
    # the branch into _make_model_runner), the CPU worker names CPUModelRunner from its module.
    "vllm.v1.worker.gpu_worker:Worker._make_model_runner|init_device": (
        "if self.use_v2_model_runner:",
        "from vllm.v1.worker.gpu_model_runner import",
        "GPUModelRunner as GPUModelRunnerV1",
    ),
    "vllm.v1.worker.cpu_worker:CPUWorker.init_device": ("CPUModelRunner(self.vllm_config",),
    # vllm_api.compute_logits_with_sampling_metadata shadows model.compute_logits(hidden).
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner": ("self.model.compute_logits(",),
    # The template's generation stage takes these from the step vLLM ran.
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model": (
        "self.execute_model_state = ExecuteModelState(",
        "self.kv_connector_output",
    ),
    # capture_model opens vLLM's capture window around the dummy runs and closes it after.
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.capture_model": (
        "set_cudagraph_capturing_enabled(True)",
        "set_cudagraph_capturing_enabled(False)",
        "self._capture_cudagraphs(",
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._warmup_and_capture": (
        "self._dummy_run(",
        "is_graph_capturing=True",
    ),
    # The wrapper validates before it captures, and checks replay addresses in debug mode.
    "vllm.compilation.cuda_graph:CUDAGraphWrapper.__call__": (
        "validate_cudagraph_capturing_enabled()",
        "forward_context.batch_descriptor",
        "forward_context.cudagraph_runtime_mode",
        "entry.input_addresses",
    ),
    # A hooked stage's _preprocess keeps the ids and embeddings vLLM's step hands back (it slices
    # the persistent buffers only where vLLM gave None): they must be those buffers' slices, the
    # memory the hooks write into and a CUDA graph captured.
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._preprocess": (
        "input_ids, inputs_embeds = self._prepare_mm_inputs(num_input_tokens)",
        "inputs_embeds = self.inputs_embeds.gpu[:num_input_tokens]",
        "input_ids = self.input_ids.gpu[:num_input_tokens]",
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_mm_inputs": (
        "input_ids = self.input_ids.gpu[:num_tokens]",
        "inputs_embeds = self.inputs_embeds.gpu[:num_tokens]",
    ),
    # async scheduling: attach_step_payloads writes to the inner output get_output returns.
    "vllm.v1.worker.gpu_model_runner:AsyncGPUModelRunnerOutput": ("self._model_runner_output",),
    "vllm.platforms.interface:Platform.get_static_graph_wrapper_cls": ("def get_static_graph_wrapper_cls",),
}


@pytest.mark.parametrize(("dotted", "params"), CALLABLES.items(), ids=list(CALLABLES))
def test_callable_and_its_parameters(dotted, params):
    obj = _resolve(dotted)
    assert callable(obj), f"vLLM changed {dotted}: no longer callable ({type(obj).__name__})"
    signature = inspect.signature(obj)
    missing = [p for p in params if p not in signature.parameters]
    assert not missing, f"vLLM changed {dotted}{signature}: no parameter {', '.join(missing)}"


@pytest.mark.parametrize(("dotted", "fields"), FIELDS.items(), ids=list(FIELDS))
def test_fields(dotted, fields):
    cls = _resolve(dotted)
    if dataclasses.is_dataclass(cls):
        known = {f.name for f in dataclasses.fields(cls)}
    elif hasattr(cls, "__struct_fields__"):  # msgspec.Struct
        known = set(cls.__struct_fields__)
    else:
        known = set(inspect.signature(cls).parameters) | set(getattr(cls, "__annotations__", {}))
    missing = [f for f in fields if f not in known]
    assert not missing, f"vLLM changed {dotted}: no field {', '.join(missing)} (has {sorted(known)})"


@pytest.mark.parametrize("dotted", NAMES)
def test_name(dotted):
    _resolve(dotted)


@pytest.mark.parametrize(("dotted", "fragments"), SOURCES.items(), ids=list(SOURCES))
def test_vllm_code_still_says(dotted, fragments):
    base, _, alternatives = dotted.partition(":")
    *owner, names = alternatives.split(".")
    candidates = [f"{base}:{'.'.join([*owner, name])}" for name in names.split("|")]
    found = [c for c in candidates if _has(c)]
    assert found, f"vLLM moved {' / '.join(candidates)}"
    source = inspect.getsource(_resolve(found[0]))
    missing = [f for f in fragments if f not in source]
    assert not missing, f"vLLM changed {found[0]}: it no longer says {missing}"


def _has(dotted: str) -> bool:
    try:
        _resolve(dotted)
    except AssertionError:
        return False
    return True


# -- what a built runner has: attributes vLLM sets in __init__ ---------------------------------

RUNNER_ATTRIBUTES = (
    "vllm_config",
    "model_config",
    "compilation_config",
    "device",
    "dtype",
    "max_num_reqs",
    "requests",
    "input_batch",
    "input_ids",
    "inputs_embeds",
    "query_start_loc",
    "uniform_decode_query_len",
    "cudagraph_dispatcher",
)
INPUT_BATCH_ATTRIBUTES = (
    "req_ids",
    "req_id_to_index",
    "num_reqs",
    "num_prompt_tokens",
    "num_computed_tokens_cpu",
    "req_output_token_ids",
    "sampling_metadata",
)


@pytest.fixture(scope="module")
def built_runner(tmp_path_factory):
    """The generated runner as the CPU worker builds it, on vLLM's own ``__init__``."""
    from vllm.config import set_current_vllm_config

    config = engine_config(write_tiny_config(tmp_path_factory.mktemp("ckpt"), TALKER_ARCH))
    with set_current_vllm_config(config):
        return cpu_runner_class(api.runner_class("omnigen_tiny", "talker"))(config, torch.device("cpu"))


@pytest.mark.parametrize("name", RUNNER_ATTRIBUTES)
def test_runner_attribute(built_runner, name):
    assert hasattr(built_runner, name), f"vLLM's GPUModelRunner.__init__ no longer sets self.{name}"


@pytest.mark.parametrize("name", ("np", "cpu", "gpu", "copy_to_gpu"))
def test_persistent_buffers_are_cpu_gpu_buffers(built_runner, name):
    # query_start_loc, input_ids, inputs_embeds and _make_buffer's MTP buffers: vLLM's CpuGpuBuffer.
    buffer = built_runner._make_buffer(4, dtype=torch.int32)
    assert hasattr(buffer, name) and hasattr(built_runner.query_start_loc, name), (
        f"CpuGpuBuffer has no {name}"
    )
    assert hasattr(built_runner.input_ids, "gpu") and hasattr(built_runner.inputs_embeds, "gpu")


@pytest.mark.parametrize("name", INPUT_BATCH_ATTRIBUTES)
def test_input_batch_attribute(built_runner, name):
    assert hasattr(built_runner.input_batch, name), f"vLLM's InputBatch no longer has {name}"


def test_compilation_config_reads(built_runner):
    compilation = built_runner.compilation_config
    assert hasattr(compilation, "max_cudagraph_capture_size"), (
        "CompilationConfig.max_cudagraph_capture_size moved"
    )
    assert callable(compilation.cudagraph_mode.has_full_cudagraphs), "CUDAGraphMode.has_full_cudagraphs moved"


def test_model_config_reads(built_runner):
    model_config = built_runner.model_config
    for name in ("hf_config", "hf_text_config", "model_arch_config", "get_model_arch_config"):
        assert hasattr(model_config, name), f"vLLM's ModelConfig no longer has {name}"
    assert callable(model_config.hf_config.get_text_config)


def test_a_moved_name_is_reported_by_its_name():
    with pytest.raises(
        AssertionError, match=r"vLLM moved vllm.v1.worker.gpu_model_runner:GPUModelRunner._dummy_rnu"
    ):
        _resolve("vllm.v1.worker.gpu_model_runner:GPUModelRunner._dummy_rnu")
