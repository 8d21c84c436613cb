"""The server's slots, queue and refusals, deterministically: the real app (``make_app``) over a
pipeline whose requests finish only when the test says so."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import httpx
import pytest
import torch

from omnigen import api
from omnigen import pipeline as omnigen_pipeline
from omnigen.pipeline_commands import serve_overrides
from omnigen.serving.http import make_app
from omnigen.serving.limits import StageLimits
from omnigen.serving.pipeline import PipelineOutput
from omnigen.serving.settings import read_settings


class HeldPipeline:
    """Takes requests and holds each until ``release`` (the model's plan, no engines)."""

    def __init__(self, plan):
        self.plan = plan
        self.stages = []
        self.limits = [StageLimits("talker", False, 512, 128, 127)]
        self.payload_bytes = {}
        self.held: list[concurrent.futures.Future] = []
        self.submitted = 0
        self.lock = threading.Lock()

    def submit(self, prompt, sampling, request_id=None, payload=None):
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            self.held.append(future)
            self.submitted += 1
        return future

    def release_all(self):
        with self.lock:
            held, self.held = self.held, []
        for future in held:
            if not future.done():
                future.set_result(
                    PipelineOutput(request_id="r", audio=torch.zeros(160), seconds={"talker": 0.1})
                )


@pytest.fixture()
def app_and_pipeline():
    overrides = serve_overrides(
        "omnigen_tiny",
        ["serve.max_concurrent_requests=2", "serve.max_queued_requests=1", "serve.request_timeout_s=30"],
    )
    cfg = omnigen_pipeline.compose_config("omnigen_tiny", overrides)
    plan = api.served_model("omnigen_tiny", overrides)
    held = HeldPipeline(plan)
    return make_app(held, read_settings(cfg, plan)), held


def test_two_run_one_waits_the_rest_get_429_then_all_are_served(app_and_pipeline):
    app, held = app_and_pipeline

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            first = [
                asyncio.create_task(client.post("/v1/audio/speech", json={"input": f"r{i}"}))
                for i in range(3)
            ]
            while len(held.held) < 2:  # two run, the third waits for a slot
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            refused = await client.post("/v1/audio/speech", json={"input": "one too many"})
            assert app.app.state.admission.running == 2 and app.app.state.admission.queued == 1
            while not all(f.done() for f in first):
                held.release_all()  # the waiting one takes a freed slot, then finishes too
                await asyncio.sleep(0.02)
            return refused, [await f for f in first]

    refused, served = asyncio.run(scenario())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert "serve.max_concurrent_requests" in refused.json()["detail"]
    assert [r.status_code for r in served] == [200, 200, 200]
    assert held.submitted == 3  # the refused request never reached the pipeline


@pytest.mark.parametrize("field", [{"speed": 2.0}, {"stream": True}, {"response_format": "mp3"}])
def test_generate_refuses_the_audio_output_fields_it_would_ignore(app_and_pipeline, field):
    # /v1/omnigen/generate answers JSON: speed, stream or a format there would change nothing.
    app, held = app_and_pipeline

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            return await client.post("/v1/omnigen/generate", json={"input": "hi", **field})

    refused = asyncio.run(scenario())
    assert refused.status_code == 422
    (name,) = field
    assert refused.json()["detail"][0]["loc"] == ["body", name]
    assert held.submitted == 0
