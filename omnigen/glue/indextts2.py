"""IndexTTS-2 / IndexTTS-2.5: talker (GPT, autoregressive) -> S2Mel decoder.

Matches vllm-omni 0.30's ``stage_input_processors/indextts2.py``: the payload of
``talker2s2mel_full_payload`` and the prompt of ``talker2s2mel_token_only``.
"""

from __future__ import annotations

from typing import Any

import torch

from .types import GlueError, NextStageInput, StageResult, owned_cpu

STOP_MEL_TOKEN = 8193
"""The talker's end-of-mel code: everything from the first one on is not speech."""
CONDITIONING_KEYS = ("S_ref", "ref_mel", "style")
"""The voice prompt's features the talker computed at prefill, which S2Mel needs too."""

NAME = "omnigen.glue.indextts2.talker2s2mel"


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return owned_cpu(tensor).contiguous()


def _mel_sequence(codes: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.long).reshape(-1).contiguous()


def _latent_sequence(latent: torch.Tensor) -> torch.Tensor:
    """``(L, D)`` from a ``(D,)``, ``(L, D)``, ``(1, L, D)`` or otherwise ``(..., D)`` latent."""
    if latent.ndim <= 1:
        return latent.reshape(1, -1).contiguous()
    if latent.ndim == 3 and latent.shape[0] == 1:
        return latent[0].contiguous()
    return latent.reshape(-1, latent.shape[-1]).contiguous()


def cut_at_stop(
    mel: torch.Tensor, latent: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``(mel[:n], latent[:n], n)``, ``n`` the position of the first stop code (or the length)."""
    stops = (mel == STOP_MEL_TOKEN).nonzero()
    length = int(stops[0].item()) if stops.numel() else int(mel.shape[0])
    return mel[:length], (latent[:length] if latent is not None else None), length


def talker2s2mel(source: StageResult) -> NextStageInput:
    """The talker's mel codes (and GPT latent) plus the voice conditioning -> S2Mel's inputs.

    * Mel codes: ``codes.mel`` when the talker runs with its GPT latent
      (``meta.use_gpt_latent``), else the talker's sampled ids (each sampled id is a mel code).
      Cut at the first stop code; ``mel_codes`` is ``(1, n)``, ``code_lens`` ``(1,)``.
    * With the latent: ``latent`` ``(1, n, D)``, which must have one row per mel code.
    * ``S_ref``, ``ref_mel``, ``style`` (required), ``duration_factor`` (1.0 by default) and
      the request's sampling ``seed`` (S2Mel draws its own noise, reproducibly).
    * The prompt is one placeholder: S2Mel reads everything from its buffer.
    """
    use_latent_value = source.get("meta.use_gpt_latent")
    if use_latent_value is None:
        raise GlueError(NAME, source.request_id, "meta.use_gpt_latent is missing")
    use_latent = bool(use_latent_value)
    if use_latent:
        mel, latent = source.get("codes.mel"), source.get("hidden_states.latent")
    else:
        if not source.output_token_ids:
            raise GlueError(NAME, source.request_id, "the talker sampled no mel code")
        mel, latent = torch.tensor(list(source.output_token_ids), dtype=torch.long), None
    if not isinstance(mel, torch.Tensor) or mel.numel() == 0:
        raise GlueError(NAME, source.request_id, f"missing mel codes (use_gpt_latent={use_latent})")
    mel = _mel_sequence(mel)

    if use_latent:
        if not isinstance(latent, torch.Tensor) or latent.numel() == 0:
            raise GlueError(NAME, source.request_id, "the GPT latent (hidden_states.latent) is missing")
        latent = _latent_sequence(latent)
        if latent.shape[0] != mel.shape[0]:
            raise GlueError(
                NAME, source.request_id, f"{mel.shape[0]} mel codes but {latent.shape[0]} latent rows"
            )

    mel, latent, length = cut_at_stop(mel.cpu(), latent.detach().cpu() if use_latent else None)
    payload: dict[str, Any] = {
        "mel_codes": _cpu_copy(mel.unsqueeze(0)),
        "code_lens": torch.tensor([length], dtype=torch.long),
        "use_gpt_latent": use_latent,
    }
    if latent is not None:
        payload["latent"] = _cpu_copy(latent.unsqueeze(0))
    duration = source.get("meta.duration_factor")
    payload["duration_factor"] = 1.0 if duration is None else float(duration)
    for key in CONDITIONING_KEYS:
        value = source.get(f"meta.{key}")
        if not isinstance(value, torch.Tensor) or value.numel() == 0:
            raise GlueError(NAME, source.request_id, f"the voice conditioning meta.{key} is missing or empty")
        payload[key] = _cpu_copy(value)
    if source.seed is not None:
        payload["seed"] = int(source.seed)
    return NextStageInput(prompt_token_ids=[0], payload=payload)
