"""Qwen3-TTS code2wav (``Qwen3TTSCode2Wav``): codec codes in, one waveform per request out.

A generation stage: no sampling. The prompt is ``talker2code2wav_token_only``'s placeholder
(``[0] * Q * frames``) and the codes travel in the payload that ``talker2code2wav_full_payload``
builds from the talker's accumulated ``codes.audio`` (called here on talker-shaped codes:
codebook-major flat ``codes.audio`` plus ``meta.finished``); the model prefers the payload's codes
over the placeholder ids (``_codec_ids_from_payload_or_input``). The stage runs in full-payload
mode, as omnigen's conf builds it (vllm-omni deploys async chunks): each request's whole payload
arrives with it and the model decodes it statelessly (no decoder state keyed by request id).

vllm-omni's generation runner returns no sampled token, so under vLLM's scheduler the request
would never finish: the oracle's scheduler finishes it once its prompt has run, as vllm-omni's
``OmniGenerationScheduler`` does (``harness.oracle_scheduler_cls``). ``max_tokens=1`` lets a
runner that does return a token finish it through vLLM's own length rule; the traces record which
of the two happened (``finished[req].finish_reason``).

The checkpoint is the talker's (``qwen3_tts_talker.write_speech_checkpoint``) with the code2wav
architecture; the decoder upsamples 16 samples per frame.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from omnigen_testing.real.case import RealRequest, RealStageCase
from omnigen_testing.real.cases.qwen3_tts_talker import (
    CODE2WAV_ARCH,
    CODEBOOK,
    NUM_CODE_GROUPS,
    write_speech_checkpoint,
)

FRAMES = {"c2w-a": 6, "c2w-b": 3, "c2w-c": 6}


def _talker_codes(frames: int, start: int) -> Any:
    """``[frames + 1, Q]`` codes as the talker accumulates them (one row per step after the
    prefill; the last step's row belongs to the stop token and is cropped by the producer)."""
    import torch

    rows = [
        [(start + 17 * f + 29 * q) % (CODEBOOK - 1) + 1 for q in range(NUM_CODE_GROUPS)]
        for f in range(frames + 1)
    ]
    return torch.tensor(rows, dtype=torch.long)


def _payload(rid: str, frames: int, start: int) -> dict[str, Any]:
    from vllm_omni.model_executor.stage_input_processors.qwen3_tts import talker2code2wav_full_payload

    request = SimpleNamespace(request_id=rid, output_token_ids=list(range(frames + 1)))
    payload = talker2code2wav_full_payload(None, {"codes.audio": _talker_codes(frames, start)}, request)
    assert int(payload["codes"]["audio"].numel()) == NUM_CODE_GROUPS * frames, payload
    return payload


EXPECT = {
    # One waveform (and its sample rate) per request.
    "payload_keys": ["model_outputs", "sr"],
    # As many frames, different codes: different waveforms.
    "differ": ["c2w-a", "c2w-c"],
}


def requests() -> list[RealRequest]:
    return [
        RealRequest(
            rid, [0] * (NUM_CODE_GROUPS * frames), max_tokens=1, payload=_payload(rid, frames, 11 * i)
        )
        for i, (rid, frames) in enumerate(FRAMES.items())
    ]


def write_checkpoint(folder: Path) -> Path:
    return write_speech_checkpoint(folder, CODE2WAV_ARCH)


CASE = RealStageCase(
    name="qwen3_tts_code2wav",
    omnigen_model="qwen3_tts",
    omnigen_stage="code2wav",
    arch=CODE2WAV_ARCH,
    model_class="vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav.Qwen3TTSCode2Wav",
    oracle_runner="vllm_omni.worker.gpu_generation_model_runner.GPUGenerationModelRunner",
    write_checkpoint=write_checkpoint,
    requests=requests,
    # vLLM disables chunked prefill for a model without KV cache (vllm/v1/engine/core.py:155,
    # "Disabling chunked prefill for model without KVCache"), so a prompt is never split: at 40
    # tokens per step the 24- and 12-id prompts share the first step, the second 24-id one runs
    # alone.
    engine_kwargs={"dtype": "bfloat16", "max_num_batched_tokens": 40},
    # N(0, 0.5) saturates the codec decoder (every sample +-1.0, only signs left to compare).
    redraw_weights_std=0.1,
    # vllm-omni's pipeline for code2wav (qwen3_tts/pipeline.py): stage 1, "audio" output,
    # async_chunk as omnigen's conf/model/qwen3_tts.yaml builds it (the full-payload form).
    omni_model_config={
        "stage_id": 1,
        "model_stage": "code2wav",
        "model_arch": CODE2WAV_ARCH,
        "worker_type": "generation",
        "engine_output_type": "audio",
        "final_output": True,
        "async_chunk": False,
    },
)
