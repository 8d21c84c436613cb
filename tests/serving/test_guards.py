"""The server's guard layer on its own: slots and queue, the key, the body size, the request id."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI, Request
from starlette.testclient import TestClient

from omnigen.serving.guards import Admission, Busy, Guard


def test_slots_run_then_queue_in_order_then_refuse():
    async def scenario() -> list[str]:
        admission = Admission(max_concurrent=2, max_queued=1)
        order: list[str] = []
        await admission.acquire()
        await admission.acquire()
        waiting = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0)
        assert (admission.running, admission.queued) == (2, 1)
        with pytest.raises(Busy):
            await admission.acquire()
        admission.release()  # the slot passes to the waiter
        await waiting
        order.append(f"running={admission.running} queued={admission.queued}")
        admission.release()
        admission.release()
        order.append(f"running={admission.running} queued={admission.queued}")
        return order

    assert asyncio.run(scenario()) == ["running=2 queued=0", "running=0 queued=0"]


def test_a_waiter_that_gives_up_frees_its_place_and_its_slot():
    async def scenario() -> tuple[int, int]:
        admission = Admission(max_concurrent=1, max_queued=2)
        await admission.acquire()
        gone = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        admission.release()
        return admission.running, admission.queued

    assert asyncio.run(scenario()) == (0, 0)


def _client(**guard):
    # (FastAPI reads the handlers' annotations from this module's globals.)
    app = FastAPI()
    seen: list[tuple[str, int]] = []

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body()), "id": request.state.request_id}

    wrapped = Guard(app, on_response=lambda path, status, _s: seen.append((path, status)), **guard)
    return TestClient(wrapped), seen


def test_the_key_guards_every_route_but_health():
    client, seen = _client(api_key="k3y", max_body_bytes=100)
    assert client.get("/health").status_code == 200
    assert client.post("/echo", content=b"x").status_code == 401
    assert client.post("/echo", content=b"x", headers={"authorization": "Bearer nope"}).status_code == 401
    assert client.post("/echo", content=b"x", headers={"authorization": "Basic k3y"}).status_code == 401
    ok = client.post("/echo", content=b"x", headers={"authorization": "Bearer k3y"})
    assert ok.status_code == 200 and ok.json()["id"] == ok.headers["x-request-id"]
    assert seen == [("/health", 200), ("/echo", 401), ("/echo", 401), ("/echo", 401), ("/echo", 200)]


def test_a_body_over_the_limit_is_refused_declared_or_streamed():
    client, _ = _client(api_key=None, max_body_bytes=10)
    assert client.post("/echo", content=b"x" * 10).json()["bytes"] == 10
    assert client.post("/echo", content=b"x" * 11).status_code == 413

    def chunks():
        yield b"x" * 8
        yield b"x" * 8

    assert client.post("/echo", content=chunks()).status_code == 413


def test_a_request_over_its_time_is_cancelled_and_answered_504():
    import concurrent.futures
    from types import SimpleNamespace

    from fastapi import HTTPException

    from omnigen.serving.http import _until_done

    class StaysConnected:
        state = SimpleNamespace(request_id="r1")

        async def is_disconnected(self) -> bool:
            return False

    future: concurrent.futures.Future = concurrent.futures.Future()
    with pytest.raises(HTTPException) as info:
        asyncio.run(_until_done(future, StaysConnected(), timeout_s=0.12))
    assert info.value.status_code == 504 and "serve.request_timeout_s" in info.value.detail
    assert future.cancelled()  # the pipeline aborts a cancelled request in every stage
