"""Stage-to-stage full payloads accumulated until a request ends (CONTRACT 5.1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PendingPayload:
    """What a producing stage will send for one request when it ends."""

    request: Any
    chunks: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """Per-token tensors (2+ dims), appended along dim 0."""
    latest: dict[str, Any] = field(default_factory=dict)
    """Everything else: the most recent value wins."""


def accumulate(entry: PendingPayload | None, output: dict[str, Any], request: Any) -> PendingPayload:
    """Fold one step's output into a request's pending payload.

    Nothing is filtered: all-zero codec rows, misaligned rows and prefill placeholders are
    all kept (the consumer crops). None values are skipped. A 2+-dim tensor whose trailing
    shape differs from what the key holds restarts that key.
    """
    if entry is None:
        entry = PendingPayload(request=request)
    else:
        entry.request = request
    for key, value in output.items():
        if value is None:
            continue
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            held = entry.chunks.get(key)
            if held and held[0].shape[1:] == value.shape[1:]:
                held.append(value)
            else:
                entry.latest.pop(key, None)
                entry.chunks[key] = [value]
        else:
            entry.chunks.pop(key, None)
            entry.latest[key] = value
    return entry


def materialize(entry: PendingPayload) -> tuple[dict[str, Any], Any]:
    """``(payload, request)``: chunks concatenated along dim 0, latest values as they are."""
    payload = dict(entry.latest)
    for key, tensors in entry.chunks.items():
        payload[key] = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
    return payload, entry.request


def compact(entry: PendingPayload) -> dict[str, Any]:
    """The payload so far, keeping each key's rows as one tensor from now on: a streaming
    request's payload is materialized at every publishing point, each time from one piece."""
    for key, tensors in entry.chunks.items():
        if len(tensors) > 1:
            entry.chunks[key] = [torch.cat(tensors, dim=0)]
    payload, _ = materialize(entry)
    return payload
