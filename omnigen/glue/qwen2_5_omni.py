"""Qwen2.5-Omni: thinker -> talker -> code2wav.

Matches vllm-omni 0.30's ``stage_input_processors/qwen2_5_omni.py``: ``thinker2talker`` is
``thinker2talker_full_payload`` (payload) with ``thinker2talker_token_only`` (prompt);
``talker2code2wav`` is ``talker2code2wav_full_payload`` with ``talker2code2wav_token_only``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .types import GlueError, NextStageInput, StageResult, finished_flag, owned_cpu

# The talker's codec vocabulary: ids below PAD are codes; START/PAD/END frame the prompt.
CODEC_PAD = 8292
CODEC_START = 8293
CODEC_END = 8294

THINKER2TALKER = "omnigen.glue.qwen2_5_omni.thinker2talker"
TALKER2CODE2WAV = "omnigen.glue.qwen2_5_omni.talker2code2wav"


def stopped_on_token(source: StageResult) -> bool:
    """Whether the thinker ended by sampling a stop token (EOS or a stop id).

    That token is in the output ids but the thinker never ran a forward on it, so it has no
    hidden row and the talker must not see it. A stop *string* ends on an ordinary token.
    """
    return source.finish_reason == "stop" and not isinstance(source.stop_reason, str)


def thinker2talker(source: StageResult, *, requires_multimodal_data: bool = False) -> NextStageInput:
    """The thinker's hidden states -> the talker's conditioning, and its codec prompt.

    ``hidden`` (the thinker's last-layer rows, prompt then reply, float32) is cut to
    ``prompt + reply - stop`` rows and split at the prompt length: ``embed.prefill`` for the
    prompt, ``hidden_states.output`` for the reply, with their shapes; ``ids.prompt`` and
    ``ids.output`` (without the stop token). The prompt is the talker's codec frame
    ``START, PAD * len(thinker prompt), END``; the caller's multimodal data goes along only to a
    talker that processes it (vllm-omni's talker stage does not: ``requires_multimodal_data``
    is the thinker's alone in its pipeline).
    """
    hidden = source.get("hidden")
    if not isinstance(hidden, torch.Tensor):
        raise GlueError(THINKER2TALKER, source.request_id, f"no 'hidden' tensor in {sorted(source.payload)}")
    prompt_ids = list(source.prompt_token_ids)
    output_ids = list(source.output_token_ids)
    stop = 1 if stopped_on_token(source) else 0
    if stop and output_ids:
        output_ids = output_ids[:-stop]
    rows = max(0, len(prompt_ids) + len(source.output_token_ids) - stop)
    if rows == 0:
        raise GlueError(THINKER2TALKER, source.request_id, "no token to condition the talker on")
    hidden = owned_cpu(hidden, torch.float32)
    if hidden.dim() >= 1 and hidden.shape[0] > rows:
        # More rows than positions the talker aligns with: keep the leading ones.
        hidden = hidden[:rows]
    if hidden.shape[0] < len(prompt_ids):
        raise GlueError(
            THINKER2TALKER,
            source.request_id,
            f"{hidden.shape[0]} hidden rows for a {len(prompt_ids)}-token prompt (prefill not captured)",
        )
    prefill, decode = hidden[: len(prompt_ids)], hidden[len(prompt_ids) :]
    payload: dict[str, Any] = {
        "hidden_states": {"output": decode, "output_shape": list(decode.shape)},
        "embed": {"prefill": prefill, "prefill_shape": list(prefill.shape)},
        "ids": {"prompt": prompt_ids, "output": output_ids},
    }
    multi_modal_data = None
    if requires_multimodal_data and isinstance(source.user_prompt, Mapping):
        multi_modal_data = source.user_prompt.get("multi_modal_data")
    prompt = [CODEC_START, *([CODEC_PAD] * len(prompt_ids)), CODEC_END]
    return NextStageInput(prompt_token_ids=prompt, payload=payload, multi_modal_data=multi_modal_data)


def codec_ids(token_ids: Sequence[int]) -> list[int]:
    """The real codec ids of a talker's output, for code2wav.

    A final END is dropped; START/PAD/END and other control ids are removed. Trailing ``-1``
    placeholders (async scheduling's not-yet-known tokens) stand for codes, so their count
    is kept by repeating the last code, unless the stream ended with END.
    """
    ids = list(token_ids)
    placeholders = len(ids) - len(_rstrip(ids, -1))
    if ids and ids[-1] == CODEC_END:
        ids = ids[:-1]
        placeholders = 0
    codes = [token for token in ids if 0 <= token < CODEC_PAD]
    if placeholders and codes:
        codes.extend([codes[-1]] * placeholders)
    return codes


def _rstrip(ids: list[int], value: int) -> list[int]:
    end = len(ids)
    while end and ids[end - 1] == value:
        end -= 1
    return ids[:end]


def talker2code2wav(source: StageResult) -> NextStageInput:
    """The talker's sampled codec ids -> code2wav's codes (``codes.audio``, a list of ints)
    and a placeholder prompt of the same length."""
    if not source.output_token_ids:
        raise GlueError(TALKER2CODE2WAV, source.request_id, "the talker sampled no token")
    codes = codec_ids(source.output_token_ids)
    if not codes:
        raise GlueError(TALKER2CODE2WAV, source.request_id, "no codec id among the talker's output ids")
    payload = {"codes": {"audio": codes}, "meta": {"finished": finished_flag()}}
    return NextStageInput(prompt_token_ids=[0] * len(codes), payload=payload)
