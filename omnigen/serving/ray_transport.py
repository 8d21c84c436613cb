"""The ``ray`` transport: a stage's payload as an object in Ray's object store (``serve.mode=ray``).

The producer side (the pipeline's driver, which runs each edge's glue) ``put``s the msgpack
envelope every transport carries (``omnigen.runtime.transport.encode_payload``) into Ray's object
store and gets a small handle; the ``ObjectRef`` itself stays in this process's table, keyed by
the object's id::

    {"omnigen_transport": "ray", "version": 1, "key": KEY, "object_id": HEX, "size": N}

The handle rides in the next request's ``SamplingParams.extra_args`` like the others. When the
driver sends that request to a replica of the consumer stage (``omnigen.serving.ray_stages``),
it ``take``s the reference out of its table and passes it with the call; the replica reads the
object (Ray moves it to the replica's node: shared memory on one node, the network across nodes)
and hands its engine the envelope inline. The object is freed when the last reference goes: the
driver gave its own away, and the replica's call returns as soon as the request is admitted
(before it runs), so a payload lives until its consumer has read it, not until its request ends.

A handle that never reaches a consumer (its request failed or was aborted first) is ``release``d
by the driver, which drops the reference; ``close`` drops every reference this producer still
holds. Nothing here imports Ray before a payload is put.
"""

from __future__ import annotations

import threading
from typing import Any

from omnigen.runtime.serialization import _ENVELOPE
from omnigen.runtime.transport import (
    _RELEASED,
    HANDLE_VERSION,
    TRANSPORT_KEY,
    TransportError,
    _check_handle,
    _check_key,
    _describe,
    decode_payload,
    encode_payload,
    is_handle,
)

NAME = "ray"

_REFS: dict[str, Any] = {}
"""Object id (hex) -> ``ObjectRef`` of every payload this process put and has not handed on."""
_LOCK = threading.Lock()


class RayTransport:
    """One object-store object per ``put``; see the module docstring."""

    name = NAME

    def __init__(self) -> None:
        self._mine: set[str] = set()
        self._closed = False

    def put(self, key: str, payload: dict) -> dict:
        import numpy as np
        import ray

        _check_key(key)
        if self._closed:
            raise TransportError(f"request {key!r}: put on a closed ray transport")
        if not ray.is_initialized():
            raise TransportError(
                f"request {key!r}: the ray transport needs Ray (serve.mode=ray); in another mode "
                "set the edge's model.stages.STAGE.transport to inline or shm"
            )
        data = encode_payload(payload)
        # A uint8 array, not bytes: a reader on the same node gets a view of the store's memory.
        ref = ray.put(np.frombuffer(data, dtype=np.uint8))
        object_id = ref.hex()
        with _LOCK:
            _REFS[object_id] = ref
            self._mine.add(object_id)
        return {
            TRANSPORT_KEY: self.name,
            "version": HANDLE_VERSION,
            "key": key,
            "object_id": object_id,
            "size": len(data),
        }

    def take(self, handle: dict) -> Any:
        """The handle's ``ObjectRef``, out of this process's table: the caller passes it on (to
        the consumer's replica), and this process no longer keeps the object alive."""
        key = _check_handle(handle, self.name)
        with _LOCK:
            ref = _REFS.pop(str(handle.get("object_id")), None)
            self._mine.discard(str(handle.get("object_id")))
        if ref is None:
            raise TransportError(
                f"request {key!r}: this process holds no Ray object {handle.get('object_id')!r} "
                "(handed on already, released, or put by another process)"
            )
        handle[_RELEASED] = 1
        return ref

    def get(self, handle: dict) -> dict:
        """The payload, read in the process that put it (a consumer reads ``read_envelope``'s way)."""
        import ray

        key = _check_handle(handle, self.name)
        with _LOCK:
            ref = _REFS.get(str(handle.get("object_id")))
        if ref is None:
            raise TransportError(
                f"request {key!r}: this process holds no Ray object {handle.get('object_id')!r}; "
                "a ray handle is read by the consumer replica its reference was passed to"
            )
        return decode_payload(memoryview(ray.get(ref)), key)

    def release(self, handle: dict) -> None:
        """Drops this process's reference (the object goes when no one else holds one)."""
        if not (is_handle(handle) and handle[TRANSPORT_KEY] == self.name):
            raise TransportError(f"ray transport: cannot release {_describe(handle)}")
        object_id = str(handle.get("object_id"))
        with _LOCK:
            _REFS.pop(object_id, None)
            self._mine.discard(object_id)
        handle[_RELEASED] = 1

    def outstanding(self) -> list[str]:
        """Object ids this producer put that are neither handed on nor released."""
        with _LOCK:
            return sorted(self._mine)

    def close(self) -> None:
        """Drop every reference this producer still holds; ``put`` is refused afterwards."""
        self._closed = True
        with _LOCK:
            for object_id in self._mine:
                _REFS.pop(object_id, None)
            self._mine.clear()


def held() -> list[str]:
    """Object ids of every payload this process still holds a reference to (tests, leaks)."""
    with _LOCK:
        return sorted(_REFS)


async def read_envelope(ref: Any, handle: dict) -> Any:
    """In the consumer's replica: the msgpack-decoded envelope of a payload object (what an
    engine takes inline in ``extra_args``), read and checked against its handle."""
    import msgspec

    key = handle.get("key")
    data = await ref
    if len(data) != handle.get("size"):
        raise TransportError(
            f"request {key!r}: Ray object {handle.get('object_id')!r} holds {len(data)} bytes, the handle says {handle.get('size')}"
        )
    try:
        envelope = msgspec.msgpack.decode(memoryview(data))  # copies every bin value out of the store
    except msgspec.DecodeError as exc:
        raise TransportError(f"payload of request {key!r}: not an omnigen envelope ({exc})") from exc
    if not (isinstance(envelope, dict) and _ENVELOPE in envelope):
        raise TransportError(f"payload of request {key!r}: not an omnigen envelope")
    return envelope
