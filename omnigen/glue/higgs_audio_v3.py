"""Higgs Audio v3: talker -> code2wav.

Matches vllm-omni 0.30's ``stage_input_processors/higgs_audio_v3.py``: ``talker2code2wav`` is its
``talker2code2wav`` (the code2wav stage's ``sync_process_input_func``; the talker has no
full-payload producer), ``talker2code2wav_window`` its ``talker2code2wav_async_chunk`` with one
code2wav request per window.
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
)

NUM_CODEBOOKS = 8
NUM_REAL_CODES = 1024
"""Codes 0-1023 are audio; 1024 (begin of codes) and 1025 (end of codes) frame the delays."""

NAME = "omnigen.glue.higgs_audio_v3.talker2code2wav"
WINDOW_NAME = "omnigen.glue.higgs_audio_v3.talker2code2wav_window"

RIGHT_HOLDBACK_FRAMES = 4
"""Frames after a window that its request decodes too and code2wav trims: the codec is not
causal, and the window's last samples need them (vllm-omni's deploy/higgs_multimodal_qwen3.yaml,
``codec_right_holdback_frames``; the stream config has no such knob, so it is this function's)."""


def undelay(codes_qt: torch.Tensor) -> torch.Tensor:
    """Undo the MusicGen delay pattern: ``(Q, T + Q - 1)`` -> ``(Q, T)``.

    Codebook ``i`` runs ``i`` steps late, so its frame ``t`` is at column ``t + i``.
    """
    q, t = codes_qt.shape
    frames = t - q + 1
    return torch.stack([codes_qt[i, i : i + frames] for i in range(q)])


def _codes_of_tokens(tokens: int, first_payload: Any, hf_config: Any) -> int:
    """code2wav's longest prompt for a talker budget of ``tokens``: the talker publishes no codes
    at its prefill step and one delay-pattern row at each later step (vllm-omni's runner and
    omnigen's alike, with prefix caching off), so ``tokens`` sampled tokens give at most
    ``tokens - 1`` rows, which undo into ``rows - 7`` frames, less the last one: 8 codes a frame,
    ``8 x max(1, tokens - 9)`` codes."""
    return NUM_CODEBOOKS * max(1, tokens - 1 - NUM_CODEBOOKS)


@bounds_next_prompt(_codes_of_tokens, min_producer_tokens=NUM_CODEBOOKS + 1)
def talker2code2wav(source: StageResult) -> NextStageInput:
    """The talker's delayed codes -> code2wav's prompt: the codes, codebook-major.

    ``codes.audio`` is ``(steps, 8)`` (or flat). The delay pattern is undone first, then any
    non-audio code (BOC, EOC, -1) becomes 0 (not clamped: 1025 -> 1023 would be a real code),
    and the last frame, the codec's ramp-down, is dropped. The codes are the prompt itself;
    there is no payload.
    """
    codes = _delayed_rows(source, NAME)
    if codes is None:
        raise GlueError(NAME, source.request_id, "the talker produced no codes.audio")
    if codes.shape[0] < NUM_CODEBOOKS:
        raise GlueError(
            NAME,
            source.request_id,
            f"{codes.shape[0]} steps cannot hold the {NUM_CODEBOOKS}-step delay pattern",
        )
    codes_qt = _audio_frames(codes)
    if codes_qt.shape[-1] >= 2:
        codes_qt = codes_qt[:, :-1]
    return NextStageInput(prompt_token_ids=codes_qt.reshape(-1).tolist())


def _delayed_rows(source: StageResult, glue: str) -> torch.Tensor | None:
    """The talker's delay-pattern rows so far, ``(steps, 8)`` long on the CPU; None if none."""
    codes = source.get("codes.audio")
    if not isinstance(codes, torch.Tensor) or codes.numel() == 0:
        return None
    codes = codes.to("cpu", torch.long)
    if codes.ndim == 1:
        if codes.numel() % NUM_CODEBOOKS:
            raise GlueError(
                glue, source.request_id, f"{codes.numel()} flat codes are not frames of {NUM_CODEBOOKS}"
            )
        codes = codes.reshape(-1, NUM_CODEBOOKS)
    if codes.ndim != 2 or codes.shape[1] != NUM_CODEBOOKS:
        raise GlueError(
            glue, source.request_id, f"codes.audio must be (steps, {NUM_CODEBOOKS}), got {tuple(codes.shape)}"
        )
    return codes


def _audio_frames(rows: torch.Tensor) -> torch.Tensor:
    """Delay-pattern rows (at least 8) -> their codec frames ``(8, rows - 7)``, any non-audio code
    (BOC, EOC, -1) made 0 (not clamped: 1025 -> 1023 would be a real code). Frame ``t`` needs rows
    ``t`` to ``t + 7`` only, so the frames of a take so far are the first of its final ones."""
    frames = undelay(rows.transpose(0, 1).contiguous())
    return torch.where((frames >= NUM_REAL_CODES) | (frames < 0), torch.zeros_like(frames), frames)


def _frames_so_far(source: StageResult) -> torch.Tensor:
    rows = _delayed_rows(source, WINDOW_NAME)
    if rows is None or rows.shape[0] < NUM_CODEBOOKS:
        return torch.zeros((NUM_CODEBOOKS, 0), dtype=torch.long)
    return _audio_frames(rows)


def _window_frames(source: StageResult, frames: int) -> int:
    """How many of ``frames`` frames windows may end by: while the talker runs, all but the last
    ``RIGHT_HOLDBACK_FRAMES`` (a window's right context); once it finished, all but the last one,
    the codec's ramp-down, which ``talker2code2wav`` drops too (a take of one frame keeps it)."""
    if source.finish_reason is None:
        return max(frames - RIGHT_HOLDBACK_FRAMES, 0)
    return frames - 1 if frames >= 2 else frames


@counts_frames(lambda source: _window_frames(source, int(_frames_so_far(source).shape[1])))
def talker2code2wav_window(source: StageResult, window: Window) -> WindowInput:
    """One window of the talker's frames -> a code2wav request for it (the streaming form of
    ``talker2code2wav``).

    The prompt is the codes of the ``left_context`` frames before the window, the window's and up
    to ``RIGHT_HOLDBACK_FRAMES`` after it (none after a finished take's last frame), codebook-major;
    ``meta.left_context_size`` and ``meta.right_holdback_size`` count the frames before and after.
    code2wav decodes each request alone and trims ``left_context_size`` and ``right_holdback_size``
    frames of samples off its audio itself, with or without vllm-omni's async chunk (it keeps no
    state between chunks), so nothing is dropped here.
    """
    frames = _frames_so_far(source)
    ready = _window_frames(source, int(frames.shape[1]))
    left = window.left_context
    if window.start < left or window.end > ready:
        raise GlueError(
            WINDOW_NAME,
            source.request_id,
            f"window {window.index} needs frames [{window.start - left}, {window.end}), {ready} are ready",
        )
    available = ready if source.finish_reason is not None else int(frames.shape[1])
    right = min(RIGHT_HOLDBACK_FRAMES, available - window.end)
    codes = frames[:, window.start - left : window.end + right].reshape(-1)
    payload = {"meta": {"left_context_size": left, "right_holdback_size": right}}
    return WindowInput(request=NextStageInput(prompt_token_ids=codes.tolist(), payload=payload))
