"""Streaming against full-payload serving of the same requests, in one run (issue 35, item 5).

Measures: time to first audio, latency and throughput of streaming, per request and concurrency.
Baseline: full-payload serving of the same requests on the same pipeline (and fixed windows).
Takes: about 8-16 minutes on 2 cores, under ~3 with ``--short``.
Writes: ``benchmarks/results/streaming.json`` (``--out``), and prints a table.

Two pipelines, one after the other, each started once in ``mp`` mode (an engine-core process per
stage) the way ``omnigen run`` starts it (its serve config, the model's request builder, each
stage's sampling; ``omnigen.pipeline_commands``):

* ``omnigen_tiny``: omnigen's tiny talker -> code2wav (random weights, ``conf/serve/omnigen_tiny.yaml``
  with a 512-token context so the takes are long enough to stream; 16 kHz, 16 samples a frame);
* ``qwen3_tts``: the tiny real-shaped Qwen3-TTS CustomVoice checkpoint (``testing/checkpoints``,
  what ``python -m omnigen_testing.checkpoints qwen3_tts --variant custom_voice --out DIR`` writes; vllm-omni's
  classes), with the engine settings of ``benchmarks/real_tts.py`` (eager). Its codec decoder is
  tiny too (16 samples a frame at 24 kHz) but the talker makes as many codec frames as the released
  model would for the same length of speech: the figures are also given in the released model's
  seconds (``nominal``: a frame is 1/12.5 s), and an utterance of ``--qwen3-max-tokens`` (80)
  frames is 6.4 s of released-model speech.

Every request runs three times on the same pipeline, with the same prompt, seed and token budget (the
talker is held to its whole budget: ``ignore_eos`` on the tiny, ``min_tokens`` on Qwen3-TTS):

* ``full``: ``Pipeline.generate_async`` (the full payload: code2wav starts when the talker has
  finished; all the audio arrives at once, so its time to first audio is its latency);
* ``stream``: ``omnigen.serving.streaming.stream_async`` (windows of the talker's frames decoded
  while it runs, per the model's ``stages.S.stream``; the first ``AudioChunk`` is the first audio):
  a request's windows decode one after another, the next taking every window ready by then
  (``coalesce``, the default), so they grow when code2wav lags;
* ``fixed``: the same, every window its configured size, several decoding at once
  (``coalesce=False``: vllm-omni's fixed chunking), the baseline coalescing is judged against.

At each concurrency C (``--concurrency``: 1 8 32) C clients each send their next request as soon as
their previous one has finished (closed loop), ``--requests-per-client`` requests each (at least
``--min-requests`` in all); the modes take turns per cell and the order flips each repeat. Measured
per cell: time to first audio p50 and p99, latency p50 and p99, audio seconds per second of wall
time (all requests' audio over the cell's wall time), and the real-time factor (each request's
latency over its audio's duration; p50). Reported: each mode's figures, the ratios stream / full
and fixed / full,
and the issue's goal per cell (first audio at most 0.2x the full-payload latency, both p50;
throughput at least 0.9x full payload), which applies to an utterance of at least 5 s
(``goal_applies``: the tiny pipeline's takes are far shorter, so there it is reported, not
judged). Also checked: each streaming mode's audio of each request against the full payload's (same sample count; largest
deviation).

The talker's ``max_num_batched_tokens`` is raised so that no prompt is prefilled in parts: vLLM
0.30's runner then rewinds a seeded request's generator (``set_offset``), which a CPU generator
refuses, and the engine dies ("CPU Generator does not use offset"; with conf/serve/qwen3_tts.yaml's
512, at about 24 concurrent seeded requests).

Results go to ``--out`` (JSON: the machine, the commit, the settings, every figure) and a short
table is printed. The machine may be shared: compare the ratios of one run, not figures across
runs (``load_average_*`` in the file say how busy it was).

    .venv/bin/python benchmarks/streaming.py            # about 8-16 minutes on 2 cores (three modes)
    .venv/bin/python benchmarks/streaming.py --short    # CI smoke: under ~3 minutes
    .venv/bin/python benchmarks/streaming.py --models qwen3_tts --concurrency 1 8
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _prepare_engine_process() -> None:
    """As ``omnigen/cli.py`` does for ``omnigen run``/``serve``: on CPU vLLM spawns each engine
    core, which imports this main module and only then unpickles its ``VllmConfig``, whose
    ``hf_config`` is vllm-omni's ``Qwen3TTSConfig``; unpickled first, it would import vllm-omni as
    a package (its patch runs) and omnigen's plugin would refuse the process. So a spawned child
    registers the model's declared classes (vllm-omni's bare package) here, first."""
    import multiprocessing

    if multiprocessing.current_process().name != "MainProcess" and os.environ.get("OMNIGEN_MODELS"):
        from omnigen import models

        models.register_from_env()


_prepare_engine_process()

from benchmarks.real_tts import LANGUAGES, TEXTS, VOICES, commit, machine  # noqa: E402

MODELS = ("omnigen_tiny", "qwen3_tts")
MODES = ("full", "stream", "fixed")
"""full payload; streaming with the edge's policy (coalescing windows); streaming with every
window its configured size (``coalesce`` off: vllm-omni's fixed chunking)."""
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "streaming.json"
GOAL_FIRST_AUDIO = 0.2
"""Issue 35: first audio at most 0.2x the full-payload latency ..."""
GOAL_THROUGHPUT = 0.9
"""... with throughput at least 0.9x full payload ..."""
GOAL_UTTERANCE_S = 5.0
"""... for an utterance of at least 5 s of audio."""
RELEASED_FRAME_RATE_HZ = 12.5
"""Qwen3-TTS-12Hz's codec frames per second of speech (24 kHz, 1920 samples a frame)."""
TINY_CONTEXT = 512
"""The tiny talker's and code2wav's ``max_position_embeddings`` (testing/tiny_omni.py):
the talker's prompt plus budget, and the code2wav's four codes a frame, must fit in it."""
TINY_TEXTS = (
    "Hello from omnigen.",
    "The quick brown fox jumps over the lazy dog.",
    "Streaming audio, one window at a time.",
    "Good day to you!",
)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One request, as both modes send it."""

    index: int
    prompt: dict[str, Any]
    payload: dict[str, Any]
    sampling: dict[str, Any]


@dataclasses.dataclass
class Record:
    """One request's figures in one mode (seconds from its submission)."""

    index: int
    first_audio_s: float
    latency_s: float
    samples: int
    frames: int
    chunks: int
    audio: Any = dataclasses.field(default=None, repr=False)


# --------------------------------------------------------------------------- the pipelines


def model_overrides(model: str, args: argparse.Namespace, checkpoint: Path | None) -> list[str]:
    """The serve overrides each model runs with (``omnigen run``'s, without ``model=``)."""
    if model == "omnigen_tiny":
        return [
            f"serve.engine.max_model_len={TINY_CONTEXT}",
            f"serve.engine.max_num_batched_tokens={TINY_CONTEXT}",
            f"serve.engine.max_num_seqs={max(args.concurrency)}",
            f"serve.max_tokens={args.tiny_max_tokens}",
        ]
    from omnigen_testing.qwen3_tts_chain import ChainSettings

    frames = args.qwen3_max_tokens
    # A stream window holds its frames and up to left_context_frames before them; a full take all.
    code2wav_len = max(2048, 16 * (frames + 8))
    chain = ChainSettings(
        max_num_seqs=max(args.concurrency),
        talker_max_model_len=max(512, frames + 256),
        code2wav_max_model_len=code2wav_len,
        default_max_tokens=frames,
        enforce_eager=True,
    )
    assert checkpoint is not None
    found = [o for o in chain.omnigen_overrides(checkpoint) if not o.startswith("model=")]
    # Every take its whole budget: the tiny random talker may sample its stop code at any step.
    found.append(f"serve.sampling.qwen3_tts.min_tokens={frames}")
    # Every prompt prefilled in one step: vLLM 0.30's runner rewinds a seeded request's generator
    # when a step only part-prefills it (``gen.set_offset``, _bookkeeping_sync), which a CPU
    # generator refuses ("CPU Generator does not use offset"): the talker's engine dies. 512
    # (conf/serve/qwen3_tts.yaml) chunks prompts from about 24 requests at once (~22 tokens each).
    found.append(
        f"serve.stage_engine.qwen3_tts.max_num_batched_tokens={max(512, 64 * max(args.concurrency))}"
    )
    return found


def start(model: str, overrides: Sequence[str]) -> tuple[Any, Any, Any]:
    """``(pipeline, settings, plan)``, as ``omnigen run`` composes and starts them (``mp``)."""
    from omnigen import api
    from omnigen import pipeline as composer
    from omnigen.pipeline_commands import serve_overrides
    from omnigen.serving.pipeline import Pipeline
    from omnigen.serving.settings import read_settings
    from omnigen.serving.streaming import streaming_edge

    overrides = serve_overrides(model, [*overrides, "serve.mode=mp"])
    cfg = composer.compose_config(model, overrides)
    plan = api.served_model(model, overrides)
    settings = read_settings(cfg, plan)
    pipe = Pipeline.from_model(plan, settings.stage_models, mode="mp", engine_kwargs=settings.engine_kwargs)
    try:
        if streaming_edge(pipe) is None:
            raise SystemExit(
                f"{model}: no stage streams (stages.S.stream in conf/model/{model}.yaml), so both "
                "modes would run the full payload; enable it there and rebuild (omnigen build "
                f"model={model}): mp engines import the built package, so an override cannot do it"
            )
    except BaseException:
        pipe.close()
        raise
    return pipe, settings, plan


def specs(
    model: str, settings: Any, plan: Any, pipe: Any, count: int, first_seed: int, budget: int
) -> list[Spec]:
    """``count`` requests, built and checked as the server builds and checks them."""
    from omnigen.requests.base import SpeechInput
    from omnigen.serving.limits import check_request
    from omnigen.serving.settings import build_request, sampling_of

    found = []
    for i in range(count):
        seed = first_seed + i
        if model == "omnigen_tiny":
            speech = SpeechInput(input=TINY_TEXTS[i % len(TINY_TEXTS)], seed=seed, max_new_tokens=budget)
        else:
            speech = SpeechInput(
                input=TEXTS[i % len(TEXTS)],
                voice=VOICES[i % len(VOICES)],
                language=LANGUAGES[i % len(LANGUAGES)],
                seed=seed,
                max_new_tokens=budget,
            )
        built = build_request(settings, speech)
        sampling = sampling_of(settings, plan, seed, built.max_tokens or budget, built.sampling)
        check_request(pipe.limits, pipe.stages, built, sampling)
        found.append(Spec(i, built.prompt, built.payload, sampling))
    return found


# --------------------------------------------------------------------------- one cell


async def one(pipe: Any, mode: str, spec: Spec, request_id: str, producer: str, keep_audio: bool) -> Record:
    from omnigen.serving.streaming import AudioChunk, stream_async

    started = time.perf_counter()
    first = None
    chunks = 0
    if mode == "full":
        out = await pipe.generate_async(spec.prompt, spec.sampling, request_id, spec.payload)
        first = time.perf_counter() - started  # the whole audio comes at once
        chunks = 1
    else:
        out = None
        coalesce = None if mode == "stream" else False
        streamed = stream_async(pipe, spec.prompt, spec.sampling, request_id, spec.payload, coalesce=coalesce)
        async for item in streamed:
            if isinstance(item, AudioChunk):
                if first is None:
                    first = time.perf_counter() - started
                chunks += 1
            else:
                out = item
    latency = time.perf_counter() - started
    if out is None or out.audio is None or first is None:
        raise RuntimeError(f"{mode} request {request_id!r} gave no audio")
    audio = out.audio.reshape(-1).float()
    frames = max(len(out.token_ids.get(producer, ())) - 1, 0)  # a frame per sampled token but the last
    return Record(
        spec.index, first, latency, int(audio.numel()), frames, chunks, audio if keep_audio else None
    )


async def cell(
    pipe: Any, mode: str, batch: list[Spec], concurrency: int, tag: str, producer: str, keep_audio: bool
) -> tuple[float, list[Record]]:
    """``batch`` through ``concurrency`` closed-loop clients: (wall seconds, records)."""
    waiting = list(batch)
    records: list[Record] = []

    async def client() -> None:
        while waiting:
            spec = waiting.pop(0)
            records.append(await one(pipe, mode, spec, f"{tag}-{mode}-{spec.index}", producer, keep_audio))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - started, records


# --------------------------------------------------------------------------- figures


def percentile(values: list[float], q: float) -> float:
    import numpy

    return float(numpy.percentile(values, q)) if values else float("nan")


def figures(
    walls: list[float], records: list[Record], sample_rate: int, frame_rate: float | None
) -> dict[str, Any]:
    """One mode's figures at one concurrency, over every repeat."""
    audio_s = [r.samples / sample_rate for r in records]
    wall = sum(walls)
    found: dict[str, Any] = {
        "requests": len(records),
        "wall_s": wall,
        "first_audio_p50_s": percentile([r.first_audio_s for r in records], 50),
        "first_audio_p99_s": percentile([r.first_audio_s for r in records], 99),
        "latency_p50_s": percentile([r.latency_s for r in records], 50),
        "latency_p99_s": percentile([r.latency_s for r in records], 99),
        "audio_s": sum(audio_s),
        "audio_s_per_s": sum(audio_s) / wall,
        "rtf_p50": percentile([r.latency_s / a for r, a in zip(records, audio_s, strict=True) if a], 50),
        "utterance_s_p50": percentile(audio_s, 50),
        "frames_p50": percentile([float(r.frames) for r in records], 50),
        "chunks_p50": percentile([float(r.chunks) for r in records], 50),
    }
    if frame_rate:
        nominal = [r.frames / frame_rate for r in records]
        found["nominal"] = {
            "frame_rate_hz": frame_rate,
            "audio_s": sum(nominal),
            "audio_s_per_s": sum(nominal) / wall,
            "rtf_p50": percentile([r.latency_s / a for r, a in zip(records, nominal, strict=True) if a], 50),
            "utterance_s_p50": percentile(nominal, 50),
        }
    return found


def ratios(full: dict[str, Any], stream: dict[str, Any]) -> dict[str, float]:
    """stream / full for each figure, and the first audio against the full-payload latency."""
    keys = (
        "first_audio_p50_s",
        "first_audio_p99_s",
        "latency_p50_s",
        "latency_p99_s",
        "audio_s_per_s",
        "rtf_p50",
    )
    found = {key: stream[key] / full[key] for key in keys if full[key]}
    found["first_audio_over_full_latency_p50"] = stream["first_audio_p50_s"] / full["latency_p50_s"]
    found["first_audio_over_full_latency_p99"] = stream["first_audio_p99_s"] / full["latency_p99_s"]
    return found


def goal(full: dict[str, Any], ratio: dict[str, float]) -> dict[str, Any]:
    utterance = (full.get("nominal") or full)["utterance_s_p50"]
    first_ok = ratio["first_audio_over_full_latency_p50"] <= GOAL_FIRST_AUDIO
    throughput_ok = ratio["audio_s_per_s"] >= GOAL_THROUGHPUT
    return {
        "utterance_s": utterance,
        "goal_applies": utterance >= GOAL_UTTERANCE_S,
        "first_audio_met": first_ok,
        "throughput_met": throughput_ok,
        "met": first_ok and throughput_ok,
    }


def same_audio(full: list[Record], stream: list[Record]) -> dict[str, Any]:
    """The two modes' audio of each request (first repeat): equal length, largest deviation."""
    by_index = {r.index: r for r in full if r.audio is not None}
    compared = lengths = 0
    deviation = 0.0
    for record in stream:
        other = by_index.get(record.index)
        if record.audio is None or other is None:
            continue
        compared += 1
        if record.audio.numel() == other.audio.numel():
            lengths += 1
            deviation = max(
                deviation, float((record.audio - other.audio).abs().max()) if record.samples else 0.0
            )
    return {"requests": compared, "same_length": lengths, "max_abs_deviation": deviation}


# --------------------------------------------------------------------------- one model


def run_model(model: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    checkpoint = None
    if model == "qwen3_tts":
        checkpoint = args.checkpoint
        if checkpoint is None:
            from omnigen_testing.checkpoints import write_qwen3_tts

            checkpoint = write_qwen3_tts(work / "qwen3_tts", variant="custom_voice", seed=0)
    budget = args.tiny_max_tokens if model == "omnigen_tiny" else args.qwen3_max_tokens
    frame_rate = RELEASED_FRAME_RATE_HZ if model == "qwen3_tts" else None
    overrides = model_overrides(model, args, checkpoint)
    log(f"{model}: starting the pipeline (mp)")
    begun = time.perf_counter()
    pipe, settings, plan = start(model, overrides)
    result: dict[str, Any] = {
        "overrides": overrides,
        "checkpoint": str(checkpoint) if checkpoint else None,
        "max_tokens": budget,
        "sample_rate": settings.sample_rate,
        "stream": dataclasses.asdict(next(s.plan.stream for s in pipe.stages if s.plan.stream is not None)),
        "start_s": time.perf_counter() - begun,
        "cells": {},
    }
    producer = next(s.plan.stage for s in pipe.stages if s.plan.stream is not None)
    try:
        warm = specs(model, settings, plan, pipe, args.warmup, 1, budget)
        for mode in MODES:
            pipe.run(cell(pipe, mode, warm, len(warm), "warm", producer, False)).result(args.timeout)
        for concurrency in args.concurrency:
            count = max(args.min_requests, concurrency * args.requests_per_client)
            batch = specs(model, settings, plan, pipe, count, 1000 * concurrency, budget)
            walls: dict[str, list[float]] = {mode: [] for mode in MODES}
            records: dict[str, list[Record]] = {mode: [] for mode in MODES}
            loads = []
            first_records: dict[str, list[Record]] = {}
            for repeat in range(args.repeats):
                order = MODES if repeat % 2 == 0 else MODES[::-1]
                for mode in order:
                    loads.append(os.getloadavg()[0])
                    tag = f"c{concurrency}-r{repeat}"
                    wall, got = pipe.run(
                        cell(pipe, mode, batch, concurrency, tag, producer, repeat == 0)
                    ).result(args.timeout)
                    walls[mode].append(wall)
                    records[mode] += got
                    if repeat == 0:
                        first_records[mode] = got
                    log(
                        f"{model} c={concurrency} repeat {repeat + 1}/{args.repeats} {mode}: {len(got)} "
                        f"requests in {wall:.1f} s"
                    )
            found = {
                mode: figures(walls[mode], records[mode], settings.sample_rate, frame_rate) for mode in MODES
            }
            found["concurrency"] = concurrency
            for mode in MODES[1:]:
                ratio = ratios(found["full"], found[mode])
                found[f"ratios_{mode}_over_full"] = ratio
                found[f"goal_{mode}"] = goal(found["full"], ratio)
                found[f"same_audio_{mode}"] = same_audio(first_records["full"], first_records[mode])
            found["load_average_1m"] = loads
            result["cells"][str(concurrency)] = found
        result["stream_windows"] = pipe.stream_windows
    finally:
        pipe.close()
    return result


# --------------------------------------------------------------------------- report


def log(message: str) -> None:
    print(f"[streaming] {message}", file=sys.stderr, flush=True)


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{'model':<13}{'c':>3} {'mode':<7}{'TTFA p50':>9}{'p99':>8}{'latency':>9}{'audio s/s':>11}"
        f"{'RTF':>8}  {'first/full':>10}{'thru':>6}  goal"
    ]
    for model, result in report["models"].items():
        for key, found in result["cells"].items():
            for mode in MODES:
                cell_figures = found[mode]
                shown = cell_figures.get("nominal", cell_figures)
                line = (
                    f"{model:<13}{key:>3} {mode:<7}{cell_figures['first_audio_p50_s']:>9.3f}"
                    f"{cell_figures['first_audio_p99_s']:>8.3f}{cell_figures['latency_p50_s']:>9.3f}"
                    f"{shown['audio_s_per_s']:>11.3f}{shown['rtf_p50']:>8.3f}"
                )
                if mode != "full":
                    ratio, met = found[f"ratios_{mode}_over_full"], found[f"goal_{mode}"]
                    verdict = ("met" if met["met"] else "not met") if met["goal_applies"] else "n/a (<5 s)"
                    line += (
                        f"  {ratio['first_audio_over_full_latency_p50']:>10.3f}{ratio['audio_s_per_s']:>6.2f}"
                        f"  {verdict}"
                    )
                lines.append(line)
    lines.append(
        "seconds; TTFA = time to first audio (full payload: its latency); first/full = stream TTFA p50 / "
        "full latency p50 (goal <= 0.2); thru = stream / full audio s/s (goal >= 0.9)."
    )
    for model, result in report["models"].items():
        utterances = sorted({found["goal_stream"]["utterance_s"] for found in result["cells"].values()})
        unit = "released-model s (12.5 codec frames a second)" if model == "qwen3_tts" else "s of audio"
        lines.append(
            f"{model}: utterance p50 {', '.join(f'{u:.3f}' for u in utterances)} {unit}; audio s/s and RTF in those seconds."
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=MODELS,
        default=list(MODELS),
        help="the pipelines to measure, in this order (default: %(default)s)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 8, 32],
        help="clients in flight, one cell each (default: %(default)s)",
    )
    parser.add_argument(
        "--requests-per-client",
        type=int,
        default=4,
        help="requests each client sends per cell and mode: a cell at C sends C times this "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--min-requests",
        type=int,
        default=16,
        help="at least this many requests per cell and mode (for the percentiles at c=1; "
        "default: %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="times each cell runs per mode, the modes' order flipped each time; percentiles over "
        "every repeat's requests, throughput over their summed wall time (default: %(default)s)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=4,
        help="requests sent at once in each mode before measuring, per model (default: %(default)s)",
    )
    parser.add_argument(
        "--tiny-max-tokens",
        type=int,
        default=120,
        help="omnigen_tiny's talker budget (ignore_eos: every take this long): max_tokens - 1 frames "
        f"of 16 samples at 16 kHz; the code2wav's four codes a frame must fit its {TINY_CONTEXT}-token "
        "context, so at most 128 (default: %(default)s)",
    )
    parser.add_argument(
        "--qwen3-max-tokens",
        type=int,
        default=80,
        help="qwen3_tts's talker budget, held by min_tokens: max_tokens - 1 codec frames, "
        f"1/{RELEASED_FRAME_RATE_HZ:g} s of the released model's speech each (the goal applies from "
        f"{GOAL_UTTERANCE_S:g} s: 64 tokens; default: %(default)s)",
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="a Qwen3-TTS checkpoint folder to serve instead of writing the tiny real-shaped one "
        "(python -m omnigen_testing.checkpoints qwen3_tts --variant custom_voice --out DIR)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=900,
        help="seconds a cell (one mode, one repeat) may take (default: %(default)s)",
    )
    parser.add_argument(
        "--short",
        action="store_true",
        help="CI smoke run, under ~3 minutes: one repeat, one request per client (at least 2 per "
        "cell), 2 warm-up requests; the budgets and concurrencies as given",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="the JSON results file (default: %(default)s)"
    )
    return parser


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, checked (``parser.error`` names a bad switch); ``--short`` applied."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.short:
        args.repeats, args.requests_per_client, args.min_requests, args.warmup = 1, 1, 2, 2
    for name in (
        "requests_per_client",
        "min_requests",
        "repeats",
        "warmup",
        "tiny_max_tokens",
        "qwen3_max_tokens",
    ):
        if getattr(args, name) < (2 if name.endswith("max_tokens") else 1):
            parser.error(f"--{name.replace('_', '-')}: {getattr(args, name)} is too small")
    if any(c < 1 for c in args.concurrency):
        parser.error(f"--concurrency: {args.concurrency}: every value must be at least 1")
    if args.tiny_max_tokens > TINY_CONTEXT // 4:
        parser.error(
            f"--tiny-max-tokens: {args.tiny_max_tokens} frames make more codes than the tiny code2wav's "
            f"{TINY_CONTEXT}-token context takes (at most {TINY_CONTEXT // 4})"
        )
    if args.checkpoint is not None and not (args.checkpoint / "config.json").is_file():
        parser.error(f"--checkpoint: {args.checkpoint} has no config.json")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: vLLM's CPU default takes minutes
    # omnigen's plugin only: vllm-omni's would patch vLLM's request classes in this process.
    os.environ.setdefault("VLLM_PLUGINS", "omnigen")
    work = Path(tempfile.mkdtemp(prefix="omnigen-streaming-"))
    report: dict[str, Any] = {
        "benchmark": "streaming",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        **commit(),
        "settings": {**vars(args), "out": str(args.out), "checkpoint": str(args.checkpoint or "")},
        "goal": {
            "first_audio_over_full_latency_at_most": GOAL_FIRST_AUDIO,
            "throughput_ratio_at_least": GOAL_THROUGHPUT,
            "for_utterances_of_at_least_s": GOAL_UTTERANCE_S,
        },
        "models": {},
    }
    begun = time.perf_counter()
    for model in args.models:
        report["models"][model] = run_model(model, args, work)
    report["seconds"] = time.perf_counter() - begun
    report["load_average_at_end"] = os.getloadavg()
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"written to {args.out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
