"""Stage-to-stage payload transport (issue 8, item 2).

A producing stage ``put``s a request's payload (a nested dict of tensors, lists and scalars)
and gets back a small **handle**; the handle travels with the next stage's request (in
``SamplingParams.extra_args``, see ``omnigen.runtime.serialization.INLINE_PAYLOAD_KEY``); the
consuming stage ``get``s the payload from it and ``release``s it. Both transports move the same
bytes: the msgpack form of omnigen's payload envelope (``serialize_additional_information``).

Handles are plain dicts whose values are ``str``, ``int`` or ``bytes`` (msgpack-safe; a shm
handle has no bytes and is also JSON-safe)::

    {"omnigen_transport": "inline", "version": 1, "key": KEY, "envelope": b"..."}
    {"omnigen_transport": "shm", "version": 1, "key": KEY,
     "name": "omnigen-<pid>-<n>", "size": N}

``get`` and ``release`` need no producer state, so a consumer uses
``transport_for_handle(handle)`` (or ``transport_for(handle["omnigen_transport"])``).

Shared memory and Python 3.11's ``resource_tracker``: ``SharedMemory`` registers a segment with
the tracker on create *and* on attach (``track=False`` arrives in 3.13), ``SharedMemory.unlink``
unregisters it, and the tracker unlinks, with a warning, whatever is still registered when it shuts
down. So a consumer that attaches through ``SharedMemory`` has its tracker destroy segments it only
read when it exits, and a producer's tracker destroys the segments of requests still in flight when
the producer exits. Spawned children share their parent's tracker, whose registry is a set per type,
so registrations of one name from two processes do not pair up (a ``KeyError`` traceback on the
tracker's stderr). The usual fix, ``SharedMemory(create=True)`` followed by
``resource_tracker.unregister(shm._name, "shared_memory")``, works for the producer but still costs
two messages to the tracker process per segment (and starts that process), plus a mapping. Hence
segments are made with the primitives ``SharedMemory`` itself is built on (``_posixshmem``):

- ``put`` creates the segment with ``shm_open(O_CREAT | O_EXCL)`` and writes it with ``pwrite``;
- ``get`` opens it read-only and decodes it from a ``preadv`` copy (small) or a read-only mapping
  (large), closing the descriptor and the mapping before it returns: the payload owns copies;
- ``release`` and ``sweep`` call ``shm_unlink``.

No segment is ever registered with a resource tracker, in any process, so none is unlinked or
reported by one; ownership is the handle's (consumer) and the producer's sweep (aborts).

The producer tracks the segments it created; ``sweep()`` (and ``close()``, and a finalizer at
exit or collection, in the creating process only) unlinks those still present: the requests that
were aborted before a consumer released them. Keep the producer's transport alive while its
handles are in flight.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import weakref
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import msgspec

from omnigen.runtime.serialization import (
    _ENVELOPE,
    deserialize_additional_information,
    serialize_additional_information,
)

HANDLE_VERSION = 1
"""Format version of every handle and of the bytes a handle points at."""

TRANSPORT_KEY = "omnigen_transport"
"""The handle key naming its transport; it also tells a handle apart from a payload."""

SEGMENT_PREFIX = "omnigen-"
"""Shared-memory segment names: ``omnigen-<pid>-<n>`` (``/dev/shm/omnigen-...`` on Linux)."""

_RELEASED = "released"


class TransportError(RuntimeError):
    """A handle that cannot be read: released, missing, another version or another transport."""


@runtime_checkable
class Transport(Protocol):
    """Moves one request's payload from a producing stage to a consuming one."""

    name: str

    def put(self, key: str, payload: dict) -> dict:
        """Store ``payload`` for the request ``key``; returns its small, msgpack-safe handle."""
        ...

    def get(self, handle: dict) -> dict:
        """The payload a handle stands for; tensors come back as CPU tensors."""
        ...

    def release(self, handle: dict) -> None:
        """Free what the handle holds (idempotent); a later ``get`` is an error."""
        ...

    def close(self) -> None:
        """Free everything this transport still owns (idempotent)."""
        ...


# -- the bytes both transports carry ---------------------------------------------------------


def encode_payload(payload: dict) -> bytes:
    """The msgpack form of omnigen's envelope of ``payload``."""
    if not isinstance(payload, dict):
        raise TypeError(f"a transported payload is a dict, got {type(payload).__name__}")
    return msgspec.msgpack.encode(serialize_additional_information(payload))


def decode_payload(data: bytes | bytearray | memoryview, key: str) -> dict:
    """The payload of ``encode_payload``'s bytes (tensors as owned CPU tensors)."""
    return _open_envelope(_load_envelope(data, key), key)


def _load_envelope(data: bytes | bytearray | memoryview, key: str) -> Any:
    """msgpack-decode; the result owns its bytes (msgspec copies every bin value out of ``data``)."""
    try:
        return msgspec.msgpack.decode(data)
    except msgspec.DecodeError as exc:
        raise TransportError(f"payload of request {key!r}: not an omnigen envelope ({exc})") from exc


def _open_envelope(envelope: Any, key: str) -> dict:
    if not (isinstance(envelope, dict) and _ENVELOPE in envelope):
        raise TransportError(f"payload of request {key!r}: not an omnigen envelope")
    return deserialize_additional_information(envelope)


# -- handles ---------------------------------------------------------------------------------


def is_handle(value: Any) -> bool:
    """Whether ``value`` is a transport handle (rather than a payload or an envelope)."""
    return isinstance(value, dict) and TRANSPORT_KEY in value


def _check_handle(handle: Any, transport: str) -> str:
    """The handle's key, after checking it is a live handle of ``transport``'s version."""
    if not is_handle(handle):
        raise TransportError(f"{transport} transport: not a transport handle: {_describe(handle)}")
    key = handle.get("key")
    if handle[TRANSPORT_KEY] != transport:
        raise TransportError(
            f"request {key!r}: a {handle[TRANSPORT_KEY]!r} handle given to the {transport} transport"
        )
    if handle.get("version") != HANDLE_VERSION:
        raise TransportError(
            f"request {key!r}: {transport} handle of format version {handle.get('version')!r}; this "
            f"omnigen reads version {HANDLE_VERSION} (producer and consumer run different omnigen versions)"
        )
    if handle.get(_RELEASED):
        raise TransportError(f"request {key!r}: its {transport} handle was released; the payload is gone")
    return key


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"dict with keys {sorted(map(str, value))[:8]}"
    return type(value).__name__


# -- inline ------------------------------------------------------------------------------------


class InlineTransport:
    """The handle carries the envelope's bytes: nothing is stored, nothing can leak."""

    name = "inline"

    def put(self, key: str, payload: dict) -> dict:
        _check_key(key)
        return {
            TRANSPORT_KEY: self.name,
            "version": HANDLE_VERSION,
            "key": key,
            "envelope": encode_payload(payload),
        }

    def get(self, handle: dict) -> dict:
        key = _check_handle(handle, self.name)
        return decode_payload(handle["envelope"], key)

    def release(self, handle: dict) -> None:
        """Drops the bytes from the handle (the caller's dict) and marks it released."""
        if is_handle(handle) and handle[TRANSPORT_KEY] == self.name:
            handle.pop("envelope", None)
            handle[_RELEASED] = 1

    def close(self) -> None:
        pass


# -- shared memory ---------------------------------------------------------------------------

_COUNTER = itertools.count()
_PRUNE_AT = 4096


def _posixshmem():
    try:
        import _posixshmem
    except ImportError as exc:  # Windows
        raise TransportError("the shm transport needs POSIX shared memory; use the inline transport") from exc
    return _posixshmem


def _shm_unlink(name: str) -> bool:
    """Unlink a segment without the resource tracker; False when it was already gone."""
    try:
        _posixshmem().shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


def _shm_exists(name: str) -> bool:
    try:
        fd = _posixshmem().shm_open("/" + name, os.O_RDONLY, 0o600)
    except FileNotFoundError:
        return False
    os.close(fd)
    return True


def _sweep_names(created: dict[str, str], lock: threading.Lock, owner_pid: int) -> list[str]:
    """Unlink every tracked segment still present; the keys of those that were."""
    if os.getpid() != owner_pid:  # a forked child must not free its parent's segments
        return []
    with lock:
        items = list(created.items())
        created.clear()
    return [key for name, key in items if _shm_unlink(name)]


class ShmTransport:
    """One POSIX shared-memory segment per ``put``; the consumer's ``release`` unlinks it."""

    name = "shm"

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._created: dict[str, str] = {}  # segment name -> request key, not yet known released
        self._prune_at = _PRUNE_AT
        self._closed = False
        self._finalizer = weakref.finalize(self, _sweep_names, self._created, self._lock, self._pid)

    # producer side

    def put(self, key: str, payload: dict) -> dict:
        _check_key(key)
        if self._closed:
            raise TransportError(f"request {key!r}: put on a closed shm transport")
        data = encode_payload(payload)
        name = self._create_segment(key, data)
        with self._lock:
            self._created[name] = key
            if len(self._created) >= self._prune_at:
                self._prune_locked()
        return {
            TRANSPORT_KEY: self.name,
            "version": HANDLE_VERSION,
            "key": key,
            "name": name,
            "size": len(data),
        }

    def _create_segment(self, key: str, data: bytes) -> str:
        """A new segment holding ``data``, created and written through its descriptor: nothing is
        mapped (a full /dev/shm is an ``ENOSPC`` here, not a SIGBUS on a mapped write) and nothing
        is registered with the resource tracker (see the module docstring)."""
        posixshmem = _posixshmem()
        while True:
            name = f"{SEGMENT_PREFIX}{os.getpid()}-{next(_COUNTER)}"
            try:
                fd = posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:  # left over by an earlier process with this pid
                continue
            break
        try:
            view = memoryview(data)
            done = 0
            while done < len(data):
                done += os.pwrite(fd, view[done:], done)
        except BaseException as exc:
            _shm_unlink(name)
            if isinstance(exc, OSError):
                raise TransportError(
                    f"request {key!r}: cannot store {len(data)} bytes in shared memory ({exc}); is /dev/shm full?"
                ) from exc
            raise
        finally:
            os.close(fd)
        return name

    def sweep(self, keys: Iterable[str] | None = None) -> list[str]:
        """Unlink this producer's segments that no consumer released (all of them, or those of
        ``keys``: aborted requests); returns the keys whose segments were still there."""
        if keys is None:
            return _sweep_names(self._created, self._lock, self._pid)
        if os.getpid() != self._pid:
            return []
        wanted = set(keys)
        with self._lock:
            items = [(name, key) for name, key in self._created.items() if key in wanted]
            for name, _ in items:
                del self._created[name]
        return [key for name, key in items if _shm_unlink(name)]

    def outstanding(self) -> list[tuple[str, str]]:
        """``(key, segment name)`` of the segments this producer created and has not seen
        released (a consumer in another process releases without telling the producer)."""
        with self._lock:
            return [(key, name) for name, key in self._created.items()]

    def _prune_locked(self) -> None:
        """Forget segments consumers have released, so a long-running producer's list stays short."""
        for name in [name for name in self._created if not _shm_exists(name)]:
            del self._created[name]
        self._prune_at = max(_PRUNE_AT, 2 * len(self._created))

    def close(self) -> None:
        """Sweep (every segment not released is unlinked); ``put`` is refused afterwards."""
        self._closed = True
        self._finalizer()

    # consumer side

    def get(self, handle: dict) -> dict:
        key = _check_handle(handle, self.name)
        name, size = handle.get("name"), handle.get("size")
        if not (isinstance(name, str) and name.startswith(SEGMENT_PREFIX) and "/" not in name):
            raise TransportError(f"request {key!r}: shm handle names no omnigen segment: {name!r}")
        if not (isinstance(size, int) and size > 0):
            raise TransportError(f"request {key!r}: shm handle has an invalid size {size!r}")
        return _open_envelope(_load_segment(name, size, key), key)

    def release(self, handle: dict) -> None:
        """Unlinks the segment (no error when it is gone already) and marks the handle released."""
        if not (is_handle(handle) and handle[TRANSPORT_KEY] == self.name):
            raise TransportError(f"shm transport: cannot release {_describe(handle)}")
        name = handle.get("name")
        if isinstance(name, str) and name.startswith(SEGMENT_PREFIX) and "/" not in name:
            _shm_unlink(name)
            if os.getpid() == self._pid:
                with self._lock:
                    self._created.pop(name, None)
        handle[_RELEASED] = 1


_MAP_FROM = 64 * 1024
"""Segments this large are decoded from a read-only mapping, smaller ones from a ``preadv`` copy
(8 MiB: about 1 ms mapped against 8 ms copied here; 1 KiB: 12 against 2 µs)."""


def _load_segment(name: str, size: int, key: str) -> Any:
    """The msgpack-decoded envelope in a segment's first ``size`` bytes. The descriptor, and the
    mapping of a large segment, are closed before returning: the envelope owns copies."""
    try:
        fd = _posixshmem().shm_open("/" + name, os.O_RDONLY, 0o600)
    except FileNotFoundError:
        raise TransportError(
            f"request {key!r}: shared-memory segment {name!r} does not exist (released already, or "
            "swept by its producer: aborted request or producer shut down)"
        ) from None
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            raise TransportError(
                f"request {key!r}: shared-memory segment {name!r} holds {actual} bytes, the handle says {size}"
            )
        if size >= _MAP_FROM:
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            try:
                with memoryview(mapping) as view:
                    return _load_envelope(view, key)
            finally:
                mapping.close()  # BufferError if anything still pointed into it
        data = bytearray(size)
        with memoryview(data) as view:
            done = 0
            while done < size:
                n = os.preadv(fd, [view[done:]], done)
                if n <= 0:
                    raise TransportError(
                        f"request {key!r}: shared-memory segment {name!r} ended at {done} bytes"
                    )
                done += n
        return _load_envelope(data, key)
    finally:
        os.close(fd)


def _check_key(key: Any) -> None:
    if not isinstance(key, str) or not key:
        raise TypeError(f"a transport key is a non-empty str (the request id), got {key!r}")


# -- choosing one ----------------------------------------------------------------------------

TRANSPORTS: dict[str, type | str] = {
    "inline": InlineTransport,
    "shm": ShmTransport,
    # Imported when first used: only serve.mode=ray imports Ray.
    "ray": "omnigen.serving.ray_transport.RayTransport",
}
"""The config names of the transports (``stages.<stage>.transport``)."""


def handle_bytes(handle: dict) -> int:
    """How many payload bytes a handle stands for (its envelope inline, its segment's size)."""
    if "envelope" in handle:
        return len(handle["envelope"])
    return int(handle.get("size", 0))


def transport_for(name: str) -> Transport:
    """A new transport for a config name (``inline``, ``shm`` or ``ray``)."""
    cls = TRANSPORTS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown transport {name!r}; choose one of: {', '.join(TRANSPORTS)}")
    if isinstance(cls, str):
        import importlib

        module, _, attr = cls.rpartition(".")
        cls = getattr(importlib.import_module(module), attr)
    return cls()


_READERS: dict[str, Transport] = {}


def transport_for_handle(handle: Any) -> Transport:
    """The transport that reads ``handle`` (consumer side: ``get`` and ``release`` need no
    producer state, so one shared instance per kind serves every handle)."""
    if not is_handle(handle):
        raise TransportError(f"not a transport handle: {_describe(handle)}")
    name = handle[TRANSPORT_KEY]
    if name not in TRANSPORTS:
        raise TransportError(
            f"request {handle.get('key')!r}: unknown transport {name!r} in handle; "
            f"this omnigen knows: {', '.join(TRANSPORTS)}"
        )
    reader = _READERS.get(name)
    if reader is None:
        reader = _READERS.setdefault(name, transport_for(name))
    return reader
