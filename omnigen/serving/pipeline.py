"""A whole model's pipeline on plain vLLM: one engine per stage, glue and transport between them.

``Pipeline.from_model`` builds it from a model's plan: each stage's generated ``worker_cls``,
omnigen's ``scheduler_cls`` (the output channel, CONTRACT 8.1), the glue function its producer
names (``next_stage_input``, from ``omnigen.glue``) and the transport of each edge (8.2). Two
modes:

- ``inproc``: one ``vllm.LLM`` per stage in this process (engine core in process). Requests
  run stage by stage in batches. For CPU tests and offline runs.
- ``mp``: one ``AsyncLLM`` per stage, each with its engine core in a process of its own,
  started with the stage's ``devices`` as ``CUDA_VISIBLE_DEVICES``. Each request is a task
  that awaits stage k and submits to stage k+1, so stages overlap across requests and each
  engine batches continuously. An abort reaches every stage. What real multi-GPU hosts use.
- ``ray``: as ``mp``, but each stage's engines are Ray actors, placed across a Ray cluster
  (``omnigen.serving.ray_stages``, docs/ray.md).

A request's payload goes from stage to stage through the transport (a handle in the next
request's ``SamplingParams.extra_args``); the consumer's runner reads and releases it. A stage's
published payload comes back in ``RequestOutput.kv_transfer_params["omnigen"]``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from omnigen import built
from omnigen.built import SCHEDULER_CLS, BuiltModel, BuiltStage
from omnigen.glue.registry import UnknownGlueError
from omnigen.glue.registry import resolve as resolve_glue
from omnigen.glue.types import GlueError, NextStageInput, StageResult
from omnigen.runtime import transport as transports
from omnigen.runtime.serialization import INLINE_PAYLOAD_KEY
from omnigen.serving.client import stage_payload
from omnigen.serving.limits import StageLimits, stage_limits

log = logging.getLogger("omnigen.serving")

MODES = ("inproc", "mp", "ray")
ASYNC_MODES = ("mp", "ray")
"""The modes whose requests run as tasks in the pipeline's event loop (``generate_async``)."""
T = TypeVar("T")


class PipelineError(RuntimeError):
    """A stage or a glue function failed a request; the message names both."""


@dataclass
class PipelineOutput:
    """One request through every stage."""

    request_id: str
    text: dict[str, str] = field(default_factory=dict)
    """What each stage with ``final_output: text`` wrote."""
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Each stage's sampled token ids."""
    finish_reasons: dict[str, str | None] = field(default_factory=dict)
    """Why each stage's request finished (vLLM's ``finish_reason``: ``stop``, ``length``)."""
    payloads: dict[str, dict[str, Any]] = field(default_factory=dict)
    """What each stage published (CONTRACT 8.1), dotted keys to CPU tensors."""
    audio: Any = None
    """The final audio stage's first published key (e.g. ``audio``), flattened to samples."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time each stage spent on this request (submit to finish)."""
    queued_seconds: dict[str, float] = field(default_factory=dict)
    """Per stage, the time the request waited in the engine's queue before its first step
    (vLLM's own timestamps, where the engine keeps them: ``log_stats``)."""
    running_seconds: dict[str, float] = field(default_factory=dict)
    """Per stage, the time from the request's first step to its last token (the same source)."""


@dataclass
class Carried:
    """What a request takes into its next stage: the payload's transport handle (``{}`` for
    none), and the payload itself, which the next glue function sees as ``input_payload``."""

    handle: dict[str, Any] = field(default_factory=dict)
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass
class StageRuntime:
    """A stage's engine and what the driver needs to talk to it."""

    plan: BuiltStage
    engine: Any
    glue_name: str | None = None
    """The glue of the edge to the next stage: this stage's ``next_stage_input``, or the next
    stage's ``input_function``."""
    glue: Any = None
    transport: Any = None
    hf_config: Any = None


class Pipeline:
    """Every stage of a model, in order; see the module docstring."""

    def __init__(self, plan: BuiltModel, stages: list[StageRuntime], mode: str) -> None:
        self.plan = plan
        self.stages = stages
        self.mode = mode
        self.stage_seconds: dict[str, float] = {s.plan.stage: 0.0 for s in stages}
        self._entry_transport = transports.transport_for("inline")
        self.payload_bytes: dict[str, int] = {}
        """Payload bytes handed to each transport (inline, shm), for the server's metrics."""
        self.stream_windows = 0
        """Windows submitted to a streaming edge's consumer so far (``omnigen.serving.streaming``)."""
        self.limits: list[StageLimits] = []
        """Each stage's limits (``omnigen.serving.limits``), read from its engine at start."""
        self._previous_sigterm: Any = None
        self.ray_cluster: Any = None
        """``ray``: the Ray connection and replicas (``ray_stages.RayCluster``), closed last."""
        self.loop: asyncio.AbstractEventLoop | None = None
        """``mp``: the event loop every request runs in (an ``AsyncLLM`` serves one loop), on a
        thread of its own; ``submit`` and ``run`` hand it work from any thread."""
        if mode in ASYNC_MODES:
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, name="omnigen-pipeline", daemon=True).start()

    def submit(
        self,
        prompt: Mapping[str, Any],
        sampling: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        payload: Mapping[str, Any] | None = None,
        *,
        last_stage: str | None = None,
    ) -> concurrent.futures.Future[PipelineOutput]:
        """``generate_async`` in the pipeline's loop (``mp``); cancelling the future aborts the request."""
        return self.run(self.generate_async(prompt, sampling, request_id, payload, last_stage=last_stage))

    def run(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coroutine`` in the pipeline's loop (``mp`` mode)."""
        if self.loop is None:
            coroutine.close()
            raise PipelineError("a pipeline started with mode='inproc' has no event loop: use generate")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    # -- construction --------------------------------------------------------------------

    @classmethod
    def from_model(
        cls,
        model: str | BuiltModel,
        stage_models: Mapping[str, str],
        *,
        mode: str = "inproc",
        engine_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        ray: Mapping[str, Any] | None = None,
    ) -> Pipeline:
        """Start one engine per stage of ``model`` (``stage_models``: stage -> model path);
        ``ray``: the ``serve.ray`` settings of ``mode='ray'`` (its cluster, replicas, resources).

        ``model``: a model name, served as its built package has it (``omnigen.built.load``), or
        a ``BuiltModel`` (``omnigen.api.served_model(name, overrides)`` for a variant)."""
        if mode not in MODES:
            raise ValueError(f"unknown pipeline mode {mode!r}; choose one of: {', '.join(MODES)}")
        plan = built.load(model) if isinstance(model, str) else model
        model = plan.name
        missing = [s.stage for s in plan.stages if s.stage not in stage_models]
        if missing:
            raise ValueError(f"{model}: no model path for stage(s) {missing}; give stage_models[stage]")
        _check_mode_keys(plan, mode, ray)
        engine_kwargs = engine_kwargs or {}
        _register_declared_classes(plan)
        stages: list[StageRuntime] = []
        cluster = engines = None
        if mode == "ray":
            from omnigen.serving import ray_stages

            cluster, engines = ray_stages.start_pipeline(plan, stage_models, engine_kwargs, ray)
        try:
            for index, stage in enumerate(plan.stages):
                glue = _edge_glue(plan, index)
                kwargs = dict(engine_kwargs.get(stage.stage, {}))
                started = time.perf_counter()
                if engines is not None:
                    engine = engines[stage.stage]  # started together, placed by Ray
                else:
                    log.info(
                        "%s: starting the %s engine (%s) from %s",
                        model,
                        stage.stage,
                        mode,
                        stage_models[stage.stage],
                    )
                    engine = _start_engine(stage, stage_models[stage.stage], kwargs, mode)
                    log.info(
                        "%s: %s engine ready in %.1f s", model, stage.stage, time.perf_counter() - started
                    )
                stages.append(
                    StageRuntime(
                        plan=stage,
                        engine=engine,
                        glue_name=glue,
                        glue=_glue_function(glue) if glue else None,
                        transport=transports.transport_for(stage.transport) if glue else None,
                        hf_config=_hf_config(engine),
                    )
                )
        except BaseException:
            for runtime in stages:
                _shutdown(runtime)
            if cluster is not None:
                cluster.close()
            raise
        pipeline = cls(plan, stages, mode)
        pipeline.ray_cluster = cluster
        try:
            pipeline.limits = stage_limits(stages, pipeline._kv_cache_groups())
        except BaseException:
            pipeline.close()
            raise
        return pipeline

    def _kv_cache_groups(self) -> list[int | None]:
        """What each stage's runner allocated (``omni_kv_cache_groups`` on its worker)."""
        if self.loop is None:
            return [runtime.engine.collective_rpc("omni_kv_cache_groups")[0] for runtime in self.stages]

        async def ask() -> list[int | None]:
            return [(await r.engine.collective_rpc("omni_kv_cache_groups"))[0] for r in self.stages]

        return self.run(ask()).result(timeout=120)

    def close(self) -> None:
        """Shut every engine down; unlink every payload segment no consumer released."""
        log.info("%s: shutting down %d stage engine(s)", self.plan.name, len(self.stages))
        if self.loop is None:
            for runtime in self.stages:
                _shutdown(runtime)
            return
        # An AsyncLLM belongs to the loop its requests ran in: shut it down there. From another
        # thread its shutdown leaves the engine-core processes running after this one exits.
        self.run(_shutdown_all(self.stages)).result(timeout=300)
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self.ray_cluster is not None:
            cluster, self.ray_cluster = self.ray_cluster, None
            cluster.close()

    def __enter__(self) -> Pipeline:
        self._previous_sigterm = _terminate_raises_system_exit()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.close()
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)

    # -- requests ------------------------------------------------------------------------

    def stages_until(self, last_stage: str | None) -> list[StageRuntime]:
        """The stages a request runs: every stage, or the first ones up to ``last_stage``."""
        if last_stage is None:
            return list(self.stages)
        names = [runtime.plan.stage for runtime in self.stages]
        if last_stage not in names:
            raise PipelineError(
                f"{self.plan.name} has no stage {last_stage!r}; its stages: {', '.join(names)}"
            )
        return list(self.stages[: names.index(last_stage) + 1])

    def generate(
        self,
        prompts: Sequence[Mapping[str, Any]],
        sampling: Mapping[str, Any] | None = None,
        request_ids: Sequence[str] | None = None,
        payloads: Sequence[Mapping[str, Any] | None] | None = None,
        *,
        last_stage: str | None = None,
    ) -> list[PipelineOutput]:
        """Every prompt through every stage (or up to ``last_stage``); ``sampling``: stage ->
        ``SamplingParams``; ``payloads``: what each request's first stage receives with its
        prompt (the request builder's payload), or None."""
        request_ids = list(request_ids or (uuid.uuid4().hex for _ in prompts))
        payloads = list(payloads) if payloads is not None else [None] * len(prompts)
        if self.mode in ASYNC_MODES:
            return self.run(
                self._generate_all_async(prompts, sampling, request_ids, payloads, last_stage)
            ).result()
        return self._generate_inproc(prompts, sampling or {}, request_ids, payloads, last_stage)

    def _generate_inproc(
        self,
        prompts: Sequence[Mapping[str, Any]],
        sampling: Mapping[str, Any],
        request_ids: list[str],
        payloads: Sequence[Mapping[str, Any] | None],
        last_stage: str | None = None,
    ) -> list[PipelineOutput]:
        stages = self.stages_until(last_stage)
        results = [PipelineOutput(request_id=rid) for rid in request_ids]
        inputs: list[dict[str, Any]] = [dict(p) for p in prompts]
        carried = [self._entry(rid, payload) for rid, payload in zip(request_ids, payloads, strict=True)]
        try:
            for index, runtime in enumerate(stages):
                name = runtime.plan.stage
                params = [self._params(runtime, sampling, c.handle) for c in carried]
                started = time.perf_counter()
                outs = runtime.engine.generate(inputs, params, use_tqdm=False)
                spent = time.perf_counter() - started
                self.stage_seconds[name] += spent
                log.info("%s: %d requests in %.3f s", name, len(outs), spent)
                if index + 1 == len(stages):
                    for result, out in zip(results, outs, strict=True):
                        result.seconds[name] = spent
                        self._record(result, runtime, out)
                    break
                handed = []
                for result, out, prompt, got in zip(results, outs, prompts, carried, strict=True):
                    result.seconds[name] = spent
                    self._record(result, runtime, out)
                    handed.append(self._handoff(runtime, result.request_id, out, prompt, got))
                inputs = [prompt for prompt, _ in handed]
                carried = [c for _, c in handed]
        except BaseException:
            for c in carried:
                _drop(c.handle)
            raise
        return results

    async def _generate_all_async(
        self,
        prompts: Sequence[Mapping[str, Any]],
        sampling: Mapping[str, Any] | None,
        request_ids: list[str],
        payloads: Sequence[Mapping[str, Any] | None],
        last_stage: str | None = None,
    ) -> list[PipelineOutput]:
        return list(
            await asyncio.gather(
                *(
                    self.generate_async(p, sampling, rid, payload, last_stage=last_stage)
                    for p, rid, payload in zip(prompts, request_ids, payloads, strict=True)
                )
            )
        )

    async def generate_async(
        self,
        prompt: Mapping[str, Any],
        sampling: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        payload: Mapping[str, Any] | None = None,
        *,
        last_stage: str | None = None,
    ) -> PipelineOutput:
        """One request through every stage, or up to ``last_stage`` (``mp`` or ``ray`` mode);
        cancelling it aborts it in every stage."""
        if self.mode not in ASYNC_MODES:
            raise PipelineError("generate_async needs a pipeline started with mode='mp' or 'ray'")
        sampling = sampling or {}
        stages = self.stages_until(last_stage)
        result = PipelineOutput(request_id=request_id or uuid.uuid4().hex)
        current: dict[str, Any] = dict(prompt)
        got = self._entry(result.request_id, payload)
        active: StageRuntime | None = None
        try:
            for index, runtime in enumerate(stages):
                active = runtime
                final = await self.run_stage_async(
                    runtime, current, self._params(runtime, sampling, got.handle), result
                )
                if index + 1 < len(stages):
                    current, got = self._handoff(runtime, result.request_id, final, prompt, got)
            active = None
        except BaseException:
            if active is not None:
                with contextlib.suppress(Exception):
                    await active.engine.abort(f"{result.request_id}-{active.plan.stage}")
            _drop(got.handle)
            raise
        return result

    async def run_stage_async(
        self, runtime: StageRuntime, prompt: Mapping[str, Any], params: Any, result: PipelineOutput
    ) -> Any:
        """One stage's request to its end (``mp``): its final ``RequestOutput``, recorded in ``result``."""
        name = runtime.plan.stage
        started = time.perf_counter()
        final = None
        async for out in runtime.engine.generate(prompt, params, f"{result.request_id}-{name}"):
            final = out
        spent = time.perf_counter() - started
        result.seconds[name] = spent
        self.stage_seconds[name] += spent
        if final is None or not final.finished:
            raise PipelineError(f"stage {name!r}: request {result.request_id!r} did not finish")
        self._record(result, runtime, final)
        return final

    # -- between stages ------------------------------------------------------------------

    def _entry(self, request_id: str, payload: Mapping[str, Any] | None) -> Carried:
        """What a request takes into the first stage: the request builder's payload, inline."""
        if not payload:
            return Carried()
        handle = self._entry_transport.put(request_id, dict(payload))
        self._count_payload(handle)
        return Carried(handle=handle, payload=dict(payload))

    def _count_payload(self, handle: dict[str, Any]) -> None:
        name = str(handle.get(transports.TRANSPORT_KEY, "inline"))
        self.payload_bytes[name] = self.payload_bytes.get(name, 0) + transports.handle_bytes(handle)

    def _params(self, runtime: StageRuntime, sampling: Mapping[str, Any], handle: dict[str, Any]) -> Any:
        from vllm import SamplingParams

        params = sampling.get(runtime.plan.stage)
        if params is None:
            params = SamplingParams(max_tokens=1) if runtime.plan.is_generation else SamplingParams()
        else:
            params = params.clone()
        if runtime.plan.is_generation:
            # A generation stage's work is its prompt; its one sampled placeholder ends it (7.3).
            params.max_tokens = 1
        if handle:
            params.extra_args = {**(params.extra_args or {}), INLINE_PAYLOAD_KEY: handle}
        return params

    def _record(self, result: PipelineOutput, runtime: StageRuntime, out: Any) -> None:
        name = runtime.plan.stage
        completion = out.outputs[0]
        if completion.finish_reason == "abort":
            raise PipelineError(f"stage {name!r}: request {result.request_id!r} was aborted")
        result.token_ids[name] = list(completion.token_ids)
        result.finish_reasons[name] = completion.finish_reason
        stats = getattr(out, "metrics", None)
        if stats is not None and getattr(stats, "scheduled_ts", 0.0) > 0.0:
            result.queued_seconds[name] = max(stats.scheduled_ts - stats.queued_ts, 0.0)
            result.running_seconds[name] = max(stats.last_token_ts - stats.scheduled_ts, 0.0)
        if runtime.plan.final_output == "text":
            result.text[name] = completion.text or ""
        payload = stage_payload(out)
        result.payloads[name] = payload
        if runtime.plan.final_output == "audio":
            result.audio = _audio_of(runtime.plan, payload, result.request_id)

    def _handoff(
        self, runtime: StageRuntime, request_id: str, out: Any, prompt: Mapping[str, Any], got: Carried
    ) -> tuple[dict[str, Any], Carried]:
        """The next stage's prompt and its payload's handle, from a finished producer request."""
        name = runtime.plan.stage
        source = stage_result(runtime, request_id, out, prompt, got)
        try:
            made: NextStageInput = runtime.glue(source)
        except GlueError as exc:
            raise PipelineError(f"stage {name!r} -> next stage: {exc}") from exc
        except Exception as exc:
            raise PipelineError(
                f"stage {name!r}: glue {runtime.glue_name} failed on request {request_id!r}: {exc}"
            ) from exc
        next_prompt: dict[str, Any] = {"prompt_token_ids": list(made.prompt_token_ids)}
        if made.multi_modal_data:
            next_prompt["multi_modal_data"] = made.multi_modal_data
        next_handle = runtime.transport.put(request_id, made.payload) if made.payload else {}
        if next_handle:
            self._count_payload(next_handle)
        return next_prompt, Carried(handle=next_handle, payload=made.payload)


def stage_result(
    runtime: StageRuntime,
    request_id: str,
    out: Any,
    prompt: Mapping[str, Any],
    got: Carried,
    payload: Mapping[str, Any] | None = None,
) -> StageResult:
    """What a glue function sees of a producer's request: its ``RequestOutput`` ``out`` (finished,
    or for a streaming edge the latest so far, with ``payload`` the payload published so far)."""
    completion = out.outputs[0]
    return StageResult(
        request_id=request_id,
        prompt_token_ids=list(out.prompt_token_ids or []),
        output_token_ids=list(completion.token_ids),
        payload=stage_payload(out) if payload is None else payload,
        text=completion.text or "",
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        input_payload=got.payload,
        user_prompt=dict(prompt),
        hf_config=runtime.hf_config,
    )


def _check_mode_keys(plan: BuiltModel, mode: str, ray: Mapping[str, Any] | None) -> None:
    """What only ``mode='ray'`` reads is refused in another mode, never ignored."""
    if mode == "ray":
        return
    if ray is not None:
        raise ValueError(f"ray= (serve.ray) is read in mode='ray' only, not {mode!r}: set serve.mode=ray")
    for index, stage in enumerate(plan.stages[:-1]):
        if stage.transport == "ray" and _edge_glue(plan, index) is not None:
            raise ValueError(
                f"model.stages.{stage.stage}.transport: ray moves the payload through Ray's object "
                f"store, which serve.mode={mode} does not start; set serve.mode=ray, or the transport "
                "to inline or shm"
            )


def _glue_function(name: str) -> Any:
    """omnigen's glue of that name, else the user's function at that dotted path."""
    try:
        return resolve_glue(name)
    except UnknownGlueError as unknown:
        from vllm.utils.import_utils import resolve_obj_by_qualname

        try:
            return resolve_obj_by_qualname(name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise PipelineError(
                f"{unknown}\nand {name!r} does not import as a function of your own: {exc}"
            ) from exc


def _edge_glue(plan: BuiltModel, index: int) -> str | None:
    """The glue function of the edge from stage ``index`` to the next (None for the last)."""
    if index + 1 >= len(plan.stages):
        return None
    glue = plan.stages[index].next_stage_input or plan.stages[index + 1].input_function
    if glue is None:
        raise PipelineError(
            f"{plan.name}: nothing turns stage {plan.stages[index].stage!r}'s output into stage "
            f"{plan.stages[index + 1].stage!r}'s request: set its next_stage_input, or the next "
            "stage's input_function"
        )
    return glue


# Where a final audio stage that publishes every key keeps its samples: omnigen's tiny code2wav
# (audio) and vllm-omni 0.30's code2wav classes (model_outputs, beside sr).
AUDIO_KEYS = ("audio", "model_outputs")


def _audio_of(plan: BuiltStage, payload: Mapping[str, Any], request_id: str) -> Any:
    """The audio samples of a final audio stage: its first published key, else a known audio key."""
    keys = list(plan.published_keys or ()) or list(AUDIO_KEYS)
    for key in keys:
        value = payload.get(key)
        if value is not None and hasattr(value, "reshape"):
            return value.reshape(-1)
    raise PipelineError(
        f"stage {plan.stage!r}: request {request_id!r} published no audio (payload keys: {sorted(payload)})"
    )


def _drop(handle: dict[str, Any]) -> None:
    """Release a payload no stage will read (a failed or aborted request)."""
    if transports.is_handle(handle):
        with contextlib.suppress(Exception):
            transports.transport_for_handle(handle).release(handle)


def _engine_args(stage: BuiltStage, model_path: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    args = dict(kwargs)
    args["model"] = model_path
    args.setdefault("worker_cls", stage.worker_cls)
    args.setdefault("scheduler_cls", SCHEDULER_CLS)
    return args


def _register_declared_classes(plan: BuiltModel) -> None:
    """Register the model's declared classes here (the engine config is created in this
    process); the engines' own processes register them through omnigen's plugin."""
    from omnigen import models

    try:
        models.register_declared(models.Declared.from_plan(plan))
    except models.ModelClassError as exc:
        raise PipelineError(str(exc)) from exc


def _plugin_environment(stage: BuiltStage) -> dict[str, str]:
    """What every vLLM process of a stage's engine needs to load the stage's classes: omnigen's
    plugin, told which model's classes to register; and no other plugin unless the user chose
    some (vllm-omni's would import its package, whose patch replaces vLLM's request classes)."""
    from omnigen import models

    package = stage.module.rsplit(".", 2)[0]
    plugins = os.environ.get("VLLM_PLUGINS")
    chosen = [p for p in (plugins or "").split(",") if p]
    return {
        models.ENV: models.env_value(stage.model, package),
        "VLLM_PLUGINS": ",".join(chosen if "omnigen" in chosen else [*chosen, "omnigen"]),
    }


def _start_engine(stage: BuiltStage, model_path: str, kwargs: dict[str, Any], mode: str) -> Any:
    args = _engine_args(stage, model_path, kwargs)
    plugin_env = _plugin_environment(stage)
    if mode == "inproc":
        from vllm import LLM

        with _environment(VLLM_ENABLE_V1_MULTIPROCESSING="0", **plugin_env):
            return LLM(**args)
    if stage.in_memory:
        raise ValueError(stage.variant_refusal(mode))
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    devices = {"CUDA_VISIBLE_DEVICES": stage.devices} if stage.devices is not None else {}
    with _environment(VLLM_ENABLE_V1_MULTIPROCESSING="1", **devices, **plugin_env):
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """``values`` in ``os.environ`` while an engine starts (its processes inherit them)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _hf_config(engine: Any) -> Any:
    model_config = getattr(getattr(engine, "llm_engine", engine), "model_config", None)
    return getattr(model_config, "hf_config", None)


def _terminate_raises_system_exit() -> Any:
    """Make SIGTERM unwind the main thread as ``SystemExit``; return the handler it replaced.

    Under Python's default handler SIGTERM kills the process at once: ``with pipeline:`` never
    closes, and in ``mp`` mode every stage's engine-core process outlives it. ``None`` (nothing
    changed) off the main thread, where signal handlers cannot be set.
    """
    if threading.current_thread() is not threading.main_thread():
        return None

    def exit_on_terminate(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_on_terminate)
    return signal.SIG_DFL if previous is None else previous  # None: a handler set outside Python


async def _shutdown_all(stages: list[StageRuntime]) -> None:
    for runtime in stages:
        _shutdown(runtime)


def _shutdown(runtime: StageRuntime) -> None:
    if runtime.transport is not None:
        with contextlib.suppress(Exception):
            runtime.transport.close()
    engine, runtime.engine = runtime.engine, None
    if engine is None:
        return  # closed before
    try:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
        else:
            engine.llm_engine.engine_core.shutdown()
    except Exception:
        log.exception("stage %r: its engine did not shut down cleanly", runtime.plan.stage)
    # The last reference goes here, while vLLM's modules are whole: AsyncLLM.__del__ shuts down
    # once more, and at interpreter exit (module globals gone) that printed a TypeError.
    del engine
