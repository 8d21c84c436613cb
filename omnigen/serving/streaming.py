"""Streaming edges: the next stage decodes windows of a producer's frames while it still runs.

A producer stage with ``stream`` in its plan (``stages.S.stream`` in the model's config) gets
``SamplingParams.extra_args["omnigen_stream"]``: the sampled-token counts at which omnigen's
scheduler attaches the payload so far to the request's unfinished output
(``omnigen.runtime.scheduler``). Each time one arrives, the driver counts the frames in it (the
window function's ``frames_of``), cuts the windows that are ready (``WindowCutter``: the first
window, the ramp, then ``chunk_frames`` each, and the remainder when the producer finishes) and
submits one request per window to the next stage, a generation stage (one decode, ``max_tokens``
1), each with ``left_context_frames`` frames before it, through the edge's transport. With
``coalesce`` (the default) a request's windows decode one after another and the next one takes
every window of the grid ready by then, so a consumer that lags under load gets fewer, larger
windows (fewer requests, less left context decoded twice); without it, windows of one request
decode concurrently. Windows of all requests batch in the consumer's engine; audio comes back in
window order, the left context's samples dropped.

Everything runs on vLLM's own extension points: unfinished ``RequestOutput`` objects of the
producer (``RequestOutputKind.CUMULATIVE``: an output vLLM merges into a later unread one keeps
the later, fuller payload), and plain requests to the consumer. The payload republished is the
whole payload so far (codec codes: small), so a merged output loses nothing.

Backpressure: at most ``ahead`` windows are decoded or held but not yet taken by the reader; a
slow reader stops the driver from submitting more (the producer keeps running: its outputs merge).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from omnigen.glue.types import GlueError, Window, WindowInput, frames_counter
from omnigen.runtime.scheduler import STREAM_KEY
from omnigen.serving.client import stage_payload
from omnigen.serving.pipeline import (
    ASYNC_MODES,
    Carried,
    Pipeline,
    PipelineError,
    PipelineOutput,
    StageRuntime,
    _audio_of,
    _drop,
    _glue_function,
    stage_result,
)
from omnigen.streams import StreamSpec

DEFAULT_AHEAD = 4
"""Windows a request may have decoding or waiting for its reader at once."""


@dataclass
class AudioChunk:
    """One window's new audio, in order."""

    index: int
    samples: torch.Tensor
    """1-D float samples (the left context's already dropped)."""
    seconds: float
    """Since the request reached the pipeline."""


class WindowCutter:
    """Cuts a producer's growing frame count into windows: ``initial_chunk_frames``, the ramp,
    then ``chunk_frames`` each; at the producer's finish, whatever remains."""

    def __init__(self, stream: StreamSpec) -> None:
        self.stream = stream
        self.sent = 0
        self.count = 0
        self.taken = 0

    def ready(self, frames: int, finished: bool) -> list[Window]:
        windows = []
        while frames > self.sent:
            size = self.stream.window_sizes(self.count + 1)[-1]
            if frames - self.sent < size and not finished:
                break
            end = min(self.sent + size, frames)
            left = min(self.stream.left_context_frames, self.sent)
            windows.append(Window(self.count, self.sent, end, left, last=finished and end == frames))
            self.sent, self.count = end, self.count + 1
        return windows

    def take(self, frames: int, finished: bool) -> list[Window]:
        """The windows to submit now: with ``coalesce``, every window ready merged into one
        (numbered in submission order; its edges still on the grid), else each ready one."""
        ready = self.ready(frames, finished)
        if not self.stream.coalesce or len(ready) < 2:
            windows = ready
        else:
            first, last = ready[0], ready[-1]
            windows = [Window(first.index, first.start, last.end, first.left_context, last.last)]
        numbered = [
            Window(self.taken + i, w.start, w.end, w.left_context, w.last) for i, w in enumerate(windows)
        ]
        self.taken += len(numbered)
        return numbered


def publish_points(stream: StreamSpec) -> dict[str, Any]:
    """The producer request's ``extra_args["omnigen_stream"]``: publish once a window's frames
    exist, a frame needing one more sampled token (its codes are written the step after)."""
    sizes = [stream.initial_chunk_frames, *stream.ramp]
    return {
        "publish_at": [frames + 1 for frames in itertools.accumulate(sizes)],
        "every": stream.chunk_frames,
    }


def streaming_edge(pipeline: Pipeline) -> int | None:
    """The index of the producer whose edge streams, or None. Only the edge into the final audio
    stage may stream: earlier stages hand over full payloads."""
    stages = pipeline.stages
    for index, runtime in enumerate(stages[:-1]):
        if runtime.plan.stream is None:
            continue
        if index + 2 != len(stages) or stages[-1].plan.final_output != "audio":
            raise PipelineError(
                f"{pipeline.plan.name}: stage {runtime.plan.stage!r} streams, but only the edge into "
                "the final audio stage can stream"
            )
        return index
    return None


_WINDOW_FUNCTIONS: dict[str, Any] = {}


def window_function(stream: StreamSpec) -> tuple[Callable[..., WindowInput], Callable[..., int]]:
    """The edge's window function and its frame counter."""
    function = _WINDOW_FUNCTIONS.get(stream.window)
    if function is None:
        function = _WINDOW_FUNCTIONS[stream.window] = _glue_function(stream.window)
    try:
        return function, frames_counter(function)
    except TypeError as exc:
        raise PipelineError(str(exc)) from exc


def window_request(
    pipeline: Pipeline,
    producer: StageRuntime,
    source: Any,
    window: Window,
    function: Callable[..., WindowInput],
) -> tuple[dict[str, Any], Carried, tuple[int, int | None]]:
    """A window's consumer prompt, its payload's handle and which of its samples are its own
    (``(drop, keep)``: ``WindowInput.drop_samples``, ``keep_samples``)."""
    try:
        made = function(source, window)
    except GlueError as exc:
        raise PipelineError(f"stage {producer.plan.stage!r} -> next stage: {exc}") from exc
    except Exception as exc:
        raise PipelineError(
            f"stage {producer.plan.stage!r}: window function {producer.plan.stream.window} failed on "
            f"request {source.request_id!r}, window {window.index}: {exc}"
        ) from exc
    prompt = {"prompt_token_ids": list(made.request.prompt_token_ids)}
    payload = made.request.payload
    handle = producer.transport.put(f"{source.request_id}-w{window.index}", payload) if payload else {}
    if handle:
        pipeline._count_payload(handle)
    return prompt, Carried(handle=handle, payload=payload), (made.drop_samples, made.keep_samples)


def chunk_of(
    consumer: StageRuntime,
    out: Any,
    request_id: str,
    window: Window,
    trim: tuple[int, int | None],
    started: float,
) -> AudioChunk:
    drop, keep = trim
    samples = _audio_of(consumer.plan, stage_payload(out), request_id).reshape(-1)
    if drop > samples.numel() or (keep is not None and drop + keep > samples.numel()):
        raise PipelineError(
            f"stage {consumer.plan.stage!r}: window {window.index} of request {request_id!r} gave "
            f"{samples.numel()} samples, fewer than its left context's {drop}"
            + ("" if keep is None else f" and its own {keep}")
        )
    own = samples[drop:] if keep is None else samples[drop : drop + keep]
    return AudioChunk(window.index, own.to("cpu", torch.float32), time.perf_counter() - started)


class Pacer:
    """When a request's next window is due (``playback_rate_hz``): once the caller, playing its
    audio in real time from the first window on, would have less than ``playback_lead_s`` left.
    Until then the frames gather into one window. Without a rate, every window is due at once."""

    def __init__(self, stream: StreamSpec) -> None:
        self.rate = stream.playback_rate_hz
        self.lead = stream.playback_lead_s
        self.first_audio: float | None = None
        """``time.monotonic()`` when the first window's audio was ready."""

    def heard(self) -> None:
        if self.first_audio is None:
            self.first_audio = time.monotonic()

    def wait_s(self, frames_sent: int) -> float:
        """Seconds until a window after ``frames_sent`` frames is due (0: now)."""
        if not self.rate or self.first_audio is None:
            return 0.0
        runs_out = self.first_audio + frames_sent / self.rate
        return max(runs_out - self.lead - time.monotonic(), 0.0)


class _Progress:
    """A streaming producer's latest payload, as the submitter reads it."""

    def __init__(self) -> None:
        self.source: Any = None
        self.frames = 0
        self.finished = False
        self.error: BaseException | None = None
        self._changed = asyncio.Event()

    def show(self, source: Any, frames: int, finished: bool) -> None:
        self.source, self.frames, self.finished = source, frames, finished
        self._changed.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._changed.set()

    async def wait(self, timeout: float | None = None) -> None:
        """Until the producer shows more (or ``timeout`` seconds pass)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)
        self._changed.clear()


def _producer_params(
    pipeline: Pipeline, producer: StageRuntime, sampling: Mapping[str, Any], got: Carried
) -> Any:
    from vllm.sampling_params import RequestOutputKind

    params = pipeline._params(producer, sampling, got.handle)
    params.extra_args = {**(params.extra_args or {}), STREAM_KEY: publish_points(producer.plan.stream)}
    params.output_kind = RequestOutputKind.CUMULATIVE
    return params


def _finish(
    result: PipelineOutput, consumer: StageRuntime, chunks: list[torch.Tensor], started: float
) -> None:
    result.audio = torch.cat(chunks) if chunks else torch.zeros(0)
    result.seconds.setdefault(consumer.plan.stage, 0.0)
    result.seconds["total"] = time.perf_counter() - started


async def stream_async(
    pipeline: Pipeline,
    prompt: Mapping[str, Any],
    sampling: Mapping[str, Any] | None = None,
    request_id: str | None = None,
    payload: Mapping[str, Any] | None = None,
    *,
    ahead: int = DEFAULT_AHEAD,
    coalesce: bool | None = None,
) -> AsyncIterator[AudioChunk | PipelineOutput]:
    """One request through the pipeline (``mp``), its audio as it is made: ``AudioChunk`` items
    in order, then the ``PipelineOutput`` (whole audio in ``audio``). Closing the iterator early
    aborts the request in every stage. A pipeline without a streaming edge yields its whole audio
    as one chunk. ``coalesce``: this request's window policy instead of the edge's
    (``stages.S.stream.coalesce``)."""
    if pipeline.mode not in ASYNC_MODES:
        raise PipelineError("stream_async needs a pipeline started with mode='mp' or 'ray' (inproc: stream)")
    sampling = sampling or {}
    started = time.perf_counter()
    result = PipelineOutput(request_id=request_id or uuid.uuid4().hex)
    edge = streaming_edge(pipeline)
    if edge is None:
        whole = await pipeline.generate_async(prompt, sampling, result.request_id, payload)
        if whole.audio is not None:
            yield AudioChunk(0, whole.audio.reshape(-1).float(), time.perf_counter() - started)
        yield whole
        return
    producer, consumer = pipeline.stages[edge], pipeline.stages[edge + 1]
    policy = producer.plan.stream
    if coalesce is not None:
        policy = dataclasses.replace(policy, coalesce=coalesce)
    function, frames_of = window_function(policy)
    in_flight: dict[str, StageRuntime] = {}
    """Engine request id -> its stage, for every request not yet finished (aborted on exit)."""
    handles: list[dict[str, Any]] = []
    slots = asyncio.Semaphore(max(ahead, 1))
    windows: asyncio.Queue[Any] = asyncio.Queue()

    async def decode(
        window: Window, next_prompt: dict[str, Any], carried: Carried, trim: tuple[int, int | None]
    ) -> AudioChunk:
        engine_id = f"{result.request_id}-{consumer.plan.stage}-w{window.index}"
        in_flight[engine_id] = consumer
        final = None
        async for out in consumer.engine.generate(
            next_prompt, pipeline._params(consumer, sampling, carried.handle), engine_id
        ):
            final = out
        in_flight.pop(engine_id, None)
        if final is None or not final.finished or final.outputs[0].finish_reason == "abort":
            raise PipelineError(
                f"stage {consumer.plan.stage!r}: window {window.index} of {result.request_id!r} did not finish"
            )
        return chunk_of(consumer, final, result.request_id, window, trim, started)

    progress = _Progress()

    async def feed(current: dict[str, Any], got: Carried) -> None:
        """Runs the producer, keeping ``progress`` at its latest payload."""
        name = producer.plan.stage
        engine_id = f"{result.request_id}-{name}"
        final = None
        begun = time.perf_counter()
        in_flight[engine_id] = producer
        async for out in producer.engine.generate(
            current, _producer_params(pipeline, producer, sampling, got), engine_id
        ):
            final = out
            published = stage_payload(out)
            if not published:
                continue  # no publishing point in this output (or merged into one without)
            source = stage_result(producer, result.request_id, out, prompt, got, published)
            progress.show(source, frames_of(source), out.finished)
        in_flight.pop(engine_id, None)
        spent = time.perf_counter() - begun
        result.seconds[name] = spent
        pipeline.stage_seconds[name] += spent
        if final is None or not final.finished:
            raise PipelineError(f"stage {name!r}: request {result.request_id!r} did not finish")
        pipeline._record(result, producer, final)

    async def fed(current: dict[str, Any], got: Carried) -> None:
        try:
            await feed(current, got)
        except BaseException as exc:  # the submitter hands it to the reader after the windows before it
            progress.fail(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def submit() -> None:
        """Cuts and submits the windows; with ``coalesce`` one decodes at a time, and the next
        takes every window ready when it is done. A slot is taken before a window is cut, so
        frames that arrive while the reader is behind join the next window too."""
        cutter = WindowCutter(policy)
        pacer = Pacer(policy)
        while True:
            await slots.acquire()
            while True:
                held = 0.0 if progress.finished else pacer.wait_s(cutter.sent)
                if not held and (ready := cutter.take(progress.frames, progress.finished)):
                    break
                if progress.error is not None or (progress.finished and not held):
                    slots.release()
                    windows.put_nowait(progress.error)  # None: the producer's take is all decoded
                    return
                await progress.wait(held or None)
            for i, window in enumerate(ready):
                if i:
                    await slots.acquire()
                next_prompt, carried, trim = window_request(
                    pipeline, producer, progress.source, window, function
                )
                handles.append(carried.handle)
                pipeline.stream_windows += 1
                decoding = asyncio.ensure_future(decode(window, next_prompt, carried, trim))
                windows.put_nowait(decoding)
            if policy.coalesce:
                await asyncio.wait([decoding])  # the reader raises its error, if any
                pacer.heard()

    async def submitted() -> None:
        try:
            await submit()
        except BaseException as exc:
            windows.put_nowait(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    feeder: asyncio.Task[None] | None = None
    submitter: asyncio.Task[None] | None = None
    got = pipeline._entry(result.request_id, payload)
    handles.append(got.handle)
    chunks: list[torch.Tensor] = []
    try:
        current: dict[str, Any] = dict(prompt)
        for runtime in pipeline.stages[:edge]:
            in_flight[f"{result.request_id}-{runtime.plan.stage}"] = runtime
            final = await pipeline.run_stage_async(
                runtime, current, pipeline._params(runtime, sampling, got.handle), result
            )
            in_flight.pop(f"{result.request_id}-{runtime.plan.stage}", None)
            current, got = pipeline._handoff(runtime, result.request_id, final, prompt, got)
            handles.append(got.handle)
        feeder = asyncio.ensure_future(fed(current, got))
        submitter = asyncio.ensure_future(submitted())
        while (item := await windows.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            chunk = await item
            slots.release()
            chunks.append(chunk.samples)
            yield chunk
        await feeder
        await submitter
        consumed = time.perf_counter() - started - result.seconds.get(producer.plan.stage, 0.0)
        result.seconds[consumer.plan.stage] = max(consumed, 0.0)
        _finish(result, consumer, chunks, started)
        yield result
    finally:
        for task in (feeder, submitter):
            if task is not None and not task.done():
                task.cancel()
        while not windows.empty():
            item = windows.get_nowait()
            if isinstance(item, asyncio.Future) and not item.done():
                item.cancel()
        for engine_id, runtime in list(in_flight.items()):
            with contextlib.suppress(Exception):
                await runtime.engine.abort(engine_id)
        for handle in handles:
            _drop(handle)  # a no-op for a handle its consumer released


def stream(
    pipeline: Pipeline,
    prompt: Mapping[str, Any],
    sampling: Mapping[str, Any] | None = None,
    request_id: str | None = None,
    payload: Mapping[str, Any] | None = None,
) -> Iterator[AudioChunk | PipelineOutput]:
    """``stream_async`` for any thread: ``mp`` runs it in the pipeline's loop and hands each item
    over as it comes; ``inproc`` steps the producer's engine core in this process and decodes each
    window as soon as it is ready (``stream_inproc``). Closing the iterator aborts the request."""
    if pipeline.mode not in ASYNC_MODES:
        yield from stream_inproc(pipeline, prompt, sampling, request_id, payload)
        return
    iterator = stream_async(pipeline, prompt, sampling, request_id, payload)
    try:
        while True:
            item = pipeline.run(_next(iterator)).result()
            if item is _END:
                return
            yield item
    finally:
        pipeline.run(iterator.aclose()).result(timeout=60)


_END = object()


async def _next(iterator: AsyncIterator[Any]) -> Any:
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return _END


async def relay(pipeline: Pipeline, iterator: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """Items of ``iterator`` (which runs in the pipeline's loop) in the caller's loop, one at a
    time: the pipeline's side waits for the caller to take each item (backpressure). Leaving
    early closes ``iterator`` in its loop (which aborts its request)."""
    try:
        while True:
            item = await asyncio.wrap_future(pipeline.run(_next(iterator)))
            if item is _END:
                return
            yield item
    finally:
        await asyncio.wrap_future(pipeline.run(iterator.aclose()))


def stream_inproc(
    pipeline: Pipeline,
    prompt: Mapping[str, Any],
    sampling: Mapping[str, Any] | None = None,
    request_id: str | None = None,
    payload: Mapping[str, Any] | None = None,
) -> Iterator[AudioChunk | PipelineOutput]:
    """``inproc``: the producer's engine core (``LLM.llm_engine``) is stepped here; after each
    step the windows that are ready are decoded by the consumer's engine at once, so the first
    audio comes after the first window's frames, not after the whole take."""
    sampling = sampling or {}
    started = time.perf_counter()
    rid = request_id or uuid.uuid4().hex
    edge = streaming_edge(pipeline)
    if edge is None:
        (whole,) = pipeline.generate([prompt], sampling, [rid], [payload])
        if whole.audio is not None:
            yield AudioChunk(0, whole.audio.reshape(-1).float(), time.perf_counter() - started)
        yield whole
        return
    if edge:  # the stages before would need their finished outputs handed over here too
        raise PipelineError(
            f"inproc streaming after stage {pipeline.stages[edge - 1].plan.stage!r}: only a pipeline "
            "whose first stage streams runs in process; use mode='mp'"
        )
    producer, consumer = pipeline.stages[edge], pipeline.stages[edge + 1]
    function, frames_of = window_function(producer.plan.stream)
    result = PipelineOutput(request_id=rid)
    got = pipeline._entry(rid, payload)
    current: dict[str, Any] = dict(prompt)
    engine = producer.engine.llm_engine
    engine_id = f"{rid}-{producer.plan.stage}"
    engine.add_request(engine_id, current, _producer_params(pipeline, producer, sampling, got))
    cutter = WindowCutter(producer.plan.stream)
    pacer = Pacer(producer.plan.stream)
    chunks: list[torch.Tensor] = []
    finished = False
    begun = time.perf_counter()
    try:
        while not finished:
            for out in engine.step():
                if out.request_id != engine_id:
                    continue
                finished = out.finished
                published = stage_payload(out)
                if finished:
                    pipeline._record(result, producer, out)
                    result.seconds[producer.plan.stage] = time.perf_counter() - begun
                if not published or (not finished and pacer.wait_s(cutter.sent)):
                    continue  # nothing new, or the caller has audio enough: the frames gather
                source = stage_result(producer, rid, out, prompt, got, published)
                for window in cutter.take(frames_of(source), finished):
                    next_prompt, carried, trim = window_request(pipeline, producer, source, window, function)
                    params = pipeline._params(consumer, sampling, carried.handle)
                    pipeline.stream_windows += 1
                    decoding = time.perf_counter()
                    try:
                        (decoded,) = consumer.engine.generate([next_prompt], [params], use_tqdm=False)
                    except BaseException:
                        _drop(carried.handle)
                        raise
                    spent = time.perf_counter() - decoding
                    result.seconds[consumer.plan.stage] = result.seconds.get(consumer.plan.stage, 0.0) + spent
                    pipeline.stage_seconds[consumer.plan.stage] += spent
                    chunk = chunk_of(consumer, decoded, rid, window, trim, started)
                    pacer.heard()
                    chunks.append(chunk.samples)
                    yield chunk
            if not finished and not engine.has_unfinished_requests():
                raise PipelineError(f"stage {producer.plan.stage!r}: request {rid!r} did not finish")
    finally:
        if not finished:
            with contextlib.suppress(Exception):
                engine.abort_request([engine_id])
        _drop(got.handle)
    _finish(result, consumer, chunks, started)
    yield result
