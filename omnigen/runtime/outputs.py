"""The omni forward output envelope and how runners unpack it (CONTRACT 1.1, 1.3, 7.2).

Two classes are an ``OmniOutput`` here: omnigen's own NamedTuple below, and vllm-omni's
``output_templates.OmniOutput``, which the real model classes return. omnigen never imports
vllm-omni, so the second is recognised by its shape: a NamedTuple whose fields start with
the contract's ``text_hidden_states, multimodal_outputs``. That is a check on the value the
forward returned, not a probe of the model.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class OmniOutput(NamedTuple):
    """What an omni model's forward returns: text hidden states plus multimodal payload."""

    text_hidden_states: torch.Tensor
    multimodal_outputs: dict[str, Any] | None = None
    intermediate_tensors: Any = None
    next_token_id: torch.Tensor | None = None


_LEADING_FIELDS = OmniOutput._fields[:2]


def is_omni_output(output: Any) -> bool:
    """True for omnigen's ``OmniOutput`` and for any NamedTuple of the same leading fields
    (vllm-omni's ``OmniOutput``)."""
    if isinstance(output, OmniOutput):
        return True
    fields = getattr(type(output), "_fields", None)
    return isinstance(output, tuple) and isinstance(fields, tuple) and fields[:2] == _LEADING_FIELDS


def as_omni_output(output: Any) -> Any:
    """The same envelope as omnigen's ``OmniOutput`` (tensors and payload by identity);
    anything that is not an envelope is returned as it is."""
    if type(output) is OmniOutput or not is_omni_output(output):
        return output
    fields = type(output)._fields
    values = dict(zip(fields, output, strict=True))
    return OmniOutput(**{name: values[name] for name in OmniOutput._fields if name in values})


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
