"""vLLM's full-graph wrapper on CPU: ``CUDAGraphWrapper``'s own code, only the CUDA driver simulated.

``SimulatedGraphWrapper`` *is* vLLM's ``CUDAGraphWrapper`` (a subclass that keeps its
``__call__``): vLLM's code decides, from the forward context, whether a call runs eager, captures
(calling vLLM's real ``validate_cudagraph_capturing_enabled`` first) or replays, and checks a
replay's input addresses (its debug-mode check, always on here). What CPU lacks is replaced, and
only that (``simulated_cuda_graphs``):

- ``torch.cuda.CUDAGraph`` / ``torch.cuda.graph``: a graph that records the one call it
  captured and, on ``replay()``, runs it again on the captured tensors and writes the result
  into the captured output tensors (what a CUDA graph does: same memory in, same memory out);
- the graph pool, the capture stream and ``weak_ref_tensors`` (vLLM's CUDA op; a strong
  reference to the same memory here).

On top of vLLM's rules the stand-in refuses a replay whose tensor arguments have other shapes
than the captured ones (on a GPU that replay would silently read the wrong rows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from vllm.compilation import cuda_graph
from vllm.compilation.cuda_graph import CUDAGraphWrapper


class SimulatedCUDAGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: the call captured into it, replayed on request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.call: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None
        self.output: Any = None
        self.replays = 0

    def replay(self) -> None:
        assert self.call is not None, "replay of a graph that captured nothing"
        runnable, args, kwargs = self.call
        _write_into(self.output, runnable(*args, **kwargs))
        self.replays += 1


_capturing: list[SimulatedCUDAGraph] = []


@contextlib.contextmanager
def _simulated_graph_capture(
    graph: SimulatedCUDAGraph, pool: Any = None, stream: Any = None
) -> Iterator[None]:
    """Stands in for ``torch.cuda.graph(...)``: calls made inside are captured into ``graph``."""
    _capturing.append(graph)
    try:
        yield
    finally:
        _capturing.pop()


@contextlib.contextmanager
def _simulated_capture_pool(pool: Any, vllm_config: Any) -> Iterator[Any]:
    yield pool


def _write_into(captured: Any, fresh: Any) -> None:
    if isinstance(captured, torch.Tensor):
        captured.copy_(fresh)
    elif isinstance(captured, (tuple, list)):
        for old, new in zip(captured, fresh, strict=True):
            _write_into(old, new)


def _shapes(args: tuple[Any, ...]) -> list[tuple[int, ...]]:
    return [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]


class _Captured:
    """The wrapped runnable: a call made while a graph captures is recorded into it."""

    def __init__(self, runnable: Any) -> None:
        self.runnable = runnable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        output = self.runnable(*args, **kwargs)
        if _capturing:
            graph = _capturing[-1]
            graph.call = (self.runnable, args, dict(kwargs))
            graph.output = output
        return output

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runnable, name)


@dataclass
class GraphLog:
    """What every simulated wrapper did: ``(event, num_tokens)`` in order."""

    events: list[tuple[str, int]] = field(default_factory=list)

    def of(self, event: str) -> list[int]:
        return [n for e, n in self.events if e == event]


class SimulatedGraphWrapper(CUDAGraphWrapper):
    """vLLM's ``CUDAGraphWrapper`` with its input-address check always on and a shape check."""

    log: GraphLog = GraphLog()

    def __init__(self, runnable: Any, vllm_config: Any, runtime_mode: Any, **kwargs: Any) -> None:
        super().__init__(_Captured(runnable), vllm_config, runtime_mode, **kwargs)
        # vLLM compares a replay's input addresses with the capture's in debug mode only.
        self.is_debugging_mode = True
        self.captured_shapes: dict[Any, list[tuple[int, ...]]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return super().__call__(*args, **kwargs)
        context = get_forward_context()
        mode, descriptor = context.cudagraph_runtime_mode, context.batch_descriptor
        if mode != self.runtime_mode:
            self.log.events.append(("eager", _rows(args)))
            return super().__call__(*args, **kwargs)
        entry = self.concrete_cudagraph_entries.get(descriptor)
        if entry is not None and entry.cudagraph is not None:
            captured = self.captured_shapes[descriptor]
            if _shapes(args) != captured:
                raise AssertionError(
                    f"replay of the graph captured for {descriptor} with inputs of shapes "
                    f"{_shapes(args)}; it captured {captured}"
                )
            output = super().__call__(*args, **kwargs)
            self.log.events.append(("replay", descriptor.num_tokens))
            return output
        output = super().__call__(*args, **kwargs)  # vLLM validates, then captures
        self.captured_shapes[descriptor] = _shapes(args)
        self.log.events.append(("capture", descriptor.num_tokens))
        return output


def _rows(args: tuple[Any, ...]) -> int:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return int(tensors[0].shape[0]) if tensors else 0


def simulated_cuda_graphs(monkeypatch: pytest.MonkeyPatch) -> GraphLog:
    """Replace the CUDA driver pieces ``CUDAGraphWrapper`` calls; return a fresh event log."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", SimulatedCUDAGraph)
    monkeypatch.setattr(torch.cuda, "graph", _simulated_graph_capture)
    monkeypatch.setattr(cuda_graph, "current_stream", lambda: None)
    # Where the capture points NCCL's allocator at the graph pool: vLLM 0.30 calls
    # set_graph_pool_id itself, vLLM 0.32 enters capture_pool (which calls it).
    if hasattr(cuda_graph, "set_graph_pool_id"):
        monkeypatch.setattr(cuda_graph, "set_graph_pool_id", lambda pool: None)
    if hasattr(cuda_graph, "capture_pool"):
        monkeypatch.setattr(cuda_graph, "capture_pool", _simulated_capture_pool)
    monkeypatch.setattr(cuda_graph, "weak_ref_tensors", lambda tensors: tensors)
    monkeypatch.setattr(cuda_graph.current_platform, "get_global_graph_pool", lambda: "simulated-pool")
    log = GraphLog()
    monkeypatch.setattr(SimulatedGraphWrapper, "log", log)
    return log
