"""Transport form of per-request payloads (CONTRACT 4.2).

``serialize_additional_information`` turns a nested dict of tensors, lists and
scalars into plain msgpack/pickle-friendly values; the inverse restores it.
A plain dict that was never serialized deserializes to itself; None to ``{}``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_ENVELOPE = "__omnigen_payload__"
_TENSOR = "__omnigen_tensor__"
_TUPLE = "__omnigen_tuple__"


def _encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        return {
            _TENSOR: {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "data": raw.numpy().tobytes(),
            }
        }
    if isinstance(value, dict):
        return {key: _encode(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(item) for item in value]}
    if isinstance(value, list):
        return [_encode(item) for item in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if _TENSOR in value and len(value) == 1:
            spec = value[_TENSOR]
            dtype = getattr(torch, spec["dtype"])
            np_dtype = np.int16 if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype
            array = np.frombuffer(spec["data"], dtype=np_dtype).reshape(spec["shape"]).copy()
            tensor = torch.from_numpy(array)
            return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor
        if _TUPLE in value and len(value) == 1:
            return tuple(_decode(item) for item in value[_TUPLE])
        return {key: _decode(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_decode(item) for item in value]
    return value


def serialize_additional_information(info: dict[str, Any] | None) -> dict[str, Any] | None:
    """Encode a payload for transport; None stays None."""
    if info is None:
        return None
    if isinstance(info, dict) and _ENVELOPE in info:
        return info
    return {_ENVELOPE: 1, "data": _encode(info)}


def deserialize_additional_information(payload: Any) -> dict[str, Any]:
    """Decode a transported payload; None gives ``{}``, a plain dict is returned as is."""
    if payload is None:
        return {}
    if isinstance(payload, dict) and _ENVELOPE in payload:
        return _decode(payload["data"])
    if isinstance(payload, dict):
        return payload
    raise TypeError(
        f"additional_information must be a dict or a serialized omnigen payload, got {type(payload).__name__}"
    )
