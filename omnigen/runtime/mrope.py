"""M-RoPE keyword filtering (CONTRACT 3.7) and text-only positions (7.6)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

_ACCEPTED_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def filter_mrope_kwargs(get_positions: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keep only the kwargs ``get_positions`` accepts.

    A function taking ``**kwargs``, or one whose signature cannot be read, gets the same
    dict object back; otherwise the names it accepts, less ``self`` and ``input_tokens``.
    """
    try:
        parameters = inspect.signature(get_positions).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    accepted = {
        name
        for name, p in parameters.items()
        if p.kind in _ACCEPTED_KINDS and name not in ("self", "input_tokens")
    }
    return {key: value for key, value in kwargs.items() if key in accepted}


def text_only_positions(req_state: Any) -> tuple[Any, int]:
    """M-RoPE positions for a model without ``get_mrope_input_positions`` (CONTRACT 7.6).

    A request of text (or placeholder) tokens only has the three rotary sections advance
    together: position ``i`` in every section, and no delta for the decode steps. A request
    with multimodal features would need the features' grids, which such a model never
    computes, so it is refused with what to change.
    """
    features = [f for f in (req_state.mm_features or ()) if f.modality != "prompt_embeds"]
    if features:
        raise ValueError(
            f"request {req_state.req_id}: positions.mrope_fallback computes text-only M-RoPE "
            f"positions, but the request has {len(features)} multimodal feature(s) "
            f"({', '.join(sorted({f.modality for f in features}))}); send this stage text only, "
            "or use a model that implements get_mrope_input_positions (positions.mrope: true)"
        )
    length = req_state.num_prompt_tokens
    positions = torch.arange(length, dtype=torch.int64).unsqueeze(0).expand(3, length).clone()
    return positions, 0
