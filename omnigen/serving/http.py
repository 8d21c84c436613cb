"""``omnigen serve``: a whole pipeline behind an OpenAI-style HTTP API (FastAPI, run by uvicorn).

- ``POST /v1/audio/speech`` ``{"input": text, "voice"?, "language"?, "instructions"?,
  "task_type"?, "ref_audio"?, "ref_text"?, "seed"?, "max_tokens"?, "prompt_token_ids"?,
  "response_format": "wav"}``: the final audio stage's audio as ``audio/wav``. The model's
  request builder turns the text and options into the first stage's prompt and payload; an
  option the model does not have, an unknown voice or language, or an unknown field is a 4xx
  that names it (never ignored).
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
import concurrent.futures
import logging
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from omnigen.requests.base import RequestError, SpeechInput
from omnigen.serving.audio import wav_bytes
from omnigen.serving.pipeline import Pipeline, PipelineError, PipelineOutput
from omnigen.serving.settings import Settings, build_request, sampling_of

log = logging.getLogger("omnigen.serving")
DISCONNECT_POLL_S = 0.05


class SpeechRequest(BaseModel):
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
    speaker_embedding: list[float] | None = None
    """A precomputed speaker embedding to clone instead of ``ref_audio``."""
    non_streaming_mode: bool | None = None
    """The model's prompt layout (Qwen3-TTS: all text at prefill); not HTTP streaming."""
    response_format: str = "wav"
    seed: int | None = None
    max_tokens: int | None = Field(default=None, gt=0)
    """The first stage's token budget (vllm-omni: ``max_new_tokens``)."""
    max_new_tokens: int | None = Field(default=None, gt=0)
    prompt_token_ids: list[int] | None = None

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


def make_app(pipeline: Pipeline, settings: Settings) -> FastAPI:
    app = FastAPI(title=f"omnigen {settings.model}")
    final_audio = any(stage.final_output == "audio" for stage in pipeline.plan.stages)

    async def run(body: SpeechRequest, request: Request) -> PipelineOutput:
        if body.model not in (None, settings.model):
            raise HTTPException(404, f"this server serves {settings.model!r}, not {body.model!r}")
        if body.max_tokens is not None and body.max_new_tokens is not None:
            raise HTTPException(400, "max_tokens and max_new_tokens name the same budget: send one")
        try:
            built = build_request(settings, body.speech_input(), body.prompt_token_ids, from_network=True)
        except RequestError as exc:
            raise HTTPException(400, str(exc)) from exc
        budget = body.max_new_tokens or body.max_tokens or built.max_tokens
        sampling = sampling_of(settings, pipeline.plan, body.seed, budget, built.sampling)
        future = pipeline.submit(built.prompt, sampling, payload=built.payload)
        try:
            return await _unless_disconnected(future, request)
        except PipelineError as exc:
            raise HTTPException(500, str(exc)) from exc

    @app.post("/v1/audio/speech")
    async def speech(body: SpeechRequest, request: Request) -> Response:
        if body.response_format != "wav":
            raise HTTPException(400, f"response_format {body.response_format!r}: this server writes wav")
        if not final_audio:
            raise HTTPException(404, f"{settings.model} has no audio stage")
        out = await run(body, request)
        return Response(wav_bytes(out.audio, settings.sample_rate), media_type="audio/wav")

    @app.post("/v1/omnigen/generate")
    async def generate(body: SpeechRequest, request: Request) -> dict[str, Any]:
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
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": settings.model, "object": "model", "owned_by": "omnigen"}]}

    @app.get("/v1/omnigen/state")
    async def state() -> dict[str, Any]:
        future = pipeline.run(_stage_states(pipeline))
        return await asyncio.wrap_future(future)

    return app


async def _unless_disconnected(
    future: concurrent.futures.Future[PipelineOutput], request: Request
) -> PipelineOutput:
    """The pipeline's result, or the request cancelled (aborted in every stage) if the client leaves."""
    waiting = asyncio.wrap_future(future)
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
        if done:
            return waiting.result()
        if await request.is_disconnected():
            future.cancel()
            log.info("client went away: request aborted in every stage")
            raise HTTPException(499, "client disconnected")


async def _stage_states(pipeline: Pipeline) -> dict[str, Any]:
    return {
        stage.plan.stage: (await stage.engine.collective_rpc("omni_request_state"))[0]
        for stage in pipeline.stages
    }


def serve(pipeline: Pipeline, settings: Settings) -> None:
    """Run the server until interrupted.

    On SIGTERM uvicorn shuts the HTTP side down, then raises the signal again under the handler
    it found: inside ``with pipeline:`` that is the pipeline's, which shuts the engines down.
    """
    import uvicorn

    uvicorn.run(make_app(pipeline, settings), host=settings.host, port=settings.port, log_level="info")
