"""omnigen.runtime.transport: round trips, handles, release, errors, and shared memory across
processes (no segment left, nothing said by Python's resource_tracker)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest
import torch

from omnigen.runtime import transport as transport_mod
from omnigen.runtime.serialization import serialize_additional_information
from omnigen.runtime.transport import (
    HANDLE_VERSION,
    TRANSPORT_KEY,
    InlineTransport,
    ShmTransport,
    Transport,
    TransportError,
    is_handle,
    transport_for,
    transport_for_handle,
)

ROOT = Path(__file__).resolve().parents[2]
KINDS = ["inline", "shm"]


@pytest.fixture(params=KINDS)
def transport(request):
    t = transport_for(request.param)
    yield t
    t.close()


def _segments(pid: int) -> list[str]:
    return sorted(glob.glob(f"/dev/shm/omnigen-{pid}-*"))


@pytest.fixture(autouse=True)
def _no_segment_left_by_this_process():
    before = _segments(os.getpid())
    yield
    assert _segments(os.getpid()) == before


def _nested_payload() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "codes": {
            "audio": torch.randint(0, 4096, (7, 16), generator=g, dtype=torch.int64),
            "empty": torch.empty(0, dtype=torch.int64),
        },
        "hidden_states": {
            "output": torch.randn(5, 32, generator=g).to(torch.bfloat16),
            "layers": {0: torch.randn(3, 4, generator=g), 24: torch.zeros(2, 0, 3)},
        },
        "mask": torch.rand(4, 6, generator=g) > 0.5,
        "empty_bool": torch.empty(0, 2, dtype=torch.bool),
        "scalar": torch.tensor(3.5),
        "strided": torch.arange(24, dtype=torch.float32).reshape(4, 6).t(),
        "half": torch.randn(3, generator=g).to(torch.float16),
        "bytes_u8": torch.arange(10, dtype=torch.uint8),
        "meta": {"text": "héllo", "ids": [1, 2, 3], "pair": (4, "x"), "none": None, "flag": True, "f": 0.25},
        "list_of_tensors": [torch.ones(2, dtype=torch.int64), torch.zeros(1, 1)],
    }


def _assert_same(got, want, path="payload"):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert got.device.type == "cpu", path
        assert got.dtype == want.dtype and got.shape == want.shape, (path, got.dtype, got.shape)
        assert torch.equal(got, want), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (path, got.keys(), want.keys())
        for key in want:
            _assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_same(a, b, f"{path}[{i}]")
    else:
        assert got == want and type(got) is type(want), (path, got, want)


# -- round trips --------------------------------------------------------------------------------


def test_round_trip_nested_payload_of_many_dtypes_and_shapes(transport):
    payload = _nested_payload()
    handle = transport.put("req-1", payload)
    got = transport.get(handle)
    _assert_same(got, payload)
    # owned tensors: writable and independent of the transport
    got["codes"]["audio"][0, 0] = -1
    assert payload["codes"]["audio"][0, 0] != -1
    transport.release(handle)


def test_empty_payload_round_trips(transport):
    handle = transport.put("req-empty", {})
    assert transport.get(handle) == {}
    transport.release(handle)


def test_both_transports_carry_the_serialization_envelope():
    payload = {"codes": {"audio": torch.arange(6).reshape(2, 3)}}
    envelope = msgspec.msgpack.decode(InlineTransport().put("r", payload)["envelope"])
    assert envelope == serialize_additional_information(payload)
    shm = ShmTransport()
    handle = shm.put("r", payload)
    try:
        raw = Path(f"/dev/shm/{handle['name']}").read_bytes()
        assert msgspec.msgpack.decode(raw) == envelope
    finally:
        shm.close()


def test_a_payload_that_is_no_dict_is_refused(transport):
    with pytest.raises(TypeError, match="dict"):
        transport.put("r", [torch.zeros(1)])
    with pytest.raises(TypeError, match="non-empty str"):
        transport.put("", {})


# -- handles ------------------------------------------------------------------------------------


def test_handles_are_small_msgpack_safe_dicts_of_str_int_bytes(transport):
    payload = {"hidden": torch.randn(256, 1024), "ids": torch.arange(4)}  # 1 MiB of float32
    handle = transport.put("req-7", payload)
    assert is_handle(handle) and handle[TRANSPORT_KEY] == transport.name
    assert handle["version"] == HANDLE_VERSION and handle["key"] == "req-7"
    assert all(isinstance(k, str) for k in handle)
    assert all(type(v) in (str, int, bytes) for v in handle.values()), handle
    wire = msgspec.msgpack.encode(handle)
    decoded = msgspec.msgpack.decode(wire)
    assert decoded == handle
    _assert_same(transport.get(decoded), payload)  # a copy that travelled reads the same
    if transport.name == "shm":
        assert len(wire) < 128, len(wire)
        assert json.loads(json.dumps(handle)) == handle
    else:
        assert len(wire) > 1024 * 1024  # inline: the bytes are the handle
    transport.release(decoded)


def test_transport_for_names_the_choices():
    assert isinstance(transport_for("inline"), InlineTransport)
    shm = transport_for("shm")
    assert isinstance(shm, ShmTransport)
    shm.close()
    for t in (InlineTransport(), ShmTransport()):
        assert isinstance(t, Transport)
        t.close()
    with pytest.raises(ValueError, match=r"unknown transport 'nixl'; choose one of: inline, shm"):
        transport_for("nixl")


def test_transport_for_handle_reads_either_kind():
    producers = {name: transport_for(name) for name in KINDS}
    try:
        for name, producer in producers.items():
            handle = producer.put(f"req-{name}", {"x": torch.arange(3)})
            reader = transport_for_handle(msgspec.msgpack.decode(msgspec.msgpack.encode(handle)))
            assert reader.name == name
            assert torch.equal(reader.get(handle)["x"], torch.arange(3))
            reader.release(handle)
    finally:
        for producer in producers.values():
            producer.close()
    with pytest.raises(TransportError, match="not a transport handle"):
        transport_for_handle({"codes": 1})
    with pytest.raises(TransportError, match=r"request 'r9': unknown transport 'nccl'.*inline, shm, ray"):
        transport_for_handle({TRANSPORT_KEY: "nccl", "version": 1, "key": "r9"})


# -- release and errors -------------------------------------------------------------------------


def test_release_is_idempotent_and_get_after_release_is_an_error(transport):
    handle = transport.put("req-rel", {"x": torch.ones(3)})
    transport.release(handle)
    transport.release(handle)
    with pytest.raises(TransportError, match=r"request 'req-rel': its \w+ handle was released"):
        transport.get(handle)


def test_shm_a_released_segment_read_through_another_copy_of_its_handle():
    shm = ShmTransport()
    try:
        handle = shm.put("req-copy", {"x": torch.ones(3)})
        copy = msgspec.msgpack.decode(msgspec.msgpack.encode(handle))  # e.g. in another process
        shm.release(handle)
        assert not Path(f"/dev/shm/{handle['name']}").exists()
        with pytest.raises(
            TransportError, match=r"request 'req-copy': shared-memory segment 'omnigen-.*' does not"
        ):
            shm.get(copy)
        shm.release(copy)  # still idempotent
    finally:
        shm.close()


def test_a_handle_of_another_version_or_transport_names_the_key(transport):
    handle = transport.put("req-v", {"x": torch.ones(1)})
    stale = {**handle, "version": HANDLE_VERSION + 1}
    with pytest.raises(TransportError, match=rf"request 'req-v': .*format version {HANDLE_VERSION + 1}"):
        transport.get(stale)
    other = "shm" if transport.name == "inline" else "inline"
    with pytest.raises(
        TransportError, match=rf"request 'req-v': a '{transport.name}' handle given to the {other}"
    ):
        transport_for(other).get(handle)
    with pytest.raises(TransportError, match="not a transport handle"):
        transport.get({"codes": torch.ones(1)})
    transport.release(handle)


def test_shm_handles_naming_no_omnigen_segment_are_refused():
    shm = ShmTransport()
    base = {TRANSPORT_KEY: "shm", "version": HANDLE_VERSION, "key": "req-x", "size": 10}
    with pytest.raises(TransportError, match=r"request 'req-x': shm handle names no omnigen segment"):
        shm.get({**base, "name": "../etc/passwd"})
    with pytest.raises(TransportError, match=r"request 'req-x': shm handle has an invalid size"):
        shm.get({**base, "name": "omnigen-1-1", "size": 0})
    with pytest.raises(
        TransportError, match=r"request 'req-x': shared-memory segment 'omnigen-0-0' does not"
    ):
        shm.get({**base, "name": "omnigen-0-0"})
    shm.close()


@pytest.mark.parametrize("numel", [16, 64 * 1024], ids=["copied", "mapped"])
def test_shm_get_keeps_no_mapping_and_no_descriptor_open(numel):
    shm = ShmTransport()
    try:
        handle = shm.put("req-map", {"x": torch.randn(numel)})
        assert (handle["size"] >= transport_mod._MAP_FROM) == (numel > 16)
        fds = len(os.listdir("/proc/self/fd"))
        shm.get(handle)
        assert len(os.listdir("/proc/self/fd")) == fds
        assert handle["name"] not in Path("/proc/self/maps").read_text()
        shm.release(handle)
    finally:
        shm.close()


# -- the producer's bookkeeping -----------------------------------------------------------------


def test_shm_sweep_unlinks_what_no_consumer_released():
    shm = ShmTransport()
    consumer = ShmTransport()  # another reader: the producer does not learn of its releases
    try:
        handles = [shm.put(f"req-{i}", {"i": torch.tensor([i])}) for i in range(6)]
        shm.release(handles[0])
        consumer.release(handles[1])
        assert [k for k, _ in shm.outstanding()] == [f"req-{i}" for i in range(1, 6)]
        assert shm.sweep(["req-2", "req-nope"]) == ["req-2"]
        assert not Path(f"/dev/shm/{handles[2]['name']}").exists()
        assert shm.sweep() == ["req-3", "req-4", "req-5"]  # req-1 was gone already
        assert shm.outstanding() == [] and _segments(os.getpid()) == []
        assert shm.sweep() == []
    finally:
        consumer.close()
        shm.close()


def test_shm_close_sweeps_and_refuses_further_puts():
    shm = ShmTransport()
    names = [shm.put(f"r{i}", {"i": i})["name"] for i in range(3)]
    shm.close()
    shm.close()
    assert not any(Path(f"/dev/shm/{n}").exists() for n in names)
    with pytest.raises(TransportError, match="r9.*closed"):
        shm.put("r9", {})


def test_shm_a_collected_producer_sweeps_its_segments():
    shm = ShmTransport()
    name = shm.put("r", {"i": 1})["name"]
    del shm
    assert not Path(f"/dev/shm/{name}").exists()


def test_shm_producer_forgets_segments_consumers_released(monkeypatch):
    monkeypatch.setattr(transport_mod, "_PRUNE_AT", 8)
    shm = ShmTransport()
    consumer = ShmTransport()
    try:
        for i in range(7):
            consumer.release(shm.put(f"r{i}", {"i": i}))
        assert len(shm.outstanding()) == 7
        kept = shm.put("r7", {"i": 7})  # the 8th prunes the released ones
        assert shm.outstanding() == [("r7", kept["name"])]
    finally:
        consumer.close()
        shm.close()


# -- across processes ---------------------------------------------------------------------------

_WORKER = textwrap.dedent(
    r"""
    import os, sys
    import msgspec, torch
    from omnigen.runtime.transport import ShmTransport

    N, CONSUMED, PEEKED = 200, 150, 10

    def payload(i):
        return {"codes": {"audio": torch.arange(i, i + 64, dtype=torch.int64).reshape(4, 16)},
                "hidden": torch.full((3, 100), float(i)).to(torch.bfloat16),
                "meta": {"i": i, "tag": f"req-{i}"}}

    def consume(path):
        handles = msgspec.msgpack.decode(open(path, "rb").read())
        reader = ShmTransport()
        for i, handle in enumerate(handles[:CONSUMED]):
            got = reader.get(handle)
            want = payload(i)
            assert got["meta"] == want["meta"], (got["meta"], want["meta"])
            assert torch.equal(got["codes"]["audio"], want["codes"]["audio"])
            assert got["hidden"].dtype == torch.bfloat16 and torch.equal(got["hidden"], want["hidden"])
            reader.release(handle)
        for handle in handles[CONSUMED:CONSUMED + PEEKED]:  # read, then the request is aborted
            reader.get(handle)
        reader.close()
        print("consumed", CONSUMED, flush=True)

    def produce(path):
        producer = ShmTransport()
        handles = [producer.put(f"req-{i}", payload(i)) for i in range(N)]
        open(path, "wb").write(msgspec.msgpack.encode(handles))
        return producer, handles

    def remaining(pid):
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"omnigen-{pid}-"))

    if __name__ == "__main__":
        mode, path = sys.argv[1], sys.argv[2]
        if mode == "consumer":
            consume(path)
        elif mode == "producer":  # the consumer is an independent process the test starts
            producer, handles = produce(path)
            print("ready", os.getpid(), flush=True)
            sys.stdin.readline()
            swept = producer.sweep()
            producer.close()
            print("swept", len(swept), ",".join(swept), flush=True)
        elif mode == "spawn":  # the consumer is a multiprocessing spawn child: one shared tracker
            import multiprocessing as mp
            producer, handles = produce(path)
            print("pid", os.getpid(), flush=True)
            child = mp.get_context("spawn").Process(target=consume, args=(path,))
            child.start()
            child.join()
            assert child.exitcode == 0, child.exitcode
            left = remaining(os.getpid())
            assert len(left) == N - CONSUMED, len(left)
            swept = producer.sweep()
            producer.close()
            print("swept", len(swept), ",".join(swept), flush=True)
            print("left", len(remaining(os.getpid())), flush=True)
    """
)

_N, _CONSUMED = 200, 150
_ABORTED = [f"req-{i}" for i in range(_CONSUMED, _N)]


def _quiet(stderr: str, who: str) -> None:
    for word in ("resource_tracker", "leaked", "Traceback", "Warning", "KeyError"):
        assert word not in stderr, f"{who} printed on stderr:\n{stderr}"


@pytest.fixture
def worker(tmp_path):
    script = tmp_path / "shm_worker.py"
    script.write_text(_WORKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return script, tmp_path / "handles.msgpack", env


def test_shm_across_independent_processes_leaves_no_segment_and_no_tracker_noise(worker):
    script, handles_path, env = worker
    producer = subprocess.Popen(
        [sys.executable, str(script), "producer", str(handles_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        ready = producer.stdout.readline().split()
        assert ready[:1] == ["ready"], (ready, producer.stderr.read() if producer.poll() is not None else "")
        pid = int(ready[1])
        assert len(_segments(pid)) == _N
        consumer = subprocess.run(
            [sys.executable, str(script), "consumer", str(handles_path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert consumer.returncode == 0, consumer.stderr
        assert consumer.stdout.split() == ["consumed", str(_CONSUMED)]
        _quiet(consumer.stderr, "the consumer")
        # the consumer's exit (its own resource_tracker) removed nothing it only read
        assert len(_segments(pid)) == _N - _CONSUMED
        out, err = producer.communicate("sweep\n", timeout=120)
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()
    assert producer.returncode == 0, err
    _quiet(err, "the producer")
    assert out.split() == ["swept", str(_N - _CONSUMED), ",".join(_ABORTED)]
    assert _segments(pid) == []


def test_shm_with_a_spawned_consumer_sharing_the_tracker(worker):
    script, handles_path, env = worker
    run = subprocess.run(
        [sys.executable, str(script), "spawn", str(handles_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        cwd=script.parent,
    )
    assert run.returncode == 0, run.stderr
    # stderr is read to its end, which includes the shared tracker's shutdown report
    _quiet(run.stderr, "the producer, its spawned consumer or their resource_tracker")
    lines = run.stdout.splitlines()
    pid = int(lines.pop(0).removeprefix("pid "))
    assert _segments(pid) == []
    assert lines == [f"consumed {_CONSUMED}", f"swept {_N - _CONSUMED} {','.join(_ABORTED)}", "left 0"]
