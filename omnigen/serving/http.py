"""``omnigen serve``: a whole pipeline behind an OpenAI-style HTTP API (FastAPI, run by uvicorn).

- ``POST /v1/audio/speech`` ``{"input": text, "voice"?, "language"?, "instructions"?,
  "task_type"?, "ref_audio"?, "ref_text"?, "seed"?, "max_tokens"?, "prompt_token_ids"?,
  "response_format"?, "speed"?, "stream"?, "stream_format"?}``: the final audio stage's audio,
  whole (wav, pcm, flac, mp3, opus, aac) or as it is made (``stream: true`` / ``stream_format:
  "sse"``: ``speech.audio.delta`` events of base64 PCM16, then ``speech.audio.done``;
  ``stream_format: "audio"``: the raw pcm or wav body), ``omnigen.serving.streaming``. The model's
  request builder turns the text and options into the first stage's prompt and payload; an
  option the model does not have, an unknown voice or language, or an unknown field is a 4xx
  that names it (never ignored).
- ``POST /v1/chat/completions`` (a chat model, e.g. Qwen3-Omni) ``{"messages": [...],
  "modalities"?: ["text", "audio"], "audio"?: {"voice", "format": "wav"}, "max_tokens"?,
  "max_completion_tokens"?, "temperature"?, "top_p"?, "top_k"?, "seed"?, "stop"?,
  "presence_penalty"?, "frequency_penalty"?}``: OpenAI's chat completion, the thinker's text as the
  message content and the audio as ``message.audio.data`` (base64 WAV), as vllm-omni answers;
  ``modalities: ["text"]`` runs the first stage only. ``stream: true`` is refused until streaming
  lands. A speech model answers it 404; a chat model answers ``/v1/audio/speech`` 400.
- ``GET /v1/audio/voices``: the checkpoint's voices.
- ``POST /v1/omnigen/generate``: the same request; JSON with each text stage's text, the token
  ids of every stage and the audio's length (for a stage that publishes text).
- ``GET /health``, ``GET /v1/models``; ``GET /v1/omnigen/state``: each stage's per-request
  state (what a runner holds), for operators and tests.

A client that disconnects mid-request aborts the request in every stage: each request's
pipeline task runs in the pipeline's loop, and the handler cancels it when the connection goes.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from omnigen.requests.base import BuiltRequest, ChatInput, RequestError, SpeechInput
from omnigen.serving import audio_out, streaming
from omnigen.serving.audio import wav_bytes
from omnigen.serving.guards import Admission, Busy, Guard
from omnigen.serving.limits import check_request
from omnigen.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from omnigen.serving.metrics import ServerMetrics
from omnigen.serving.pipeline import Pipeline, PipelineError, PipelineOutput
from omnigen.serving.settings import Settings, build_chat_request, build_request, sampling_of

log = logging.getLogger("omnigen.serving")
DISCONNECT_POLL_S = 0.05


class GenerateRequest(BaseModel):
    """What a pipeline request says, for any route; ``POST /v1/omnigen/generate`` reads this alone
    (it answers JSON, so the audio-output fields of :class:`SpeechRequest` would be ignored there:
    they are refused as unknown instead)."""

    # A field this server does not know is refused (422 naming it), never dropped.
    model_config = ConfigDict(extra="forbid")

    input: str | None = None
    model: str | None = None
    voice: str | None = None
    """A voice of the checkpoint (``GET /v1/audio/voices``); ``default`` or none: the model's."""
    language: str | None = None
    instructions: str | None = None
    task_type: str | None = None
    ref_audio: str | None = None
    """Reference audio for voice cloning: a ``data:`` URI (base64) or a file path on the server."""
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None
    """Clone from the reference's speaker embedding alone (no ``ref_text``)."""
    speaker_embedding: list[Annotated[float, Field(allow_inf_nan=False)]] | None = Field(
        default=None, max_length=65536
    )
    """A precomputed speaker embedding to clone instead of ``ref_audio``."""
    non_streaming_mode: bool | None = None
    """The model's prompt layout (Qwen3-TTS: all text at prefill); not HTTP streaming."""
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    max_tokens: int | None = Field(default=None, gt=0, le=2**31 - 1)
    """The first stage's token budget (vllm-omni: ``max_new_tokens``)."""
    max_new_tokens: int | None = Field(default=None, gt=0, le=2**31 - 1)
    prompt_token_ids: list[StrictInt] | None = None
    """JSON integers only: ``true``, ``1.0`` or a string is refused (422), never read as a token id."""

    def speech_input(self) -> SpeechInput:
        return SpeechInput(
            input=self.input or "",
            voice=None if self.voice in (None, "", "default") else self.voice,
            language=self.language,
            instructions=self.instructions,
            task_type=self.task_type,
            ref_audio=self.ref_audio,
            ref_text=self.ref_text,
            x_vector_only_mode=self.x_vector_only_mode,
            speaker_embedding=None if self.speaker_embedding is None else tuple(self.speaker_embedding),
            non_streaming_mode=self.non_streaming_mode,
            max_new_tokens=self.max_new_tokens or self.max_tokens,
            seed=self.seed,
        )


class SpeechRequest(GenerateRequest):
    """``POST /v1/audio/speech``: a pipeline request and how its audio is answered."""

    response_format: str = "wav"
    """wav, pcm, flac, mp3, opus or aac (a stream: pcm or wav)."""
    speed: float = Field(default=1.0, allow_inf_nan=False)
    """0.25 to 4.0: the audio sped up or slowed down, pitch kept (FFmpeg's atempo)."""
    stream: bool = False
    """Answer ``text/event-stream`` events as the audio is made (``stream_format`` sse)."""
    stream_format: str | None = None
    """``sse``: events ``speech.audio.delta`` (base64 PCM16) then ``speech.audio.done``;
    ``audio``: the raw body (pcm, or wav with a streaming header) as it is made."""


class ChatAudio(BaseModel):
    """OpenAI's ``audio`` output parameters of a chat completion."""

    model_config = ConfigDict(extra="forbid")

    voice: str | None = None
    """A voice of the checkpoint (``GET /v1/audio/voices``); ``default`` or none: the model's."""
    format: str = "wav"


class ChatRequest(BaseModel):
    """OpenAI's chat completion request, the fields a chat model reads; any other is refused (422)."""

    model_config = ConfigDict(extra="forbid")

    messages: list[dict[str, Any]]
    """OpenAI chat messages; the request builder checks each (roles, content parts)."""
    model: str | None = None
    modalities: list[str] | None = None
    """What the answer carries: ``text``, ``audio``; none: every output of the model (as vllm-omni)."""
    audio: ChatAudio | None = None
    voice: str | None = None
    """vllm-omni's spelling of ``audio.voice``."""
    language: str | None = None
    stream: bool = False
    n: int = 1
    max_tokens: int | None = Field(default=None, gt=0, le=2**31 - 1)
    max_completion_tokens: int | None = Field(default=None, gt=0, le=2**31 - 1)
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)

    def sampling_fields(self) -> dict[str, Any]:
        """The first stage's ``SamplingParams`` fields this request sets (vllm-omni's chat
        serving overrides the first stage's defaults with them)."""
        found = {
            name: getattr(self, name)
            for name in ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty")
            if getattr(self, name) is not None
        }
        if self.stop is not None:
            found["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return found


CHAT_AUDIO_FORMATS = ("wav",)
AUDIO_EXPIRY_S = 24 * 3600
"""How long vllm-omni's answers say an audio stays valid (``expires_at``); nothing is stored here."""


class ServerState:
    """What the server knows of its pipeline's health."""

    def __init__(self) -> None:
        self.dead: dict[str, str] = {}
        """stage -> why its engine is dead (from then on the server answers 503 and exits)."""


def make_app(
    pipeline: Pipeline, settings: Settings, *, on_engine_death: Callable[[str, str], None] | None = None
) -> FastAPI:
    """The HTTP API over ``pipeline``; ``on_engine_death(stage, reason)`` is called once when a
    stage's engine is found dead (``serve`` then stops the server with a non-zero exit)."""
    metrics = ServerMetrics(pipeline)
    admission = Admission(settings.max_concurrent_requests, settings.max_queued_requests)
    health = ServerState()
    final_audio = any(stage.final_output == "audio" for stage in pipeline.plan.stages)
    # The stage whose text a chat completion answers with (Qwen3-Omni: the thinker).
    text_stage = next((stage.stage for stage in pipeline.plan.stages if stage.final_output == "text"), None)
    first_stage = pipeline.plan.stages[0].stage

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watchdog = asyncio.create_task(_watch_engines(pipeline, health, metrics, on_engine_death))
        try:
            yield
        finally:
            watchdog.cancel()

    app = FastAPI(title=f"omnigen {settings.model}", lifespan=lifespan)
    app.state.health = health
    app.state.admission = admission

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, exc: RequestValidationError) -> Response:
        # FastAPI's own answer echoes each bad value, which may not be JSON (a NaN, Infinity):
        # name the field and the rule only.
        detail = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        return Response(json.dumps({"detail": detail}), status_code=422, media_type="application/json")

    def dead_stage() -> HTTPException | None:
        _look_at_engines(pipeline, health, metrics, on_engine_death)
        if not health.dead:
            return None
        stage, reason = next(iter(health.dead.items()))
        return HTTPException(503, f"stage {stage!r}'s engine is dead ({reason}); the server is restarting")

    async def run(body: GenerateRequest, request: Request) -> PipelineOutput:
        arrived = time.perf_counter()
        built, sampling = checked(body)
        return await execute(built, sampling, request, arrived)

    def checked(body: GenerateRequest) -> tuple[BuiltRequest, dict[str, Any]]:
        """The request's first-stage prompt and payload and its per-stage sampling, checked
        against the whole pipeline (a 4xx naming the field otherwise)."""
        if body.model not in (None, settings.model):
            raise HTTPException(404, f"this server serves {settings.model!r}, not {body.model!r}")
        if body.max_tokens is not None and body.max_new_tokens is not None:
            raise HTTPException(400, "max_tokens and max_new_tokens name the same budget: send one")
        if (refusal := dead_stage()) is not None:
            raise refusal
        try:
            built = build_request(settings, body.speech_input(), body.prompt_token_ids, from_network=True)
            budget = body.max_new_tokens or body.max_tokens or built.max_tokens
            sampling = sampling_of(settings, pipeline.plan, body.seed, budget, built.sampling)
            check_request(pipeline.limits, pipeline.stages, built, sampling)
        except RequestError as exc:
            raise HTTPException(400, str(exc)) from exc
        return built, sampling

    async def execute(
        built: BuiltRequest,
        sampling: dict[str, Any],
        request: Request,
        arrived: float,
        last_stage: str | None = None,
    ) -> PipelineOutput:
        """Run a checked request through the pipeline (up to ``last_stage``) in a slot."""
        request_id = request.state.request_id
        try:
            await admission.acquire()
        except Busy:
            raise HTTPException(429, busy_message(), headers={"Retry-After": "1"}) from None
        metrics.queue_seconds.observe(time.perf_counter() - arrived)
        try:
            options = {"last_stage": last_stage} if last_stage is not None else {}
            future = pipeline.submit(
                built.prompt, sampling, request_id=request_id, payload=built.payload, **options
            )
            try:
                out = await _until_done(future, request, settings.request_timeout_s)
            except Exception as exc:
                if (refusal := refusal_for(exc)) is not None:
                    raise refusal from exc
                raise
        finally:
            admission.release()
        for stage, seconds in out.seconds.items():
            metrics.stage_seconds.labels(stage).observe(seconds)
        for stage, seconds in out.queued_seconds.items():
            metrics.stage_queue_seconds.labels(stage).observe(seconds)
        for stage, seconds in out.running_seconds.items():
            metrics.stage_run_seconds.labels(stage).observe(seconds)
        log.info("request %s: done in %.3f s", request_id, time.perf_counter() - arrived)
        return out

    @app.post("/v1/audio/speech")
    async def speech(body: SpeechRequest, request: Request) -> Response:
        stream_format = body.stream_format or ("sse" if body.stream else None)
        try:
            audio_out.check_request(body.response_format, body.speed, stream_format)
        except RequestError as exc:
            raise HTTPException(400, str(exc)) from exc
        if not final_audio:
            raise HTTPException(404, f"{settings.model} has no audio stage")
        arrived = time.perf_counter()
        if stream_format is not None:
            return await streamed_speech(body, stream_format, request, arrived)
        out = await run(body, request)
        metrics.first_audio_seconds.observe(time.perf_counter() - arrived)
        metrics.audio_seconds.inc(out.audio.numel() / settings.sample_rate)
        encoded = audio_out.encode(out.audio, settings.sample_rate, body.response_format, speed=body.speed)
        return Response(encoded.data, media_type=encoded.media_type)

    async def streamed_speech(
        body: SpeechRequest, stream_format: str, request: Request, arrived: float
    ) -> Response:
        """The audio as the pipeline makes it (``omnigen.serving.streaming``): the first window's
        audio is awaited here, so a request that fails before any audio still gets its status;
        a failure later ends an SSE stream with ``speech.audio.error`` (a raw body just ends)."""
        built, sampling = checked(body)
        request_id = request.state.request_id
        try:
            await admission.acquire()
        except Busy:
            raise HTTPException(429, busy_message(), headers={"Retry-After": "1"}) from None
        metrics.queue_seconds.observe(time.perf_counter() - arrived)
        writer = audio_out.open_stream(
            stream_format, body.response_format, settings.sample_rate, speed=body.speed
        )
        items = streaming.relay(
            pipeline,
            streaming.stream_async(pipeline, built.prompt, sampling, request_id, built.payload),
        )
        try:
            first = await _first_item(items, request, settings.request_timeout_s)
        except BaseException as exc:
            admission.release()
            await items.aclose()
            if isinstance(exc, Exception) and (refusal := refusal_for(exc)) is not None:
                raise refusal from exc
            raise
        metrics.first_audio_seconds.observe(time.perf_counter() - arrived)
        prompt_tokens = len(built.prompt.get("prompt_token_ids") or ())

        async def body_bytes() -> AsyncIterator[bytes]:
            deadline = arrived + settings.request_timeout_s
            try:
                item: Any = first
                while isinstance(item, streaming.AudioChunk):
                    metrics.audio_seconds.inc(item.samples.numel() / settings.sample_rate)
                    if data := writer.write(item.samples):
                        yield data
                    if time.perf_counter() > deadline:
                        raise TimeoutError(
                            f"the request ran over {settings.request_timeout_s:g} s (serve.request_timeout_s)"
                        )
                    item = await anext(items)
                produced = sum(len(ids) for ids in item.token_ids.values()) if item.token_ids else 0
                yield writer.finish(audio_out.SpeechUsage(prompt_tokens, produced))
                log.info("request %s: streamed in %.3f s", request_id, time.perf_counter() - arrived)
            except Exception as exc:  # headers are sent: say it in the stream, or end the body
                log.warning("request %s: stream failed: %s", request_id, exc)
                if stream_format == "sse":
                    yield audio_out.sse_error(str(exc))
            finally:
                admission.release()
                await items.aclose()

        return StreamingResponse(body_bytes(), media_type=writer.media_type)

    def refusal_for(exc: Exception) -> HTTPException | None:
        """The HTTP answer to a request the pipeline failed: 503 for a dead engine, 400 for input
        a stage refused, 500 for any other pipeline error; None: not the pipeline's (re-raised)."""
        if isinstance(exc, PipelineError):
            return dead_stage() or _input_error(exc) or HTTPException(500, str(exc))
        return dead_stage() or _dead_engine_error(exc) or _vllm_input_error(exc)

    def busy_message() -> str:
        return (
            f"{admission.running} requests are running and {admission.queued} waiting "
            "(serve.max_concurrent_requests, serve.max_queued_requests); retry later"
        )

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> dict[str, Any]:
        arrived = time.perf_counter()
        builder = settings.builder
        if builder is None or builder.api != "chat":
            takes = "POST /v1/audio/speech" if final_audio else "POST /v1/omnigen/generate"
            raise HTTPException(
                404, f"{settings.model} is not a chat model (it has no chat request builder): send {takes}"
            )
        if body.model not in (None, settings.model):
            raise HTTPException(404, f"this server serves {settings.model!r}, not {body.model!r}")
        if body.stream:
            raise HTTPException(
                400, "stream: streaming chat completions are not built yet; send stream: false (or omit it)"
            )
        if body.n != 1:
            raise HTTPException(400, f"n: {body.n}; this server answers one choice per request (n: 1)")
        outputs = [m for m, has in (("text", text_stage is not None), ("audio", final_audio)) if has]
        modalities = list(body.modalities) if body.modalities is not None else outputs
        unknown = [m for m in modalities if m not in outputs]
        if not modalities or unknown:
            what = f"{', '.join(map(repr, unknown))} is not" if unknown else "none is"
            raise HTTPException(
                400, f"modalities: {what} an output of {settings.model} (allowed: {', '.join(outputs)})"
            )
        if len(set(modalities)) != len(modalities):
            raise HTTPException(400, f"modalities: {modalities} names an output twice")
        wants_audio = "audio" in modalities
        if body.audio is not None and not wants_audio:
            raise HTTPException(400, 'audio: the audio parameters need "audio" in modalities')
        if body.audio is not None and body.audio.format not in CHAT_AUDIO_FORMATS:
            raise HTTPException(
                400,
                f"audio.format: {body.audio.format!r}; this server writes {', '.join(CHAT_AUDIO_FORMATS)}",
            )
        voices = [v for v in (body.audio.voice if body.audio else None, body.voice) if v is not None]
        if len(set(voices)) > 1:
            raise HTTPException(400, f"audio.voice {voices[0]!r} and voice {voices[1]!r} disagree: send one")
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise HTTPException(400, "max_tokens and max_completion_tokens name the same budget: send one")
        if (refusal := dead_stage()) is not None:
            raise refusal
        last_stage = None if wants_audio else text_stage
        chat_input = ChatInput(
            messages=tuple(body.messages),
            voice=voices[0] if voices else None,
            language=body.language,
            max_tokens=body.max_completion_tokens or body.max_tokens,
        )
        try:
            built = build_chat_request(settings, chat_input)
            sampling = sampling_of(
                settings,
                pipeline.plan,
                body.seed,
                built.max_tokens,
                {**built.sampling, **body.sampling_fields()},
                later_stages=built.stage_sampling,
                request_first_stage_only=True,
            )
            names = [stage.stage for stage in pipeline.plan.stages]
            ran = names.index(last_stage) + 1 if last_stage else len(names)
            check_request(
                pipeline.limits[:ran], pipeline.stages[:ran], built, sampling, prompt_field="messages"
            )
        except RequestError as exc:
            raise HTTPException(400, str(exc)) from exc
        out = await execute(built, sampling, request, arrived, last_stage)
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if "text" in modalities:
            message["content"] = out.text.get(text_stage, "")
        if wants_audio:
            metrics.first_audio_seconds.observe(time.perf_counter() - arrived)
            metrics.audio_seconds.inc(out.audio.numel() / settings.sample_rate)
            message["audio"] = {
                "id": f"audio-{out.request_id}",
                "data": base64.b64encode(wav_bytes(out.audio, settings.sample_rate)).decode("ascii"),
                "expires_at": int(time.time()) + AUDIO_EXPIRY_S,
                "transcript": "",
            }
        prompt_tokens = len(built.prompt.get("prompt_token_ids") or [])
        completion_tokens = len(out.token_ids.get(first_stage, []))
        return {
            "id": f"chatcmpl-{out.request_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": settings.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": out.finish_reasons.get(first_stage) or "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    @app.post("/v1/omnigen/generate")
    async def generate(body: GenerateRequest, request: Request) -> dict[str, Any]:
        out = await run(body, request)
        return {
            "request_id": out.request_id,
            "text": out.text,
            "token_ids": out.token_ids,
            "audio_samples": 0 if out.audio is None else int(out.audio.numel()),
            "sample_rate": settings.sample_rate,
            "seconds": out.seconds,
        }

    @app.get("/v1/audio/voices")
    async def voices() -> dict[str, Any]:
        builder = settings.builder
        return {
            "voices": sorted(builder.voices()) if builder else [],
            "default": builder.default_voice() if builder else None,
            "languages": builder.languages() if builder else [],
            "uploaded_voices": [],
        }

    @app.get("/health")
    async def health_route() -> Response:
        _look_at_engines(pipeline, health, metrics, on_engine_death)
        if health.dead:
            stage, reason = next(iter(health.dead.items()))
            body = {"status": "dead", "stage": stage, "reason": reason}
            return Response(json.dumps(body), status_code=503, media_type="application/json")
        return Response(json.dumps({"status": "ok"}), media_type="application/json")

    @app.get("/metrics")
    async def metrics_route() -> Response:
        metrics.running.set(admission.running)
        metrics.queued.set(admission.queued)
        return Response(metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": settings.model, "object": "model", "owned_by": "omnigen"}]}

    @app.get("/v1/omnigen/state")
    async def state() -> dict[str, Any]:
        future = pipeline.run(_stage_states(pipeline))
        return await asyncio.wrap_future(future)

    def answered(path: str, status: int, seconds: float) -> None:
        route = path if path in ROUTES else "other"
        metrics.requests.labels(route, str(status)).inc()
        metrics.request_seconds.labels(route).observe(seconds)

    return Guard(app, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes, on_response=answered)


ROUTES = frozenset(
    {"/v1/audio/speech", "/v1/chat/completions", "/v1/omnigen/generate", "/v1/audio/voices", "/health",
     "/metrics", "/v1/models", "/v1/omnigen/state", "/docs", "/openapi.json"}
)  # fmt: skip
ENGINE_WATCH_S = 0.5


async def _watch_engines(
    pipeline: Pipeline,
    health: ServerState,
    metrics: ServerMetrics,
    on_death: Callable[[str, str], None] | None,
) -> None:
    """Look at every stage's engine twice a second (``/health`` and each request look too)."""
    while True:
        _look_at_engines(pipeline, health, metrics, on_death)
        await asyncio.sleep(ENGINE_WATCH_S)


def _look_at_engines(
    pipeline: Pipeline,
    health: ServerState,
    metrics: ServerMetrics,
    on_death: Callable[[str, str], None] | None,
) -> None:
    """Record each stage whose engine is dead (once): 503 from then on, and ``on_death``."""
    for runtime in pipeline.stages:
        engine = runtime.engine
        stage = runtime.plan.stage
        if engine is None or stage in health.dead or not getattr(engine, "errored", False):
            continue
        reason = _reason(getattr(engine, "dead_error", None)) or "its engine core stopped"
        health.dead[stage] = reason
        metrics.engine_deaths.labels(stage).inc()
        log.error("stage %r: engine dead (%s); answering 503 from now on", stage, reason)
        if on_death is not None:
            on_death(stage, reason)


def _reason(error: Any) -> str:
    return " ".join(str(error).split())[:300] if error is not None else ""


def _dead_engine_error(exc: BaseException) -> HTTPException | None:
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(exc, EngineDeadError):
        return HTTPException(503, f"a stage's engine died while running the request ({_reason(exc)})")
    return None


def _vllm_input_error(exc: BaseException) -> HTTPException | None:
    """vLLM refused a stage's input in this process, before its engine saw it (its own checks)."""
    if type(exc).__name__ == "VLLMValidationError":
        return HTTPException(400, " ".join(str(exc).split()))
    return None


def _input_error(exc: PipelineError) -> HTTPException | None:
    """A stage refused its input before running it (vLLM's own checks): the caller's to fix."""
    cause = exc.__cause__
    if cause is not None and type(cause).__name__ == "VLLMValidationError":
        return HTTPException(400, str(exc))
    return None


async def _until_done(
    future: concurrent.futures.Future[PipelineOutput], request: Request, timeout_s: float
) -> PipelineOutput:
    """The pipeline's result; the request cancelled (aborted in every stage) if the client leaves
    or it runs past ``timeout_s``."""
    return await _watched(asyncio.wrap_future(future), future.cancel, request, timeout_s)


async def _first_item(items: AsyncIterator[Any], request: Request, timeout_s: float) -> Any:
    """A stream's first item, watched as ``_until_done`` watches a whole request."""
    waiting = asyncio.ensure_future(anext(items))
    return await _watched(waiting, waiting.cancel, request, timeout_s)


async def _watched(
    waiting: asyncio.Future[Any], cancel: Callable[[], Any], request: Request, timeout_s: float
) -> Any:
    deadline = time.perf_counter() + timeout_s
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
        if done:
            return waiting.result()
        if await request.is_disconnected():
            cancel()
            log.info("request %s: client went away: aborted in every stage", request.state.request_id)
            raise HTTPException(499, "client disconnected")
        if time.perf_counter() > deadline:
            cancel()
            log.info("request %s: over %.0f s: aborted in every stage", request.state.request_id, timeout_s)
            raise HTTPException(
                504, f"the request ran over {timeout_s:g} s (serve.request_timeout_s) and was aborted"
            )


async def _stage_states(pipeline: Pipeline) -> dict[str, Any]:
    return {
        stage.plan.stage: (await stage.engine.collective_rpc("omni_request_state"))[0]
        for stage in pipeline.stages
    }


ENGINE_DEATH_GRACE_S = 2.0
"""How long a server whose engine died keeps answering (503) before it stops."""
ENGINE_DEATH_EXIT = 70
"""``omnigen serve``'s exit status when a stage's engine died (EX_SOFTWARE): a supervisor
(systemd, Kubernetes) restarts the whole server, which starts every engine again."""


def serve(pipeline: Pipeline, settings: Settings) -> int:
    """Run the server until interrupted; returns the exit status (``ENGINE_DEATH_EXIT`` when a
    stage's engine died: in-flight requests got 503, then the server stopped).

    On SIGTERM uvicorn stops taking connections, lets in-flight requests finish (up to its
    graceful timeout), then raises the signal again under the handler it found: inside
    ``with pipeline:`` that is the pipeline's, which shuts the engines down.
    """
    import uvicorn

    exit_status = 0
    server: uvicorn.Server | None = None

    def on_engine_death(stage: str, reason: str) -> None:
        nonlocal exit_status
        exit_status = ENGINE_DEATH_EXIT
        if server is not None:
            # A moment for in-flight requests to get their 503, then stop.
            asyncio.get_running_loop().call_later(ENGINE_DEATH_GRACE_S, setattr, server, "should_exit", True)

    config = uvicorn.Config(
        make_app(pipeline, settings, on_engine_death=on_engine_death),
        host=settings.host,
        port=settings.port,
        log_level="info",
        timeout_graceful_shutdown=30,
    )
    server = uvicorn.Server(config)
    server.run()
    return exit_status
