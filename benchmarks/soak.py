"""Soak of ``omnigen serve``: thousands of mixed requests against the tiny pipeline, then SIGTERM.

Measures: ``omnigen serve`` under thousands of mixed requests, then SIGTERM: status counts,
  engine deaths, leftover state and shared memory, memory growth, latency, throughput.
Baseline: none: pass/fail checks (exit 1 if one fails) and absolute figures.
Takes: a few minutes on 2 cores with the defaults.
Writes: ``benchmarks/results/soak.json`` (``--out``), and prints a summary.

The server is the command a user runs (``python -m omnigen.cli serve model=omnigen_tiny``, a
subprocess: the talker -> code2wav pipeline, one engine-core process per stage) with an API key
and a small ``serve.max_body_bytes``. ``--requests`` requests go out at ``--concurrency`` from
one ``httpx.AsyncClient``:

- ~5% malformed, a mix: out-of-vocabulary, negative and non-integer ``prompt_token_ids``
  (``true``, ``1.0``, ``"7"``), unknown fields, wrong types, over-budget ``max_tokens``, a prompt
  over the talker's context, ``max_tokens: 1`` (the code2wav gets an empty prompt), bad JSON,
  bodies over the limit (with and without a Content-Length), a wrong API key: each must get a
  4xx;
- ~5% clients that disconnect mid-request (a client timeout shorter than the request): the server
  aborts the request in every stage;
- the rest valid: text (ASCII and not) or token ids of varied lengths, with and without a seed
  and ``max_tokens``, on ``/v1/audio/speech`` and ``/v1/omnigen/generate``: none may get a 5xx.

Recorded: status counts per kind (and per malformed variant), engine deaths (``/metrics``
``omnigen_engine_deaths_total`` and ``/health``), the per-request state the runners hold after
one final request (``/v1/omnigen/state``: only that request's ids may be left), the server's
shared-memory segments (``/dev/shm/omnigen-<pid>-*``), the resident memory of the server and its
engine-core processes summed (psutil, every ~2 s): at warm-up (10% of the requests done) against
the end, and the slope after warm-up; p50/p99 latency of the valid requests, throughput.

The tiny models record every forward, hook and predictor call they see, for the tests
(``omnigen_testing.tiny_omni.OmniRecord``, never trimmed): their worker processes grow with
every request served, and their steps slow down as the record grows. The RSS figures are also
given per process (the server, each engine core, each worker), and the throughput per fifth
of the load, to tell the server's own memory and speed from the test models'.

Then SIGTERM while ``--concurrency`` clients keep sending: every request in flight at the signal
must complete or get a clean error (an HTTP status, or a refused/closed connection) within
uvicorn's graceful timeout; the server must exit 128+15 (SIGTERM, after the engines shut down)
and leave no engine-core or worker process and no shared-memory segment.

Every phase has a deadline; the default run takes a few minutes on 2 CPU cores. Writes a JSON
file (the commit, the settings, every figure) and prints a summary; exits 1 if a check failed.

    .venv/bin/python benchmarks/soak.py
    .venv/bin/python benchmarks/soak.py --requests 200 --concurrency 16 --out /tmp/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "soak.json"
GRACEFUL_S = 30.0
"""uvicorn's ``timeout_graceful_shutdown`` in ``omnigen.serving.http.serve``."""
SIGTERM_EXIT = 128 + signal.SIGTERM
# The tiny pipeline (conf/serve/omnigen_tiny.yaml, testing/tiny_omni.py): the talker's
# vocabulary is 0..511 and its context 128 tokens; a talker budget over 31 tokens makes more
# codes than the code2wav's context takes; one talker token makes no audio frame.
VOCAB = 512
CONTEXT = 128
MAX_BUDGET = 31
LONGEST_VALID_PROMPT = 100
"""Valid prompts stay well inside the context: a prompt of 127 tokens leaves the talker one token,
which (like ``max_tokens: 1``) gives the code2wav an empty prompt (a 400)."""
STATE_FIELDS = ("requests", "buffers", "generators", "pending")


@dataclass(frozen=True)
class SoakSettings:
    requests: int = 2000
    concurrency: int = 32
    malformed_fraction: float = 0.05
    disconnect_fraction: float = 0.05
    seed: int = 0
    max_body_bytes: int = 65536
    """``serve.max_body_bytes`` of the server (the oversized bodies are just over it)."""
    disconnect_timeout_s: float = 0.05
    """The client timeout of a disconnecting client (a valid request takes longer under load)."""
    request_timeout_s: float = 120.0
    """The client timeout of every other request (a valid request that runs over it is a hang)."""
    warmup_fraction: float = 0.1
    rss_interval_s: float = 2.0
    startup_deadline_s: float = 300.0
    load_deadline_s: float = 420.0
    sigterm_after_s: float = 1.0
    """How long clients send before the SIGTERM (they keep sending after it)."""
    shutdown_deadline_s: float = 180.0
    """From the SIGTERM to the server's exit (uvicorn's 30 s graceful timeout, then each stage's
    engine shut down)."""
    server_log: str | None = None
    """Where the server's output goes (None: a temporary folder)."""


# -- the requests --------------------------------------------------------------------------


@dataclass
class Planned:
    index: int
    kind: str
    """``valid``, ``malformed`` or ``disconnect``."""
    variant: str
    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 120.0
    chunked: bool = False
    """Send the body without a Content-Length (chunked)."""


SPEECH = "/v1/audio/speech"
GENERATE = "/v1/omnigen/generate"

MALFORMED_VARIANTS = (
    "oov_token",
    "negative_token",
    "non_int_token",
    "unknown_field",
    "wrong_type",
    "over_budget_max_tokens",
    "prompt_over_context",
    "max_tokens_1",
    "bad_json",
    "oversized",
    "oversized_chunked",
    "wrong_key",
)


def plan_requests(settings: SoakSettings, key: str) -> list[Planned]:
    """``settings.requests`` requests in a shuffled order: the fractions malformed (every variant
    in turn) and disconnecting, the rest valid; reproducible from ``settings.seed``."""
    rng = random.Random(settings.seed)
    count = settings.requests
    malformed = round(count * settings.malformed_fraction)
    disconnect = round(count * settings.disconnect_fraction)
    kinds = ["malformed"] * malformed + ["disconnect"] * disconnect
    kinds += ["valid"] * (count - len(kinds))
    rng.shuffle(kinds)
    auth = {"authorization": f"Bearer {key}"}
    planned = []
    bad = 0
    for index, kind in enumerate(kinds):
        if kind == "valid":
            request = _valid(rng, index, settings)
        elif kind == "disconnect":
            request = _disconnecting(rng, index, settings)
        else:
            request = _malformed(rng, index, MALFORMED_VARIANTS[bad % len(MALFORMED_VARIANTS)], settings, key)
            bad += 1
        request.headers = {"content-type": "application/json", **auth, **request.headers}
        planned.append(request)
    return planned


def _text(rng: random.Random, length: int) -> str:
    """About ``length`` bytes of text (serve.tokenizer=bytes: a token per UTF-8 byte)."""
    if rng.random() < 0.2:
        words = ["héllo", "naïve", "日本語", "ß", "✓", "über", "voilà"]
        text = ""
        while len((text + " ").encode()) < length:
            text += rng.choice(words) + " "
        return text.encode()[:length].decode(errors="ignore") or "x"
    alphabet = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ.,!?0123456789"
    return "".join(rng.choice(alphabet) for _ in range(length))


def valid_body(rng: random.Random, longest: int = LONGEST_VALID_PROMPT) -> dict[str, Any]:
    length = rng.randint(1, longest)
    if rng.random() < 0.3:
        body: dict[str, Any] = {"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(length)]}
    else:
        body = {"input": _text(rng, length)}
    if rng.random() < 0.6:
        body["seed"] = rng.randrange(2**31)
    if rng.random() < 0.4:
        body["max_tokens"] = rng.randint(2, MAX_BUDGET)
    return body


def _valid(rng: random.Random, index: int, settings: SoakSettings) -> Planned:
    body = valid_body(rng)
    if rng.random() < 0.15:
        return Planned(
            index,
            "valid",
            "generate",
            "/v1/omnigen/generate",
            _json(body),
            timeout_s=settings.request_timeout_s,
        )
    if rng.random() < 0.1:
        body["response_format"] = "wav"
    return Planned(
        index, "valid", "speech", "/v1/audio/speech", _json(body), timeout_s=settings.request_timeout_s
    )


def _disconnecting(rng: random.Random, index: int, settings: SoakSettings) -> Planned:
    # The longest budget: the talker's 31 steps take longer than the client waits.
    body = {"input": _text(rng, rng.randint(20, 60)), "max_tokens": MAX_BUDGET, "seed": rng.randrange(2**31)}
    return Planned(
        index,
        "disconnect",
        "client_timeout",
        "/v1/audio/speech",
        _json(body),
        timeout_s=settings.disconnect_timeout_s,
    )


def _malformed(rng: random.Random, index: int, variant: str, settings: SoakSettings, key: str) -> Planned:
    headers: dict[str, str] = {}
    chunked = False
    path = SPEECH if index % 4 else GENERATE
    if variant == "oov_token":
        ids = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 20))]
        ids.insert(rng.randint(0, len(ids)), rng.choice([VOCAB, VOCAB + 1, 10**6, 2**31, 2**63]))
        body = _json({"prompt_token_ids": ids})
    elif variant == "negative_token":
        body = _json({"prompt_token_ids": [rng.randrange(VOCAB), -rng.randint(1, 10**9)]})
    elif variant == "non_int_token":
        body = _json({"prompt_token_ids": [rng.randrange(VOCAB), rng.choice([True, False, 1.0, "7", None])]})
    elif variant == "unknown_field":
        # Fields neither route has; the audio-output fields (speed, stream, ...) only where they
        # would be ignored: /v1/omnigen/generate answers JSON.
        extra = rng.choice([{"inputs": "hi"}, {"temperature": 0.5}, {"speeed": 2.0}, {"streaming": True}])
        if path == GENERATE:
            extra = rng.choice([extra, {"speed": 2.0}, {"stream": True}, {"response_format": "mp3"}])
        body = _json({"input": _text(rng, 10), **extra})
    elif variant == "wrong_type":
        body = _json(
            rng.choice(
                [
                    {"input": 5},
                    {"input": ["a", "b"]},
                    {"input": "x", "seed": "abc"},
                    {"prompt_token_ids": "abc"},
                    {"prompt_token_ids": [[1, 2]]},
                    {"input": "x", "max_tokens": 1.5},
                    {"input": "x", "voice": 3},
                    {"input": "x", "speaker_embedding": "abc"},
                ]
            )
        )
    elif variant == "over_budget_max_tokens":
        body = _json(
            {"input": _text(rng, 10), "max_tokens": rng.choice([MAX_BUDGET + 1, 48, 500, 2**31 - 1])}
        )
    elif variant == "prompt_over_context":
        body = _json({"input": _text(rng, rng.randint(CONTEXT, 4 * CONTEXT))})
    elif variant == "max_tokens_1":
        body = _json({"input": _text(rng, 10), "max_tokens": 1})
    elif variant == "bad_json":
        body = rng.choice(
            [
                b'{"input": ',
                b"[1]",
                b'"x"',
                b"",
                b"\xff\xfe",
                b'{"input": "x"}garbage',
                b"null",
                b"{'input': 'x'}",
            ]
        )
    elif variant in ("oversized", "oversized_chunked"):
        body = b'{"input": "' + b"a" * settings.max_body_bytes + b'"}'
        chunked = variant == "oversized_chunked"
    elif variant == "wrong_key":
        headers = {"authorization": rng.choice(["Bearer wrong", f"Basic {key}", "Bearer"])}
        body = _json({"input": "hi"})
    else:
        raise ValueError(variant)
    return Planned(index, "malformed", variant, path, body, headers, settings.request_timeout_s, chunked)


def _json(body: Any) -> bytes:
    return json.dumps(body).encode()


# -- the server ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    base: str
    key: str
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def start_server(settings: SoakSettings, key: str) -> Server:
    """``omnigen serve`` on a free port of 127.0.0.1, as a user starts it; waits for /health."""
    import httpx

    port = free_port()
    log = Path(settings.server_log or Path(tempfile.mkdtemp(prefix="omnigen-soak-")) / "server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {
        # No VLLM_USE_V2_MODEL_RUNNER: the generated worker and scheduler choose the V1 runner.
        **{k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"},
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_PLUGINS": "omnigen",
        "PYTHONPATH": str(REPO_ROOT),
        "OMNIGEN_API_KEY": key,
    }
    command = [
        sys.executable, "-m", "omnigen.cli", "serve", "model=omnigen_tiny", f"serve.port={port}",
        f"serve.max_body_bytes={settings.max_body_bytes}",
    ]  # fmt: skip
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    server = Server(process, f"http://127.0.0.1:{port}", key, log)
    deadline = time.monotonic() + settings.startup_deadline_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"omnigen serve exited {process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.base}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(server)
    raise RuntimeError(
        f"omnigen serve did not come up in {settings.startup_deadline_s:g} s:\n{server.log_tail()}"
    )


def stop_server(server: Server) -> None:
    """Whatever is left of the server and its processes, gone (after a failed or aborted run)."""
    import psutil

    if server.process.poll() is not None:
        return
    try:
        descendants = psutil.Process(server.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    server.process.terminate()
    try:
        server.process.wait(120)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(10)
    _, alive = psutil.wait_procs(descendants, timeout=30)
    for orphan in alive:
        orphan.kill()


def segments(server_pid: int) -> list[str]:
    """The server's shared-memory segments (named by its pid: other runs share the machine)."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"omnigen-{server_pid}-*"))


def engine_deaths(metrics_text: str) -> float:
    """The sum of ``omnigen_engine_deaths_total`` over stages (0 when no stage has died)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("omnigen_engine_deaths_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- resident memory -----------------------------------------------------------------------


class RssSampler:
    """The resident memory of the server and every process under it (engine cores, workers),
    summed, every ``interval_s`` on a thread of its own; ``mark()`` samples at once."""

    def __init__(self, pid: int, interval_s: float) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.interval_s = interval_s
        self.progress = 0
        """Requests done when a sample was taken (the load loop keeps this current)."""
        self.samples: list[dict[str, Any]] = []
        self._started = time.monotonic()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._marks: list[str] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(10)

    def mark(self, label: str) -> None:
        with self._lock:
            self._marks.append(label)
        self._wake.set()

    def sample_now(self, label: str) -> dict[str, Any]:
        """A sample taken on the caller's thread (between phases)."""
        return self._take(label)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._lock:
                label, self._marks = ",".join(self._marks), []
            self._take(label)

    def _take(self, label: str) -> dict[str, Any]:
        import psutil

        total, unique, names, each = 0, 0, [], {}
        try:
            everyone = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            everyone = []
        for process in everyone:
            try:
                memory = process.memory_full_info()
                name = process.name()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            total += memory.rss
            unique += memory.uss
            names.append(name)
            each[f"{name}[{process.pid}]"] = round(memory.rss / 2**20, 1)
        sample = {
            "t_s": round(time.monotonic() - self._started, 3),
            "rss_mib": round(total / 2**20, 2),
            "uss_mib": round(unique / 2**20, 2),
            "processes": len(names),
            "done": self.progress,
            "label": label,
            "rss_mib_by_process": each,
        }
        if label in ("start", "end"):
            sample["names"] = sorted(names)
        with self._lock:
            self.samples.append(sample)
        return sample


def _slope(points: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of ``(x, y)`` points (None for fewer than two distinct x)."""
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread


def rss_figures(samples: list[dict[str, Any]], warmup_done: int) -> dict[str, Any]:
    """Warm-up RSS (the first sample once ``warmup_done`` requests were done) against the end
    (the last sample), and the slope after warm-up, per minute and per 1000 requests."""
    load = [s for s in samples if s["processes"]]
    warm = next((s for s in load if s["done"] >= warmup_done), None)
    if warm is None or not load:
        return {"warmup_mib": None, "end_mib": None, "ratio": None, "samples": samples}
    end = load[-1]
    after = [s for s in load if s["t_s"] >= warm["t_s"]]
    per_s = _slope([(s["t_s"], s["rss_mib"]) for s in after])
    per_request = _slope([(s["done"], s["rss_mib"]) for s in after])
    return {
        "warmup_mib": warm["rss_mib"],
        "warmup_at_done": warm["done"],
        "end_mib": end["rss_mib"],
        "ratio": round(end["rss_mib"] / warm["rss_mib"], 4),
        "peak_mib": max(s["rss_mib"] for s in after),
        "uss_warmup_mib": warm["uss_mib"],
        "uss_end_mib": end["uss_mib"],
        "slope_mib_per_min": None if per_s is None else round(per_s * 60, 3),
        "slope_mib_per_1000_requests": None if per_request is None else round(per_request * 1000, 3),
        "processes": end["processes"],
        "process_names": end.get("names"),
        "by_process_mib": {
            name: {"warmup": mib, "end": end["rss_mib_by_process"].get(name)}
            for name, mib in warm["rss_mib_by_process"].items()
        },
        "samples": samples,
    }


# -- the load ------------------------------------------------------------------------------


@dataclass
class Outcome:
    index: int
    kind: str
    variant: str
    outcome: str
    """The HTTP status (``"200"``) or what happened instead (``client_timeout``, ``refused``,
    ``closed``, ``error:<type>``, ``unfinished``)."""
    latency_s: float | None = None
    started_s: float | None = None
    ended_s: float | None = None
    request_id: str | None = None
    problem: str | None = None
    """A 200 whose body is not what the route returns."""


async def _chunks(body: bytes, size: int = 8192) -> AsyncIterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


async def send(client: Any, request: Planned, origin: float) -> Outcome:
    """One planned request; the outcome, never an exception."""
    import httpx

    started = time.perf_counter()
    outcome = Outcome(request.index, request.kind, request.variant, "unfinished", started_s=started - origin)
    try:
        response = await client.post(
            request.path,
            content=_chunks(request.body) if request.chunked else request.body,
            headers=request.headers,
            timeout=request.timeout_s,
        )
    except httpx.TimeoutException:
        outcome.outcome = "client_timeout"
    except httpx.ConnectError:
        outcome.outcome = "refused"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
        outcome.outcome = "closed"
    except httpx.HTTPError as exc:
        outcome.outcome = f"error:{type(exc).__name__}"
    else:
        outcome.outcome = str(response.status_code)
        outcome.request_id = response.headers.get("x-request-id")
        if outcome.request_id is None:
            outcome.problem = "no X-Request-Id"
        if response.status_code == 200:
            outcome.problem = _check_body(request, response) or outcome.problem
    ended = time.perf_counter()
    outcome.latency_s = ended - started
    outcome.ended_s = ended - origin
    return outcome


def _check_body(request: Planned, response: Any) -> str | None:
    if request.path == "/v1/audio/speech":
        content = response.content
        if (
            response.headers.get("content-type") != "audio/wav"
            or content[:4] != b"RIFF"
            or len(content) <= 44
        ):
            return f"not a WAV with samples ({response.headers.get('content-type')}, {len(content)} bytes)"
        return None
    body = response.json()
    if body.get("audio_samples", 0) <= 0 or set(body.get("token_ids", {})) != {"talker", "code2wav"}:
        return f"unexpected generate body {str(body)[:200]}"
    return None


async def run_load(
    server: Server, planned: list[Planned], settings: SoakSettings, sampler: RssSampler | None
) -> tuple[list[Outcome], float]:
    """Every planned request at ``settings.concurrency``; (outcomes in plan order, wall time).
    Requests not done by ``settings.load_deadline_s`` are cancelled and count as unfinished."""
    import httpx

    outcomes: list[Outcome | None] = [None] * len(planned)
    queue: asyncio.Queue[Planned] = asyncio.Queue()
    for request in planned:
        queue.put_nowait(request)
    warmup = max(1, int(len(planned) * settings.warmup_fraction))
    done = 0
    origin = time.perf_counter()
    limits = httpx.Limits(
        max_connections=settings.concurrency + 8, max_keepalive_connections=settings.concurrency
    )

    async with httpx.AsyncClient(base_url=server.base, limits=limits) as client:

        async def worker() -> None:
            nonlocal done
            while True:
                try:
                    request = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                outcomes[request.index] = await send(client, request, origin)
                done += 1
                if sampler is not None:
                    sampler.progress = done
                    if done == warmup:
                        sampler.mark("warmup")

        workers = [asyncio.create_task(worker()) for _ in range(settings.concurrency)]
        _, pending = await asyncio.wait(workers, timeout=settings.load_deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - origin
    return [
        o if o is not None else Outcome(p.index, p.kind, p.variant, "unfinished")
        for o, p in zip(outcomes, planned, strict=True)
    ], wall


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def load_figures(outcomes: list[Outcome], wall_s: float) -> dict[str, Any]:
    by_kind: dict[str, Counter[str]] = {}
    by_variant: dict[str, Counter[str]] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[o.outcome] += 1
        if o.kind == "malformed":
            by_variant.setdefault(o.variant, Counter())[o.outcome] += 1
    valid = [o for o in outcomes if o.kind == "valid"]
    ok = [o.latency_s for o in valid if o.outcome == "200" and o.latency_s is not None]
    # The load in fifths by completion: a server that slows down as it ages shows it here.
    ended = sorted((o for o in outcomes if o.ended_s is not None), key=lambda o: o.ended_s or 0)
    fifths = []
    for part in range(5):
        chunk = ended[len(ended) * part // 5 : len(ended) * (part + 1) // 5]
        if not chunk:
            continue
        since = ended[len(ended) * part // 5 - 1].ended_s if part else 0.0
        span = (chunk[-1].ended_s or 0) - (since or 0)
        latencies = [o.latency_s for o in chunk if o.kind == "valid" and o.outcome == "200" and o.latency_s]
        fifths.append(
            {
                "requests": len(chunk),
                "rps": round(len(chunk) / span, 2) if span > 0 else None,
                "valid_p50_s": _round(percentile(latencies, 0.5)),
            }
        )
    malformed = [o for o in outcomes if o.kind == "malformed"]
    disconnect = [o for o in outcomes if o.kind == "disconnect"]
    return {
        "status_counts": {kind: dict(sorted(c.items())) for kind, c in sorted(by_kind.items())},
        "malformed_by_variant": {v: dict(sorted(c.items())) for v, c in sorted(by_variant.items())},
        "valid_5xx": sum(o.outcome.startswith("5") for o in valid),
        "valid_not_200": sum(o.outcome != "200" for o in valid),
        "valid_bad_body": [f"{o.index}: {o.problem}" for o in valid if o.problem][:20],
        "malformed_not_4xx": [
            f"{o.index} {o.variant}: {o.outcome}" for o in malformed if not o.outcome.startswith("4")
        ],
        "disconnects_timed_out": sum(o.outcome == "client_timeout" for o in disconnect),
        "disconnects_answered_first": sum(o.outcome != "client_timeout" for o in disconnect),
        "unfinished": sum(o.outcome == "unfinished" for o in outcomes),
        "no_request_id": sum(o.problem == "no X-Request-Id" for o in outcomes),
        "latency_valid_s": {
            "count": len(ok),
            "p50": _round(percentile(ok, 0.5)),
            "p99": _round(percentile(ok, 0.99)),
            "max": _round(max(ok, default=None)),
        },
        "by_fifth": fifths,
        "wall_s": round(wall_s, 3),
        "throughput_rps": round(len(outcomes) / wall_s, 2) if wall_s else None,
        "valid_throughput_rps": round(len(ok) / wall_s, 2) if wall_s else None,
    }


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


# -- after the load ------------------------------------------------------------------------


async def after_load(server: Server, settings: SoakSettings) -> dict[str, Any]:
    """Engine deaths, /health, the state left after one final request, segments."""
    import httpx

    auth = {"authorization": f"Bearer {server.key}"}
    async with httpx.AsyncClient(
        base_url=server.base, headers=auth, timeout=settings.request_timeout_s
    ) as client:
        # vLLM tells a worker what finished or was aborted with the next step's batch: one more
        # request through every stage, after which only its own ids may be held.
        final = await client.post("/v1/audio/speech", json={"input": "the final request", "seed": 1})
        final_id = final.headers.get("x-request-id", "")
        state = (await client.get("/v1/omnigen/state")).json()
        metrics = (await client.get("/metrics")).text
        health = await client.get("/health")
    leaked: dict[str, dict[str, list[str]]] = {}
    held: dict[str, int] = {}
    for stage, fields in state.items():
        for name, ids in fields.items():
            held[f"{stage}.{name}"] = len(ids)
            others = [i for i in ids if not (final_id and str(i).startswith(final_id))]
            if others:
                leaked.setdefault(stage, {})[name] = others[:20]
    log = server.log.read_text(errors="replace")
    return {
        "final_request": {"status": final.status_code, "request_id": final_id},
        "state_held": held,
        "leaked_state": leaked,
        "engine_deaths_metric": engine_deaths(metrics),
        "health": {"status": health.status_code, "body": health.json()},
        "segments_left": segments(server.pid),
        "server_aborts_logged": log.count("client went away: aborted in every stage"),
        "server_tracebacks_logged": log.count("Traceback (most recent call last)"),
    }


async def sigterm_phase(server: Server, settings: SoakSettings) -> dict[str, Any]:
    """SIGTERM while ``settings.concurrency`` clients keep sending valid requests; what each
    request in flight at the signal got, the exit status, processes and segments left."""
    import httpx
    import psutil

    descendants = psutil.Process(server.pid).children(recursive=True)
    rng = random.Random(settings.seed + 1)
    origin = time.perf_counter()
    outcomes: list[Outcome] = []
    in_flight: dict[int, float] = {}
    signalled: list[float] = []
    counter = 0
    # A hang: a request still open once the server had its graceful timeout and a margin.
    client_timeout = GRACEFUL_S + 30
    limits = httpx.Limits(
        max_connections=settings.concurrency + 8, max_keepalive_connections=settings.concurrency
    )
    auth = {"authorization": f"Bearer {server.key}", "content-type": "application/json"}

    async with httpx.AsyncClient(base_url=server.base, limits=limits) as client:

        async def worker() -> None:
            nonlocal counter
            while True:
                counter += 1
                index = counter
                body = valid_body(rng)
                body["max_tokens"] = rng.randint(20, MAX_BUDGET)  # long enough to be caught mid-way
                request = Planned(
                    index, "sigterm", "speech", "/v1/audio/speech", _json(body), auth, client_timeout
                )
                in_flight[index] = time.perf_counter() - origin
                outcome = await send(client, request, origin)
                del in_flight[index]
                outcomes.append(outcome)
                if outcome.outcome in ("refused", "closed") or outcome.outcome.startswith("error:"):
                    return  # the server is gone or going: stop sending
                if signalled and outcome.outcome != "200":
                    return

        workers = [asyncio.create_task(worker()) for _ in range(settings.concurrency)]
        await asyncio.sleep(settings.sigterm_after_s)
        # Signal when most clients have a request open (they always have, but for a moment).
        wait_until = time.perf_counter() + 5
        while len(in_flight) < settings.concurrency // 2 and time.perf_counter() < wait_until:
            await asyncio.sleep(0.005)
        at_signal = dict(in_flight)
        server.process.send_signal(signal.SIGTERM)
        signalled.append(time.perf_counter() - origin)
        _, pending = await asyncio.wait(workers, timeout=settings.shutdown_deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    sigterm_at = signalled[0]
    exit_deadline = time.monotonic() + max(
        10.0, settings.shutdown_deadline_s - (time.perf_counter() - origin)
    )
    try:
        exit_status: int | None = server.process.wait(max(1.0, exit_deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        exit_status = None
        server.process.kill()
        server.process.wait(10)
    exited_after = time.perf_counter() - origin - sigterm_at
    _, alive = psutil.wait_procs(descendants, timeout=30)
    left = []
    for orphan in alive:  # never leave them to fill the machine's memory
        try:
            left.append(f"{orphan.pid} {orphan.name()}")
            orphan.kill()
        except psutil.NoSuchProcess:
            pass
    by_index = {o.index: o for o in outcomes}
    caught = [by_index.get(i, Outcome(i, "sigterm", "speech", "unfinished")) for i in sorted(at_signal)]
    hang_after = GRACEFUL_S + 5
    hung = [
        o.index
        for o in caught
        if o.outcome in ("unfinished", "client_timeout") or (o.ended_s or 0) - sigterm_at > hang_after
    ]
    return {
        "sigterm_at_s": round(sigterm_at, 3),
        "in_flight_at_sigterm": len(at_signal),
        "in_flight_outcomes": dict(sorted(Counter(o.outcome for o in caught).items())),
        "in_flight_last_answer_after_sigterm_s": _round(
            max(((o.ended_s or 0) - sigterm_at for o in caught), default=None), 3
        ),
        "in_flight_hung": hung,
        "in_flight_not_clean": [
            f"{o.index}: {o.outcome}"
            for o in caught
            if not (o.outcome.isdigit() or o.outcome in ("refused", "closed"))
        ],
        "all_outcomes": dict(sorted(Counter(o.outcome for o in outcomes).items())),
        "requests_sent": len(outcomes),
        "exit_status": exit_status,
        "exited_after_sigterm_s": round(exited_after, 3),
        "descendants_before": len(descendants),
        "processes_left": left,
        "segments_left": segments(server.pid),
        "engines_shut_down_logged": "shutting down 2 stage engine(s)" in server.log_tail(20000),
    }


# -- the whole soak ------------------------------------------------------------------------


def commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            run = subprocess.run(
                ["git", "--no-optional-locks", *args],
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=30,
            )
            return run.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain"))}


def soak(settings: SoakSettings, progress: Any = None) -> dict[str, Any]:
    """The whole soak (server started and stopped here); the report (see ``problems``)."""
    say = progress or (lambda _message: None)
    key = secrets.token_hex(16)
    planned = plan_requests(settings, key)
    report: dict[str, Any] = {
        **commit(),
        "settings": dataclasses.asdict(settings),
        "planned": dict(sorted(Counter(p.kind for p in planned).items())),
        "phases_s": {},
    }
    started = time.perf_counter()
    say("starting omnigen serve model=omnigen_tiny ...")
    server = start_server(settings, key)
    report["server_log"] = str(server.log)
    report["server_pid"] = server.pid
    report["phases_s"]["startup"] = round(time.perf_counter() - started, 2)
    try:
        with RssSampler(server.pid, settings.rss_interval_s) as sampler:
            sampler.sample_now("start")
            say(
                f"server up in {report['phases_s']['startup']} s; {len(planned)} requests at {settings.concurrency}"
            )
            phase = time.perf_counter()
            outcomes, wall = asyncio.run(run_load(server, planned, settings, sampler))
            report["load"] = load_figures(outcomes, wall)
            report["phases_s"]["load"] = round(time.perf_counter() - phase, 2)
            phase = time.perf_counter()
            report["after"] = asyncio.run(after_load(server, settings))
            sampler.progress = len(planned)
            sampler.sample_now("end")
            report["phases_s"]["after"] = round(time.perf_counter() - phase, 2)
        warmup = max(1, int(len(planned) * settings.warmup_fraction))
        report["rss"] = rss_figures(sampler.samples, warmup)
        say("load done; SIGTERM with requests in flight ...")
        phase = time.perf_counter()
        report["sigterm"] = asyncio.run(sigterm_phase(server, settings))
        report["phases_s"]["sigterm"] = round(time.perf_counter() - phase, 2)
    finally:
        stop_server(server)
    report["phases_s"]["total"] = round(time.perf_counter() - started, 2)
    report["problems"] = problems(report)
    return report


def problems(report: dict[str, Any], rss_ratio: float = 1.5) -> list[str]:
    """What the soak found wrong (empty: every check passed)."""
    found = []
    load, after, sigterm, rss = report["load"], report["after"], report["sigterm"], report["rss"]
    if load["valid_5xx"]:
        found.append(f"{load['valid_5xx']} valid requests got a 5xx: {load['status_counts'].get('valid')}")
    if load["valid_not_200"]:
        found.append(
            f"{load['valid_not_200']} valid requests did not get a 200: {load['status_counts'].get('valid')}"
        )
    if load["valid_bad_body"]:
        found.append(f"valid requests with a bad body: {load['valid_bad_body']}")
    if load["malformed_not_4xx"]:
        found.append(f"malformed requests without a 4xx: {load['malformed_not_4xx'][:20]}")
    if load["unfinished"]:
        found.append(f"{load['unfinished']} requests unfinished by the load deadline")
    if load["no_request_id"]:
        found.append(f"{load['no_request_id']} responses without X-Request-Id")
    if after["engine_deaths_metric"] or after["health"]["status"] != 200:
        found.append(f"engine deaths: metric {after['engine_deaths_metric']}, /health {after['health']}")
    if after["final_request"]["status"] != 200:
        found.append(f"the final request got {after['final_request']['status']}")
    if after["leaked_state"]:
        found.append(f"per-request state left in the runners: {after['leaked_state']}")
    if after["segments_left"]:
        found.append(f"shared-memory segments left after the load: {after['segments_left']}")
    if rss.get("ratio") is None:
        found.append("no RSS sample after warm-up")
    elif rss["ratio"] >= rss_ratio:
        found.append(f"RSS grew {rss['ratio']}x from warm-up ({rss['warmup_mib']} -> {rss['end_mib']} MiB)")
    if sigterm["exit_status"] != SIGTERM_EXIT:
        found.append(f"exit status after SIGTERM {sigterm['exit_status']}, not {SIGTERM_EXIT}")
    if sigterm["in_flight_at_sigterm"] == 0:
        found.append("no request was in flight at the SIGTERM")
    if sigterm["in_flight_hung"]:
        found.append(f"requests in flight at the SIGTERM hung: {sigterm['in_flight_hung']}")
    if sigterm["in_flight_not_clean"]:
        found.append(
            f"requests in flight at the SIGTERM without a clean end: {sigterm['in_flight_not_clean']}"
        )
    if sigterm["processes_left"]:
        found.append(f"processes left after SIGTERM: {sigterm['processes_left']}")
    if sigterm["segments_left"]:
        found.append(f"shared-memory segments left after SIGTERM: {sigterm['segments_left']}")
    return found


def summary(report: dict[str, Any]) -> str:
    load, after, rss, sigterm = report["load"], report["after"], report["rss"], report["sigterm"]
    latency = load["latency_valid_s"]
    lines = [
        f"soak: {report['settings']['requests']} requests at {report['settings']['concurrency']} "
        f"({report['planned']}), commit {str(report['commit'])[:10]}{' (dirty)' if report['dirty'] else ''}",
        f"  status counts: {load['status_counts']}",
        f"  malformed by variant: {load['malformed_by_variant']}",
        f"  valid 5xx: {load['valid_5xx']}; engine deaths: {after['engine_deaths_metric']:g}, "
        f"/health {after['health']['status']}; server aborts logged: {after['server_aborts_logged']}",
        f"  left after the load: state {after['leaked_state'] or 'none'} (held: "
        f"{ {k: v for k, v in after['state_held'].items() if v} or 'nothing' }), "
        f"segments {after['segments_left'] or 'none'}",
        f"  RSS (server + {rss.get('processes')} processes): warm-up {rss.get('warmup_mib')} MiB -> end "
        f"{rss.get('end_mib')} MiB (x{rss.get('ratio')}), slope {rss.get('slope_mib_per_min')} MiB/min, "
        f"{rss.get('slope_mib_per_1000_requests')} MiB/1000 requests; unique (USS) "
        f"{rss.get('uss_warmup_mib')} -> {rss.get('uss_end_mib')} MiB",
        "  RSS by process (warm-up -> end MiB): "
        + ", ".join(f"{k} {v['warmup']} -> {v['end']}" for k, v in (rss.get("by_process_mib") or {}).items()),
        f"  valid latency p50 {latency['p50']} s, p99 {latency['p99']} s, max {latency['max']} s; "
        f"throughput {load['throughput_rps']} req/s ({load['valid_throughput_rps']} valid 200/s)",
        "  by fifth of the load (req/s, valid p50 s): "
        + ", ".join(f"{f['rps']} {f['valid_p50_s']}" for f in load["by_fifth"]),
        f"  SIGTERM: {sigterm['in_flight_at_sigterm']} in flight -> {sigterm['in_flight_outcomes']} "
        f"(last answer {sigterm['in_flight_last_answer_after_sigterm_s']} s after); exit "
        f"{sigterm['exit_status']} after {sigterm['exited_after_sigterm_s']} s; processes left "
        f"{sigterm['processes_left'] or 'none'}; segments left {sigterm['segments_left'] or 'none'}",
        f"  phases (s): {report['phases_s']}",
        "  problems: " + ("; ".join(report["problems"]) if report["problems"] else "none"),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    defaults = SoakSettings()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--requests", "-n", type=int, default=defaults.requests, help="requests to send (%(default)s)"
    )
    parser.add_argument(
        "--concurrency",
        "-c",
        type=int,
        default=defaults.concurrency,
        help="concurrent requests (%(default)s)",
    )
    parser.add_argument(
        "--malformed", type=float, default=defaults.malformed_fraction, help="fraction (%(default)s)"
    )
    parser.add_argument(
        "--disconnect", type=float, default=defaults.disconnect_fraction, help="fraction (%(default)s)"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="of the request mix (%(default)s)")
    parser.add_argument(
        "--max-body-bytes", type=int, default=defaults.max_body_bytes, help="serve.max_body_bytes"
    )
    parser.add_argument(
        "--rss-interval", type=float, default=defaults.rss_interval_s, help="seconds (%(default)s)"
    )
    parser.add_argument(
        "--load-deadline",
        type=float,
        default=defaults.load_deadline_s,
        help="seconds for the load (%(default)s)",
    )
    parser.add_argument("--server-log", help="where the server's output goes (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON data file (%(default)s)")
    args = parser.parse_args(argv)
    if args.requests <= 0 or args.concurrency <= 0:
        parser.error("--requests and --concurrency must be positive")
    settings = dataclasses.replace(
        defaults,
        requests=args.requests,
        concurrency=args.concurrency,
        malformed_fraction=args.malformed,
        disconnect_fraction=args.disconnect,
        seed=args.seed,
        max_body_bytes=args.max_body_bytes,
        rss_interval_s=args.rss_interval,
        load_deadline_s=args.load_deadline,
        server_log=args.server_log,
    )
    report = soak(settings, progress=lambda message: print(f"soak: {message}", file=sys.stderr, flush=True))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(summary(report))
    print(f"  data: {args.out}")
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
