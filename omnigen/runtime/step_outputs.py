"""What a step's forward leaves for after sampling: post-forward hooks and per-request payloads
(CONTRACT 7.1-7.3).

The forward runs inside vLLM's ``execute_model``; sampling happens later, in
``sample_tokens``. A ``StepSnapshot`` carries what the forward produced (text hidden states,
the multimodal payload, and the rows it was computed for) across that gap, so the model's
``postprocess`` and the per-request payload split run once the step's tokens are known, as
vLLM's rows were when the forward ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omnigen.runtime.serialization import flatten_payload


@dataclass(frozen=True)
class StepSnapshot:
    """One forward's rows and outputs."""

    req_ids: tuple[str, ...]
    bounds: tuple[int, ...]
    """Row ``i`` covers hidden rows ``bounds[i]:bounds[i + 1]`` (vLLM's ``query_start_loc``)."""
    hidden: Any
    """The text hidden states (None for a generation stage that has none)."""
    payload: Any
    """The step's multimodal outputs as the forward (or ``make_omni_output``) returned them:
    a dict, or for a generation stage also a tensor or list of one entry per request."""

    def rows(self) -> list[tuple[int, str, int, int]]:
        """``(row, req_id, start, end)`` for each row, in batch order."""
        return [
            (row, req_id, self.bounds[row], self.bounds[row + 1]) for row, req_id in enumerate(self.req_ids)
        ]


def snapshot(runner: Any, hidden: Any, payload: Any) -> StepSnapshot:
    """The rows of the step that just ran forward, with what it produced."""
    return StepSnapshot(
        req_ids=tuple(runner.input_batch.req_ids),
        bounds=tuple(_bounds(runner)),
        hidden=hidden,
        payload=payload,
    )


def postprocess_infos(buffer: dict[str, Any] | None) -> dict[str, Any]:
    """A row's buffer as ``postprocess`` keyword arguments: every entry but ``hidden_states``,
    which would collide with the hook's positional hidden states (the entry stays in the
    buffer: the next preprocess reads ``hidden_states.last`` from it)."""
    if not buffer:
        return {}
    return {key: value for key, value in buffer.items() if key != "hidden_states"}


def ar_request_payloads(step: StepSnapshot, *, include_hidden: bool) -> dict[str, dict[str, Any]]:
    """Each request's share of an autoregressive step's payload, under dotted keys (7.2).

    A tensor whose first dimension is the step's token count is cut to the request's rows;
    a list holds one entry per request (a shorter list's first entry is shared); anything
    else is the whole step's, copied so requests never alias each other. With
    ``include_hidden`` the request's text hidden rows are published as ``hidden``. Each tensor
    goes to the host once for the step; requests get slices of that copy.
    """
    flat = (
        {key: _host_tree(value) for key, value in flatten_payload(step.payload).items()}
        if isinstance(step.payload, dict)
        else {}
    )
    total = step.bounds[-1] if step.bounds else 0
    hidden = _host(step.hidden[:total]) if include_hidden and isinstance(step.hidden, torch.Tensor) else None
    hidden_rows = int(step.hidden.shape[0]) if isinstance(step.hidden, torch.Tensor) else None
    found: dict[str, dict[str, Any]] = {}
    for row, req_id, start, end in step.rows():
        payload: dict[str, Any] = {} if hidden is None else {"hidden": hidden[start:end]}
        for key, value in flat.items():
            payload[key] = _request_share(value, row, start, end, (total, hidden_rows))
        found[req_id] = payload
    return found


def _host_tree(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _host_tree(item) for key, item in value.items()}
    return _host(value)


def _request_share(value: Any, row: int, start: int, end: int, step_lengths: tuple[int, int | None]) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() >= 1 and value.shape[0] in step_lengths:
            return value[start:end]
        return value.clone()
    if isinstance(value, dict):
        return {key: _request_share(item, row, start, end, step_lengths) for key, item in value.items()}
    if isinstance(value, list):
        if not value:
            return value
        item = value[row] if row < len(value) else value[0]
        return _host(item).clone() if isinstance(item, torch.Tensor) else item
    return value


def generation_request_payloads(step: StepSnapshot) -> dict[str, dict[str, Any]]:
    """Each request's output of a generation step (7.3): the model returns one entry per request.

    A tensor of one row per request or a list of one entry per request is published under
    ``model_outputs``. A dict is published key by key (nested keys dotted): a list entry is split
    one item per request, a tensor goes whole (one host copy, the same object) to every request,
    and any other value as it is; as vllm-omni 0.30's generation runner publishes it. Anything else
    is an error naming what came back.
    """
    raw = step.payload
    count = len(step.req_ids)
    if isinstance(raw, (torch.Tensor, list)):
        entries = _per_request(raw, count, "model outputs")
        return {req_id: {"model_outputs": entry} for req_id, entry in zip(step.req_ids, entries, strict=True)}
    if isinstance(raw, dict):
        found: dict[str, dict[str, Any]] = {req_id: {} for req_id in step.req_ids}
        for key, value in flatten_payload(raw).items():
            if isinstance(value, list):
                entries = _per_request(value, count, f"model output {key!r}")
            elif isinstance(value, torch.Tensor):
                entries = [_host(value)] * count
            else:
                entries = [value] * count
            for req_id, entry in zip(step.req_ids, entries, strict=True):
                found[req_id][key] = entry
        return found
    if raw is None:
        return {req_id: {} for req_id in step.req_ids}
    raise TypeError(
        f"a generation stage's multimodal outputs must be a tensor, list or dict, got {type(raw).__name__}"
    )


def _per_request(value: Any, count: int, what: str) -> list[Any]:
    length = int(value.shape[0]) if isinstance(value, torch.Tensor) else len(value)
    if length != count:
        raise ValueError(
            f"a generation stage returned {length} {what} for {count} requests; the model must "
            "return one entry per request (for several tensors per request, return a dict)"
        )
    return [None if item is None else _host(item) for item in value]


def _host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").contiguous()
    return value


def row_spans(runner: Any) -> list[tuple[int, int]]:
    """Each row's ``(start, end)`` hidden rows in this step, in batch order."""
    bounds = _bounds(runner)
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _bounds(runner: Any) -> list[int]:
    """vLLM's ``query_start_loc`` of the step's rows: row ``i`` is ``bounds[i]:bounds[i + 1]``."""
    return runner.query_start_loc.np[: len(runner.input_batch.req_ids) + 1].tolist()
