"""The hot path's views and writes: the per-row slices a hook gets (``phases.row_slices``), the MTP
buffers' leading rows (``mtp.leading_rows``) and the writes that skip a copy onto itself
(``phases.write_into``) must be exactly what plain slicing and copying give."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.utils import CpuGpuBuffer

from omnigen.runtime import mtp, phases

HIDDEN = 4


def _rows(bounds: list[tuple[int, int]]) -> phases.RowPhases:
    starts = [start for start, _ in bounds]
    ends = [end for _, end in bounds]
    n = len(bounds)
    return phases.RowPhases(
        req_ids=[f"r{i}" for i in range(n)],
        starts=starts,
        ends=ends,
        prompt_lens=[1] * n,
        computed=[1] * n,
        is_prefill=[False] * n,
        single_decode=[end - start == 1 for start, end in bounds],
        first_token=min(starts),
        end_token=max(ends),
        disjoint=True,
        tiled=ends[:-1] == starts[1:],
        decode_starts_increasing=True,
        last_decode_start=-1,
    )


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())


@pytest.mark.parametrize(
    "bounds",
    [
        [(0, 1)],
        [(3, 5)],
        [(i, i + 1) for i in range(phases.SPLIT_ROWS)],  # tiled: one split
        [(0, 3), *((3 + i, 4 + i) for i in range(phases.SPLIT_ROWS))],  # tiled, a prefill first
        [(2 * i, 2 * i + 1) for i in range(phases.SPLIT_ROWS)],  # gaps: sliced row by row
        [(5, 6), (0, 2), (2, 3)],
    ],
)
@pytest.mark.parametrize("inference", [False, True], ids=["outside inference mode", "inference mode"])
def test_row_slices_are_the_rows_slices(bounds, inference):
    # Made outside inference mode, as vLLM's persistent buffers are; the step may run inside it.
    ids = torch.arange(40, dtype=torch.int32)
    embeds = torch.randn(40, HIDDEN)
    with torch.inference_mode(inference):
        id_rows, embed_rows = phases.row_slices(_rows(bounds), ids, embeds)
        assert len(id_rows) == len(embed_rows) == len(bounds)
        for (start, end), id_row, embed_row in zip(bounds, id_rows, embed_rows, strict=True):
            assert _same_view(id_row, ids[start:end])
            assert _same_view(embed_row, embeds[start:end])
            # A view, not a copy: the hook's in-place writes land in the step.
            embed_row.fill_(start)
            id_row.fill_(-start)
    for start, end in bounds:
        assert bool((embeds[start:end] == start).all())
        assert bool((ids[start:end] == -start).all())


def test_a_hook_outside_inference_mode_gets_ordinary_views_it_can_write():
    """Outside inference mode no slice is of an inference tensor: one could not be written there."""
    bounds = [(i, i + 1) for i in range(phases.SPLIT_ROWS)]
    ids, embeds = torch.arange(40, dtype=torch.int32), torch.randn(40, HIDDEN)
    id_rows, embed_rows = phases.row_slices(_rows(bounds), ids, embeds)
    assert not any(row.is_inference() for row in (*id_rows, *embed_rows))
    for row, (id_row, embed_row) in enumerate(zip(id_rows, embed_rows, strict=True)):
        id_row.fill_(row + 100)  # an inference tensor would raise here, outside inference mode
        embed_row.fill_(row)
    assert ids[: phases.SPLIT_ROWS].tolist() == [row + 100 for row in range(phases.SPLIT_ROWS)]
    assert embeds[: phases.SPLIT_ROWS, 0].tolist() == list(range(phases.SPLIT_ROWS))
    with torch.inference_mode():
        id_rows, embed_rows = phases.row_slices(_rows(bounds), ids, embeds)
    # Inside it, from SPLIT_ROWS rows on, they are (what the hot path saves: no autograd view record).
    assert all(row.is_inference() for row in (*id_rows, *embed_rows))


def _mtp_runner(rows: int = 8) -> SimpleNamespace:
    return SimpleNamespace(
        talker_mtp_input_ids=CpuGpuBuffer(rows, dtype=torch.int32, device="cpu"),
        talker_mtp_inputs_embeds=CpuGpuBuffer(
            rows, HIDDEN, dtype=torch.float32, device="cpu", with_numpy=False
        ),
        last_talker_hidden=CpuGpuBuffer(rows, HIDDEN, dtype=torch.float32, device="cpu", with_numpy=False),
        text_step=CpuGpuBuffer(rows, HIDDEN, dtype=torch.float32, device="cpu", with_numpy=False),
        _talker_mtp_views={},
    )


def test_leading_rows_are_kept_per_size_and_made_again_for_a_replaced_buffer():
    runner = _mtp_runner()
    views = mtp.leading_rows(runner, 3)
    names = ("talker_mtp_input_ids", "talker_mtp_inputs_embeds", "last_talker_hidden", "text_step")
    for name, view in zip(names, views, strict=True):
        assert _same_view(view, getattr(runner, name).gpu[:3])
    assert mtp.leading_rows(runner, 3) is views
    assert mtp.leading_rows(runner, 2)[0].shape == (2,)
    # A test or a reload that puts a new buffer in place gets views of the new one.
    runner.text_step = CpuGpuBuffer(8, HIDDEN, dtype=torch.float32, device="cpu", with_numpy=False)
    fresh = mtp.leading_rows(runner, 3)
    assert _same_view(fresh[3], runner.text_step.gpu[:3])
    assert fresh[0] is not views[0] and _same_view(fresh[0], views[0])


def test_write_into_copies_unless_the_values_are_the_slots():
    ids = torch.arange(10, dtype=torch.int32)
    slots = ids[2:5]
    phases.write_into(slots, torch.tensor([[7, 8, 9]], dtype=torch.int64))  # 2-D, another dtype
    assert ids[2:5].tolist() == [7, 8, 9]
    # The hook's own input handed back (or a view of it, or its memory reshaped): nothing to copy.
    for same in (slots, slots.reshape(-1), slots.view(1, 3), ids[2:5]):
        before = slots.clone()
        phases.write_into(slots, same)
        assert torch.equal(slots, before)
    # Overlapping memory that is not the slots' is copied.
    phases.write_into(ids[3:6], ids[2:5].clone())
    assert ids[3:6].tolist() == [7, 8, 9]
    # The same bytes read as another dtype are other values: copied (converted) all the same.
    raw = torch.tensor([1, 2, 3], dtype=torch.int32)
    as_floats = raw.view(torch.float32)
    phases.write_into(as_floats, raw)
    assert as_floats.tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    "shapes",
    [
        [(HIDDEN,)] * 3,  # Qwen3-Omni's talker: 1-D hidden vectors
        [(1, HIDDEN)] * 3,  # one (1, width) block per per-row hook row
        [(2, HIDDEN), (1, HIDDEN)],  # decode batches' blocks
        [(HIDDEN,), (1, HIDDEN), (2, HIDDEN)],  # mixed: reshaped row by row
        [(1, HIDDEN), (HIDDEN,)],
        [(1, 1, HIDDEN), (HIDDEN,)],
    ],
)
def test_stack_rows_gives_the_rows_in_order(shapes):
    tensors = [torch.randn(shape) for shape in shapes]
    expected = torch.cat([t.reshape(-1, HIDDEN) for t in tensors])
    stacked = mtp.stack_rows(tensors, HIDDEN)
    assert torch.equal(stacked, expected)


def test_a_single_mtp_row_is_copied_into_its_staging_row_as_it_is():
    row = torch.randn(HIDDEN)
    assert mtp.stack_rows([row], HIDDEN) is row
    slots = torch.zeros(1, HIDDEN)
    slots.copy_(mtp.stack_rows([row], HIDDEN))
    assert torch.equal(slots[0], row)


@pytest.mark.parametrize(
    "shapes",
    [
        [(1,)] * 3,  # per-row hook rows' ids
        [(1, 1)] * 3,  # ids handed back 2-D
        [(3,), (1,)],  # a decode batch's ids, then a row's
        [(1, 3), (1, 3)],  # 2-D batches of one shape: flattened row by row
        [(1, 3), (1, 2)],  # 2-D of other widths: they do not join as they are
        [(1,), (1, 1), (2,)],  # mixed ranks
        [(), (1,)],  # a 0-d id
    ],
)
def test_flat_ids_gives_the_ids_in_order(shapes):
    tensors = [torch.randint(0, 100, shape) for shape in shapes]
    expected = torch.cat([t.reshape(-1) for t in tensors])
    flat = mtp.flat_ids(tensors)
    assert flat.dim() == 1
    assert torch.equal(flat, expected)
