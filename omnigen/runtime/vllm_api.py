"""Everything omnigen takes from vLLM's internal API, in one place.

A rebase onto another vLLM version changes this module (and the templates),
not every generated model. Generated code reaches vLLM only through these names.
"""

from __future__ import annotations

import functools

from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.sequence import IntermediateTensors
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

__all__ = [
    "CUDAGraphMode",
    "GPUModelRunner",
    "IntermediateTensors",
    "full_graph_wrapper_cls",
    "is_full_graph_wrapped",
    "set_forward_context",
]


@functools.cache
def full_graph_wrapper_cls() -> type:
    """The platform's full-graph wrapper class (``CUDAGraphWrapper`` on CUDA)."""
    from vllm.platforms import current_platform

    return resolve_obj_by_qualname(current_platform.get_static_graph_wrapper_cls())


def is_full_graph_wrapped(module: object) -> bool:
    """Whether ``module`` is wrapped in the platform's full-graph wrapper.

    On a platform without a concrete wrapper (vLLM's CPU platform names a typing Protocol,
    which ``isinstance`` rejects), nothing can be wrapped.
    """
    try:
        return isinstance(module, full_graph_wrapper_cls())
    except TypeError:
        return False


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
