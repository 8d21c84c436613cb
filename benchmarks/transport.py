"""Handoff cost per request of omnigen's stage-to-stage transports (issue 8, item 2).

Measures: handoff cost per request (put + get + release, and with msgpack) of the stage transports.
Baseline: the inline and shm transports against each other, in the same process.
Takes: under a minute.
Writes: a table to stdout; no data file.

For each payload size, a payload ``{"hidden": float32 tensor of that many bytes, "ids": int64[16]}``
goes through ``put`` + ``get`` + ``release`` of the inline and the shm transport, one request at a
time, in one process. Reported per request, median of the repeats (each repeat times a batch of
requests), in microseconds:

- ``put+get+release``: the transport alone;
- ``+ wire``: the same plus one msgpack encode and decode of the handle, which is what vLLM's
  engine-core IPC does to ``SamplingParams.extra_args`` (the ZMQ copy between processes is not
  included; it scales with the handle's size, i.e. favours shm further).

    .venv/bin/python benchmarks/transport.py [--sizes 1KiB 1MiB 8MiB] [--repeats 7]

The MiB rows depend on glibc's allocator: by default every MiB-sized buffer is a fresh mapping,
and inline's four such buffers per request (tensor bytes, envelope, decoded bytes, tensor) fault
their pages in each time. With ``MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824``
freed memory is reused and inline is about four times faster, shm (whose extra cost is the kernel
allocating and freeing the segment's tmpfs pages) hardly changes: run both before concluding.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omnigen.runtime.transport import transport_for  # noqa: E402

UNITS = {"B": 1, "KiB": 1024, "KB": 1024, "MiB": 1024**2, "MB": 1024**2}


def parse_size(text: str) -> int:
    for unit in sorted(UNITS, key=len, reverse=True):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * UNITS[unit])
    return int(text)


def make_payload(nbytes: int) -> dict:
    return {"hidden": torch.randn(max(1, nbytes // 4)), "ids": torch.arange(16, dtype=torch.int64)}


def handoff_cost(name: str, payload: dict, *, wire: bool, requests: int, repeats: int) -> float:
    """Median over ``repeats`` of the seconds per request of put + get + release (+ the handle's
    msgpack round trip when ``wire``)."""
    transport = transport_for(name)
    encode, decode = msgspec.msgpack.encode, msgspec.msgpack.decode
    try:
        for i in range(2):  # warm up
            handle = transport.put(f"warm-{i}", payload)
            transport.get(handle)
            transport.release(handle)
        samples = []
        for r in range(repeats):
            start = time.perf_counter()
            for i in range(requests):
                handle = transport.put(f"req-{r}-{i}", payload)
                if wire:
                    handle = decode(encode(handle))
                transport.get(handle)
                transport.release(handle)
            samples.append((time.perf_counter() - start) / requests)
        return statistics.median(samples)
    finally:
        transport.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=["1KiB", "1MiB", "8MiB"])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    print("| payload | inline µs | shm µs | shm/inline | inline + wire µs | shm + wire µs | shm/inline |")
    print("|---|---|---|---|---|---|---|")
    for text in args.sizes:
        nbytes = parse_size(text)
        payload = make_payload(nbytes)
        requests = max(3, min(500, (64 * 1024**2) // max(nbytes, 1) // 4))
        row = {}
        for wire in (False, True):
            for name in ("inline", "shm"):
                row[name, wire] = 1e6 * handoff_cost(
                    name, payload, wire=wire, requests=requests, repeats=args.repeats
                )
        cells = []
        for wire in (False, True):
            inline, shm = row["inline", wire], row["shm", wire]
            cells += [f"{inline:.1f}", f"{shm:.1f}", f"{shm / inline:.2f}"]
        print(f"| {text} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
