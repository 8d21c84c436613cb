"""MOSS-TTS (MOSS-TTS-Local and the other MOSS talkers): talker -> codec.

Matches vllm-omni 0.30's ``stage_input_processors/moss_tts.py:talker2codec`` (the codec
stage's ``sync_process_input_func``; the talker has no full-payload producer).
"""

from __future__ import annotations

import torch

from .types import GlueError, NextStageInput, StageResult

NAME = "omnigen.glue.moss_tts.talker2codec"


def talker2codec(source: StageResult) -> NextStageInput:
    """The talker's ``(T, NQ)`` codes -> the codec's prompt, codebook-major (``NQ * T`` ids).

    The codec decodes its prompt ids (it reshapes them back to ``(NQ, T)``); nothing else is
    sent.
    """
    codes = source.get("codes.audio")
    if not isinstance(codes, torch.Tensor) or codes.numel() == 0:
        raise GlueError(NAME, source.request_id, "the talker produced no codes.audio")
    if codes.ndim != 2:
        raise GlueError(NAME, source.request_id, f"codes.audio must be (T, NQ), got {tuple(codes.shape)}")
    return NextStageInput(prompt_token_ids=codes.transpose(0, 1).contiguous().reshape(-1).tolist())
