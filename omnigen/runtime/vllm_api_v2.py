"""Everything the generated Model Runner V2 targets take from vLLM's V2 runner, in one place.

Imported only where a stage runs its V2 target (``<stage>_v2.py``, chosen by
``vllm_api.runner_target``): on a vLLM whose V2 runner lacks these names the V1 side never
imports this module. ``docs/model-runner-v2.md`` maps each contract clause onto the V2 seam it
uses, and ``tests/test_vllm_surface.py`` checks every name below against each vLLM version.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from vllm.config import CUDAGraphMode
from vllm.distributed.parallel_state import graph_capture
from vllm.forward_context import BatchDescriptor, set_forward_context
from vllm.logger import init_logger
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker.gpu import model_runner as _runner_module
from vllm.v1.worker.gpu.mm.rope import RopeState
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu.model_states import default as _default_state_module
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.v1.worker.gpu.sample.output import SamplerOutput

from omnigen.runtime.vllm_api import GENERATION_DONE_TOKEN, attach_step_payloads

__all__ = [
    "BatchDescriptor",
    "CUDAGraphMode",
    "CpuGpuBuffer",
    "DefaultModelState",
    "GPUModelRunner",
    "ModelRunnerOutput",
    "RopeState",
    "SamplerOutput",
    "attach_step_payloads",
    "building_model_state",
    "generation_step_output",
    "graph_capture_context",
    "pin_memory",
    "rope_state_factory",
    "set_forward_context",
]

logger = init_logger(__name__)

_SWAP_LOCK = threading.RLock()
"""Held while a module-level name of vLLM's is swapped (two runners built at once in one process
must not see each other's)."""


@contextlib.contextmanager
def _swapped(module: Any, name: str, value: Any) -> Iterator[None]:
    with _SWAP_LOCK:
        original = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, original)


def building_model_state(state_cls: type) -> contextlib.AbstractContextManager[None]:
    """Within: V2's ``GPUModelRunner.load_model`` builds ``state_cls`` as its model state.

    The runner calls the module-level ``init_model_state(vllm_config, model, encoder_cache,
    device)`` of ``vllm.v1.worker.gpu.model_runner`` once the model is loaded (vLLM resolves
    ``model.get_model_state_cls()`` or its defaults there); the generated state is this stage's
    for every model class it serves, so that name is swapped for the state's constructor."""

    def init_model_state(vllm_config: Any, model: Any, encoder_cache: Any, device: Any) -> Any:
        return state_cls(vllm_config, model, encoder_cache, device)

    return _swapped(_runner_module, "init_model_state", init_model_state)


def rope_state_factory(rope_cls: type) -> contextlib.AbstractContextManager[None]:
    """Within: ``DefaultModelState.__init__`` builds a ``rope_cls`` where vLLM's
    ``get_rope_state`` would build its ``RopeState`` (an M-RoPE checkpoint: ``uses_mrope``), with
    the same sizes, and nothing elsewhere. vLLM's function also asserts the model implements
    ``SupportsMRoPE``; the rope states omnigen builds (CONTRACT 3.7, 7.6) serve models that do
    not, or not with V2's call."""

    def get_rope_state(
        model_config: Any, model: Any, max_num_reqs: int, max_num_tokens: int, max_model_len: int, device: Any
    ) -> Any:
        if not model_config.uses_mrope:
            return None
        return rope_cls(
            num_dims=model_config.mrope_num_dims,
            max_num_reqs=max_num_reqs,
            max_num_tokens=max_num_tokens,
            max_model_len=max_model_len,
            device=device,
        )

    return _swapped(_default_state_module, "get_rope_state", get_rope_state)


@contextlib.contextmanager
def graph_capture_context(device: torch.device, stream: Any = None) -> Iterator[None]:
    """vLLM's ``graph_capture`` for an inner graph: on the model graphs' capture stream where the
    hook is handed one (vLLM 0.34's ``capture_inner_cudagraphs(..., stream)``), else its own."""
    if stream is None:
        with graph_capture(device):
            yield
    else:
        with graph_capture(device, stream=stream):
            yield


def pin_memory() -> bool:
    """Whether host buffers may be pinned here (vLLM's own answer; a CPU has no pinned memory)."""
    from vllm.utils.platform_utils import is_pin_memory_available

    return is_pin_memory_available()


def cpu_gpu_buffer(*size: int, dtype: torch.dtype, device: torch.device, numpy: bool = True) -> CpuGpuBuffer:
    """A persistent host/device buffer pair, as V1's ``GPUModelRunner._make_buffer`` made them."""
    return CpuGpuBuffer(*size, dtype=dtype, device=device, pin_memory=pin_memory(), with_numpy=numpy)


def generation_step_output(runner: Any, input_batch: Any, kv_connector_output: Any) -> ModelRunnerOutput:
    """V2's step output for a generation stage (CONTRACT 7.3): ``GENERATION_DONE_TOKEN`` for each
    request whose prompt is in after this step, nothing for one still being chunked in.

    Computed from the step's ``InputBatch`` (rows in V2's order) and the request state's prompt
    lengths (not V2's ``prefill_len``, which after a resume includes generated tokens).
    ``req_id_to_index`` is passed only where vLLM's ``ModelRunnerOutput`` still declares it."""
    req_ids = list(input_batch.req_ids)
    n = len(req_ids)
    prompt_lens = runner.req_states.prompt_len.np[input_batch.idx_mapping_np[:n]]
    ends = input_batch.num_computed_tokens_np[:n] + input_batch.num_scheduled_tokens[:n]
    sampled = [[GENERATION_DONE_TOKEN] if done else [] for done in (ends >= prompt_lens).tolist()]
    fields: dict[str, Any] = {"req_ids": req_ids, "sampled_token_ids": sampled}
    if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:
        fields["req_id_to_index"] = {req_id: index for index, req_id in enumerate(req_ids)}
    output = ModelRunnerOutput(**fields)
    output.kv_connector_output = kv_connector_output
    return attach_step_payloads(output, runner.model_state.published_step_payloads())


class SamplingMetadataView:
    """What a model's ``compute_logits(h, sampling_metadata=)`` or ``sample(logits, metadata)``
    gets on V2, which has no V1 ``SamplingMetadata`` (CONTRACT 7.4, 7.7): each row's output
    tokens so far, read from V2's request state. Any other field is an error that names it."""

    def __init__(self, output_token_ids: list[list[int]]) -> None:
        self.output_token_ids = output_token_ids

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"the V2 target's sampling metadata has output_token_ids only, and the model read {name!r}: "
            "vLLM's Model Runner V2 has no V1 SamplingMetadata (docs/model-runner-v2.md, section 4 item 3)"
        )


def sampling_metadata_view(runner_states: Any, input_batch: Any) -> SamplingMetadataView:
    """``output_token_ids`` per row of ``input_batch``: the request's tokens after its prompt."""
    history = []
    all_token_ids = runner_states.all_token_ids.gpu
    for row in range(input_batch.num_reqs):
        index = int(input_batch.idx_mapping_np[row])
        start = int(runner_states.prompt_len.np[index])
        end = int(runner_states.total_len.gpu[index])
        tokens = all_token_ids[index, start:end].tolist() if end > start else []
        history.append(list(tokens[: tokens.index(-1)] if -1 in tokens else tokens))
    return SamplingMetadataView(history)


class ModelSampler:
    """V2's sampler for a stage with ``sampler=model`` (CONTRACT 7.4): the model's
    ``sample(logits, metadata)``, V2's own sampler where it returns None. Returned to V2 by the
    model state's ``custom_sampler``."""

    def __init__(self, model: Any, sampler: Any, req_states: Callable[[], Any]) -> None:
        self.model = model
        self.sampler = sampler
        self._req_states = req_states

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)

    def __call__(self, logits: torch.Tensor, input_batch: Any) -> Any:
        metadata = sampling_metadata_view(self._req_states(), input_batch)
        sampled = self.model.sample(logits, metadata)
        if sampled is None:
            return self.sampler(logits, input_batch)
        tokens = getattr(sampled, "sampled_token_ids", sampled)
        tokens = tokens.reshape(input_batch.num_reqs, -1).to(torch.int64)
        rows = tokens.shape[0]
        return SamplerOutput(
            sampled_token_ids=tokens,
            logprobs_tensors=None,
            num_nans=None,
            num_sampled=torch.ones(rows, dtype=torch.int32, device=tokens.device),
            num_rejected=torch.zeros(rows, dtype=torch.int32, device=tokens.device),
        )


def v2_cpu_runner_locations() -> list[tuple[str, str]]:
    """Where vLLM's ``CPUWorker.init_device`` looks up the V2 CPU runner it builds: the names
    that hold a V2 runner class (0.32/0.33 import it inside ``init_device`` from
    ``vllm.v1.worker.cpu.model_runner``; 0.34 binds it in ``vllm.v1.worker.cpu_worker``)."""
    found = []
    for module_name in ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu.model_runner"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        value = getattr(module, "CPUModelRunner", None)
        if isinstance(value, type) and issubclass(value, GPUModelRunner):
            found.append((module_name, "CPUModelRunner"))
    return found


def v2_cpu_runner_class() -> type:
    """vLLM's V2 CPU runner class (``vllm.v1.worker.cpu.model_runner.CPUModelRunner``)."""
    return importlib.import_module("vllm.v1.worker.cpu.model_runner").CPUModelRunner


def standalone_cpu_runner() -> bool:
    """Whether vLLM's CPU worker would build its standalone V2 runner (no Triton, non-x86: vLLM
    0.34), whose own model-state interface takes no custom state."""
    from vllm.platforms import current_platform

    probe = getattr(current_platform, "uses_standalone_cpu_model_runner", None)
    return bool(probe()) if callable(probe) else False


def swapped(module_name: str, name: str, value: Any) -> contextlib.AbstractContextManager[None]:
    """Within: ``module_name.name`` is ``value`` (under the same lock as the other swaps)."""
    return _swapped(importlib.import_module(module_name), name, value)
