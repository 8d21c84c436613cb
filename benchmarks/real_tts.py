"""Real Qwen3-TTS on CPU: omnigen's served pipeline against vllm-omni's runners chained by hand.

Measures: cold start and audio seconds per second of real Qwen3-TTS (tiny checkpoint) served by
  ``omnigen serve``.
Baseline: vllm-omni's runners chained by hand (its serving layer, two ``vllm.LLM`` engines).
Takes: about 4-6 minutes with the defaults.
Writes: ``benchmarks/results/real_tts.json`` (``--out``), and prints the medians and ratios.

Both sides serve the tiny real-shaped Qwen3-TTS CustomVoice checkpoint (``testing/checkpoints``:
one folder for both stages, safetensors weights) with the same engine arguments, requests and
seeds, in one run on this machine:

* ``omnigen``: ``omnigen serve`` (``mp``: an engine-core process per stage, requests over HTTP to
  ``POST /v1/audio/speech`` on a loopback port, WAV back);
* ``vllm-omni``: the oracle chain of ``tests/e2e/test_real_qwen3_tts.py`` in a process of its
  own: vllm-omni's speech serving layer builds each request, ``vllm.LLM`` runs the talker with
  vllm-omni's ``GPUARModelRunner`` and code2wav with its ``GPUGenerationModelRunner`` (both on
  vLLM's CPU runner, engine cores in that process), vllm-omni's glue between them
  (``talker2code2wav_full_payload`` through the runner, ``talker2code2wav_token_only``). It takes
  requests over a pipe (JSON lines) and answers with the audio.

Measured, per side and repeat (a fresh process each repeat; the sides alternate which goes first):

* cold start: process start until the first request's audio is back (engine start-up included);
* audio seconds per second at concurrency 1: ``--requests`` requests one after another;
* audio seconds per second at concurrency C (``--concurrency``, default 8): ``--requests-at-c``
  requests with C in flight (omnigen: C concurrent HTTP clients; vllm-omni: batches of C through
  ``LLM.generate``, talker batch then code2wav batch, as a user chains two engines by hand).

Medians over the repeats and the ratios omnigen / vllm-omni are printed and written to ``--out``
with the machine, the commit and the settings. Both sides run eager (``enforce_eager``) by
default: with vLLM's compilation omnigen's talker currently ignores its prompt embeddings (see
the test's ``COMPILED_TALKER_BUG``), so ``--compile`` measures a wrong computation on that side.
The machine may be shared: compare the ratios of one run, not figures across runs.

Threads: vLLM's CPU worker binds each engine of ``omnigen serve`` to one OpenMP thread on core 0
(``VLLM_CPU_OMP_THREADS_BIND=auto`` reserves core 1), so both of its stages share core 0; the
vllm-omni process runs one OpenMP thread (``OMP_NUM_THREADS=1``), unbound, both engines in it.

    .venv/bin/python benchmarks/real_tts.py                      # defaults: about 4-6 minutes here
    .venv/bin/python benchmarks/real_tts.py --repeats 2 --max-tokens 24 --requests 4 --requests-at-c 16
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SIDES = ("omnigen", "vllm-omni")
SAMPLE_RATE = 24000
# Texts in the tiny tokenizer's words; voices of the CustomVoice checkpoint.
TEXTS = (
    "hello world the quick brown fox jumps over the lazy dog",
    "good day to you and thank you",
    "this is my voice and it is a good one",
    "please say hello to the world",
)
VOICES = ("ryan", "dylan", "vivian")
LANGUAGES = ("English", "Auto")


def requests(cell: str, count: int, max_tokens: int, first_seed: int) -> list[dict[str, Any]]:
    """``count`` speech requests of a cell, each with its own seed (the same on both sides)."""
    return [
        {
            "id": f"{cell}-{i}",
            "input": TEXTS[i % len(TEXTS)],
            "voice": VOICES[i % len(VOICES)],
            "language": LANGUAGES[i % len(LANGUAGES)],
            "seed": first_seed + i,
            "max_tokens": max_tokens,
        }
        for i in range(count)
    ]


@dataclasses.dataclass
class Measure:
    cold_start_s: float
    c1: dict[str, float]
    """``wall_s``, ``audio_s``, ``audio_s_per_s``, ``requests``."""
    cc: dict[str, float]
    audio: dict[str, str] = dataclasses.field(default_factory=dict)
    """Each request's 16-bit audio, as ``samples:sha1`` (request id -> it), to compare the sides."""


def fingerprint(pcm: Any) -> str:
    import hashlib

    return f"{pcm.size}:{hashlib.sha1(pcm.tobytes()).hexdigest()[:16]}"


def rate(wall_s: float, samples: list[int]) -> dict[str, float]:
    audio_s = sum(samples) / SAMPLE_RATE
    return {"wall_s": wall_s, "audio_s": audio_s, "audio_s_per_s": audio_s / wall_s, "requests": len(samples)}


# --------------------------------------------------------------------------- omnigen serve


def run_omnigen(checkpoint: Path, settings: Any, args: argparse.Namespace, log: Path) -> Measure:
    import httpx

    from omnigen_testing import qwen3_tts_chain as rt

    port = rt.free_port()
    base = f"http://127.0.0.1:{port}"
    first = requests("cold", 1, args.max_tokens, 1)
    started = time.perf_counter()
    process = rt.start_serve(checkpoint, settings, port, log)
    try:
        deadline = time.monotonic() + args.timeout
        cold = None
        while cold is None:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"omnigen serve did not serve (exit {process.poll()}):\n{log.read_text()[-3000:]}"
                )
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    response = httpx.post(
                        f"{base}/v1/audio/speech", json=rt.speech_body(first[0]), timeout=120
                    )
                    response.raise_for_status()
                    cold = time.perf_counter() - started
                    continue
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        audio: dict[str, str] = {}

        async def one(client: httpx.AsyncClient, spec: dict[str, Any], gate: asyncio.Semaphore) -> int:
            async with gate:
                response = await client.post("/v1/audio/speech", json=rt.speech_body(spec))
                response.raise_for_status()
                pcm = rt.wav_samples(response.content)[0]
                audio[spec["id"]] = fingerprint(pcm)
                return int(pcm.size)

        async def cell(specs: list[dict[str, Any]], concurrency: int) -> dict[str, float]:
            gate = asyncio.Semaphore(concurrency)
            limits = httpx.Limits(max_connections=concurrency)
            async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
                t0 = time.perf_counter()
                samples = await asyncio.gather(*(one(client, spec, gate) for spec in specs))
                return rate(time.perf_counter() - t0, list(samples))

        c1 = asyncio.run(cell(requests("c1", args.requests, args.max_tokens, 1000), 1))
        cc = asyncio.run(cell(requests("cc", args.requests_at_c, args.max_tokens, 2000), args.concurrency))
        return Measure(cold, c1, cc, audio)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(180)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)


# --------------------------------------------------------------------------- vllm-omni by hand


def run_oracle(
    checkpoint: Path, settings: Any, args: argparse.Namespace, log: Path, scratch: Path
) -> Measure:
    from omnigen_testing import qwen3_tts_chain as rt

    started = time.perf_counter()
    process = rt.start_oracle(checkpoint, {"bench": settings}, log, scratch)
    assert process.stdin is not None and process.stdout is not None

    def ask(specs: list[dict[str, Any]], batch: bool) -> tuple[float, dict[str, Any]]:
        process.stdin.write(json.dumps({"requests": specs, "batch": batch}) + "\n")
        process.stdin.flush()
        t0 = time.perf_counter()
        while True:
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"the vllm-omni chain exited {process.poll()}:\n{log.read_text()[-3000:]}")
            reply = json.loads(line)
            if "results" in reply or "error" in reply:
                break
        if "error" in reply:
            raise RuntimeError(f"the vllm-omni chain failed: {reply['error']}\n{reply.get('traceback', '')}")
        return time.perf_counter() - t0, reply

    def samples(reply: dict[str, Any]) -> list[int]:
        return [len(base64.b64decode(r["audio"])) // 4 for r in reply["results"]]

    def keep(reply: dict[str, Any]) -> None:
        for result in reply["results"]:
            audio[result["id"]] = fingerprint(rt.pcm16(rt._unb64(result["audio"])))

    audio: dict[str, str] = {}

    try:
        ask(requests("cold", 1, args.max_tokens, 1), batch=False)
        cold = time.perf_counter() - started
        wall, reply = ask(requests("c1", args.requests, args.max_tokens, 1000), batch=False)  # one at a time
        c1 = rate(wall, samples(reply))
        keep(reply)
        specs = requests("cc", args.requests_at_c, args.max_tokens, 2000)
        wall, got = 0.0, []
        for i in range(0, len(specs), args.concurrency):  # batches of C through LLM.generate
            spent, reply = ask(specs[i : i + args.concurrency], batch=True)
            wall += spent
            got += samples(reply)
            keep(reply)
        cc = rate(wall, got)
        return Measure(cold, c1, cc, audio)
    finally:
        if process.poll() is None:
            process.stdin.write(json.dumps({"quit": True}) + "\n")
            process.stdin.close()
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)


# --------------------------------------------------------------------------- report


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_kib"] = int(line.split()[1])
    except OSError:
        pass
    try:
        import torch
        import vllm

        info["vllm"] = vllm.__version__
        info["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        info["vllm_omni"] = version("vllm-omni")
    except Exception:
        pass
    info["load_average_at_start"] = os.getloadavg()
    return info


def commit() -> dict[str, Any]:
    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else ""

    changed = [line[3:] for line in git("status", "--porcelain").splitlines() if line.strip()]
    return {"commit": git("rev-parse", "HEAD").strip(), "uncommitted_changes": changed}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(runs: dict[str, list[Measure]]) -> dict[str, Any]:
    rows: dict[str, dict[str, float]] = {}
    for side, measures in runs.items():
        rows[side] = {
            "cold_start_s": median([m.cold_start_s for m in measures]),
            "c1_audio_s_per_s": median([m.c1["audio_s_per_s"] for m in measures]),
            "cc_audio_s_per_s": median([m.cc["audio_s_per_s"] for m in measures]),
        }
    ours, theirs = rows.get("omnigen"), rows.get("vllm-omni")
    ratios = {}
    if ours and theirs:
        ratios = {key: ours[key] / theirs[key] for key in ours if theirs[key]}
    return {"medians": rows, "ratios_omnigen_over_vllm_omni": ratios}


def same_audio(runs: dict[str, list[Measure]]) -> dict[str, Any] | None:
    """Which requests got the same 16-bit audio on both sides (first repeat)."""
    if not all(runs.get(side) for side in SIDES):
        return None
    ours, theirs = (runs[side][0].audio for side in SIDES)
    cells = {cell: [k for k in ours if k.startswith(f"{cell}-")] for cell in ("c1", "cc")}
    return {
        cell: {"requests": len(ids), "equal": sum(ours[k] == theirs.get(k) for k in ids)}
        for cell, ids in cells.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="fresh processes per side (default: %(default)s)"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="each request's talker budget, i.e. its length: about max_tokens - 1 codec frames of "
        "16 samples at 24 kHz, unless the talker samples its stop code first (default: %(default)s)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=8,
        help="requests at concurrency 1, one after another (default: %(default)s)",
    )
    parser.add_argument(
        "--requests-at-c", type=int, default=32, help="requests at concurrency C (default: %(default)s)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=8, help="C: requests in flight (default: %(default)s)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="vLLM's default torch.compile instead of eager on both sides (omnigen's compiled talker "
        "currently computes the wrong thing: see the module docstring)",
    )
    parser.add_argument("--sides", default=",".join(SIDES), help="comma-separated subset of: %(default)s")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a side may take to start")
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "real_tts.json",
        help="the JSON results file (default: benchmarks/results/real_tts.json)",
    )
    args = parser.parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        parser.error(f"unknown side(s) {unknown}; choose from {', '.join(SIDES)}")

    from omnigen_testing import qwen3_tts_chain as rt
    from omnigen_testing.checkpoints import write_qwen3_tts

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    settings = rt.ChainSettings(
        max_num_seqs=max(args.concurrency, 1),
        default_max_tokens=args.max_tokens,
        enforce_eager=not args.compile,
    )
    work = Path(tempfile.mkdtemp(prefix="omnigen-real-tts-"))
    checkpoint = write_qwen3_tts(work / "checkpoint", variant="custom_voice", seed=0)
    report: dict[str, Any] = {
        "benchmark": "real_tts",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        **commit(),
        "settings": {**vars(args), "out": str(args.out), "engine": dataclasses.asdict(settings)},
        "runs": {side: [] for side in sides},
    }
    runs: dict[str, list[Measure]] = {side: [] for side in sides}
    for repeat in range(args.repeats):
        order = sides if repeat % 2 == 0 else sides[::-1]
        for side in order:
            log = work / f"{side}-{repeat}.log"
            print(f"[repeat {repeat + 1}/{args.repeats}] {side} ...", file=sys.stderr, flush=True)
            if side == "omnigen":
                measure = run_omnigen(checkpoint, settings, args, log)
            else:
                measure = run_oracle(checkpoint, settings, args, log, work / f"scratch-{repeat}")
            runs[side].append(measure)
            report["runs"][side].append(dataclasses.asdict(measure))
            print(
                f"[repeat {repeat + 1}/{args.repeats}] {side}: cold start {measure.cold_start_s:.1f} s, "
                f"c=1 {measure.c1['audio_s_per_s']:.3f}, c={args.concurrency} {measure.cc['audio_s_per_s']:.3f} "
                "audio s/s",
                file=sys.stderr,
                flush=True,
            )
    report.update(summarize(runs))
    report["same_audio"] = same_audio(runs)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    shutil.rmtree(work, ignore_errors=True)  # kept (checkpoint, logs) when a side failed
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")

    medians, ratios = report["medians"], report["ratios_omnigen_over_vllm_omni"]
    mode = "compiled" if args.compile else "eager"
    print(
        f"Qwen3-TTS tiny, {mode}, {args.max_tokens} tokens/request, medians of {args.repeats} "
        f"(c=1: {args.requests} requests, c={args.concurrency}: {args.requests_at_c})"
    )
    keys = (
        ("cold_start_s", "cold start to first audio (s)"),
        ("c1_audio_s_per_s", "audio s/s at c=1"),
        ("cc_audio_s_per_s", f"audio s/s at c={args.concurrency}"),
    )
    print(f"{'':<32} " + " ".join(f"{side:>10}" for side in sides) + f" {'ratio':>7}")
    for key, label in keys:
        cells = " ".join(f"{medians[side][key]:>10.3f}" for side in sides)
        ratio = f"{ratios[key]:>7.2f}" if key in ratios else f"{'':>7}"
        print(f"{label:<32} {cells} {ratio}")
    if report["same_audio"]:
        same = report["same_audio"]
        print(
            f"same 16-bit audio on both sides: c=1 {same['c1']['equal']}/{same['c1']['requests']}, "
            f"c={args.concurrency} {same['cc']['equal']}/{same['cc']['requests']} requests"
        )
    print(f"ratio = omnigen / vllm-omni; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
