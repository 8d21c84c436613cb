"""``read_row_phases`` reads a step's rows with Python below ``VECTOR_ROWS`` rows (as scalars for
one row) and numpy from there on: all must give the same rows and facts, for any offsets
(unordered, overlapping, out of bounds), spans and prefill states."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from omnigen.runtime import phases

ROW = st.tuples(
    st.integers(-2, 40),  # start
    st.integers(1, 4),  # span
    st.integers(1, 6),  # prompt length
    st.integers(0, 8),  # computed
)


def _step(rows):
    n = len(rows)
    req_ids = [f"r{i}" for i in range(n)]
    batch = SimpleNamespace(
        req_ids=req_ids,
        num_prompt_tokens=np.array([r[2] for r in rows] + [0], dtype=np.int32),
        num_computed_tokens_cpu=np.array([r[3] for r in rows] + [0], dtype=np.int32),
    )
    qsl = SimpleNamespace(np=np.array([r[0] for r in rows] + [0], dtype=np.int32))
    return batch, qsl, {req_id: r[1] for req_id, r in zip(req_ids, rows, strict=True)}


def _sorted_step(rows):
    """The usual step: rows laid out one after another from token 0."""
    start, out = 0, []
    for _, span, prompt_len, computed in rows:
        out.append((start, span, prompt_len, computed))
        start += span
    return out


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(ROW, min_size=1, max_size=40), laid_out=st.booleans())
def test_the_python_and_the_vector_reads_agree(rows, laid_out):
    step = _step(_sorted_step(rows) if laid_out else rows)
    with mock.patch.object(phases, "VECTOR_ROWS", len(rows) + 1):
        small = phases.read_row_phases(*step)
    vector = phases._read_rows_vectorized(step[0].req_ids, *step)
    assert small == vector
    starts = [r[0] for r in (_sorted_step(rows) if laid_out else rows)]
    ends = [s + r[1] for s, r in zip(starts, rows, strict=True)]
    slots = [t for s, e in zip(starts, ends, strict=True) for t in range(s, e)]
    assert vector.disjoint is (len(slots) == len(set(slots)))
    assert vector.tiled is all(end == start for end, start in zip(ends[:-1], starts[1:], strict=True))
    decode = [r[1] == 1 and r[3] >= r[2] for r in rows]
    assert vector.single_decode == decode
    assert (vector.first_token, vector.end_token) == (min(starts), max(ends))
    decode_starts = [s for s, d in zip(starts, decode, strict=True) if d]
    assert vector.last_decode_start == (decode_starts[-1] if decode_starts else -1)
    assert vector.decode_starts_increasing is all(a < b for a, b in itertools.pairwise(decode_starts))
    assert vector.prompt_lens == [r[2] for r in rows]
    assert vector.computed == [r[3] for r in rows]
    assert vector.is_prefill == [r[3] < r[2] for r in rows]
    # 3.1: the runner keys are Python ints and bools (never numpy scalars).
    assert all(type(value) is int for value in (*vector.prompt_lens, *vector.computed))
    assert all(type(value) is bool for value in vector.is_prefill)


@settings(max_examples=100, deadline=None)
@given(row=ROW)
def test_the_one_row_read_agrees_with_the_vector_read(row):
    step = _step([row])
    one = phases.read_row_phases(*step)
    assert one == phases._read_rows_vectorized(step[0].req_ids, *step)
    assert all(type(value) is int for value in (*one.starts, *one.ends, *one.prompt_lens, *one.computed))
    assert all(type(value) is bool for value in one.is_prefill)


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(ROW, min_size=1, max_size=40))
def test_the_mtp_rows_are_the_single_token_decode_rows_in_row_order(rows):
    laid_out = _sorted_step(rows)
    req_ids, starts = phases.single_decode_rows(phases.read_row_phases(*_step(laid_out)))
    # 3.2: span 1 and computed >= prompt length.
    expected = [
        (f"r{row}", start)
        for row, (start, span, prompt_len, computed) in enumerate(laid_out)
        if span == 1 and computed >= prompt_len
    ]
    assert list(zip(req_ids, starts, strict=True)) == expected
