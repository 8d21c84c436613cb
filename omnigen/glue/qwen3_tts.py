"""Qwen3-TTS: talker (``qwen3_tts`` stage) -> code2wav.

Matches vllm-omni 0.30's ``stage_input_processors/qwen3_tts.py``: the payload of
``talker2code2wav_full_payload`` and the prompt of ``talker2code2wav_token_only`` (both halves
of its full-payload edge), in one function.
"""

from __future__ import annotations

from typing import Any

import torch

from .types import (
    GlueError,
    NextStageInput,
    StageResult,
    Window,
    WindowInput,
    bounds_next_prompt,
    counts_frames,
    finished_flag,
    prompt_list_entry,
)

CODEBOOK_SIZE = 2048
"""Codes of the 12 Hz tokenizer are in [0, 2048)."""
DEFAULT_NUM_QUANTIZERS = 16
"""Codebooks per frame when the payload does not say (the released checkpoints' value)."""

NAME = "omnigen.glue.qwen3_tts.talker2code2wav"
WINDOW_NAME = "omnigen.glue.qwen3_tts.talker2code2wav_window"


def valid_frames(codes: torch.Tensor) -> torch.Tensor:
    """The rows of a ``(frames, Q)`` code tensor that are real codec frames.

    The runner keeps every row it published (CONTRACT 5.1): prefill placeholders (negative),
    all-zero padding rows and anything out of the codebook are dropped here.
    """
    if codes.numel() == 0 or codes.ndim != 2:
        return codes
    in_range = (codes >= 0).all(dim=1) & (codes.max(dim=1).values < CODEBOOK_SIZE)
    return codes[in_range & codes.any(dim=1)]


def _ref_code_len(raw: Any) -> int:
    # meta.ref_code_len is latest-wins: a tensor (last entry counts), an int or absent.
    if isinstance(raw, torch.Tensor):
        value = int(raw.reshape(-1)[-1].item()) if raw.numel() else 0
    else:
        value = 0 if raw is None else int(raw)
    return max(value, 0)


def _ref_codes(raw: Any, num_quantizers: int, ref_code_len: int) -> torch.Tensor | None:
    """The voice-clone reference codes as ``(ref_frames, Q)`` long, or None when unusable."""
    if isinstance(raw, list):
        raw = raw[0] if raw else None
    if not isinstance(raw, torch.Tensor) or raw.numel() == 0:
        return None
    ref = raw.to(device="cpu", dtype=torch.long)
    if ref.ndim == 1:
        if ref.numel() % num_quantizers:
            return None
        ref = ref.reshape(-1, num_quantizers)
    elif ref.ndim != 2:
        return None
    if ref_code_len > 0 and ref.shape[0] > ref_code_len:
        ref = ref[:ref_code_len]
    return ref.contiguous()


def _codes_of_tokens(tokens: int, first_payload: Any, hf_config: Any) -> int:
    """code2wav's longest prompt for a talker budget: one position per code, Q codes a frame,
    a frame per sampled token but the stop token (at least one), plus a clone's reference frames
    (the request builder's ``ref_code_length``)."""
    talker = getattr(hf_config, "talker_config", None)
    num_quantizers = int(getattr(talker, "num_code_groups", DEFAULT_NUM_QUANTIZERS))
    ref = first_payload.get("ref_code_length") if isinstance(first_payload, dict) else None
    ref_frames = int(ref[0]) if isinstance(ref, list) and ref and isinstance(ref[0], int) else 0
    return num_quantizers * (max(tokens - 1, 1) + ref_frames)


@bounds_next_prompt(_codes_of_tokens)
def talker2code2wav(source: StageResult) -> NextStageInput:
    """The talker's codec frames -> code2wav's codes, codebook-major, reference codes first.

    * ``codes.audio`` (one row per scheduled token) is filtered to real frames, then cropped
      to the last ``len(output_token_ids) - 1`` frames: the final sampled token is the stop
      code, which has no frame.
    * Voice-clone reference codes (``codes.ref``, cut to ``meta.ref_code_len``) are prepended
      so the decoder has their acoustic context; ``meta.left_context_size`` tells code2wav how
      many frames to trim from the front of its audio.
    * The prompt is a placeholder of one position per code: code2wav reads the codes from its
      buffer.
    * A take with no usable frame still gets one all-ones frame (about 80 ms of placeholder
      audio), so the consumer runs and the request finishes (vllm-omni #5196, #5471).
    * The caller's ``speaker`` / ``language`` (prompt ``additional_information``) go along.
    """
    audio = source.get("codes.audio")
    frames = None
    if isinstance(audio, torch.Tensor) and audio.numel():
        if audio.ndim != 2:
            # vllm-omni fails on this too (a transpose of a 1-D tensor); say what was wrong.
            raise GlueError(
                NAME, source.request_id, f"codes.audio must be (frames, Q), got {tuple(audio.shape)}"
            )
        frames = valid_frames(audio.to(torch.long))
    if frames is None or frames.numel() == 0:
        payload: dict[str, Any] = {
            "codes": {"audio": torch.ones(DEFAULT_NUM_QUANTIZERS, dtype=torch.long)},
            "meta": {"finished": finished_flag()},
        }
        return NextStageInput(
            prompt_token_ids=[0] * DEFAULT_NUM_QUANTIZERS, payload=_with_voice(payload, source)
        )

    kept = max(len(source.output_token_ids) - 1, 0)
    if kept and frames.ndim == 2 and frames.shape[0] > kept:
        frames = frames[-kept:]
    num_quantizers = (
        int(frames.shape[1]) if frames.ndim == 2 and frames.shape[1] > 0 else DEFAULT_NUM_QUANTIZERS
    )

    ref = _ref_codes(source.get("codes.ref"), num_quantizers, _ref_code_len(source.get("meta.ref_code_len")))
    if ref is not None:
        frames = torch.cat([ref.to(frames.device), frames], dim=0)

    codes = frames.transpose(0, 1).to(device="cpu", dtype=torch.long).reshape(-1).contiguous()
    meta: dict[str, Any] = {"finished": finished_flag()}
    if ref is not None and ref.shape[0] > 0:
        meta["left_context_size"] = int(ref.shape[0])
    payload = {"codes": {"audio": codes}, "meta": meta}
    return NextStageInput(prompt_token_ids=[0] * int(codes.numel()), payload=_with_voice(payload, source))


def _with_voice(payload: dict[str, Any], source: StageResult) -> dict[str, Any]:
    for key in ("speaker", "language"):
        value = prompt_list_entry(source.user_prompt, "additional_information", key)
        if value is not None:
            payload[key] = value
    return payload


def _frames_so_far(source: StageResult) -> torch.Tensor:
    """The talker's real frames so far, cropped as ``talker2code2wav`` crops a finished take
    (one frame per sampled token but the last, whose frame the next step writes)."""
    audio = source.get("codes.audio")
    if not isinstance(audio, torch.Tensor) or audio.ndim != 2 or audio.numel() == 0:
        return torch.zeros((0, DEFAULT_NUM_QUANTIZERS), dtype=torch.long)
    frames = valid_frames(audio.to(torch.long))
    kept = max(len(source.output_token_ids) - 1, 0)
    return frames[-kept:] if kept and frames.shape[0] > kept else frames


@counts_frames(lambda source: int(_frames_so_far(source).shape[0]))
def talker2code2wav_window(source: StageResult, window: Window) -> WindowInput:
    """One window of the talker's frames -> a code2wav request for it (the streaming form of
    ``talker2code2wav``): codebook-major codes of the window and its left context,
    ``meta.left_context_size`` telling code2wav how many frames to trim from the front of its
    audio (it trims them itself, so nothing is dropped here). A voice clone's reference codes
    are the context before the first frame: the first window carries them all, as the full
    payload does, and later windows reach into them when ``left_context`` asks for more frames
    than came before."""
    frames = _frames_so_far(source)
    if window.end > frames.shape[0]:
        raise GlueError(
            WINDOW_NAME,
            source.request_id,
            f"window {window.index} ends at frame {window.end}, the payload holds {int(frames.shape[0])}",
        )
    num_quantizers = int(frames.shape[1]) if frames.shape[1] > 0 else DEFAULT_NUM_QUANTIZERS
    ref = _ref_codes(source.get("codes.ref"), num_quantizers, _ref_code_len(source.get("meta.ref_code_len")))
    ref_frames = 0 if ref is None else int(ref.shape[0])
    history = frames if ref is None else torch.cat([ref.to(frames.device), frames], dim=0)
    left = ref_frames if window.start == 0 else min(window.left_context, ref_frames + window.start)
    piece = history[ref_frames + window.start - left : ref_frames + window.end]
    codes = piece.transpose(0, 1).to(device="cpu", dtype=torch.long).reshape(-1).contiguous()
    # Each window is a whole code2wav request: it ends with its window (no decoder state kept).
    meta: dict[str, Any] = {"finished": finished_flag()}
    if left:
        meta["left_context_size"] = left
    payload = {"codes": {"audio": codes}, "meta": meta}
    return WindowInput(
        request=NextStageInput(
            prompt_token_ids=[0] * int(codes.numel()), payload=_with_voice(payload, source)
        )
    )
