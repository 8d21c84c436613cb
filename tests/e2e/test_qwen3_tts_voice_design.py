"""Qwen3-TTS VoiceDesign served from its (tiny real-shaped) checkpoint by ``omnigen run``: the
instructions reach the talker, and a request the checkpoint cannot serve is refused by name.

The CustomVoice checkpoint is compared sample for sample with vllm-omni's own chain
(``test_real_qwen3_tts.py``); this covers the other task's path through the same pipeline.
"""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
import wave

import pytest

from omnigen_testing.qwen3_tts_chain import REPO_ROOT, omnigen_environment

pytestmark = pytest.mark.e2e

if importlib.util.find_spec("vllm_omni") is None:
    pytest.skip("vllm-omni (the provider of Qwen3-TTS's classes) is not installed", allow_module_level=True)

ENGINE = [
    "serve.mode=inproc",
    "serve.engine.enforce_eager=true",
    "serve.engine.max_num_seqs=4",
    "serve.stage_engine.qwen3_tts.max_model_len=512",
    "serve.stage_engine.qwen3_tts.dtype=bfloat16",
    "serve.stage_engine.code2wav.max_model_len=2048",
    "serve.stage_engine.code2wav.max_num_batched_tokens=2048",
    "serve.sampling.qwen3_tts.max_tokens=16",
    "serve.seed=3",
    "serve.prompt='hello world the quick brown fox'",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from omnigen_testing.checkpoints import write_qwen3_tts

    return write_qwen3_tts(tmp_path_factory.mktemp("vd") / "checkpoint", "voice_design")


def _run(checkpoint, out, *overrides: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "omnigen.cli", "run", "model=qwen3_tts", f"serve.checkpoint={checkpoint}",
        f"serve.output={out}", *ENGINE, *overrides,
    ]  # fmt: skip
    return subprocess.run(
        command, cwd=REPO_ROOT, env=omnigen_environment(), capture_output=True, text=True, timeout=600
    )


def _frames(path) -> bytes:
    with wave.open(io.BytesIO(path.read_bytes())) as audio:
        assert audio.getframerate() == 24000  # the checkpoint's speech tokenizer says so
        return audio.readframes(audio.getnframes())


def test_the_instructions_shape_the_voice(checkpoint, tmp_path):
    calm, bright = tmp_path / "calm.wav", tmp_path / "bright.wav"
    for out, words in ((calm, "a calm voice"), (bright, "a bright quick speaker")):
        done = _run(checkpoint, out, f"serve.request.instructions='{words}'")
        assert done.returncode == 0, done.stderr[-3000:]
    again = tmp_path / "calm_again.wav"
    assert _run(checkpoint, again, "serve.request.instructions='a calm voice'").returncode == 0
    assert _frames(calm) and _frames(calm) == _frames(again)  # seeded: the same request, the same audio
    assert _frames(calm) != _frames(bright)


def test_a_request_the_checkpoint_cannot_serve_is_refused_by_name(checkpoint, tmp_path):
    done = _run(checkpoint, tmp_path / "x.wav")  # VoiceDesign without instructions
    assert done.returncode == 1
    assert "serve.request.instructions" in done.stderr
    done = _run(
        checkpoint, tmp_path / "y.wav", "serve.request.instructions='calm'", "serve.request.voice=ryan"
    )
    assert done.returncode == 1 and "serve.request.voice" in done.stderr
    assert not (tmp_path / "x.wav").exists() and not (tmp_path / "y.wav").exists()
