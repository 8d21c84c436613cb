"""Transport form of per-request payloads (CONTRACT 4.2, 7.8).

``serialize_additional_information`` turns a nested dict of tensors, lists and
scalars into plain msgpack/pickle-friendly values; the inverse restores it.
A plain dict that was never serialized deserializes to itself; None to ``{}``.

``deserialize_additional_information`` also reads vllm-omni's wire form, an
``AdditionalInformationPayload`` (``entries: {dotted_key: entry}``, each entry one of
``tensor_data``/``tensor_shape``/``tensor_dtype``, ``list_data`` or ``scalar_data``), as the
struct itself or as the plain mapping msgpack decodes it to, so a payload produced by either
side is understood. omnigen decodes it with its own code; it never imports vllm-omni.
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
    entries = _omni_wire_entries(payload)
    if entries is not None:
        return _decode_omni_wire(entries)
    if isinstance(payload, dict):
        return payload
    raise TypeError(
        "additional_information must be a dict, a serialized omnigen payload or vllm-omni's "
        f"AdditionalInformationPayload, got {type(payload).__name__}"
    )


def payload_to_text(payload: dict[str, Any]) -> str:
    """``payload`` as ASCII text (base64 of the msgpack envelope): safe in JSON and msgpack alike,
    so it passes ``vllm serve``'s JSON responses as well as vLLM's own process boundary."""
    import base64

    import msgspec

    return base64.b64encode(msgspec.msgpack.encode(serialize_additional_information(payload))).decode("ascii")


def payload_from_text(text: str) -> dict[str, Any]:
    """The payload of ``payload_to_text``."""
    import base64

    import msgspec

    return deserialize_additional_information(msgspec.msgpack.decode(base64.b64decode(text, validate=True)))


INLINE_PAYLOAD_KEY = "omnigen_payload"
"""``SamplingParams.extra_args`` key of a request's inline payload (serialized by
``serialize_additional_information``, or vllm-omni's wire form): plain vLLM's request has no
other field a payload can ride in."""


def inline_payload(sampling_params: Any) -> Any:
    """The payload a request carries in its sampling params' ``extra_args``, or None."""
    extra_args = sampling_params.extra_args if sampling_params is not None else None
    return extra_args.get(INLINE_PAYLOAD_KEY) if isinstance(extra_args, dict) else None


# -- vllm-omni's wire form (7.8) -------------------------------------------------------------

_ENTRY_FIELDS = frozenset({"tensor_data", "tensor_shape", "tensor_dtype", "list_data", "scalar_data"})


def _omni_wire_entries(payload: Any) -> dict[str, Any] | None:
    """The ``entries`` mapping of a vllm-omni ``AdditionalInformationPayload``, else None."""
    if isinstance(payload, dict):
        entries = payload.get("entries") if set(payload) == {"entries"} else None
    else:
        entries = getattr(payload, "entries", None)
    if not isinstance(entries, dict) or not all(_is_wire_entry(entry) for entry in entries.values()):
        return None
    return entries


def _is_wire_entry(entry: Any) -> bool:
    if isinstance(entry, dict):
        return bool(entry) and set(entry) <= _ENTRY_FIELDS
    return all(hasattr(entry, name) for name in _ENTRY_FIELDS)


def _entry_field(entry: Any, name: str) -> Any:
    return entry.get(name) if isinstance(entry, dict) else getattr(entry, name)


def _decode_omni_wire(entries: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, entry in entries.items():
        if _entry_field(entry, "tensor_data") is not None:
            flat[key] = _decode_wire_tensor(entry, key)
        elif _entry_field(entry, "list_data") is not None:
            flat[key] = _entry_field(entry, "list_data")
        elif _entry_field(entry, "scalar_data") is not None:
            flat[key] = _entry_field(entry, "scalar_data")
    return _unflatten(flat)


def _decode_wire_tensor(entry: Any, key: str) -> torch.Tensor:
    name = _entry_field(entry, "tensor_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    shape = _entry_field(entry, "tensor_shape")
    if not isinstance(dtype, torch.dtype) or shape is None:
        raise ValueError(
            f"additional_information entry {key!r}: unreadable tensor (dtype {name!r}, shape {shape!r})"
        )
    data = _entry_field(entry, "tensor_data")
    if not data:
        return torch.empty(0, dtype=dtype).reshape(shape)
    # The wire holds the tensor's bytes, C order; a copy owns them (the frame may be reused).
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"codes.audio": x}`` -> ``{"codes": {"audio": x}}``; ``hidden_states.layer_N`` keys
    gather under ``hidden_states.layers[N]``."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        if "." not in key:
            nested[key] = value
            continue
        kind, qualifier = key.split(".", 1)
        group = nested.setdefault(kind, {})
        if kind == "hidden_states" and qualifier.startswith("layer_") and qualifier[6:].isdigit():
            group.setdefault("layers", {})[int(qualifier[6:])] = value
        else:
            group[qualifier] = value
    return nested


def flatten_payload(payload: dict[str, Any]) -> dict[str, Any]:
    """``{"codes": {"audio": x}}`` -> ``{"codes.audio": x}``: the dotted keys a step payload is
    published under (one level, as the buffers nest; ``hidden_states.layers`` per layer)."""
    flat: dict[str, Any] = {}
    for key, value in payload.items():
        if not isinstance(value, dict):
            flat[key] = value
            continue
        for qualifier, item in value.items():
            if key == "hidden_states" and qualifier == "layers" and isinstance(item, dict):
                for layer, tensor in item.items():
                    flat[f"hidden_states.layer_{layer}"] = tensor
            else:
                flat[f"{key}.{qualifier}"] = item
    return flat
