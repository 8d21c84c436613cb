"""MiMo-Audio: fused thinker-talker -> code2wav.

Matches vllm-omni 0.30's ``stage_input_processors/mimo_audio.py``: the payload of
``llm2code2wav_full_payload`` and the prompt of ``llm2code2wav_token_only``.
"""

from __future__ import annotations

import torch

from .types import GlueError, NextStageInput, StageResult, finished_flag

CODEC_PAD = 151667
"""The talker's codec pad id (``config_mimo_audio.TALKER_CODEC_PAD_TOKEN_ID``): each frame
group the code2wav stage decodes starts with one pad row."""
MAX_CODE2WAV_TOKENS = 18192
"""The code2wav stage's ``max_model_len`` in vllm-omni's deploy config: longer code
sequences are cut (a longer prompt would not fit the stage)."""

NAME = "omnigen.glue.mimo_audio.llm2code2wav"


def nonzero_groups(codes: torch.Tensor) -> torch.Tensor:
    """Drop the all-zero groups of a ``(N, 1, 8, 4)`` code tensor (steps without audio)."""
    if codes.ndim != 4 or codes.numel() == 0:
        return codes
    return codes[(codes != 0).flatten(1).any(dim=1)]


def pad_and_flatten(codes: torch.Tensor, pad: int) -> torch.Tensor:
    """Prepend a pad row to each ``(rows, C)`` group and flatten column by column.

    ``(..., R, C)`` -> ``(..., C, R + 1)`` -> 1-D: the layout the code2wav stage reads.
    """
    pad_rows = torch.full(
        (*codes.shape[:-2], 1, codes.shape[-1]), pad, dtype=codes.dtype, device=codes.device
    )
    padded = torch.cat([pad_rows, codes], dim=-2)
    return padded.transpose(-1, -2).reshape(-1)


def llm2code2wav(source: StageResult) -> NextStageInput:
    """The fused stage's codec groups -> code2wav's codes (``codes.audio``, a list of ints)
    and a placeholder prompt of the same length (capped at ``MAX_CODE2WAV_TOKENS``)."""
    codes = source.get("codes.audio")
    if not isinstance(codes, torch.Tensor) or codes.numel() == 0:
        raise GlueError(NAME, source.request_id, f"missing or empty codes.audio in {sorted(source.payload)}")
    codes = nonzero_groups(codes.to(torch.long))
    if codes.numel() == 0:
        raise GlueError(NAME, source.request_id, "every codec group is all zeros")
    if codes.ndim < 2:
        raise GlueError(
            NAME, source.request_id, f"codes.audio must be (N, 1, 8, 4), got {tuple(codes.shape)}"
        )
    flat = pad_and_flatten(codes, CODEC_PAD).tolist()[:MAX_CODE2WAV_TOKENS]
    payload = {"codes": {"audio": flat}, "meta": {"finished": finished_flag()}}
    return NextStageInput(prompt_token_ids=[0] * len(flat), payload=payload)
