"""The Ray actor that hosts one stage engine in ``serve.mode=ray`` (``omnigen.serving.ray_stages``
is the driver's side).

A ``StageReplica`` builds its stage's engine as ``inproc`` mode builds one (``LLM`` with the engine
core in this process: the stage's generated worker, omnigen's scheduler; the actor's environment
has ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and omnigen's plugin). It is an async actor: every call
runs in the actor's event loop, while one thread of its own builds the engine, steps it and alone
touches it; calls hand that thread commands (add, abort, rpc, stop) and the thread hands each
request's outputs back to the loop. The engine is built in the background, so the actor is placed
(``ping``) before it is ready (``info``), and a restart by Ray (the process died) builds it again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
import types
from collections.abc import AsyncIterator
from typing import Any

from vllm.v1.engine.exceptions import EngineDeadError

from omnigen.runtime.serialization import INLINE_PAYLOAD_KEY
from omnigen.serving import ray_transport

log = logging.getLogger("omnigen.serving")


class _Outputs:
    """One request's outputs between the engine thread and the actor's loop, merged as
    ``AsyncLLM`` merges them when the reader is behind (vLLM's ``RequestOutput.add``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delta: bool) -> None:
        self.loop = loop
        self.delta = delta
        self.output: Any = None
        self.ready = asyncio.Event()

    def put(self, output: Any) -> None:  # in the loop
        if self.output is None or isinstance(output, BaseException):
            self.output = output
        elif not isinstance(self.output, BaseException):
            self.output.add(output, aggregate=self.delta)
        self.ready.set()

    async def get(self) -> Any:
        while self.output is None:
            await self.ready.wait()
            self.ready.clear()
        output, self.output = self.output, None
        if isinstance(output, BaseException):
            raise output
        return output


class StageReplica:
    """A Ray actor hosting one vLLM engine of a stage (an async actor: every call runs in its
    event loop, the engine in a thread of its own, which alone touches it)."""

    def __init__(self, stage: str, name: str, args: dict[str, Any], declared: Any) -> None:
        self.stage, self.name = stage, name
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._streams: dict[str, _Outputs] = {}
        self._engine: Any = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        # A restart (Ray's, after the process died) runs __init__ again: the engine is built anew.
        self._thread = threading.Thread(
            target=self._serve, args=(args, declared), name=f"omnigen-{stage}-engine", daemon=True
        )
        self._thread.start()

    async def ping(self) -> int:
        return os.getpid()

    async def info(self) -> dict[str, Any]:
        await self._until_ready()
        import ray

        config = self._engine.vllm_config
        return {
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            # What the driver reads (omnigen.serving.limits, the glue's hf_config); the whole
            # VllmConfig also holds the model's layers (gigabytes pickled).
            "vllm_config": types.SimpleNamespace(
                model_config=config.model_config, scheduler_config=config.scheduler_config
            ),
        }

    async def submit(self, prompt: Any, params: Any, request_id: str, refs: list[Any]) -> None:
        """Admit one request: its ``ray`` payload read and handed to the engine inline."""
        from vllm.sampling_params import RequestOutputKind

        await self._until_ready()
        if refs:
            handle = params.extra_args[INLINE_PAYLOAD_KEY]
            envelope = await ray_transport.read_envelope(refs[0], handle)
            params.extra_args = {**params.extra_args, INLINE_PAYLOAD_KEY: envelope}
            del refs[:]
        loop = asyncio.get_running_loop()
        stream = _Outputs(loop, getattr(params, "output_kind", None) == RequestOutputKind.DELTA)
        self._streams[request_id] = stream
        added: asyncio.Future[None] = loop.create_future()
        self._commands.put(("add", request_id, prompt, params, added))
        try:
            await added
        except BaseException:
            self._streams.pop(request_id, None)
            raise

    async def generate(self, prompt: Any, params: Any, request_id: str, every: bool) -> AsyncIterator[Any]:
        """``submit`` and ``outputs`` in one call (a request without a ``ray`` payload)."""
        await self.submit(prompt, params, request_id, [])
        async for output in self.outputs(request_id, every):
            yield output

    async def outputs(self, request_id: str, every: bool) -> AsyncIterator[Any]:
        """The request's outputs as they come (``every``), or only its final one."""
        stream = self._streams.get(request_id)
        if stream is None:
            raise RuntimeError(
                f"replica {self.name}: no request {request_id!r} was submitted (or it was aborted)"
            )
        try:
            while True:
                output = await stream.get()
                if output.finished:
                    yield output
                    return
                if every:
                    yield output
        finally:
            self._streams.pop(request_id, None)

    async def abort(self, request_ids: list[str]) -> None:
        self._commands.put(("abort", list(request_ids), None, None, None))
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(RuntimeError(f"replica {self.name}: request {rid!r} was aborted"))

    async def rpc(self, method: str, args: tuple = ()) -> list[Any]:
        await self._until_ready()
        done: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._commands.put(("rpc", method, args, None, done))
        return await done

    async def stop(self) -> None:
        if self._engine is None:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._commands.put(("stop", None, None, None, done))
        await done

    async def _until_ready(self) -> None:
        while not self._ready.is_set():
            await asyncio.sleep(0.05)
        if self._error is not None:
            raise RuntimeError(
                f"replica {self.name}: the engine did not start: {self._error}"
            ) from self._error

    # -- the engine thread -------------------------------------------------------------------

    def _serve(self, args: dict[str, Any], declared: Any) -> None:
        try:
            self._engine = _build_engine(args, declared)
        except BaseException as exc:
            log.exception("replica %s: the engine did not start", self.name)
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        engine = self._engine
        while True:
            idle = not engine.has_unfinished_requests()
            try:
                command = self._commands.get(timeout=None) if idle else self._commands.get_nowait()
            except queue.Empty:
                command = None
            while command is not None:
                if self._run_command(engine, command) == "stop":
                    return
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except BaseException:
                # The engine is gone: fail every request, then let the process die, so Ray
                # restarts the replica with a new engine (max_restarts).
                log.exception("replica %s: the engine failed a step", self.name)
                for stream in list(self._streams.values()):
                    stream.loop.call_soon_threadsafe(stream.put, EngineDeadError())
                time.sleep(1.0)
                os._exit(70)
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.loop.call_soon_threadsafe(stream.put, output)

    def _run_command(self, engine: Any, command: tuple[Any, ...]) -> str | None:
        kind, first, second, third, done = command
        result: Any = None
        try:
            if kind == "add":
                engine.add_request(first, second, third)
            elif kind == "abort":
                engine.abort_request(first, internal=False)
            elif kind == "rpc":
                result = engine.collective_rpc(first, args=tuple(second))
            elif kind == "stop":
                engine.engine_core.shutdown()
        except BaseException as exc:
            if done is not None:
                done.get_loop().call_soon_threadsafe(_settle, done, None, exc)
            elif kind != "abort":
                log.exception("replica %s: %s failed", self.name, kind)
            return None
        if done is not None:
            done.get_loop().call_soon_threadsafe(_settle, done, result, None)
        return "stop" if kind == "stop" else None


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _build_engine(args: dict[str, Any], declared: Any) -> Any:
    """The stage's engine, as ``inproc`` mode builds it (this actor's environment has
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and omnigen's plugin)."""
    from vllm import LLM

    from omnigen import models

    models.register_declared(declared)
    return LLM(**args).llm_engine
