"""MiniCPM-o 4.5: llm -> tts -> code2wav.

Matches vllm-omni 0.30's ``stage_input_processors/minicpmo_4_5_omni.py``:

* ``llm2tts``: ``llm2tts`` (the tts stage's input function) for ordinary requests. Its
  full-duplex streaming branch (resumable sessions, per-unit handoffs) is not ported: omnigen
  has no streaming sessions, and a payload with duplex metadata is refused by name.
* ``tts2code2wav``: the payload of ``tts2code2wav_full_payload`` and the prompt of
  ``tts2code2wav_token_only``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .types import GlueError, NextStageInput, StageResult, finished_flag, flat_payload, owned_cpu

# Fixed boundaries of the plain-chat TTS template (the tokenizer's ids; used when the llm
# does not publish its special token ids).
TTS_BOS = 151703
TTS_EOS = 151704
IM_END = 151645
# Special ids that end the TTS span when the llm publishes them.
BOUNDARY_NAMES = (
    "tts_eos_token_id",
    "tts_pad_token_id",
    "listen_token_id",
    "chunk_eos_token_id",
    "chunk_tts_eos_token_id",
    "unit_token_id",
    "unit_end_token_id",
)
CONDITION_SUFFIX = 2
"""Talker positions after the handed-over text condition (its own bos and the first code)."""
SILENCE_CODE = 4218
"""The codec's silence code: the left context code2wav warms up on."""
DEFAULT_LEFT_CONTEXT_FRAMES = 3
"""``codec_left_context_frames`` of vllm-omni's deploy/minicpmo_4_5.yaml."""
REFERENCE_AUDIO_KEY = "_minicpmo45_reference_audio"
"""Where vllm-omni's serving layer puts a reference voice on the prompt (pipeline.py)."""

LLM2TTS = "omnigen.glue.minicpmo_4_5.llm2tts"
TTS2CODE2WAV = "omnigen.glue.minicpmo_4_5.tts2code2wav"


def _as_int(value: Any) -> int | None:
    if hasattr(value, "detach"):
        flat = value.detach().cpu().reshape(-1)
        if flat.numel() == 0:
            return None
        value = flat[0].item()
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def special_token_ids(payload: Mapping[str, Any]) -> dict[str, int]:
    """The special ids the llm published (``special_token_ids.*``, then ``meta.*``), >= 0."""
    flat = flat_payload(payload)
    found: dict[str, int] = {}
    for prefix in ("special_token_ids.", "meta."):
        for key, raw in flat.items():
            value = _as_int(raw) if key.startswith(prefix) else None
            if value is not None and value >= 0:
                found[key[len(prefix) :]] = value
    return found


def _reference_audio(user_prompt: Mapping[str, Any] | None) -> tuple[list[float], int] | None:
    """The caller's voice reference: the first ``audio`` item of ``multi_modal_data`` (or the
    serving layer's reference key), as a mono float waveform list and its sample rate."""
    if not isinstance(user_prompt, Mapping):
        return None
    for audio in (
        _first_audio(user_prompt.get("multi_modal_data")),
        _first_audio({"audio": user_prompt.get(REFERENCE_AUDIO_KEY)}),
    ):
        if audio is not None:
            return audio
    return None


def _first_audio(multi_modal_data: Any) -> tuple[list[float], int] | None:
    if not isinstance(multi_modal_data, dict):
        return None
    item = multi_modal_data.get("audio")
    if isinstance(item, list):
        item = item[0] if item else None
    samples = rate = None
    if isinstance(item, tuple) and len(item) >= 2:
        samples, rate = item[0], item[1]
    elif isinstance(item, dict):
        rate = item.get("sample_rate") or item.get("sampling_rate") or item.get("sr")
        samples = next(
            (item[key] for key in ("audio", "wav", "samples", "array", "waveform") if key in item), None
        )
    if samples is None or rate is None:
        return None
    wave = torch.as_tensor(samples, dtype=torch.float32)
    if wave.ndim > 1:
        # Mix down to mono: channels are the short axis.
        channels_first = wave.shape[0] <= 2 and wave.shape[-1] > wave.shape[0]
        wave = wave.mean(dim=0) if channels_first else wave.mean(dim=-1)
    return wave.reshape(-1).cpu().tolist(), int(rate)


def llm2tts(source: StageResult, *, requires_multimodal_data: bool = False) -> NextStageInput:
    """The llm's reply and hidden states -> the tts stage's text condition.

    * The TTS span of prompt + reply starts after the last ``<|tts_bos|>`` (or, without one,
      at the reply) and ends before the first boundary id after it; the talker is conditioned
      on those ids (``ids.tts``) and the llm's hidden rows for them (``hidden_states.tts``,
      float32, as lists). The hidden rows come from the llm's ``latent`` payload.
    * The buffer also carries the llm's prompt and reply ids and text, the request id and the
      caller's reference voice (``codes.ref``, ``meta.ref_audio_sr``).
    * The prompt: with a span, placeholders for its length plus the talker's two own positions
      (``meta.next_stage_prompt_len``); without one, the reply or else the last prompt id.
    """
    payload = source.payload
    if payload.get("duplex_prompt_token_ids") is not None or source.get("ids.prompt") is not None:
        raise GlueError(
            LLM2TTS, source.request_id, "full-duplex handoffs (duplex prompt metadata) are not supported"
        )
    special = special_token_ids(payload)
    prompt_ids = list(source.prompt_token_ids)
    output_ids = list(source.output_token_ids)
    latent = source.get("latent")
    if not isinstance(latent, torch.Tensor):
        raise GlueError(
            LLM2TTS, source.request_id, f"no latent (the llm's hidden states) in {sorted(payload)}"
        )
    hidden = latent.detach()
    if hidden.ndim == 3 and hidden.shape[0] == 1:
        hidden = hidden.squeeze(0)

    full_ids = prompt_ids + output_ids
    tts_bos = special.get("tts_bos_token_id")
    end_ids = {special[name] for name in BOUNDARY_NAMES if name in special}
    if tts_bos is None:
        tts_bos, end_ids = TTS_BOS, end_ids | {TTS_EOS, IM_END}
    starts = [i + 1 for i, token in enumerate(full_ids) if token == tts_bos]
    start = starts[-1] if starts else (len(prompt_ids) if output_ids else None)
    span_ids = span_hidden = None
    if start is not None and hidden.shape[0] > start:
        end = next((i for i in range(start, len(full_ids)) if full_ids[i] in end_ids), int(hidden.shape[0]))
        span_ids = [int(token) for token in full_ids[start:end]]
        span_hidden = hidden[start:end].to(torch.float32).contiguous().cpu().tolist()

    buffer: dict[str, Any] = {
        "global_request_id": [source.request_id],
        "ids": {"prompt": prompt_ids, "output": output_ids},
        "prompt_token_ids": prompt_ids,
        "llm_output_token_ids": output_ids,
        "llm_output_text": [source.text or ""],
    }
    reference = _reference_audio(source.user_prompt)
    if reference is not None:
        buffer.setdefault("codes", {})["ref"] = reference[0]
        buffer.setdefault("meta", {})["ref_audio_sr"] = reference[1]
    if span_ids is not None:
        buffer["ids"]["tts"] = span_ids
    if span_hidden is not None:
        buffer.setdefault("hidden_states", {})["tts"] = span_hidden

    if span_ids is not None and span_hidden is not None:
        # Placeholders only reserve the talker's positions: its prefill writes the embeddings.
        length = max(len(span_ids), len(span_hidden)) + CONDITION_SUFFIX
        prompt = [0] * length
        meta = buffer.setdefault("meta", {})
        meta["next_stage_prompt_len"] = length
        meta["replace_streaming_prompt"] = True
    elif output_ids:
        prompt = output_ids
    elif prompt_ids:
        prompt = prompt_ids[-1:]
    else:
        raise GlueError(LLM2TTS, source.request_id, "the tts stage needs at least one prompt token")
    multi_modal_data = None
    if requires_multimodal_data and isinstance(source.user_prompt, Mapping):
        multi_modal_data = source.user_prompt.get("multi_modal_data")
    return NextStageInput(prompt_token_ids=prompt, payload=buffer, multi_modal_data=multi_modal_data)


def _codec_scalars(value: Any) -> list[int]:
    """Every code of a codec payload (tensors of any shape, nested lists, ints), in order."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.long).reshape(-1).tolist()
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        return [code for item in value for code in _codec_scalars(item)]
    if isinstance(value, (int, bool)):
        return [int(value)]
    raise TypeError(f"unsupported MiniCPM-o codec value: {type(value).__name__}")


def tts2code2wav(
    source: StageResult, *, left_context_frames: int = DEFAULT_LEFT_CONTEXT_FRAMES
) -> NextStageInput:
    """The tts stage's codes -> code2wav's one terminal chunk, after ``left_context_frames``
    silence codes (the decoder's warm-up context, trimmed from the audio again).

    The payload replaces code2wav's buffer (``meta.replace_runtime_additional_information``)
    and carries the voice reference and metadata the tts request was given. The prompt has
    ``len(codes) + 3`` placeholder positions (vllm-omni's sizing, independent of the context).
    """
    if left_context_frames < 0:
        raise ValueError(f"left_context_frames must be >= 0, got {left_context_frames}")
    routed = source.get("meta.request_id")
    if routed is None:
        routed = source.payload.get("request_id")
    codes = (
        []
        if routed is not None and str(routed) != source.request_id
        else _codec_scalars(source.get("codes.audio"))
    )
    if not codes:
        raise GlueError(TTS2CODE2WAV, source.request_id, "the tts stage produced no codec code")
    context = [SILENCE_CODE] * left_context_frames
    output = [*context, *codes]

    given = source.input_payload
    codes_in, meta_in, duplex_in = (
        given.get(key) if isinstance(given.get(key), Mapping) else {} for key in ("codes", "meta", "duplex")
    )
    ref = codes_in.get("ref")
    segment_text = meta_in.get("native_duplex_segment_text")
    meta: dict[str, Any] = {
        "finished": finished_flag(),
        "stream_finished": finished_flag(),
        "request_id": source.request_id,
        "chunk_seq": 0,
        "cache_epoch": 0,
        "last_chunk": True,
        "req_id": [source.request_id],
        "left_context_size": len(context),
        "replace_runtime_additional_information": True,
        "codec_chunk_frames": len(codes),
        "codec_left_context_frames": len(context),
        "code_flat_numel": len(output),
        "ref_audio_sr": _as_int(meta_in.get("ref_audio_sr")),
        "native_duplex_segment_text": segment_text if isinstance(segment_text, str) else None,
        "duplex_turn_id": _as_int(duplex_in.get("model_turn_id", duplex_in.get("turn_id"))),
        "duplex_epoch": _as_int(duplex_in.get("epoch")),
        "segment_end": bool(meta_in.get("segment_end", False)),
        "turn_end": bool(meta_in.get("turn_end", False)),
        "tts_is_last_chunk": True,
    }
    audio: dict[str, Any] = {"audio": torch.tensor(output, dtype=torch.long)}
    if ref is not None:
        audio["ref"] = owned_cpu(torch.as_tensor(ref, dtype=torch.float32).reshape(-1))
    payload = {
        "codes": audio,
        "meta": {key: value for key, value in meta.items() if value is not None},
        "request_id": source.request_id,
    }
    return NextStageInput(prompt_token_ids=[0] * (len(codes) + 3), payload=payload)
