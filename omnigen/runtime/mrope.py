"""M-RoPE keyword filtering (CONTRACT 3.7)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

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
