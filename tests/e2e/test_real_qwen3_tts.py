"""Differential pipeline test: ``omnigen run``/``omnigen serve`` against vllm-omni's own pieces.

One tiny real-shaped Qwen3-TTS CustomVoice checkpoint (``omnigen_testing.checkpoints``: one folder
for both stages, safetensors weights, speakers vivian, ryan and dylan, dylan a Beijing-dialect
speaker; three of its tensors scaled so that the text and voice reach the codes, ``SHARPENED``)
serves a handful of speech requests (three voices, English/Auto/Chinese, with and without
instructions, three seeds) two ways, and the audio must be equal sample for sample:

* omnigen: ``omnigen run`` (``serve.mode=inproc``, a subprocess) for one request, and
  ``omnigen serve`` (``mp``: an engine-core process per stage) on a free loopback port for every
  request, one at a time over HTTP (``POST /v1/audio/speech``), then stopped with SIGTERM (it must
  exit 128 + 15 and leave no engine process behind). The WAVs are decoded with ``wave``.
* oracle: one subprocess (``python -m omnigen_testing.qwen3_tts_chain oracle``) that imports
  vllm_omni and chains vllm-omni 0.30's own pieces on vLLM's CPU engine, in the full-payload form
  omnigen runs (``async_chunk: false``): its speech serving layer builds the request, its runners
  run the talker and code2wav, its glue builds the edge (the chain module's docstring says how
  each piece is driven).

Both sides run the same engine arguments (``ChainSettings``: conf/serve/qwen3_tts.yaml's values,
which are vllm-omni's deploy values where it has them, plus this test's small lengths), eager
(``enforce_eager``), and each request alone (no batching on either side). Eager, because vLLM's
compiled bfloat16 kernels round differently from eager ones (even vllm-omni's compiled chain
drifts from its eager one); ``test_compiled_talker_hears_its_request`` runs ``omnigen run``
compiled on two requests of different texts, which must sound different.

What is compared: omnigen's 16-bit WAV samples against the oracle's float audio written with the
same rule (``round(clip(x) * 32767)``), exactly; and against the WAV vllm-omni's own serving layer
writes (``AudioMixin.create_audio``: soundfile, PCM_16). Negative controls: the oracle also runs
the first request with another seed, another voice and another text, and omnigen's audio must
differ from each.

    .venv/bin/python -m pytest -q -m e2e tests/e2e/test_real_qwen3_tts.py
"""

from __future__ import annotations

import base64
import dataclasses
import json
import signal
from typing import Any

import pytest

from omnigen_testing.qwen3_tts_chain import (
    CONTROLS,
    ORACLE_TIMEOUT_S,
    REQUESTS,
    RUN_REQUEST,
    SERVE_TIMEOUT_S,
    ChainSettings,
    ServerEnd,
    _unb64,
    finished_run,
    first_difference,
    free_port,
    kill_all,
    oracle_results,
    pcm16,
    post_speech,
    post_speech_streamed,
    require_vllm_omni,
    speech_body,
    start_oracle,
    start_run,
    start_serve,
    stop_server,
    wait_healthy,
    wav_samples,
    write_checkpoint,
)

pytestmark = pytest.mark.e2e
require_vllm_omni()

# The comparison runs eager on both sides (enforce_eager): see test_compiled_talker_hears_its_request.
EAGER = ChainSettings(enforce_eager=True)
COMPILED = ChainSettings()


@dataclasses.dataclass
class Runs(ServerEnd):
    voices: dict[str, Any]
    oracle: dict[str, dict[str, dict[str, Any]]]
    """chain ("eager") -> request id -> the oracle's result."""
    served: dict[str, bytes]
    run: dict[str, bytes]
    """``omnigen run``'s WAVs: "eager", "compiled" (the first request), "compiled:text" (its text control)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Everything runs once, side by side: the oracle process, ``omnigen serve`` and ``omnigen run``
    (eager; and twice with vLLM's default compilation); once the server is up every request goes
    to it, one at a time."""
    import httpx

    root = tmp_path_factory.mktemp("real_qwen3_tts")
    checkpoint = write_checkpoint(root / "checkpoint")
    oracle = start_oracle(checkpoint, {"eager": EAGER}, root / "oracle.log", root / "oracle")
    assert oracle.stdin is not None
    commands = [{"chain": "eager", "requests": [*REQUESTS, RUN_REQUEST, *CONTROLS]}, {"quit": True}]
    oracle.stdin.write("".join(json.dumps(command) + "\n" for command in commands))
    oracle.stdin.flush()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    serve = start_serve(checkpoint, EAGER, port, root / "serve.log")
    # omnigen run: the first request eager; with vLLM's default compilation, it and the text control.
    jobs = {
        "eager": (EAGER, RUN_REQUEST),
        "compiled": (COMPILED, RUN_REQUEST),
        "compiled:text": (COMPILED, {**CONTROLS[2], "max_tokens": None}),
    }
    wavs = {name: root / f"run-{name.replace(':', '-')}.wav" for name in jobs}
    logs = {name: root / f"run-{name.replace(':', '-')}.log" for name in jobs}
    runs = {
        name: start_run(checkpoint, settings, spec, wavs[name], logs[name])
        for name, (settings, spec) in jobs.items()
    }
    try:
        wait_healthy(serve, base, root / "serve.log", SERVE_TIMEOUT_S)
        served: dict[str, bytes] = {}
        with httpx.Client(base_url=base, timeout=120) as client:
            voices = client.get("/v1/audio/voices").json()
            for spec in REQUESTS:
                served[spec["id"]] = post_speech(client, speech_body(spec), spec["id"])
            # The first request again, streamed: raw PCM16 as code2wav decodes each window.
            served["stream:" + REQUESTS[0]["id"]] = post_speech_streamed(client, speech_body(REQUESTS[0]))
        end = stop_server(serve, root / "serve.log")
        run = {name: finished_run(process, wavs[name], logs[name]) for name, process in runs.items()}
        out, _ = oracle.communicate(timeout=ORACLE_TIMEOUT_S)
    finally:
        kill_all(serve, oracle, *runs.values())
    return Runs(
        oracle={"eager": oracle_results(out, root / "oracle.log", commands=True)},
        served=served,
        run=run,
        voices=voices,
        **vars(end),  # ServerEnd: serve_exit, orphans, serve_log
    )


def oracle_pcm(runs: Runs, request_id: str, chain: str = "eager") -> Any:
    return pcm16(_unb64(runs.oracle[chain][request_id]["audio"]))


def test_the_oracle_made_real_audio(runs: Runs):
    """The oracle's audio has the expected length (16 samples per codec frame, one frame per
    talker token but the last), is not silence, and the talker's codes reached code2wav; so the
    equalities below are not those of empty or constant audio."""
    import numpy as np

    for spec in [*REQUESTS, RUN_REQUEST, *CONTROLS]:
        result = runs.oracle["eager"][spec["id"]]
        audio = _unb64(result["audio"])
        frames = len(result["codes"]) // 4  # four code groups
        assert result["sample_rate"] == 24000
        assert frames >= 1 and audio.size == 16 * frames, (spec["id"], frames, audio.size)
        assert len(np.unique(pcm16(audio))) > 10, spec["id"]
        assert result["code2wav_prompt_len"] == len(result["codes"])
        assert result["token_ids"] == result["runner_output_token_ids"]
        assert len(result["token_ids"]) <= (spec["max_tokens"] or EAGER.default_max_tokens)
    # The conditioning reaches the talker: each request's codes are its own.
    codes = [tuple(runs.oracle["eager"][spec["id"]]["codes"]) for spec in [*REQUESTS, *CONTROLS]]
    assert len(set(codes)) == len(codes)


def test_served_audio_equals_vllm_omni(runs: Runs):
    """Each request over HTTP: omnigen's WAV samples equal the oracle's audio, sample for sample."""
    problems = []
    for spec in REQUESTS:
        ours, rate = wav_samples(runs.served[spec["id"]])
        assert rate == runs.oracle["eager"][spec["id"]]["sample_rate"]
        problem = first_difference(ours, oracle_pcm(runs, spec["id"]))
        if problem:
            problems.append(f"{spec['id']}: {problem}")
    assert not problems, "omnigen serve's audio differs from vllm-omni's:\n" + "\n".join(problems)


def test_streamed_audio_equals_the_whole_answer(runs: Runs):
    """The streaming edge of the shipped config (windows of 1, then 25 frames, 72 frames of left
    context, paced playback): the streamed PCM holds every sample of the whole WAV answer, each
    within code2wav's bf16 rounding (its windows decode the same codes in other batches)."""
    import numpy as np

    whole, _ = wav_samples(runs.served[REQUESTS[0]["id"]])
    streamed = np.frombuffer(runs.served["stream:" + REQUESTS[0]["id"]], dtype="<i2")
    assert streamed.shape == np.asarray(whole).shape  # no sample dropped or doubled at a seam
    gap = int(np.abs(streamed.astype(np.int32) - np.asarray(whole).astype(np.int32)).max())
    assert gap <= 32, first_difference(streamed, whole)  # 1e-3 of full scale


def test_run_audio_equals_vllm_omni(runs: Runs):
    """``omnigen run`` (inproc, the configured token budget) equals the oracle, and equals the
    same request served over HTTP with that budget named."""
    ours, rate = wav_samples(runs.run["eager"])
    assert rate == 24000
    assert first_difference(ours, oracle_pcm(runs, RUN_REQUEST["id"])) is None
    assert first_difference(ours, wav_samples(runs.served[REQUESTS[0]["id"]])[0]) is None


def test_negative_controls_differ(runs: Runs):
    """Another seed, voice or text on the oracle side gives other audio: the comparison above can
    fail, and would fail for a port that lost the seed, the voice or the text."""
    ours, _ = wav_samples(runs.served[REQUESTS[0]["id"]])
    for control in CONTROLS:
        assert first_difference(ours, oracle_pcm(runs, control["id"])) is not None, control["id"]


def test_compiled_talker_hears_its_request(runs: Runs):
    """With vLLM's default compilation, ``omnigen run``'s audio depends on the request: the first
    request and its text control (same voice and seed, another text) sound different, as they do
    eager and in vllm-omni. (Before the generated talker's dummy runs fed the model its
    embeddings, vLLM compiled it once on the ids path and it ignored the text and the voice:
    ``vllm_api.dummy_runs_feed_embeddings``.) (The compiled audio is not compared with the oracle's: vLLM's compiled
    bfloat16 kernels round differently from eager ones, so even vllm-omni's compiled chain drifts
    from its eager one after a few tokens.)"""
    assert (
        first_difference(oracle_pcm(runs, RUN_REQUEST["id"]), oracle_pcm(runs, CONTROLS[2]["id"])) is not None
    )
    same = first_difference(wav_samples(runs.run["compiled"])[0], wav_samples(runs.run["compiled:text"])[0])
    assert same is not None, "the compiled talker gave two requests of different texts the same audio"


def test_wav_bytes_match_vllm_omnis(runs: Runs):
    """omnigen's WAV decodes to the samples vllm-omni's serving layer writes for the same audio
    (its ``create_audio``: soundfile, PCM_16). The two float-to-16-bit rules are not the same
    (omnigen rounds x * 32767; libsndfile writes 0.1 as 3276 where omnigen writes 3277), but they
    agree on this audio, which code2wav computes in bfloat16 (x * 32768 is then mostly an integer)."""
    problems = []
    for spec in REQUESTS:
        ours, _ = wav_samples(runs.served[spec["id"]])
        theirs, _ = wav_samples(base64.b64decode(runs.oracle["eager"][spec["id"]]["wav"]))
        problem = first_difference(ours, theirs)
        if problem:
            problems.append(f"{spec['id']}: {problem}")
    assert not problems, "\n".join(problems)


def test_voices_and_shutdown(runs: Runs):
    """The server lists the checkpoint's voices; SIGTERM stops it (128 + 15) with no engine
    process left behind."""
    assert runs.voices["voices"] == ["dylan", "ryan", "vivian"]
    assert runs.serve_exit == 128 + signal.SIGTERM, runs.serve_log[-3000:]
    assert not runs.orphans, runs.orphans
    assert "qwen3_tts: shutting down 2 stage engine(s)" in runs.serve_log
