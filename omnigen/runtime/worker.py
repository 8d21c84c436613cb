"""How vLLM loads a generated runner: worker classes that build it (CONTRACT 6).

vLLM has no setting for a runner class; a worker builds the runner inside its
``init_device``, from a name in its own module. The omni workers below build the
generated runner in that place instead: on vLLM's GPU worker they build the
generated class itself, on vLLM's CPU worker a variant of it composed with
``CPUModelRunner`` (``cpu_runner_class``).

Each stage has two generated targets: the V1 runner (``<stage>.py``) and the Model Runner V2
target (``<stage>_v2.py``). ``vllm_api.runner_target`` picks one from vLLM's features (never its
version string), here and in the engine core's scheduler alike; on a vLLM without its V1
runner only the V2 target can be built (the V1 one is refused with vLLM's reason).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from typing import Any, ClassVar

from vllm.logger import init_logger
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from omnigen.runtime import vllm_api
from omnigen.runtime.vllm_api import apply_stage_model_config, is_cpu_platform, keep_v1_model_runner

if vllm_api.v1_runner_available():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
else:  # vLLM without Model Runner V1: the V1 CPU composition is never built there.
    CPUModelRunner = vllm_api.V1RunnerRemoved  # type: ignore[misc, assignment]

logger = init_logger(__name__)


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


@functools.cache
def cpu_runner_v2_class(runner_class: type) -> type:
    """A generated V2 runner rebuilt on vLLM's V2 CPU runner: ``(runner_class, CPUModelRunner)``
    (vLLM's ``vllm.v1.worker.cpu.model_runner.CPUModelRunner`` subclasses the V2
    ``GPUModelRunner``, as the generated class does)."""
    from omnigen.runtime import vllm_api_v2

    name = f"{runner_class.__name__}OnCPU"
    return type(
        name,
        (runner_class, vllm_api_v2.v2_cpu_runner_class()),
        {"__module__": runner_class.__module__, "__qualname__": name},
    )


class _OmniWorker:
    runner_class: ClassVar[type]
    """The generated V1 runner class this worker builds."""

    runner_v2: ClassVar[str | None] = None
    """The class name of the stage's V2 runner, in this module's ``_v2`` sibling (``<stage>_v2``)."""

    v2_narrow_full_graphs: ClassVar[bool] = False
    """Plan decision ``v2.full_graph=narrowed``: the forward returns its payload itself, which a full
    CUDA graph replay on V2 drops (docs/model-runner-v2.md, section 4 item 1)."""

    v2_jit_warmup: ClassVar[bool] = True
    """Plan decision ``v2.jit_warmup``: whether V2's warm-up may run real steps of synthetic
    requests through this stage."""

    model_config_fields: ClassVar[dict[str, Any]] = {}
    """Deployment fields the stage's model reads from vLLM's ``model_config`` (CONTRACT 7.5),
    set before the runner and the model are built."""

    text_config_name: ClassVar[str | None] = None
    """The sub-config of the checkpoint's config that is this stage's text config, or None."""

    # Where vLLM's worker looks up the runner class it constructs in init_device.
    _RUNNER_LOOKUP: ClassVar[tuple[str, str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # vLLM's worker chose V1 or V2 from its config; it builds the runner in init_device. The
        # stage runs the target that choice and vLLM's features allow (the engine core's
        # scheduler asks the same question of the same config).
        self.omni_runner_choice = vllm_api.runner_target(self.vllm_config)  # type: ignore[attr-defined]
        if self.omni_runner_choice.target == "v1":
            keep_v1_model_runner(self)
        else:
            self._prepare_v2()
        logger.info(
            "%s: %s target (%s)",
            type(self).__name__,
            self.omni_runner_choice.target,
            self.omni_runner_choice.reason,
        )

    @classmethod
    def built_runner_class(cls) -> type:
        return cls.runner_class

    @classmethod
    def runner_v2_class(cls) -> type:
        """The stage's generated V2 runner class (its module is imported here, not before)."""
        if cls.runner_v2 is None:
            raise RuntimeError(
                f"{cls.__qualname__} was generated without a Model Runner V2 target; rebuild the model "
                "(omnigen build) to serve it on a vLLM that runs Model Runner V2"
            )
        # The generated worker (the class that names runner_v2; a subclass may live elsewhere).
        generated = next(klass for klass in cls.__mro__ if "runner_v2" in vars(klass))
        module = importlib.import_module(f"{generated.__module__}_v2")
        return getattr(module, cls.runner_v2)

    @classmethod
    def built_runner_v2_class(cls) -> type:
        return cls.runner_v2_class()

    def _prepare_v2(self) -> None:
        """What the V2 target needs of vLLM's config before any runner exists (plan decisions,
        docs/model-runner-v2.md section 6.4)."""
        config = self.vllm_config  # type: ignore[attr-defined]
        name = type(self).__qualname__
        if config.parallel_config.pipeline_parallel_size > 1:
            raise RuntimeError(
                f"{name}: the Model Runner V2 target runs one pipeline stage (pipeline_parallel_size=1): V2 "
                "prepares the preprocess hooks' embeddings on the first rank and the payload exists on the "
                "last; serve this stage with pipeline_parallel_size=1"
            )
        self.runner_v2_class()  # a missing or broken V2 module fails here, naming it
        compilation = config.compilation_config
        mode = compilation.cudagraph_mode
        if self.v2_narrow_full_graphs and mode is not None and mode.has_full_cudagraphs():
            narrowed = (
                vllm_api.CUDAGraphMode.PIECEWISE
                if mode.has_piecewise_cudagraphs()
                else vllm_api.CUDAGraphMode.NONE
            )
            compilation.cudagraph_mode = narrowed
            logger.info(
                "%s: cudagraph_mode %s -> %s (v2.full_graph=narrowed: the forward returns its payload "
                "itself, and a full-graph replay on Model Runner V2 returns the hidden states only)",
                name,
                mode.name,
                narrowed.name,
            )
        kernel_config = getattr(config, "kernel_config", None)
        if not self.v2_jit_warmup and getattr(kernel_config, "enable_jit_warmup", False):
            kernel_config.enable_jit_warmup = False
            logger.info(
                "%s: kernel_config.enable_jit_warmup off (v2.jit_warmup=off: V2's warm-up would run the "
                "stage's hooks on synthetic requests without a payload)",
                name,
            )

    def init_device(self) -> None:
        apply_stage_model_config(
            self.vllm_config.model_config, self.model_config_fields, self.text_config_name
        )
        if self.omni_runner_choice.target == "v2":
            with self._v2_runner_lookup():
                super().init_device()  # type: ignore[misc]
            return
        module_name, attr = self._RUNNER_LOOKUP
        with _module_attr(module_name, attr, self.built_runner_class()):
            super().init_device()  # type: ignore[misc]

    def _v2_runner_lookup(self) -> contextlib.AbstractContextManager[None]:
        """Within: vLLM's worker builds the V2 target where it would build its V2 runner."""
        return contextlib.nullcontext()

    def omni_state(self) -> Any:
        """The object that holds the stage's omni state: the V1 runner, or the V2 target's model state."""
        runner = self.model_runner  # type: ignore[attr-defined]
        return runner.model_state if self.omni_runner_choice.target == "v2" else runner

    def omni_kv_cache_groups(self) -> int | None:
        """How many KV-cache groups the runner allocated (0: a model without attention cache,
        whose prompts vLLM's engine core will not chunk); for the server's request limits."""
        config = getattr(self.model_runner, "kv_cache_config", None)  # type: ignore[attr-defined]
        return None if config is None else len(config.kv_cache_groups)

    def omni_request_state(self) -> dict[str, list[str]]:
        """The per-request state the runner holds, by request id; for ``collective_rpc`` by name
        (across processes vLLM calls a worker method by its name only)."""
        runner = self.omni_state()
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

    def _make_model_runner(self) -> Any:
        """vLLM's seam for the runner a GPU worker builds (vLLM 0.32 on): the V2 target where the
        stage runs it, else what vLLM builds (the V1 runner, swapped in by ``init_device``)."""
        if self.omni_runner_choice.target == "v2":
            return self.built_runner_v2_class()(self.vllm_config, self.device)
        return super()._make_model_runner()  # type: ignore[misc]

    def _prepare_v2(self) -> None:
        if not hasattr(Worker, "_make_model_runner"):
            raise RuntimeError(
                f"{type(self).__qualname__}: vLLM's GPU worker has no _make_model_runner, where the V2 target "
                "is built; serve with a vLLM that has it (0.32 on) or with its V1 runner"
            )
        super()._prepare_v2()


class OmniCPUWorker(_OmniWorker, CPUWorker):
    """vLLM's CPU worker building the CPU variant of the generated runner."""

    _RUNNER_LOOKUP = ("vllm.v1.worker.cpu_worker", "CPUModelRunner")

    @classmethod
    def built_runner_class(cls) -> type:
        return cpu_runner_class(cls.runner_class)

    @classmethod
    def built_runner_v2_class(cls) -> type:
        return cpu_runner_v2_class(cls.runner_v2_class())

    def _prepare_v2(self) -> None:
        from omnigen.runtime import vllm_api_v2

        if vllm_api_v2.standalone_cpu_runner():
            raise RuntimeError(
                f"{type(self).__qualname__}: vLLM's CPU worker would build its standalone Model Runner V2 "
                "(no Triton on this CPU), which takes no custom model state; the stage's V2 target needs "
                "vLLM's CPU runner with Triton (triton-cpu)"
            )
        super()._prepare_v2()

    def _v2_runner_lookup(self) -> contextlib.AbstractContextManager[None]:
        from omnigen.runtime import vllm_api_v2

        built = self.built_runner_v2_class()
        stack = contextlib.ExitStack()
        for module_name, attr in vllm_api_v2.v2_cpu_runner_locations():
            stack.enter_context(vllm_api_v2.swapped(module_name, attr, built))
        return stack


def worker_base(device: str) -> type:
    """The omni worker base for a configured device: ``cuda``, ``cpu``, or ``auto`` (vLLM's platform)."""
    if device == "cpu" or (device == "auto" and is_cpu_platform()):
        return OmniCPUWorker
    if device in ("cuda", "auto"):
        return OmniGPUWorker
    raise ValueError(f"unknown device {device!r}; expected auto, cuda or cpu")
