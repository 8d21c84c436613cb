"""``omnigen serve`` over real HTTP on 127.0.0.1: the tiny talker -> code2wav pipeline (issue 8).

The server is the command a user runs, in a subprocess (one engine-core process per stage), and
the client is httpx: concurrent requests get WAV audio of the expected length, a seeded request
twice gets the same bytes, and a client that disconnects mid-request leaves no per-request state
in any stage and no shared-memory segment.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import time
import wave
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 12  # conf/serve/omnigen_tiny.yaml
SAMPLES = (MAX_TOKENS - 1) * 4 * 4  # frames x codebooks x hop_length


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(log: Path, overrides: list[str], env: dict[str, str] | None = None, deadline_s: float = 420):
    """``omnigen serve model=omnigen_tiny`` on a free loopback port, in a session of its own (a
    server that never comes up is killed with its engine cores); returns (base URL, process)."""
    import httpx

    port = free_port()
    environment = {
        # No VLLM_USE_V2_MODEL_RUNNER: the generated worker and scheduler choose the V1 runner.
        **{k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"},
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": str(REPO_ROOT),
        **(env or {}),
    }
    command = [
        sys.executable,
        "-m",
        "omnigen.cli",
        "serve",
        "model=omnigen_tiny",
        f"serve.port={port}",
        *overrides,
    ]
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=environment, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + deadline_s  # two engines start in turn; a loaded machine takes minutes
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"omnigen serve exited {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return base, process
        except httpx.HTTPError:
            time.sleep(1)
    os.killpg(process.pid, signal.SIGKILL)
    pytest.fail(f"omnigen serve did not come up:\n{log.read_text()[-4000:]}")


def stop_server(process: subprocess.Popen) -> None:
    """For a run that skipped the test that stops it: SIGTERM, then the whole session killed."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(120)  # the server shuts each stage's engine down (about 15 s each)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # Room for the long requests of the disconnect test: 100 talker tokens are 400 codes.
    base, process = start_server(
        log,
        ["serve=omnigen_tiny", "serve.stage_engine.code2wav.max_model_len=512"],
        {"VLLM_PLUGINS": "omnigen"},
    )
    yield base, log, process
    stop_server(process)


def samples_of(wav: bytes) -> int:
    with wave.open(io.BytesIO(wav)) as audio:
        assert (audio.getnchannels(), audio.getsampwidth(), audio.getframerate()) == (1, 2, 16000)
        return audio.getnframes()


def segments(server_pid: int) -> set[str]:
    # The server's segments only (named by its pid): other runs share the machine.
    return {p.name for p in Path("/dev/shm").glob(f"omnigen-{server_pid}-*")}


def test_the_start_up_says_what_it_waits_for(server):
    _, log, _ = server
    text = log.read_text()
    assert "starting the talker engine (mp)" in text and "code2wav engine ready in" in text


def test_concurrent_requests_get_wav_audio(server):
    import httpx

    base, _, _ = server

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            return await asyncio.gather(
                *(client.post("/v1/audio/speech", json={"input": f"request {i}"}) for i in range(8))
            )

    for response in asyncio.run(run()):
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "audio/wav"
        assert samples_of(response.content) == SAMPLES


def test_a_seeded_request_twice_gets_the_same_audio(server):
    import httpx

    base, _, _ = server
    body = {"input": "the same words", "seed": 7}
    first = httpx.post(f"{base}/v1/audio/speech", json=body, timeout=120)
    second = httpx.post(f"{base}/v1/audio/speech", json=body, timeout=120)
    other = httpx.post(f"{base}/v1/audio/speech", json={**body, "seed": 8}, timeout=120)
    assert first.status_code == second.status_code == other.status_code == 200
    assert first.content == second.content
    assert other.content != first.content


def test_bad_requests_are_clear_errors(server):
    import httpx

    base, _, _ = server
    assert httpx.post(f"{base}/v1/audio/speech", json={"input": "x", "model": "other"}).status_code == 404
    assert (
        httpx.post(f"{base}/v1/audio/speech", json={"input": "x", "response_format": "wma"}).status_code
        == 400
    )
    assert httpx.post(f"{base}/v1/audio/speech", json={}).status_code == 400
    models = httpx.get(f"{base}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["omnigen_tiny"]


def test_a_client_that_disconnects_leaves_no_state(server):
    import httpx

    base, log, process = server
    before = segments(process.pid)

    def outcomes() -> tuple[int, int]:
        text = log.read_text()
        return text.count("client went away: aborted in every stage"), text.count(": done in ")

    async def running(client: httpx.AsyncClient) -> float:
        metrics = (await client.get("/metrics")).text
        return float(metrics.split("\nomnigen_requests_running ")[1].split()[0])

    async def disconnect_after(client: httpx.AsyncClient, i: int, seconds: float) -> None:
        request = asyncio.create_task(
            client.post("/v1/audio/speech", json={"input": f"long {i}", "max_tokens": 100}, timeout=120)
        )
        await asyncio.sleep(seconds)
        request.cancel()  # closes the connection, unless the answer came first
        with contextlib.suppress(asyncio.CancelledError):
            await request

    async def run() -> int:
        # A 100-token request runs about 0.3 s here and longer on a loaded machine (a timer or a
        # poll of the server alone could not catch it mid-run on a fast one): leave after
        # different delays until three requests were left mid-run.
        delays = [0.1, 0.2, 0.05, 0.15, 0.3, 0.02, 0.5]
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            for attempt in range(28):
                if outcomes()[0] >= aborted_before + 3:
                    return attempt
                await disconnect_after(client, attempt, delays[attempt % len(delays)])
                while await running(client) > 0:  # the request has left the server, one way or another
                    await asyncio.sleep(0.01)
        return 28

    aborted_before, done_before = outcomes()
    attempts = asyncio.run(run())
    aborted, done = outcomes()
    assert aborted - aborted_before == 3, log.read_text()[-3000:]
    # None was answered and aborted both (a request the client left before the server read it is neither).
    assert (aborted - aborted_before) + (done - done_before) <= attempts, log.read_text()[-3000:]
    # vLLM tells a worker what finished or was aborted with the next step's batch: one more request.
    assert httpx.post(f"{base}/v1/audio/speech", json={"input": "after"}, timeout=120).status_code == 200
    state = httpx.get(f"{base}/v1/omnigen/state", timeout=30).json()
    for stage, held in state.items():
        assert all(len(ids) <= 1 for ids in held.values()), (stage, held)
    assert segments(process.pid) == before


def test_streamed_speech_is_the_whole_answer_as_it_is_made(server):
    """The tiny talker streams windows to code2wav (conf/model/omnigen_tiny.yaml): SSE deltas and a
    raw body carry the same PCM16 as the whole WAV of the same seeded request, to the last sample."""
    import base64
    import json

    import httpx

    base, _, _ = server
    body = {"input": "streamed words", "seed": 21}
    whole = httpx.post(f"{base}/v1/audio/speech", json=body, timeout=120)
    assert whole.status_code == 200
    pcm = whole.content[44:]
    assert len(pcm) == SAMPLES * 2

    events = []
    with httpx.stream(
        "POST", f"{base}/v1/audio/speech", json={**body, "stream": True}, timeout=120
    ) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        for line in answer.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 3  # windows of 2, 4, then 8 frames: the audio came in pieces
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == pcm
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["total_tokens"] > 0

    raw = httpx.post(
        f"{base}/v1/audio/speech",
        json={**body, "stream_format": "audio", "response_format": "pcm"},
        timeout=120,
    )
    assert raw.status_code == 200 and raw.headers["content-type"] == "audio/pcm"
    assert raw.content == pcm
    streamed_wav = httpx.post(
        f"{base}/v1/audio/speech", json={**body, "stream_format": "audio"}, timeout=120
    ).content
    assert streamed_wav[:4] == b"RIFF" and streamed_wav[44:] == pcm


def test_whole_answers_in_every_format_and_speed(server):
    import av
    import httpx

    base, _, _ = server
    body = {"input": "formats", "seed": 4}
    for name, media in [
        ("flac", "audio/flac"),
        ("mp3", "audio/mpeg"),
        ("opus", "audio/ogg"),
        ("aac", "audio/aac"),
    ]:
        answer = httpx.post(f"{base}/v1/audio/speech", json={**body, "response_format": name}, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"] == media
        with av.open(io.BytesIO(answer.content)) as container:
            assert sum(frame.samples for frame in container.decode(audio=0)) > 0
    slow = httpx.post(
        f"{base}/v1/audio/speech", json={**body, "speed": 0.5, "response_format": "pcm"}, timeout=120
    )
    assert slow.status_code == 200
    assert abs(len(slow.content) / 2 / (2 * SAMPLES) - 1) < 0.1  # twice as long, pitch kept
    for bad, field in [
        ({"response_format": "ogg"}, "response_format"),
        ({"speed": 9}, "speed"),
        ({"stream_format": "chunks"}, "stream_format"),
        ({"stream": True, "response_format": "mp3"}, "response_format"),
    ]:
        refused = httpx.post(f"{base}/v1/audio/speech", json={**body, **bad}, timeout=30)
        assert refused.status_code == 400 and field in refused.json()["detail"], (bad, refused.text)


def test_sigterm_shuts_every_stage_engine_down(server):
    """Runs last: a terminated server leaves no engine-core or worker process behind."""
    import psutil

    _, log, process = server
    descendants = psutil.Process(process.pid).children(recursive=True)
    assert len(descendants) >= 2, descendants  # an engine core per stage (and their workers)
    process.terminate()
    exit_code = process.wait(120)
    _, alive = psutil.wait_procs(descendants, timeout=30)
    for orphan in alive:  # never leave them to fill the machine's memory
        orphan.kill()
    assert not alive, [f"{p.pid} {p.name()}" for p in alive]
    assert exit_code == 128 + 15  # SIGTERM, after the engines were shut down
    assert "omnigen_tiny: shutting down 2 stage engine(s)" in log.read_text()
