"""Per-step row bookkeeping for the preprocess phase contract (CONTRACT 3.1-3.5).

A step's rows are read once (``read_row_phases``), with the facts the checks need, so
that deciding phases, MTP routing and decode-batch segments costs a few operations for
the whole batch: numpy's for a large step, Python's for a small one.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

CONTIGUITY_ERROR = "Non-MTP batched decode preprocessing requires contiguous in-bounds token offsets"
MTP_OFFSETS_ERROR = "Talker-MTP decode rows require distinct in-bounds token offsets"
ROW_BOUNDS_ERROR = "Preprocessing requires every row's tokens within the step"
ROW_OVERLAP_ERROR = "Preprocessing requires rows that share no token"


@dataclass(slots=True)
class RowPhases:
    """The rows of one step, in ``input_batch.req_ids`` order, as plain Python values (the per-row
    loops index them), with the facts the step's checks need computed once. Made once a step by
    the readers below with positional arguments, in field order: thirteen keywords cost more
    than the step's other reads (docs/measurements.md, 'The runtime's hot loops')."""

    req_ids: list[str]
    starts: list[int]
    """First token of each row in the flattened step (``query_start_loc``)."""
    ends: list[int]
    """``starts + spans``, the spans being each row's scheduled tokens."""
    prompt_lens: list[int]
    computed: list[int]
    is_prefill: list[bool]
    """``computed < prompt_len`` (a 5-token prompt scheduled 4 + 1 is prefill at computed=4). With
    ``req_ids``, ``prompt_lens`` and ``computed``: each row's ``RUNNER_KEYS`` values (3.1), a
    list per key (``stamp_rows`` stores each with one call)."""
    single_decode: list[bool]
    """Span 1 and not prefill: the rows a talker MTP or a decode batch takes."""
    first_token: int
    """The smallest start."""
    end_token: int
    """The largest end."""
    disjoint: bool
    """No two rows share a token slot. (Rows may overlap: a later row's hook then reads what an
    earlier row wrote, so writes are deferred only when this is true.)"""
    tiled: bool
    """Each row starts where the one before it ends (vLLM's layout), so the rows' slices are one
    split of the step's tokens."""
    decode_starts_increasing: bool
    """The single-token decode rows' starts increase in row order (so they are distinct)."""
    last_decode_start: int
    """The last single-token decode row's start (-1: there is none)."""

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)

    @property
    def all_single_decode(self) -> bool:
        """Every row is a single-token decode (a decode step). ``count(True)`` over a list of True
        is an identity test a row."""
        return self.single_decode.count(True) == len(self.req_ids)


VECTOR_ROWS = 16
"""From this many rows on, a step's rows are read with numpy vector operations; below it, with
Python's (a numpy call costs about a microsecond whatever its size)."""


def read_row_phases(
    input_batch: Any, query_start_loc: Any, num_scheduled_tokens: dict[str, int]
) -> RowPhases:
    """Read the step's rows from vLLM's input batch and the scheduler's token counts."""
    req_ids = list(input_batch.req_ids)
    n = len(req_ids)
    if n >= VECTOR_ROWS:
        return _read_rows_vectorized(req_ids, input_batch, query_start_loc, num_scheduled_tokens)
    if n == 1:
        return _read_one_row(req_ids, input_batch, query_start_loc, num_scheduled_tokens)
    starts = query_start_loc.np[:n].tolist()
    spans = list(map(num_scheduled_tokens.__getitem__, req_ids))
    prompt_lens = input_batch.num_prompt_tokens[:n].tolist()
    computed = input_batch.num_computed_tokens_cpu[:n].tolist()
    ends = list(map(operator.add, starts, spans))
    is_prefill = list(map(operator.lt, computed, prompt_lens))
    single_decode = [span == 1 and not prefill for span, prefill in zip(spans, is_prefill, strict=True)]
    decode_starts = list(itertools.compress(starts, single_decode))
    tiled = ends[:-1] == starts[1:]
    disjoint = tiled or all(map(operator.le, ends[:-1], starts[1:])) or _disjoint_unordered(starts, ends)
    first_token = min(starts, default=0)
    end_token = max(ends, default=0)
    decode_starts_increasing = all(map(operator.lt, decode_starts, decode_starts[1:]))
    last_decode_start = decode_starts[-1] if decode_starts else -1
    return RowPhases(
        req_ids, starts, ends, prompt_lens, computed, is_prefill, single_decode,
        first_token, end_token, disjoint, tiled, decode_starts_increasing, last_decode_start,
    )  # fmt: skip


def _read_one_row(
    req_ids: list[str], input_batch: Any, query_start_loc: Any, num_scheduled_tokens: dict[str, int]
) -> RowPhases:
    """``read_row_phases`` for a one-row step: the same values, read as scalars."""
    # ``item`` reads a Python int out of the array at once; ``int(array[0])`` makes a numpy
    # scalar first (docs/measurements.md, 'The runtime's hot loops').
    start = query_start_loc.np.item(0)
    end = start + num_scheduled_tokens[req_ids[0]]
    prompt_len = input_batch.num_prompt_tokens.item(0)
    computed = input_batch.num_computed_tokens_cpu.item(0)
    prefill = computed < prompt_len
    decode = end - start == 1 and not prefill
    last_decode_start = start if decode else -1
    return RowPhases(
        req_ids, [start], [end], [prompt_len], [computed], [prefill], [decode],
        start, end, True, True, True, last_decode_start,
    )  # fmt: skip


def _disjoint_unordered(starts: list[int], ends: list[int]) -> bool:
    spans = sorted(zip(starts, ends, strict=True))
    return all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))


def _read_rows_vectorized(
    req_ids: list[str], input_batch: Any, query_start_loc: Any, num_scheduled_tokens: dict[str, int]
) -> RowPhases:
    """``read_row_phases`` for a large step: the same values, from numpy vector operations."""
    n = len(req_ids)
    offsets = np.asarray(query_start_loc.np[:n], dtype=np.int64)
    span_list = list(map(num_scheduled_tokens.__getitem__, req_ids))
    # A decode step's spans are all 1 (``count`` is an identity test a row): its ends are the
    # offsets plus one, with no array to convert the spans into (docs/measurements.md, 'The runtime's hot loops').
    unit_spans = span_list.count(1) == n
    spans = 1 if unit_spans else np.array(span_list, dtype=np.int64)
    prompt_lens = input_batch.num_prompt_tokens[:n]
    computed = input_batch.num_computed_tokens_cpu[:n]
    is_prefill = computed < prompt_lens
    ends = offsets + spans
    tiled = bool((offsets[1:] == ends[:-1]).all())
    if tiled or (offsets[1:] >= ends[:-1]).all():
        disjoint = True
    else:
        order = np.argsort(offsets, kind="stable")
        disjoint = bool((offsets[order][1:] >= ends[order][:-1]).all())
    single_decode = ~is_prefill if unit_spans else (spans == 1) & ~is_prefill
    decode_starts = offsets[single_decode]
    decode_starts_increasing = bool((decode_starts[1:] > decode_starts[:-1]).all())
    last_decode_start = int(decode_starts[-1]) if decode_starts.size else -1
    return RowPhases(
        req_ids, offsets.tolist(), ends.tolist(), prompt_lens.tolist(), computed.tolist(),
        is_prefill.tolist(), single_decode.tolist(), int(offsets.min()), int(ends.max()),
        disjoint, tiled, decode_starts_increasing, last_decode_start,
    )  # fmt: skip


SPLIT_ROWS = 8
"""From this many rows on, a tiled step's row slices are made by one ``split``: a view costs half
as much that way, but the call has a fixed cost of a few views."""


def row_slices(
    rows: RowPhases, input_ids: torch.Tensor, inputs_embeds: torch.Tensor
) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
    """Each row's ``input_ids[start:end]`` and ``inputs_embeds[start:end]`` views, the ones a
    per-row hook gets (3.3). Call after ``check_row_bounds``."""
    if rows.num_rows == 1 and rows.first_token == 0 and rows.end_token == input_ids.shape[0]:
        # One row that is the whole step: its slices would be the step's tensors (a view costs
        # about as much as a dozen lines of Python).
        return (input_ids,), (inputs_embeds,)
    if rows.tiled and rows.num_rows >= SPLIT_ROWS:
        first, last = rows.first_token, rows.end_token
        # A decode step's rows are one token each: their spans need no subtraction.
        n = rows.num_rows
        spans = [1] * n if rows.all_single_decode else list(map(operator.sub, rows.ends, rows.starts))
        if torch.is_inference_mode_enabled():
            # Inside inference mode (vLLM's step), the views are of inference aliases of the
            # step's tensors: the same memory, but a view of an inference tensor carries no
            # autograd view record, to make and to free; the two aliases cost what a few rows
            # save, hence SPLIT_ROWS (docs/measurements.md, 'Figures behind the design choices').
            input_ids, inputs_embeds = inference_alias(input_ids), inference_alias(inputs_embeds)
        return input_ids[first:last].split(spans), inputs_embeds[first:last].split(spans)
    bounds = list(zip(rows.starts, rows.ends, strict=True))
    return [input_ids[s:e] for s, e in bounds], [inputs_embeds[s:e] for s, e in bounds]


def inference_alias(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself if it is an inference tensor, else a tensor made in inference mode (call
    it inside) on the same memory, with the same shape and strides: writes through either show
    in the other. vLLM makes its persistent buffers outside inference mode, so the views of them
    it hands a step are ordinary tensors."""
    return tensor if tensor.is_inference() else tensor.new_empty(0).set_(tensor)


def write_into(slots: torch.Tensor, values: torch.Tensor) -> None:
    """``slots.copy_(values)``, ``values`` reshaped to the slots' shape (ids may come back 2-D),
    unless ``values`` already are the slots' memory: a hook that keeps its inputs hands back its
    input or a view of it, and copying memory onto itself is a wasted device operation."""
    if values is slots or (
        values.data_ptr() == slots.data_ptr()
        and values.dtype == slots.dtype
        and values.numel() == slots.numel()
        and values.is_contiguous()
        and slots.is_contiguous()
    ):
        return
    slots.copy_(values if values.shape == slots.shape else values.reshape(slots.shape))


RUNNER_KEYS = ("request_id", "_omni_prompt_len", "_omni_num_computed_tokens", "_omni_is_prefill")
"""The keys the runner owns in each row's buffer (3.1)."""


def stamp_rows(
    runner: Any, rows: RowPhases, found: list[Any] | None = None, all_found: bool = False
) -> list[dict[str, Any]]:
    """Each row's buffer, created (and mirrored) where missing by ``runner._request_buffer``, with
    the row's ``RUNNER_KEYS`` written into it (3.1), in row order: what the hooks see. Every row
    is stamped before the first hook runs (a hook sees its own rows' keys either way; a failure
    later in the step is undone by the step's ``StepJournal``). ``found``: the rows' buffers (None
    where missing) as the step's journal read them, where nothing can have replaced one since,
    and ``all_found`` whether the journal found every one; without them they are looked up."""
    row_buffers = (
        found if found is not None else list(map(runner.model_intermediate_buffer.get, rows.req_ids))
    )
    if not all_found and None in row_buffers:
        row_buffers = [
            runner._request_buffer(req_id) if buffer is None else buffer
            for req_id, buffer in zip(rows.req_ids, row_buffers, strict=True)
        ]
    # One plain loop: cheaper than a C-level map per key at every batch size (docs/measurements.md, 'The runtime's hot loops').
    stamped = zip(row_buffers, rows.req_ids, rows.prompt_lens, rows.computed, rows.is_prefill, strict=True)
    for buffer, req_id, prompt_len, computed, prefill in stamped:
        buffer["request_id"] = req_id
        buffer["_omni_prompt_len"] = prompt_len
        buffer["_omni_num_computed_tokens"] = computed
        buffer["_omni_is_prefill"] = prefill
    return row_buffers


def single_decode_rows(rows: RowPhases) -> tuple[list[str], list[int]]:
    """The request ids and starts of the step's single-token decode rows, in row order: the rows
    a talker MTP takes (3.2). Where every row is one (a decode step), ``rows``' own lists: the
    callers only read them."""
    if rows.all_single_decode:
        return rows.req_ids, rows.starts
    return (
        list(itertools.compress(rows.req_ids, rows.single_decode)),
        list(itertools.compress(rows.starts, rows.single_decode)),
    )


def segments(batchable: list[bool]) -> list[tuple[int, int, bool]]:
    """Split rows into ``(start, end, is_batch)`` segments in row order.

    Adjacent batchable rows form one batch segment; every other row is a segment of its
    own, so a non-batchable row between two batchable ones splits them (3.3).
    """
    n = len(batchable)
    if all(batchable):
        return [(0, n, True)] if n else []
    out: list[tuple[int, int, bool]] = []
    i = 0
    while i < n:
        if batchable[i]:
            j = i + 1
            while j < n and batchable[j]:
                j += 1
            out.append((i, j, True))
            i = j
        else:
            out.append((i, i + 1, False))
            i += 1
    return out


def check_contiguous_runs(phases: RowPhases, runs: list[tuple[int, int, bool]], num_tokens: int) -> None:
    """Raise before any hook runs if a non-MTP decode batch's offsets are not contiguous and in bounds (3.5).

    Tiled rows within the step pass without a look at each run: a batch's rows are single-token
    decodes, each starting where the one before it ends."""
    if phases.tiled and phases.first_token >= 0 and phases.end_token <= num_tokens:
        return
    for start, end, is_batch in runs:
        if not is_batch:
            continue
        offs = phases.starts[start:end]
        first = offs[0]
        if (
            first < 0
            or first + (end - start) > num_tokens
            or offs != list(range(first, first + (end - start)))
        ):
            raise RuntimeError(
                f"{CONTIGUITY_ERROR}: rows {start}..{end - 1} (requests {', '.join(phases.req_ids[start:end])}) "
                f"have offsets {offs} for {num_tokens} scheduled tokens; "
                "model.preprocess_decode_batch was not called"
            )


def check_mtp_offsets(phases: RowPhases, num_tokens: int) -> None:
    """Raise before any hook runs unless the step's talker-MTP rows (its single-token decode rows)
    have distinct in-bounds offsets (3.5).

    A decode batch gathers their ids and scatters their embeddings by offset, and the MTP writes
    each row's embedding back at its offset: an offset past the step reads and writes another
    step's slots, and two rows at one offset write the same slot (which one wins is unspecified).
    The common case (increasing starts within the step) is two comparisons of facts
    ``read_row_phases`` computed; the message is built only on failure.
    """
    if phases.decode_starts_increasing and phases.first_token >= 0 and phases.last_decode_start < num_tokens:
        return
    rows = [row for row, decode in enumerate(phases.single_decode) if decode]
    offs = [phases.starts[row] for row in rows]
    if len(set(offs)) == len(offs) and all(0 <= off < num_tokens for off in offs):
        return
    repeated = {off for off, count in collections.Counter(offs).items() if count > 1}
    bad = [
        f"{phases.req_ids[row]} (row {row}) at {off}"
        for row, off in zip(rows, offs, strict=True)
        if off < 0 or off >= num_tokens or off in repeated
    ]
    raise RuntimeError(
        f"{MTP_OFFSETS_ERROR}: {', '.join(bad)} for {num_tokens} scheduled tokens "
        "(an offset out of bounds or shared by two rows); no hook was called"
    )


def check_row_bounds(phases: RowPhases, num_tokens: int) -> None:
    """Raise before any hook runs unless every row's tokens ``start .. end`` lie within the step's
    ``num_tokens`` and no two rows share a token (3.5): a row past the end would hand its hook a
    short slice, a negative offset another row's tokens, and two rows over the same tokens would
    each be handed the other's and write over them (which write wins would depend on row order).
    Rows in any order are taken if they share no token (the MTP rows are gathered and scattered
    by index). Three reads of facts ``read_row_phases`` computed (``disjoint``: by vector
    operations from ``VECTOR_ROWS`` rows on); the message only on failure."""
    if phases.first_token >= 0 and phases.end_token <= num_tokens and phases.disjoint:
        return
    rows = list(enumerate(zip(phases.starts, phases.ends, strict=True)))
    bad = [
        f"{phases.req_ids[row]} (row {row}) at {start}..{end}"
        for row, (start, end) in rows
        if start < 0 or end > num_tokens
    ]
    if bad:
        raise RuntimeError(
            f"{ROW_BOUNDS_ERROR}: {', '.join(bad)} for {num_tokens} scheduled tokens; no hook was called"
        )
    # Sorted by start, each row against the row before it that reaches furthest.
    overlaps = []
    reach: tuple[int, int, int] | None = None
    for row, (start, end) in sorted(rows, key=lambda r: (r[1][0], r[0])):
        if reach is not None and start < reach[2]:
            pair = sorted((reach, (row, start, end)))
            overlaps.append(" and ".join(f"{phases.req_ids[r]} (row {r}) at {s}..{e}" for r, s, e in pair))
        if reach is None or end > reach[2]:
            reach = (row, start, end)
    raise RuntimeError(
        f"{ROW_OVERLAP_ERROR}: {'; '.join(overlaps)} for {num_tokens} scheduled tokens "
        "(two rows over the same tokens); no hook was called"
    )


ABSENT = object()
"""What a dict or an object did not have (where None may be a value it has)."""
_IS_DICT = dict.__instancecheck__
"""``isinstance(value, dict)`` as a one-argument C callable (for ``filter``)."""
MIRROR = "additional_information_cpu"
"""The request attribute that mirrors its buffer (4.1)."""


def with_request_features(
    runner: Any, req_ids: list[str], requests: list[Any], row_buffers: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """What a decode batch's hook sees with ``attach_request_features``: the copies of its rows'
    buffers ``runner._attach_request_features`` makes, which carry the runner keys (3.1, 3.8)."""
    return [
        runner._attach_request_features(request, buffer, req_id)
        for req_id, request, buffer in zip(req_ids, requests, row_buffers, strict=True)
    ]


_Tensor = torch.Tensor
"""``torch.Tensor``, bound once: a per-row check looks it up without going through ``torch``'s module."""
INTEGER_DTYPES = frozenset(
    {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64}
)
FLOATING_DTYPES = frozenset(
    dtype for dtype in vars(torch).values() if isinstance(dtype, torch.dtype) and dtype.is_floating_point
)
"""Every dtype with ``is_floating_point``: a per-row check asks ``dtype in`` it, a set lookup,
cheaper than reading the dtype's attribute three times a talker-MTP row (docs/measurements.md, 'The runtime's hot loops')."""
BATCH_RESULT = {
    3: "(ids, embeddings, updates)",
    5: "(ids, embeddings, last_hidden, text_step, updates)",
}


def batch_output(
    req_ids: list[str],
    out: Any,
    width: int,
    mtp_width: int | None = None,
    hook: str = "preprocess_decode_batch",
) -> Any:
    """A decode batch hook's result, unpackable as the template does, or a ``ValueError`` naming the
    hook and the requests, raised before anything is written (3.5).

    The plain hook returns ``(ids, embeddings, updates)``, the MTP one ``(ids, embeddings,
    last_hidden, text_step, updates)`` (``mtp_width`` given): one integer id and one
    ``width``-wide floating-point embedding row per request, one update (a dict or None) per
    request, and ``(rows, mtp_width)`` floating-point MTP inputs. The common case is one pass of
    attribute reads; the message is built only on failure. The step's ``StepJournal`` then puts
    back the runner keys the batch stamped.
    """
    arity = 3 if mtp_width is None else 5
    if not isinstance(out, tuple) or len(out) != arity:
        got = (
            f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
        )
        raise ValueError(
            f"{_batch_prefix(hook, req_ids)} returned {got}; expected a {arity}-tuple {BATCH_RESULT[arity]}"
        )
    ids, embeds, updates = out[0], out[1], out[-1]
    n = len(req_ids)
    if (
        isinstance(ids, torch.Tensor)
        and ids.numel() == n
        and ids.dtype in INTEGER_DTYPES
        and isinstance(embeds, torch.Tensor)
        and embeds.shape == (n, width)
        and embeds.is_floating_point()
        and isinstance(updates, (list, tuple))
        and len(updates) == n
        and _updates_ok(updates)
        and (mtp_width is None or (_rows_ok(out[2], n, mtp_width) and _rows_ok(out[3], n, mtp_width)))
    ):
        return out
    raise ValueError(_batch_problems(hook, req_ids, out, width, mtp_width))


def _updates_ok(updates: Any) -> bool:
    for update in updates:
        if update is not None and not isinstance(update, dict):
            return False
    return True


def _rows_ok(tensor: Any, rows: int, width: int) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.shape == (rows, width) and tensor.is_floating_point()


def _batch_prefix(hook: str, req_ids: list[str]) -> str:
    return f"batched decode preprocessing: model.{hook} for requests {', '.join(req_ids)}"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    return type(value).__name__


def _batch_problems(hook: str, req_ids: list[str], out: Any, width: int, mtp_width: int | None) -> str:
    """The message of a bad batch result: every problem found, each with the request it concerns."""
    ids, embeds, updates = out[0], out[1], out[-1]
    n = len(req_ids)
    got_ids = int(ids.numel()) if isinstance(ids, torch.Tensor) else None
    got_embeds = int(embeds.shape[0]) if isinstance(embeds, torch.Tensor) and embeds.ndim == 2 else None
    got_updates = len(updates) if isinstance(updates, (list, tuple)) else None
    problems = []
    if not got_ids == got_embeds == got_updates == n:
        counts = (
            f"{_count(got_ids, ids)} ids, {_count(got_embeds, embeds)} embeddings and "
            f"{_count(got_updates, updates)} updates"
        )
        problems.append(f"{counts} for {n} rows; it must return exactly one of each per row")
    if isinstance(ids, torch.Tensor) and ids.dtype not in INTEGER_DTYPES:
        problems.append(f"ids of dtype {ids.dtype}, expected an integer dtype")
    elif not isinstance(ids, torch.Tensor):
        problems.append(f"ids of type {type(ids).__name__}, expected a tensor")
    if not (isinstance(embeds, torch.Tensor) and embeds.ndim == 2 and embeds.shape[1] == width):
        problems.append(f"embeddings {_describe(embeds)}, expected ({n}, {width})")
    if isinstance(embeds, torch.Tensor) and not embeds.is_floating_point():
        problems.append(f"embeddings of dtype {embeds.dtype}, expected floating point")
    if isinstance(updates, (list, tuple)):
        for req_id, update in zip(req_ids, updates, strict=False):
            if update is not None and not isinstance(update, dict):
                problems.append(
                    f"request {req_id}'s update is a {type(update).__name__}, expected a dict or None"
                )
                break
    else:
        problems.append(
            f"updates of type {type(updates).__name__}, expected a list of one dict (or None) per row"
        )
    if mtp_width is not None:
        for name, tensor in (("last_hidden", out[2]), ("text_step", out[3])):
            if not _rows_ok(tensor, n, mtp_width):
                problems.append(f"{name} {_describe(tensor)}, expected ({n}, {mtp_width}) floating point")
    return f"{_batch_prefix(hook, req_ids)} returned " + "; ".join(problems)


def _count(got: int | None, value: Any) -> str:
    return str(got) if got is not None else f"no ({_describe(value)})"


# -- A step's preprocessing, all or nothing (issue 9) ---------------------------------------------


class StepJournal:
    """What a step's hooks may change (the rows' buffers and mirrors, the persistent inputs, the
    MTP generators), kept so that a failure anywhere in the step puts every one of them back.

    Buffers are restored in place, so a buffer and its mirror stay the same object (4.1). A merge
    (the runner's or a hook's own writes: Qwen3-Omni's talker writes into its buffer's ``meta``)
    reaches one level deep, so the journal keeps a copy of each row's buffer and of each dict
    inside it. This runs for every row of every step: the lookups and copies are C calls over
    the rows (``map``), and what is kept is a few flat lists, not an object per row or dict.
    """

    def __init__(self, runner: Any, req_ids: list[str], *inputs: Any) -> None:
        self._runner = runner
        # The persistent inputs the hooks' results are written into: ids and embeddings. (An MTP
        # stage's four staging buffers are written only once every hook has run and been checked.)
        self._inputs = [(tensor, tensor.clone()) for tensor in inputs]
        generators = runner._talker_mtp_generators
        self._generators = dict(generators) if generators else None
        self._req_ids = req_ids
        # Each row's buffer object (None: dropped again), in case a hook replaced it in the map,
        # and each row's request (None: unknown) with its mirror as it was (ABSENT: none). The
        # step's rows use the two lists too (read-only).
        self.buffers = row_buffers = list(map(runner.model_intermediate_buffer.get, req_ids))
        # Whether every row has a buffer (the common step): ``stamp_rows`` need not look again.
        self.all_found = all_found = None not in row_buffers
        self.requests = requests = list(map(runner.requests.get, req_ids))
        try:
            # The common step: every request known and mirrored, read by a plain attribute read
            # (a getattr with a default costs more than twice as much) (docs/measurements.md, 'The runtime's hot loops').
            self._mirrors = [request.additional_information_cpu for request in requests]
        except AttributeError:
            self._mirrors = list(map(getattr, requests, itertools.repeat(MIRROR), itertools.repeat(ABSENT)))
        # Every existing buffer and every dict inside one, and a copy of each. The values are
        # scanned by C calls (a buffer's every value, every row), not a Python loop (docs/measurements.md, 'The runtime's hot loops').
        existing = row_buffers if all_found else [b for b in row_buffers if b is not None]
        inner = filter(_IS_DICT, itertools.chain.from_iterable(map(dict.values, existing)))
        self._saved = saved = [*existing, *inner]
        self._copies = list(map(dict.copy, saved))

    def undo(self) -> None:
        runner = self._runner
        buffers = runner.model_intermediate_buffer
        for req_id, buffer in zip(self._req_ids, self.buffers, strict=True):
            if buffer is None:
                buffers.pop(req_id, None)
            else:
                buffers[req_id] = buffer
        for request, mirror in zip(self.requests, self._mirrors, strict=True):
            if request is None:
                continue
            if mirror is ABSENT:
                with contextlib.suppress(AttributeError):
                    delattr(request, MIRROR)
            else:
                setattr(request, MIRROR, mirror)
        for saved, contents in zip(self._saved, self._copies, strict=True):
            saved.clear()
            saved.update(contents)
        for tensor, saved_input in self._inputs:
            tensor.copy_(saved_input)
        generators = runner._talker_mtp_generators
        generators.clear()
        if self._generators:
            generators.update(self._generators)


def note_hook_failure(exc: BaseException, hook: str, req_ids: list[str]) -> None:
    """Name the hook and the requests on an exception a hook raised (a note: its type and message
    stay the model's); the step's ``StepJournal`` then undoes the step."""
    exc.add_note(
        f"raised by model.{hook} for request{'s' if len(req_ids) != 1 else ''} {', '.join(req_ids)}; "
        "the step's preprocessing was undone"
    )


ROW_RESULT = "(ids, embeddings, update)"


def row_output(req_id: str, out: Any, span: int, width: int, hook: str = "preprocess") -> Any:
    """A per-row hook's ``(ids, embeddings, update)``, or a ``ValueError`` naming the request and
    the hook, raised before anything is written (3.5), unless the row got what it needs: ``span``
    embedding rows of ``width`` (floating point), ``span`` integer ids (or None, to keep the
    scheduled ones), an update dict (or None). A talker-MTP decode row is checked in the generated
    row loop itself (``mtp_row_problems`` builds its message).

    This runs on every row: the common case is one expression of attribute reads, the dtypes
    looked up in sets (``t.dtype in FLOATING_DTYPES``) rather than asked of the tensor (a tensor
    method call costs more than an attribute read: torch releases and takes back the GIL around it);
    the message is built only on failure."""
    if isinstance(out, tuple) and len(out) == 3:
        ids, embeds, update = out
        if (
            isinstance(embeds, _Tensor)
            and embeds.shape == (span, width)
            and embeds.dtype in FLOATING_DTYPES
            and (
                ids.numel() == span and ids.dtype in INTEGER_DTYPES
                if isinstance(ids, _Tensor)
                else ids is None
            )
            and (update is None or isinstance(update, dict))
        ):
            return out
    raise ValueError(_row_problems(req_id, out, span, width, None, hook))


def mtp_row_problems(req_id: str, out: Any, mtp_inputs: Any, width: int, mtp_width: int) -> str:
    """The message of a talker-MTP decode row's bad result (one token, ``mtp_width`` given): the
    generated row loop checks such a result in line, as ``row_output`` checks another row's, and
    has taken ``mtp_inputs`` (``ABSENT``: none) out of its update, so it is put back first."""
    if mtp_inputs is not ABSENT:
        out[2]["mtp_inputs"] = mtp_inputs
    return _row_problems(req_id, out, 1, width, mtp_width, "preprocess")


def _row_problems(req_id: str, out: Any, span: int, width: int, mtp_width: int | None, hook: str) -> str:
    """The message of a bad per-row result: every problem found, naming the request and the hook."""
    if not isinstance(out, tuple) or len(out) != 3:
        got = (
            f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
        )
        return f"request {req_id}: model.{hook} returned {got}; expected a 3-tuple {ROW_RESULT}"
    ids, embeds, update = out
    problems = []
    if not (isinstance(embeds, _Tensor) and embeds.shape == (span, width) and embeds.dtype.is_floating_point):
        problems.append(f"embeddings {_describe(embeds)}, expected ({span}, {width}) floating point")
    if isinstance(ids, _Tensor):
        if ids.numel() != span or ids.dtype not in INTEGER_DTYPES:
            problems.append(
                f"{ids.numel()} ids of dtype {ids.dtype}, expected {span} integer ids{_ids_hint(mtp_width)}"
            )
    elif ids is not None or mtp_width is not None:
        got = "None for the ids" if ids is None else f"ids of type {type(ids).__name__}"
        problems.append(f"{got}, expected {span} integer ids{_ids_hint(mtp_width)}")
    if not (update is None or isinstance(update, dict)):
        problems.append(f"an update of type {type(update).__name__}, expected a dict")
    if mtp_width is not None and not _mtp_inputs_ok(update, mtp_width):
        problems.append(
            f"no update['mtp_inputs'] of two {mtp_width}-wide floating-point hidden vectors on a "
            "talker-MTP decode row"
        )
    return f"request {req_id}: model.{hook} returned " + "; ".join(problems)


def _ids_hint(mtp_width: int | None) -> str:
    """What a row's ids may be instead, for the message of ``_row_problems``."""
    return (
        " (or None to keep the scheduled ones)"
        if mtp_width is None
        else " (a talker-MTP row's ids feed the MTP)"
    )


def _mtp_inputs_ok(update: Any, width: int) -> bool:
    pair = update.get("mtp_inputs") if isinstance(update, dict) else None
    if not (isinstance(pair, tuple) and len(pair) == 2):
        return False
    last_hidden, text_step = pair
    return (
        isinstance(last_hidden, _Tensor)
        and isinstance(text_step, _Tensor)
        and last_hidden.numel() == width
        and text_step.numel() == width
        and last_hidden.dtype.is_floating_point
        and text_step.dtype.is_floating_point
    )
