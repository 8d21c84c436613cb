"""Per-request buffer mechanics (CONTRACT 4): merge, replace, streaming re-admission.

A request's buffer is a dict of dicts, ``{"codes": {"audio": tensor}, "meta": {...}}``.
These functions take the stage's policies (GPU-resident keys) as arguments; the
runner methods that call them are in ``base.py`` and the generated classes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

GpuKeys = frozenset[tuple[str, str]]
_Tensor = torch.Tensor
"""``torch.Tensor``, bound once: a merge looks it up for every update value."""

HOST_LAYOUT = True
"""Whether ``merge_updates`` reads a host tensor's layout (``requires_grad``, ``is_contiguous()``)
before storing it as it is, so that the buffer keeps it detached and contiguous as vllm-omni does
(4.1). Always on in the product. It is a named switch for one measurement only: set to False, every
host tensor is stored as it is, unread, which is what ``benchmarks/host_cost.py wall --ablate
host_layout`` times (what the two reads cost). Read once a call (not a row), into a local."""

REPLACE_MARKER = "replace_runtime_additional_information"
RUNNER_META_KEYS = ("num_processed_tokens", "resumable")


def to_host(value: Any) -> Any:
    """A buffer value as the buffer keeps it when its key is not GPU-resident: tensors on the host,
    detached and contiguous (a detach or a copy only where it changes something: this runs for
    every update value of every row)."""
    if isinstance(value, _Tensor):
        t = value.detach() if value.requires_grad else value
        if not t.is_cpu:
            return t.to("cpu").contiguous()
        return t if t.is_contiguous() else t.contiguous()
    if isinstance(value, list):
        return [to_host(item) if isinstance(item, torch.Tensor) else item for item in value]
    return value


def keep_on_device(value: Any) -> Any:
    """A GPU-resident key's value: an owned copy of a tensor (a graph replay must not rewrite what
    the buffer holds), anything else as ``to_host`` keeps it."""
    if isinstance(value, _Tensor):
        return (value.detach() if value.requires_grad else value).clone()
    return to_host(value)


def owned_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``[keep_on_device(t) for t in tensors]``, in one device copy when the tensors can be joined
    (one dtype, one device, and one shape, or the same trailing shape and at least one dimension):
    the copies are then views of one new tensor, so no copy aliases its source and none aliases
    another. (Whether they can is asked of ``torch.stack`` and ``torch.cat`` themselves, not tensor
    by tensor: this runs for every row.)"""
    if len(tensors) > 1 and len({t.dtype for t in tensors}) == 1:
        # Tensors of one shape (one row each, the common case) stack: no sizes to read, which cost
        # more than ``unbind`` costs over ``split`` (docs/measurements.md, 'The runtime's hot loops').
        with contextlib.suppress(RuntimeError):  # shapes or devices differ
            return list(torch.stack(tensors).detach().unbind())
        try:
            sizes = [t.shape[0] for t in tensors]  # IndexError: a 0-d tensor
            joined = torch.cat(tensors)  # RuntimeError: mixed devices or trailing shapes
        except (IndexError, RuntimeError):
            pass
        else:
            return list(joined.detach().split(sizes))
    return [keep_on_device(t) for t in tensors]


DeferredCopies = dict[tuple[str, str], tuple[list[dict[str, Any]], list[torch.Tensor]]]
"""GPU-resident tensors a merge left for its caller to copy: ``(type, qualifier) -> (the
sub-dicts they go into, the tensors)``."""


def merge_updates(
    row_buffers: Sequence[dict[str, Any]],
    requests: Sequence[Any],
    updates: Sequence[Any],
    gpu_keys: GpuKeys,
    deferred: DeferredCopies | None = None,
) -> None:
    """Merge each row's update into its buffer one level deep, in place, and mirror the buffer as
    its request's ``additional_information_cpu`` (4.1): nothing for an empty or non-dict update or
    an unknown request (None). A step's rows, a decode batch's or one request's (a sequence of one).

    ``{type: {qualifier: value}}`` merges per qualifier; top-level scalars are stored.
    Tensors move to CPU unless ``(type, qualifier)`` is a GPU-resident key, which keeps an owned
    copy; with ``deferred`` that copy is left to the caller (``store_owned_copies``), so a batch
    of rows can make all of theirs in one device operation.

    The one copy of the merge rule, written out in the loop over the rows: a call a row cost
    0.5k instructions a request more on the batched cells (this runs for every row of every step).
    """
    host_layout = HOST_LAYOUT
    for buffer, request, update in zip(row_buffers, requests, updates, strict=True):
        if request is None or not update or not isinstance(update, dict):
            continue
        # Keys, then a look-up, rather than ``.items()``: no items view to make (docs/measurements.md, 'The runtime's hot loops').
        for key in update:
            value = update[key]
            if not isinstance(value, dict):
                buffer[key] = to_host(value)
                continue
            sub = buffer.get(key)
            if not isinstance(sub, dict):
                sub = buffer[key] = {}
            for qualifier in value:
                item = value[qualifier]
                if not (gpu_keys and (pair := (key, qualifier)) in gpu_keys):
                    # to_host(item), without the call where it would hand back the item itself: a
                    # contiguous host tensor that needs no detach. (vllm-omni stores its tensors
                    # detached and contiguous; what the two reads that keep that cost is measured by
                    # host_cost.py wall --ablate host_layout, which turns them off through
                    # ``HOST_LAYOUT``.)
                    if (
                        type(item) is _Tensor
                        and item.is_cpu
                        and (not host_layout or (not item.requires_grad and item.is_contiguous()))
                    ):
                        sub[qualifier] = item
                    else:
                        sub[qualifier] = to_host(item)
                elif deferred is not None and isinstance(item, _Tensor):
                    entry = deferred.get(pair)
                    if entry is None:
                        entry = deferred[pair] = ([], [])
                    entry[0].append(sub)
                    entry[1].append(item)
                else:
                    sub[qualifier] = keep_on_device(item)
        request.additional_information_cpu = buffer


def store_owned_copies(deferred: DeferredCopies) -> None:
    """Store the owned copies ``merge_updates`` deferred: one device copy per ``(type, qualifier)``."""
    for (_, qualifier), (subs, tensors) in deferred.items():
        for sub, copy in zip(subs, owned_copies(tensors), strict=True):
            sub[qualifier] = copy


def is_replace_marker(payload: Any) -> bool:
    """True when ``payload["meta"]["replace_runtime_additional_information"]`` is true (4.3).

    The marker may be a Python bool or a 0-d bool tensor.
    """
    if not isinstance(payload, dict):
        return False
    meta = payload.get("meta")
    if not isinstance(meta, dict):
        return False
    flag = meta.get(REPLACE_MARKER)
    if isinstance(flag, torch.Tensor):
        return flag.numel() == 1 and bool(flag.item())
    return flag is True


def replacement_for_new_request(previous: Any, incoming: dict[str, Any]) -> dict[str, Any]:
    """The buffer a re-admitted request gets from a replacing payload (4.3, new-request path).

    The old terminal payload is not merged back; only the runner's own bookkeeping
    (``meta.num_processed_tokens``, ``meta.resumable``) survives where the payload lacks it.
    """
    snapshot = dict(incoming)
    meta = dict(incoming["meta"]) if isinstance(incoming.get("meta"), dict) else {}
    prev_meta = previous.get("meta") if isinstance(previous, dict) else None
    if isinstance(prev_meta, dict):
        for key in RUNNER_META_KEYS:
            if key not in meta and key in prev_meta:
                meta[key] = prev_meta[key]
    snapshot["meta"] = meta
    return snapshot


def replacement_for_cached_request(incoming: dict[str, Any]) -> dict[str, Any]:
    """The buffer a running request gets from a replacing payload: the marker payload itself (4.3)."""
    snapshot = dict(incoming)
    if isinstance(incoming.get("meta"), dict):
        snapshot["meta"] = dict(incoming["meta"])
    return snapshot


def merged_for_streaming(previous: Any, incoming: Any) -> dict[str, Any]:
    """A copy of ``previous`` with ``incoming`` merged one level deep, marked resumable (4.4)."""
    merged = dict(previous) if isinstance(previous, dict) else {}
    if isinstance(incoming, dict):
        for key, value in incoming.items():
            if isinstance(value, dict):
                sub = merged.get(key)
                merged[key] = {**(sub if isinstance(sub, dict) else {}), **value}
            else:
                merged[key] = value
    meta = merged.get("meta")
    meta = dict(meta) if isinstance(meta, dict) else {}
    meta["num_processed_tokens"] = 0
    meta["resumable"] = True
    merged["meta"] = meta
    return merged
