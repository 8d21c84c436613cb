"""Request builders' tests, and the tiny checkpoints and reference clips they build against
(shared with the differential test, tests/oracle/test_request_builders.py)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

from omnigen_testing.real.cases.qwen3_tts_talker import ARCH, write_speech_checkpoint

# talker_config per variant. The CustomVoice speakers are written mixed-case (the builder
# lowercases them), one of them a dialect speaker whose dialect has its own language id.
QWEN3_TTS_TALKER = {
    "custom_voice": {
        "spk_id": {"Alice": 157, "bob": 158, "chen": 159},
        "spk_is_dialect": {"alice": False, "bob": False, "chen": "sichuan_dialect"},
        "codec_language_id": {"english": 155, "chinese": 156, "sichuan_dialect": 159},
    },
    "voice_design": {},
    "base": {"spk_id": {}, "spk_is_dialect": {}},
}
CODEC_FRAME_RATE = 12.5  # the released tokenizer's: 24000 / 1920


def qwen3_tts_checkpoint(
    folder: Path,
    variant: str,
    *,
    talker: dict[str, Any] | None = None,
    speech: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
) -> Path:
    """The tiny Qwen3-TTS checkpoint of the real-model case, as the ``variant`` checkpoint
    (tts_model_type), with the released tokenizer's 12.5 Hz codec frame rate; ``talker``,
    ``speech`` and ``config`` update talker_config, speech_tokenizer/config.json and config.json
    (a None value removes the key)."""
    write_speech_checkpoint(folder, ARCH)
    path = folder / "config.json"
    data = json.loads(path.read_text())
    data["tts_model_type"] = variant
    _update(data["talker_config"], {**QWEN3_TTS_TALKER.get(variant, {}), **(talker or {})})
    _update(data, config or {})
    path.write_text(json.dumps(data, indent=2))
    speech_path = folder / "speech_tokenizer" / "config.json"
    speech_data = json.loads(speech_path.read_text())
    _update(speech_data, {"encode_downsample_rate": 1920, **(speech or {})})
    speech_path.write_text(json.dumps(speech_data, indent=2))
    return folder


def _update(target: dict[str, Any], changes: dict[str, Any]) -> None:
    for key, value in changes.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value


def wav_bytes(
    seconds: float, rate: int = 24000, channels: int = 1, seed: int = 0, subtype: str = "PCM_16"
) -> bytes:
    """A noise clip as a WAV file."""
    import numpy as np
    import soundfile

    frames = int(round(seconds * rate))
    samples = np.random.default_rng(seed).uniform(-0.5, 0.5, size=(frames, channels)).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, samples if channels > 1 else samples[:, 0], rate, format="WAV", subtype=subtype)
    return buffer.getvalue()


def data_uri(blob: bytes, media_type: str = "audio/wav") -> str:
    return f"data:{media_type};base64,{base64.b64encode(blob).decode('ascii')}"
