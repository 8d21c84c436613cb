"""Samples to a WAV file: 16-bit PCM, mono, with the standard library's ``wave``."""

from __future__ import annotations

import io
import wave

import torch


def wav_bytes(samples: torch.Tensor, sample_rate: int) -> bytes:
    """``samples`` (floats in [-1, 1], any shape) as the bytes of a mono 16-bit WAV file."""
    pcm = (samples.detach().to("cpu", torch.float32).reshape(-1).clamp(-1.0, 1.0) * 32767.0).round()
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm.to(torch.int16).numpy().tobytes())
    return buffer.getvalue()
