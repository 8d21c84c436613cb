"""``omnigen serve``: a whole pipeline behind an OpenAI-style HTTP API (FastAPI, run by uvicorn).

- ``POST /v1/audio/speech`` ``{"input": text, "seed"?, "max_tokens"?, "prompt_token_ids"?,
  "response_format": "wav"}``: the final audio stage's audio as ``audio/wav``.
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
from pydantic import BaseModel, Field

from omnigen.serving.audio import wav_bytes
from omnigen.serving.pipeline import Pipeline, PipelineError, PipelineOutput
from omnigen.serving.settings import Settings, SettingsError, prompt_of, sampling_of

log = logging.getLogger("omnigen.serving")
DISCONNECT_POLL_S = 0.05


class SpeechRequest(BaseModel):
    input: str | None = None
    model: str | None = None
    voice: str | None = None
    response_format: str = "wav"
    seed: int | None = None
    max_tokens: int | None = Field(default=None, gt=0)
    prompt_token_ids: list[int] | None = None


def make_app(pipeline: Pipeline, settings: Settings) -> FastAPI:
    app = FastAPI(title=f"omnigen {settings.model}")
    final_audio = any(stage.final_output == "audio" for stage in pipeline.plan.stages)

    async def run(body: SpeechRequest, request: Request) -> PipelineOutput:
        if body.model not in (None, settings.model):
            raise HTTPException(404, f"this server serves {settings.model!r}, not {body.model!r}")
        try:
            prompt = prompt_of(settings, body.input, body.prompt_token_ids)
        except SettingsError as exc:
            raise HTTPException(400, str(exc)) from exc
        future = pipeline.submit(prompt, sampling_of(settings, pipeline.plan, body.seed, body.max_tokens))
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
