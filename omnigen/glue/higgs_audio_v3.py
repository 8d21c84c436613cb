"""Higgs Audio v3: talker -> code2wav.

Matches vllm-omni 0.30's ``stage_input_processors/higgs_audio_v3.py:talker2code2wav`` (the
code2wav stage's ``sync_process_input_func``; the talker has no full-payload producer).
"""

from __future__ import annotations

from typing import Any

import torch

from .types import GlueError, NextStageInput, StageResult, bounds_next_prompt

NUM_CODEBOOKS = 8
NUM_REAL_CODES = 1024
"""Codes 0-1023 are audio; 1024 (begin of codes) and 1025 (end of codes) frame the delays."""

NAME = "omnigen.glue.higgs_audio_v3.talker2code2wav"


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
    codes = source.get("codes.audio")
    if not isinstance(codes, torch.Tensor) or codes.numel() == 0:
        raise GlueError(NAME, source.request_id, "the talker produced no codes.audio")
    codes = codes.to(torch.long)
    if codes.ndim == 1:
        if codes.numel() % NUM_CODEBOOKS:
            raise GlueError(
                NAME, source.request_id, f"{codes.numel()} flat codes are not frames of {NUM_CODEBOOKS}"
            )
        codes = codes.reshape(-1, NUM_CODEBOOKS)
    if codes.ndim != 2 or codes.shape[1] != NUM_CODEBOOKS:
        raise GlueError(
            NAME, source.request_id, f"codes.audio must be (steps, {NUM_CODEBOOKS}), got {tuple(codes.shape)}"
        )
    codes_qt = codes.transpose(0, 1).contiguous().cpu()
    if codes_qt.shape[1] < NUM_CODEBOOKS:
        raise GlueError(
            NAME,
            source.request_id,
            f"{codes_qt.shape[1]} steps cannot hold the {NUM_CODEBOOKS}-step delay pattern",
        )
    codes_qt = undelay(codes_qt)
    codes_qt = torch.where(
        (codes_qt >= NUM_REAL_CODES) | (codes_qt < 0), torch.zeros_like(codes_qt), codes_qt
    )
    if codes_qt.shape[-1] >= 2:
        codes_qt = codes_qt[:, :-1]
    return NextStageInput(prompt_token_ids=codes_qt.reshape(-1).tolist())
