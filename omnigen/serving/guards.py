"""What stands between a caller and the pipeline: the API key, the body size, the request id,
and the number of requests running and waiting.

``Guard`` is an ASGI middleware (it sees every request, before FastAPI parses a body):

- ``Authorization: Bearer KEY`` on every route but ``/health`` when the server has a key; a
  missing or wrong key is a 401, compared in constant time; the key is never logged.
- a body over ``max_body_bytes`` is a 413, by its ``Content-Length`` or, without one, as soon
  as the bytes read exceed it;
- every response carries ``X-Request-Id`` (the id the server's logs and the pipeline use).

``Admission`` hands out pipeline slots: ``max_concurrent`` run, up to ``max_queued`` wait in
arrival order, and a request beyond that is refused at once (429 with ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("omnigen.serving")

OPEN_PATHS = frozenset({"/health"})
REQUEST_ID_HEADER = "x-request-id"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class Guard:
    def __init__(
        self,
        app: Any,
        *,
        api_key: str | None,
        max_body_bytes: int,
        on_response: Callable[[str, int, float], None] | None = None,
    ) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.on_response = on_response
        """Called with (path, status, seconds) as each response starts (the server's metrics)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        arrived = time.perf_counter()

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", []),
                    (REQUEST_ID_HEADER.encode(), request_id.encode()),
                ]
                if self.on_response is not None:
                    self.on_response(scope["path"], int(message["status"]), time.perf_counter() - arrived)
            await send(message)

        headers = {name.decode("latin-1").lower(): value for name, value in scope.get("headers", [])}
        if self._key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(headers):
            log.info(
                "request %s: %s %s refused: no valid API key", request_id, scope["method"], scope["path"]
            )
            await _answer(send_with_id, 401, "a valid API key is required: Authorization: Bearer KEY",
                          extra=[(b"www-authenticate", b"Bearer")])  # fmt: skip
            return
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await _answer(
                send_with_id, 413, f"the body is over {self.max_body_bytes} bytes (serve.max_body_bytes)"
            )
            return
        read = 0
        too_large = False
        answered = False
        refusal = f"the body is over {self.max_body_bytes} bytes (serve.max_body_bytes)"

        async def counted_receive() -> dict[str, Any]:
            nonlocal read, too_large
            if too_large:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.max_body_bytes:
                    # The app sees the client gone and stops reading; the caller gets the 413.
                    too_large = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            nonlocal answered
            if too_large:
                if message["type"] == "http.response.start" and not answered:
                    answered = True
                    await _answer(send_with_id, 413, refusal)
                return  # whatever the app answered to a body it never got whole
            await send_with_id(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not too_large:
                raise
        if too_large and not answered:
            await _answer(send_with_id, 413, refusal)

    def _authorized(self, headers: dict[str, bytes]) -> bool:
        scheme, _, token = headers.get("authorization", b"").partition(b" ")
        assert self._key is not None
        # compare_digest on bytes of any length: the time does not depend on where they differ.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)


async def _answer(send: Send, status: int, message: str, extra: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"detail": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Busy(Exception):
    """Every slot is taken and the queue is full."""


class Admission:
    """Pipeline slots: ``async with admission.slot():`` runs, waits its turn, or raises ``Busy``."""

    def __init__(self, max_concurrent: int, max_queued: int) -> None:
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.running = 0
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.running < self.max_concurrent and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise Busy
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # the releasing request counted this one as running
        except BaseException:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.done() and not waiter.cancelled():
                self.release()  # handed a slot while being cancelled: pass it on
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.pop(0)
            if not waiter.done():
                waiter.set_result(None)
                return  # the slot passes to the waiter: running stays the same
        self.running -= 1
