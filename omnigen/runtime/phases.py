"""Per-step row bookkeeping for the preprocess phase contract (CONTRACT 3.1-3.5).

A step's rows are read once, as numpy arrays, so that deciding phases, MTP
routing and decode-batch segments costs a few vector operations for the whole
batch instead of per-row Python arithmetic.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

CONTIGUITY_ERROR = "Non-MTP batched decode preprocessing requires contiguous in-bounds token offsets"


@dataclass(frozen=True)
class RowPhases:
    """The rows of one step, in ``input_batch.req_ids`` order."""

    req_ids: list[str]
    offsets: np.ndarray
    """First token of each row in the flattened step (``query_start_loc``)."""
    spans: np.ndarray
    """Scheduled tokens of each row."""
    prompt_lens: np.ndarray
    computed: np.ndarray
    """Tokens computed before this step."""
    is_prefill: np.ndarray
    """``computed < prompt_len``: a 5-token prompt scheduled 4 + 1 is prefill at computed=4."""
    single_decode: np.ndarray
    """Span 1 and not prefill: the rows a talker MTP or a decode batch takes."""

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)


def read_row_phases(
    input_batch: Any, query_start_loc: Any, num_scheduled_tokens: dict[str, int]
) -> RowPhases:
    """Read the step's rows from vLLM's input batch and the scheduler's token counts."""
    req_ids = list(input_batch.req_ids)
    n = len(req_ids)
    offsets = np.asarray(query_start_loc.np[:n], dtype=np.int64)
    spans = np.fromiter((num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=n)
    prompt_lens = np.asarray(input_batch.num_prompt_tokens[:n], dtype=np.int64)
    computed = np.asarray(input_batch.num_computed_tokens_cpu[:n], dtype=np.int64)
    is_prefill = computed < prompt_lens
    return RowPhases(
        req_ids=req_ids,
        offsets=offsets,
        spans=spans,
        prompt_lens=prompt_lens,
        computed=computed,
        is_prefill=is_prefill,
        single_decode=(spans == 1) & ~is_prefill,
    )


RUNNER_KEYS = ("request_id", "_omni_prompt_len", "_omni_num_computed_tokens", "_omni_is_prefill")
"""The keys the runner owns in each row's buffer (3.1)."""


def runner_keys(phases: RowPhases) -> list[dict[str, Any]]:
    """Each row's ``RUNNER_KEYS``, as plain Python values (3.1)."""
    columns = (
        phases.req_ids,
        phases.prompt_lens.tolist(),
        phases.computed.tolist(),
        phases.is_prefill.tolist(),
    )
    return [dict(zip(RUNNER_KEYS, row, strict=True)) for row in zip(*columns, strict=True)]


def segments(batchable: np.ndarray) -> list[tuple[int, int, bool]]:
    """Split rows into ``(start, end, is_batch)`` segments in row order.

    Adjacent batchable rows form one batch segment; every other row is a segment of its
    own, so a non-batchable row between two batchable ones splits them (3.3).
    """
    n = int(batchable.shape[0])
    if n == 0:
        return []
    if not batchable.any():
        return [(i, i + 1, False) for i in range(n)]
    out: list[tuple[int, int, bool]] = []
    flags = batchable.tolist()
    i = 0
    while i < n:
        if flags[i]:
            j = i + 1
            while j < n and flags[j]:
                j += 1
            out.append((i, j, True))
            i = j
        else:
            out.append((i, i + 1, False))
            i += 1
    return out


def check_contiguous_runs(phases: RowPhases, runs: list[tuple[int, int, bool]], num_tokens: int) -> None:
    """Raise before any hook runs if a non-MTP decode batch's offsets are not contiguous and in bounds (3.5)."""
    for start, end, is_batch in runs:
        if not is_batch:
            continue
        offs = phases.offsets[start:end]
        first = int(offs[0])
        if (
            first < 0
            or first + (end - start) > num_tokens
            or not np.array_equal(offs, np.arange(first, first + (end - start)))
        ):
            raise RuntimeError(
                f"{CONTIGUITY_ERROR}: rows {start}..{end - 1} have offsets {offs.tolist()} "
                f"for {num_tokens} scheduled tokens"
            )


_ABSENT = object()


def stamp_batch(
    runner: Any, req_ids: list[str], keys: list[dict[str, Any]], *, attach_request_features: bool = False
) -> list[dict[str, Any]]:
    """Write the runner keys of a decode batch's rows into their buffers (3.1); what the batch
    hook sees: the requests' buffers, created where missing (``runner._request_buffer``), or, with
    ``attach_request_features``, the copies ``runner._attach_request_features`` makes. (A failure
    later in the step is undone by the step's ``StepJournal``.)
    """
    own = [runner._request_buffer(req_id) for req_id in req_ids]
    for row_infos, row_keys in zip(own, keys, strict=True):
        row_infos.update(row_keys)
    if not attach_request_features:
        return own
    # The copies carry the runner keys written into the buffers above (3.1, 3.8).
    return [
        runner._attach_request_features(runner.requests.get(req_id), row_infos, req_id)
        for req_id, row_infos in zip(req_ids, own, strict=True)
    ]


def check_batch_outputs(num_rows: int, ids: Any, embeds: Any, updates: Any, hook: str) -> None:
    """Raise before any buffer write unless a batch hook returned one result per row (3.5).

    The step's ``StepJournal`` then puts the runner keys the batch stamped back as they were.
    """
    got_ids = int(ids.numel()) if hasattr(ids, "numel") else len(ids)
    got_embeds = int(embeds.shape[0]) if getattr(embeds, "ndim", 0) == 2 else 0
    got_updates = len(updates)
    if not got_ids == got_embeds == got_updates == num_rows:
        raise ValueError(
            f"batched decode preprocessing: model.{hook} returned {got_ids} ids, {got_embeds} "
            f"embeddings and {got_updates} updates for {num_rows} rows; it must return exactly one "
            "of each per row"
        )


# -- A step's preprocessing, all or nothing (issue 9) ---------------------------------------------


class StepJournal:
    """What a step's hooks may change (the rows' buffers and mirrors, the persistent inputs, the
    MTP generators), kept so that a failure anywhere in the step puts every one of them back.

    Buffers are restored in place, so a buffer and its mirror stay the same object (4.1).
    """

    def __init__(self, runner: Any, req_ids: list[str], *inputs: Any) -> None:
        self._runner = runner
        # The persistent inputs the step writes: ids, embeddings and, on an MTP stage, the four
        # MTP staging buffers.
        self._inputs = [(tensor, tensor.clone()) for tensor in inputs]
        self._generators = dict(runner._talker_mtp_generators)
        buffers = runner.model_intermediate_buffer
        self._buffers: dict[str, Any] = {}
        self._mirrors: dict[str, Any] = {}
        for req_id in req_ids:
            buffer = buffers.get(req_id)
            self._buffers[req_id] = _ABSENT if buffer is None else _buffer_contents(buffer)
            request = runner.requests.get(req_id)
            if request is not None:
                self._mirrors[req_id] = getattr(request, "additional_information_cpu", _ABSENT)

    def undo(self) -> None:
        runner = self._runner
        buffers = runner.model_intermediate_buffer
        for req_id, saved in self._buffers.items():
            if saved is _ABSENT:
                buffers.pop(req_id, None)
            else:
                buffers[req_id] = saved[0]
                _restore_buffer(saved)
        for req_id, mirror in self._mirrors.items():
            request = runner.requests.get(req_id)
            if request is None:
                continue
            if mirror is _ABSENT:
                with contextlib.suppress(AttributeError):
                    delattr(request, "additional_information_cpu")
            else:
                request.additional_information_cpu = mirror
        for tensor, saved in self._inputs:
            tensor.copy_(saved)
        generators = runner._talker_mtp_generators
        generators.clear()
        generators.update(self._generators)


def _buffer_contents(
    buffer: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
    """``(the buffer, its entries, each sub-dict's entries)``: what a merge one level deep can change."""
    return (
        buffer,
        dict(buffer),
        {key: dict(value) for key, value in buffer.items() if isinstance(value, dict)},
    )


def _restore_buffer(saved: tuple[Any, ...]) -> None:
    buffer, entries, subs = saved
    for key, sub in subs.items():
        entries[key].clear()
        entries[key].update(sub)
    buffer.clear()
    buffer.update(entries)


def check_row_output(
    req_id: str, span: int, width: int, ids: Any, embeds: Any, update: Any, mtp_width: int | None = None
) -> None:
    """Raise, naming the request, unless a per-row ``preprocess`` returned what the row needs:
    ``span`` embedding rows of ``width`` (floating point), ids of the row's length (or None), an
    update dict (or None), and, on an MTP row, ``mtp_inputs`` of two hidden vectors of
    ``mtp_width``. The common case is a handful of attribute reads: this runs on every row."""
    embeds_ok = (
        isinstance(embeds, torch.Tensor) and embeds.shape == (span, width) and embeds.is_floating_point()
    )
    ids_ok = ids is None or (isinstance(ids, torch.Tensor) and ids.numel() == span)
    update_ok = update is None or isinstance(update, dict)
    mtp_ok = mtp_width is None or _mtp_inputs_ok(update, mtp_width)
    if embeds_ok and ids_ok and update_ok and mtp_ok:
        return
    problems = []
    if not embeds_ok:
        got = (
            f"{tuple(embeds.shape)} {embeds.dtype}"
            if isinstance(embeds, torch.Tensor)
            else type(embeds).__name__
        )
        problems.append(f"embeddings {got}, expected ({span}, {width}) floating point")
    if not ids_ok:
        got = f"{ids.numel()} ids" if isinstance(ids, torch.Tensor) else type(ids).__name__
        problems.append(f"{got}, expected {span} ids (or None to keep the scheduled ones)")
    if not update_ok:
        problems.append(f"an update of type {type(update).__name__}, expected a dict")
    if not mtp_ok:
        problems.append(
            f"no update['mtp_inputs'] of two {mtp_width}-wide hidden vectors on a talker-MTP decode row"
        )
    raise ValueError(f"request {req_id}: model.preprocess returned " + "; ".join(problems))


def _mtp_inputs_ok(update: Any, width: int) -> bool:
    pair = update.get("mtp_inputs") if isinstance(update, dict) else None
    return (
        isinstance(pair, tuple)
        and len(pair) == 2
        and isinstance(pair[0], torch.Tensor)
        and isinstance(pair[1], torch.Tensor)
        and pair[0].numel() == width
        and pair[1].numel() == width
    )
