"""``serve.mode=ray`` against what runs on one machine already, in one run (issue 38).

Measures: the ``ray`` transport's handoff cost per request and ``serve.mode=ray``'s requests/s.
Baseline: the ``inline`` and ``shm`` transports, and ``mp`` mode, in the same run.
Takes: about 4 minutes on 2 cores, about 2 with ``--short``.
Writes: ``benchmarks/results/ray.json`` (``--out``), and prints a table.

1. **Handoff cost per request** of the ``ray`` transport against ``inline`` and ``shm``, on one
   node, at each payload size (``--sizes``: 1 KiB, 1 MiB, 8 MiB; the payload of
   ``benchmarks/transport.py``: a float32 tensor of that many bytes and 16 int64 ids), one request
   at a time, median over ``--repeats`` batches, in microseconds:

   - ``local``: put + get + release in this process (``ray``: ``ray.put`` of the envelope, then
     ``ray.get`` and the decode), the transport alone;
   - ``to_replica``: what ``serve.mode=ray`` does per request: this process (the driver) puts the
     payload and calls a Ray actor on the same node with the handle (``ray``: the object's
     reference, as ``omnigen.serving.ray_stages`` passes it), the actor reads the payload into
     tensors and releases it, and the call returns. Every transport pays the same actor call.

2. **Requests per second** of the tiny pipeline (``omnigen_tiny``: talker -> code2wav, random
   weights, ``conf/serve/omnigen_tiny.yaml``) in ``ray`` mode (local Ray, one replica per stage
   with half a CPU, so Ray gives each engine one thread, the edge's payload through the ``ray``
   transport) against ``mp`` mode (an engine-core process per stage, the committed ``shm`` edge),
   at each ``--concurrency`` (8 and 32): C clients each send
   their next request when their last one has finished, ``--requests-per-client`` each. The
   pipelines start one after the other; the two modes take turns, the order flipping per repeat.

Reported as ratios (``ray / inline``, ``ray / shm``; ``ray / mp``) in ``--out`` (JSON: the machine,
the commit, the settings, every figure) and a printed table. The machine may be shared: compare the
ratios of one run (``load_average_*`` in the file say how busy it was).

    .venv/bin/python benchmarks/ray_transport.py            # about 4 minutes on 2 cores
    .venv/bin/python benchmarks/ray_transport.py --short    # a quick smoke run, about 2 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.real_tts import commit, machine  # noqa: E402
from benchmarks.transport import make_payload, parse_size  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "ray.json"
TRANSPORTS = ("inline", "shm", "ray")
MODES = ("mp", "ray")


# --------------------------------------------------------------------------- handoff


class Reader:
    """The consumer end in another process: reads a payload as a replica does, releases it."""

    async def read(self, handle: dict, refs: list) -> int:
        from omnigen.runtime import transport as transports
        from omnigen.runtime.serialization import deserialize_additional_information
        from omnigen.serving import ray_transport

        if refs:  # the ray transport: the object read into this process, as StageReplica.submit does
            payload = deserialize_additional_information(await ray_transport.read_envelope(refs[0], handle))
        else:
            reader = transports.transport_for_handle(handle)
            payload = reader.get(handle)
            reader.release(handle)
        return int(payload["hidden"].numel())


def local_cost(name: str, payload: dict, requests: int, repeats: int) -> float:
    """Seconds per request of put + get + release in this process (median of ``repeats``)."""
    from omnigen.runtime.transport import transport_for

    transport = transport_for(name)
    try:
        samples = []
        for r in range(-1, repeats):  # -1: a warm-up batch
            started = time.perf_counter()
            for i in range(requests):
                handle = transport.put(f"req-{r}-{i}", payload)
                transport.get(handle)
                transport.release(handle)
            if r >= 0:
                samples.append((time.perf_counter() - started) / requests)
        return statistics.median(samples)
    finally:
        transport.close()


def replica_cost(name: str, payload: dict, reader: Any, requests: int, repeats: int) -> float:
    """Seconds per request of put here, then a call to ``reader`` (an actor) that reads it."""
    import ray

    from omnigen.runtime.transport import transport_for

    transport = transport_for(name)
    size = int(payload["hidden"].numel())
    try:
        samples = []
        for r in range(-1, repeats):
            started = time.perf_counter()
            for i in range(requests):
                handle = transport.put(f"req-{r}-{i}", payload)
                refs = [transport.take(handle)] if name == "ray" else []
                if ray.get(reader.read.remote(handle, refs)) != size:
                    raise RuntimeError(f"{name}: the replica read another payload")
                del refs
            if r >= 0:
                samples.append((time.perf_counter() - started) / requests)
        return statistics.median(samples)
    finally:
        transport.close()


def handoff(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    import torch

    torch.set_num_threads(1)
    ray.init(address="local", num_cpus=1, include_dashboard=False, configure_logging=False)
    try:
        reader = ray.remote(num_cpus=0)(Reader).remote()
        ray.get(reader.__ray_ready__.remote())
        found: dict[str, Any] = {}
        for text in args.sizes:
            nbytes = parse_size(text)
            payload = make_payload(nbytes)
            requests = max(3, min(200, (32 * 1024**2) // max(nbytes, 1) // 4))
            if args.short:
                requests = max(3, requests // 4)
            row: dict[str, Any] = {"bytes": nbytes, "requests_per_repeat": requests}
            for where, cost in (("local", local_cost), ("to_replica", None)):
                figures = {}
                for name in TRANSPORTS:
                    if cost is None:
                        seconds = replica_cost(name, payload, reader, requests, args.repeats)
                    else:
                        seconds = cost(name, payload, requests, args.repeats)
                    figures[f"{name}_us"] = 1e6 * seconds
                figures["ray_over_inline"] = figures["ray_us"] / figures["inline_us"]
                figures["ray_over_shm"] = figures["ray_us"] / figures["shm_us"]
                row[where] = figures
            found[text] = row
            log(
                f"handoff {text}: "
                + ", ".join(f"{k} {v['ray_us']:.0f} µs ray" for k, v in row.items() if isinstance(v, dict))
            )
        return found
    finally:
        ray.shutdown()


# --------------------------------------------------------------------------- requests per second


def start(mode: str, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """``(pipeline, settings, plan)`` as ``omnigen run`` composes and starts them."""
    from omnigen import api
    from omnigen import pipeline as composer
    from omnigen.pipeline_commands import serve_overrides
    from omnigen.serving.pipeline import Pipeline
    from omnigen.serving.settings import read_settings

    extra = [
        f"serve.mode={mode}",
        f"serve.engine.max_num_seqs={max(args.concurrency)}",
        f"serve.max_tokens={args.max_tokens}",
    ]
    model_overrides = []
    if mode == "ray":
        # The edge through Ray's object store (what crosses nodes), each replica half a CPU.
        model_overrides = ["model.stages.talker.transport=ray"]
        extra += ["serve.ray.replica.num_cpus=0.5", "serve.ray.env_vars.VLLM_CPU_KVCACHE_SPACE=1"]
    overrides = serve_overrides("omnigen_tiny", [*extra, *model_overrides])
    cfg = composer.compose_config("omnigen_tiny", overrides)
    plan = api.served_model("omnigen_tiny", overrides)
    settings = read_settings(cfg, plan)
    pipe = Pipeline.from_model(
        plan,
        settings.stage_models,
        mode=mode,
        engine_kwargs=settings.engine_kwargs,
        ray=settings.ray,
    )
    return pipe, settings, plan


async def closed_loop(pipe: Any, requests: list[tuple[dict, dict]], concurrency: int, tag: str) -> float:
    """Every request through ``concurrency`` clients; the wall seconds."""
    waiting = list(enumerate(requests))

    async def client() -> None:
        while waiting:
            index, (prompt, sampling) = waiting.pop(0)
            out = await pipe.generate_async(prompt, sampling, f"{tag}-{index}")
            if out.audio is None or not out.audio.numel():
                raise RuntimeError(f"request {tag}-{index} gave no audio")

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - started


def requests_for(settings: Any, plan: Any, count: int, first_seed: int) -> list[tuple[dict, dict]]:
    from omnigen.serving.settings import prompt_of, sampling_of

    return [
        (prompt_of(settings, f"request {first_seed + i}", None), sampling_of(settings, plan, first_seed + i))
        for i in range(count)
    ]


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    walls: dict[tuple[str, int], list[float]] = {}
    counts: dict[tuple[str, int], int] = {}
    starts: dict[str, list[float]] = {mode: [] for mode in MODES}
    loads: list[float] = []
    for repeat in range(args.throughput_repeats):
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
            log(f"throughput: starting the tiny pipeline ({mode})")
            begun = time.perf_counter()
            pipe, settings, plan = start(mode, args)
            starts[mode].append(time.perf_counter() - begun)
            try:
                warm = requests_for(settings, plan, 4, 1)
                pipe.run(closed_loop(pipe, warm, 4, f"warm-{mode}")).result(args.timeout)
                for concurrency in args.concurrency:
                    count = concurrency * args.requests_per_client
                    batch = requests_for(settings, plan, count, 1000 * concurrency)
                    loads.append(os.getloadavg()[0])
                    tag = f"{mode}-c{concurrency}-r{repeat}"
                    wall = pipe.run(closed_loop(pipe, batch, concurrency, tag)).result(args.timeout)
                    walls.setdefault((mode, concurrency), []).append(wall)
                    counts[mode, concurrency] = counts.get((mode, concurrency), 0) + count
                    log(f"throughput {mode} c={concurrency}: {count} requests in {wall:.2f} s")
            finally:
                pipe.close()
    cells: dict[str, Any] = {}
    for concurrency in args.concurrency:
        cell = {
            mode: {
                "requests": counts[mode, concurrency],
                "wall_s": sum(walls[mode, concurrency]),
                "requests_per_s": counts[mode, concurrency] / sum(walls[mode, concurrency]),
            }
            for mode in MODES
        }
        cell["ray_over_mp"] = cell["ray"]["requests_per_s"] / cell["mp"]["requests_per_s"]
        cells[str(concurrency)] = cell
    return {"cells": cells, "start_s": starts, "load_average_1m": loads}


# --------------------------------------------------------------------------- report


def log(message: str) -> None:
    print(f"[ray_transport] {message}", file=sys.stderr, flush=True)


def table(report: dict[str, Any]) -> str:
    lines = [
        "handoff per request, µs (one node):",
        f"{'payload':<8}{'where':<12}{'inline':>10}{'shm':>10}{'ray':>10}{'ray/inline':>12}{'ray/shm':>9}",
    ]
    for text, row in report["handoff"].items():
        for where in ("local", "to_replica"):
            f = row[where]
            lines.append(
                f"{text:<8}{where:<12}{f['inline_us']:>10.1f}{f['shm_us']:>10.1f}{f['ray_us']:>10.1f}"
                f"{f['ray_over_inline']:>12.2f}{f['ray_over_shm']:>9.2f}"
            )
    lines.append("tiny pipeline, requests/s:")
    lines.append(f"{'c':>4}{'mp':>10}{'ray':>10}{'ray/mp':>9}")
    for key, cell in report["throughput"]["cells"].items():
        lines.append(
            f"{key:>4}{cell['mp']['requests_per_s']:>10.2f}{cell['ray']['requests_per_s']:>10.2f}"
            f"{cell['ray_over_mp']:>9.2f}"
        )
    return "\n".join(lines)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", nargs="+", default=["1KiB", "1MiB", "8MiB"], help="payload sizes (default: %(default)s)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="handoff batches per figure (median) (default: %(default)s)"
    )
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[8, 32], help="clients in flight (default: %(default)s)"
    )
    parser.add_argument(
        "--requests-per-client",
        type=int,
        default=6,
        help="requests each client sends per cell (default: %(default)s)",
    )
    parser.add_argument(
        "--throughput-repeats",
        type=int,
        default=2,
        help="times each mode's pipeline is started and measured, the order flipped each time (default: %(default)s)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=12, help="the talker's tokens per request (default: %(default)s)"
    )
    parser.add_argument(
        "--timeout", type=float, default=600, help="seconds a cell may take (default: %(default)s)"
    )
    parser.add_argument(
        "--short",
        action="store_true",
        help="a quick run: 2 handoff repeats of fewer requests, 2 requests per client, each pipeline started once",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="the JSON results file (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    if args.short:
        args.repeats, args.requests_per_client, args.throughput_repeats = 2, 2, 1
    for name in ("repeats", "requests_per_client", "throughput_repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: {getattr(args, name)} must be at least 1")
    if any(c < 1 for c in args.concurrency):
        parser.error(f"--concurrency: {args.concurrency}: every value must be at least 1")
    if not 2 <= args.max_tokens <= 32:
        parser.error(f"--max-tokens: {args.max_tokens}: the tiny code2wav's 128-token context takes 2..32")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: vLLM's CPU default takes minutes
    os.environ.setdefault("VLLM_PLUGINS", "omnigen")  # vllm-omni's plugin would patch vLLM here
    os.environ.setdefault("PYTHONPATH", str(ROOT))  # Ray's workers import omnigen from this checkout
    report: dict[str, Any] = {
        "benchmark": "ray_transport",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        **commit(),
        "settings": {**vars(args), "out": str(args.out)},
    }
    begun = time.perf_counter()
    report["handoff"] = handoff(args)
    report["throughput"] = throughput(args)
    report["seconds"] = time.perf_counter() - begun
    report["load_average_at_end"] = os.getloadavg()
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"written to {args.out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
