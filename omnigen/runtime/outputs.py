"""The omni forward output envelope and how runners unpack it (CONTRACT 1.1, 1.3)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class OmniOutput(NamedTuple):
    """What an omni model's forward returns: text hidden states plus multimodal payload."""

    text_hidden_states: torch.Tensor
    multimodal_outputs: dict[str, Any] | None = None
    intermediate_tensors: Any = None
    next_token_id: torch.Tensor | None = None


def restore_flattened_omni_output(output: Any) -> Any:
    """Rebuild an ``OmniOutput`` that a CUDA-graph weak reference flattened to a tuple.

    ``weak_ref_tensors`` turns NamedTuples into plain tuples. A 4-tuple whose second
    slot is a payload dict (or None) is such an envelope; a tuple of auxiliary hidden
    states (second slot a tensor) is returned unchanged, as the same object.
    """
    if (
        type(output) is tuple
        and len(output) == len(OmniOutput._fields)
        and (output[1] is None or isinstance(output[1], dict))
    ):
        return OmniOutput(*output)
    return output
