"""How vLLM loads a generated runner: worker classes that build it (CONTRACT 6).

vLLM has no setting for a runner class; a worker builds the runner inside its
``init_device``, from a name in its own module. The omni workers below build the
generated runner in that place instead: on vLLM's GPU worker they build the
generated class itself, on vLLM's CPU worker a variant of it composed with
``CPUModelRunner`` (``cpu_runner_class``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from typing import Any, ClassVar

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from omnigen.runtime.vllm_api import apply_stage_model_config, is_cpu_platform, keep_v1_model_runner


@functools.cache
def cpu_runner_class(runner_class: type) -> type:
    """``runner_class`` rebuilt on vLLM's CPU runner: ``(runner_class, CPUModelRunner)``.

    The generated class subclasses ``GPUModelRunner``; ``CPUModelRunner`` does too, so the
    composition keeps the generated methods first and CPU specifics before the GPU base.
    """
    name = f"{runner_class.__name__}OnCPU"
    return type(
        name,
        (runner_class, CPUModelRunner),
        {"__module__": runner_class.__module__, "__qualname__": name},
    )


@contextlib.contextmanager
def _module_attr(module_name: str, attr: str, value: Any) -> Iterator[None]:
    module = importlib.import_module(module_name)
    original = getattr(module, attr)
    setattr(module, attr, value)
    try:
        yield
    finally:
        setattr(module, attr, original)


class _OmniWorker:
    runner_class: ClassVar[type]
    """The generated runner class this worker builds."""

    model_config_fields: ClassVar[dict[str, Any]] = {}
    """Deployment fields the stage's model reads from vLLM's ``model_config`` (CONTRACT 7.5),
    set before the runner and the model are built."""

    text_config_name: ClassVar[str | None] = None
    """The sub-config of the checkpoint's config that is this stage's text config, or None."""

    # Where vLLM's worker looks up the runner class it constructs in init_device.
    _RUNNER_LOOKUP: ClassVar[tuple[str, str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # vLLM's worker chose V1 or V2 from its config; it builds the runner in init_device.
        keep_v1_model_runner(self)

    @classmethod
    def built_runner_class(cls) -> type:
        return cls.runner_class

    def init_device(self) -> None:
        apply_stage_model_config(
            self.vllm_config.model_config, self.model_config_fields, self.text_config_name
        )
        module_name, attr = self._RUNNER_LOOKUP
        with _module_attr(module_name, attr, self.built_runner_class()):
            super().init_device()  # type: ignore[misc]

    def omni_kv_cache_groups(self) -> int | None:
        """How many KV-cache groups the runner allocated (0: a model without attention cache,
        whose prompts vLLM's engine core will not chunk); for the server's request limits."""
        config = getattr(self.model_runner, "kv_cache_config", None)  # type: ignore[attr-defined]
        return None if config is None else len(config.kv_cache_groups)

    def omni_request_state(self) -> dict[str, list[str]]:
        """The per-request state the runner holds, by request id; for ``collective_rpc`` by name
        (across processes vLLM calls a worker method by its name only)."""
        runner = self.model_runner  # type: ignore[attr-defined]
        return {
            "requests": sorted(runner.requests),
            "buffers": sorted(runner.model_intermediate_buffer),
            "generators": sorted(runner._talker_mtp_generators),
            "pending": sorted(runner._pending_full_payload_send),
            "local_payloads": sorted(runner._local_stage_payload_cache),
            "pending_broadcast": sorted(runner._full_payload_pending_broadcast_req_ids),
        }


class OmniGPUWorker(_OmniWorker, Worker):
    """vLLM's GPU worker building the generated runner."""

    _RUNNER_LOOKUP = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")


class OmniCPUWorker(_OmniWorker, CPUWorker):
    """vLLM's CPU worker building the CPU variant of the generated runner."""

    _RUNNER_LOOKUP = ("vllm.v1.worker.cpu_worker", "CPUModelRunner")

    @classmethod
    def built_runner_class(cls) -> type:
        return cpu_runner_class(cls.runner_class)


def worker_base(device: str) -> type:
    """The omni worker base for a configured device: ``cuda``, ``cpu``, or ``auto`` (vLLM's platform)."""
    if device == "cpu" or (device == "auto" and is_cpu_platform()):
        return OmniCPUWorker
    if device in ("cuda", "auto"):
        return OmniGPUWorker
    raise ValueError(f"unknown device {device!r}; expected auto, cuda or cpu")
