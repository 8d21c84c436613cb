"""omnigen.runtime.transport: the behaviour mutmut's surviving transport mutants changed (issue 37).

What ``tests/serving/test_transport.py`` does not pin: which segments a handle may name (never
another program's, never a path), the segments' permissions, a leftover segment with the next
name, short and failing reads and writes (POSIX lets ``pwrite``/``preadv`` move fewer bytes; a
full /dev/shm fails the write), corrupt or mismatched segments, that one transport leaves the other
kind's handles alone, the producer's pruning schedule, ``transport_for("ray")``, the shared readers
of ``transport_for_handle``, ``handle_bytes``, and what the errors name (the request, the value
given, the fix). Every test leaves no /dev/shm entry behind (checked by an autouse fixture).
"""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from omnigen.runtime import transport as transport_mod
from omnigen.runtime.transport import (
    HANDLE_VERSION,
    TRANSPORT_KEY,
    InlineTransport,
    ShmTransport,
    TransportError,
    encode_payload,
    handle_bytes,
    transport_for,
    transport_for_handle,
)

SHM = Path("/dev/shm")


def _shm_entries() -> list[str]:
    # every entry a test here may create: this process's segments and the foreign names below
    pid = os.getpid()
    return sorted(
        n for n in os.listdir(SHM) if n.startswith(("omnigen-", f"foreign-{pid}")) and str(pid) in n
    )


@pytest.fixture(autouse=True)
def _nothing_left_in_dev_shm():
    before = _shm_entries()
    yield
    assert _shm_entries() == before


@pytest.fixture
def shm():
    t = ShmTransport()
    yield t
    t.close()


@pytest.fixture
def foreign_segment():
    """A segment of another program (no ``omnigen-`` name) holding a valid omnigen envelope."""
    path = SHM / f"foreign-{os.getpid()}"
    path.write_bytes(encode_payload({"secret": torch.arange(3)}))
    yield path
    path.unlink(missing_ok=True)


def _shm_handle(name: str, size: int = 10, key: str = "req-x") -> dict:
    return {TRANSPORT_KEY: "shm", "version": HANDLE_VERSION, "key": key, "name": name, "size": size}


def _payload() -> dict:
    return {"codes": torch.arange(40, dtype=torch.int64).reshape(4, 10), "meta": {"i": 7, "tag": "x"}}


def _assert_payload(got: dict) -> None:
    want = _payload()
    assert torch.equal(got["codes"], want["codes"]) and got["meta"] == want["meta"]


# -- which segments a handle may touch ------------------------------------------------------


def test_a_handle_naming_another_programs_segment_is_neither_read_nor_unlinked(shm, foreign_segment):
    handle = _shm_handle(foreign_segment.name, size=foreign_segment.stat().st_size)
    with pytest.raises(TransportError, match=r"request 'req-x': shm handle names no omnigen segment"):
        shm.get(handle)
    shm.release(handle)  # only marks the handle: the segment is not omnigen's to free
    assert foreign_segment.exists()


def test_a_handle_naming_a_path_is_neither_opened_nor_unlinked(shm):
    # a slash in the name would reach a file inside an omnigen-looking directory of /dev/shm;
    # shm_open refuses it (EINVAL, not a TransportError), and glibc 2.36's shm_unlink answers
    # ENOENT, but the transport must not depend on the C library for either
    folder = SHM / f"omnigen-dir-{os.getpid()}"
    folder.mkdir()
    try:
        victim = folder / "victim"
        victim.write_bytes(encode_payload({"x": 1}))
        handle = _shm_handle(f"{folder.name}/victim", size=victim.stat().st_size)
        with pytest.raises(TransportError, match=r"request 'req-x': shm handle names no omnigen segment"):
            shm.get(handle)
        shm.release(handle)
        assert victim.exists()
        assert handle["released"]
    finally:
        shutil.rmtree(folder)


def test_segments_are_readable_by_their_owner_only(shm):
    old = os.umask(0)  # so the mode the transport asks for is the mode the segment gets
    try:
        handle = shm.put("req-mode", {"x": torch.ones(2)})
    finally:
        os.umask(old)
    try:
        assert (SHM / handle["name"]).stat().st_mode & 0o777 == 0o600
    finally:
        shm.release(handle)


def test_a_leftover_segment_with_the_next_name_is_skipped_and_kept(shm, monkeypatch):
    # a segment an earlier process with this pid left behind: put takes the next name, and must
    # not unlink what it did not create
    start = 10**9
    monkeypatch.setattr(transport_mod, "_COUNTER", itertools.count(start))
    leftover = SHM / f"omnigen-{os.getpid()}-{start}"
    leftover.write_bytes(b"an earlier process's payload")
    try:
        handle = shm.put("req-next", _payload())
        assert handle["name"] == f"omnigen-{os.getpid()}-{start + 1}"
        _assert_payload(shm.get(handle))
        shm.release(handle)
        assert leftover.read_bytes() == b"an earlier process's payload"
    finally:
        leftover.unlink(missing_ok=True)


# -- short and failing I/O ------------------------------------------------------------------


def _guard(limit: int):
    calls = []

    def count() -> None:
        calls.append(1)
        assert len(calls) <= limit, f"{len(calls)} calls: the loop makes no progress"

    return count


def test_short_writes_store_every_byte(shm, monkeypatch):
    real = os.pwrite
    data_len = len(encode_payload(_payload()))
    count = _guard(data_len)

    def seven_bytes_at_a_time(fd, data, offset):
        count()
        return real(fd, memoryview(data)[:7], offset)

    monkeypatch.setattr(os, "pwrite", seven_bytes_at_a_time)
    handle = shm.put("req-short-write", _payload())
    monkeypatch.undo()
    assert handle["size"] == data_len
    _assert_payload(shm.get(handle))
    shm.release(handle)


def test_short_reads_load_every_byte(shm, monkeypatch):
    handle = shm.put("req-short-read", _payload())  # well under _MAP_FROM: the preadv path
    real = os.preadv
    count = _guard(handle["size"])

    def one_byte_at_a_time(fd, buffers, offset):
        count()
        return real(fd, [memoryview(buffers[0])[:1]], offset)

    monkeypatch.setattr(os, "preadv", one_byte_at_a_time)
    try:
        _assert_payload(shm.get(handle))
    finally:
        monkeypatch.undo()
        shm.release(handle)


def test_a_segment_that_shrinks_while_read_is_an_error_not_an_endless_read(shm, monkeypatch):
    handle = shm.put("req-shrunk", _payload())
    path = SHM / handle["name"]
    real = os.preadv
    count = _guard(8)

    def truncated_by_someone_else(fd, buffers, offset):
        count()
        if offset == 0:
            os.truncate(path, 5)  # after get's size check, before its read
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", truncated_by_someone_else)
    try:
        with pytest.raises(
            TransportError, match=rf"request 'req-shrunk': .*'{handle['name']}' ended at 5 bytes"
        ):
            shm.get(handle)
    finally:
        monkeypatch.undo()
        shm.release(handle)


def test_a_full_dev_shm_fails_the_put_names_the_request_and_leaves_no_segment(shm, monkeypatch):
    def no_space(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", no_space)
    size = len(encode_payload(_payload()))
    with pytest.raises(
        TransportError, match=rf"request 'req-full': cannot store {size} bytes.*/dev/shm full"
    ):
        shm.put("req-full", _payload())
    assert shm.outstanding() == []
    # the autouse fixture checks the half-made segment was unlinked


def test_without_posix_shared_memory_the_error_names_the_inline_transport(shm, monkeypatch):
    monkeypatch.setitem(sys.modules, "_posixshmem", None)  # what Windows has: the import fails
    with pytest.raises(TransportError, match="use the inline transport"):
        shm.put("req-win", {"x": 1})


# -- corrupt and mismatched payloads ----------------------------------------------------------


@pytest.mark.parametrize(
    "envelope",
    [b"\xc1\xc1", msgspec.msgpack.encode({"codes": 1}), msgspec.msgpack.encode([1, 2])],
    ids=["not-msgpack", "dict-without-envelope", "list"],
)
def test_an_inline_handle_with_bytes_that_are_no_envelope_names_its_request(envelope):
    handle = {TRANSPORT_KEY: "inline", "version": HANDLE_VERSION, "key": "req-bad", "envelope": envelope}
    with pytest.raises(TransportError, match=r"payload of request 'req-bad': not an omnigen envelope"):
        InlineTransport().get(handle)


@pytest.mark.parametrize(
    "content",
    [b"\xc1" * 16, b"\xc1" * transport_mod._MAP_FROM, msgspec.msgpack.encode({"codes": 1})],
    ids=["copied-not-msgpack", "mapped-not-msgpack", "dict-without-envelope"],
)
def test_a_segment_holding_no_envelope_names_its_request(shm, content):
    handle = shm.put("req-corrupt", {"x": 1})
    (SHM / handle["name"]).write_bytes(content)
    handle["size"] = len(content)
    try:
        with pytest.raises(
            TransportError, match=r"payload of request 'req-corrupt': not an omnigen envelope"
        ):
            shm.get(handle)
    finally:
        shm.release(handle)


def test_a_handle_claiming_more_bytes_than_its_segment_holds_is_refused(shm):
    handle = shm.put("req-size", _payload())
    actual = handle["size"]
    try:
        with pytest.raises(
            TransportError,
            match=rf"request 'req-size': .* holds {actual} bytes, the handle says {actual + 10}",
        ):
            shm.get({**handle, "size": actual + 10})
    finally:
        shm.release(handle)


# -- each transport releases its own handles only ---------------------------------------------


def test_the_inline_transport_leaves_other_handles_and_plain_dicts_alone(shm):
    handle = shm.put("req-shm", _payload())
    try:
        InlineTransport().release(handle)
        _assert_payload(shm.get(handle))  # still live: the shm segment is not the inline's to drop
        plain = {"codes": 1}
        InlineTransport().release(plain)
        assert plain == {"codes": 1}
    finally:
        shm.release(handle)


def test_a_released_inline_handle_no_longer_holds_the_payload_bytes():
    inline = InlineTransport()
    handle = inline.put("req-big", {"x": torch.zeros(1024)})
    inline.release(handle)
    assert "envelope" not in handle  # the caller's dict stops keeping the bytes alive
    assert handle_bytes(handle) == 0


def test_the_shm_transport_refuses_to_release_an_inline_handle_and_leaves_it_readable(shm):
    inline = InlineTransport()
    handle = inline.put("req-inline", _payload())
    with pytest.raises(TransportError, match=r"shm transport: cannot release dict with keys \['envelope'"):
        shm.release(handle)
    _assert_payload(inline.get(handle))
    with pytest.raises(TransportError, match=r"shm transport: cannot release dict with keys \['codes'\]"):
        shm.release({"codes": 1})


# -- what an error names -------------------------------------------------------------------------


def test_errors_describe_the_value_given_instead_of_a_handle_or_payload(shm):
    with pytest.raises(
        TransportError, match=r"inline transport: not a transport handle: dict with keys \['codes'\]"
    ):
        InlineTransport().get({"codes": 1})
    with pytest.raises(TransportError, match=r"^not a transport handle: dict with keys \['codes'\]"):
        transport_for_handle({"codes": 1})
    with pytest.raises(TransportError, match=r"not a transport handle: list$"):
        transport_for_handle([1, 2])
    with pytest.raises(TypeError, match=r"a transported payload is a dict, got list"):
        shm.put("r", [torch.zeros(1)])
    # a dict of many keys is described by its first eight, sorted: the message stays short
    with pytest.raises(TransportError) as info:
        transport_for_handle({f"k{i}": i for i in range(10)})
    assert "'k7'" in str(info.value) and "'k8'" not in str(info.value)


# -- the producer's pruning schedule ----------------------------------------------------------


def test_after_a_prune_the_next_comes_when_the_list_has_doubled(monkeypatch):
    # each prune opens every tracked segment: pruning on every put would cost O(n) per put
    monkeypatch.setattr(transport_mod, "_PRUNE_AT", 4)
    shm, consumer = ShmTransport(), ShmTransport()
    try:
        first = [shm.put(f"r{i}", {"i": i}) for i in range(4)]  # the 4th prunes: all still there
        for handle in first:
            consumer.release(handle)  # the producer does not learn of these
        for i in range(4, 7):
            shm.put(f"r{i}", {"i": i})
        assert len(shm.outstanding()) == 7  # no prune before the list reaches 2 * 4
        shm.put("r7", {"i": 7})
        assert [key for key, _ in shm.outstanding()] == ["r4", "r5", "r6", "r7"]
    finally:
        consumer.close()
        shm.close()


# -- choosing a transport -------------------------------------------------------------------


def test_transport_for_ray_builds_the_ray_transport_by_its_import_path():
    ray_transport = transport_for("ray")
    assert type(ray_transport).__name__ == "RayTransport" and ray_transport.name == "ray"
    assert type(ray_transport).__module__ == "omnigen.serving.ray_transport"


def test_a_transport_name_that_is_no_string_is_an_unknown_transport():
    # e.g. ``transport: [shm]`` in a config: the choices, not an "unhashable type" TypeError
    with pytest.raises(ValueError, match=r"unknown transport \['shm'\]; choose one of: inline, shm, ray"):
        transport_for(["shm"])


def test_transport_for_handle_gives_one_reader_per_kind(monkeypatch):
    monkeypatch.setattr(transport_mod, "_READERS", {})  # as in a fresh consumer process
    producers = {name: transport_for(name) for name in ("shm", "inline")}
    try:
        for name, producer in producers.items():
            handles = [producer.put(f"req-{name}-{i}", _payload()) for i in range(2)]
            readers = [transport_for_handle(handle) for handle in handles]
            assert readers[0] is readers[1] and readers[0].name == name
            for reader, handle in zip(readers, handles, strict=True):
                _assert_payload(reader.get(handle))
                reader.release(handle)
    finally:
        for producer in producers.values():
            producer.close()


# -- handle_bytes: what the pipeline counts as a payload's size --------------------------------


def test_handle_bytes_counts_the_envelope_inline_and_the_segment_size_in_shm(shm):
    inline_handle = InlineTransport().put("r", _payload())
    assert handle_bytes(inline_handle) == len(inline_handle["envelope"]) == len(encode_payload(_payload()))
    shm_handle = shm.put("r", _payload())
    try:
        assert handle_bytes(shm_handle) == shm_handle["size"] == len(encode_payload(_payload()))
    finally:
        shm.release(shm_handle)
    ray_handle = {TRANSPORT_KEY: "ray", "version": 1, "key": "r", "object_id": "00ff", "size": 123}
    assert handle_bytes(ray_handle) == 123
