"""benchmarks/host_overhead.py (``host_cost.py wall``): every runner and batch size in every repeat
(a block each, or a step at a time with cold caches), each step's hook calls replayed right after it, the marginal
cost a median of paired slopes, and every contract mechanism's ablation runnable (a diagnostic
that fails to run measures nothing)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from benchmarks import host_overhead
from omnigen.runtime import buffers
from omnigen_testing.oracle import harness

pytestmark = pytest.mark.oracle

STEPS = 3


@contextlib.contextmanager
def _lanes(cell: host_overhead.Cell, batches: list[int]) -> Iterator[list[host_overhead._Lane]]:
    """Both runners' lanes at each of ``batches``, inside the harness's patches (as measured)."""
    for batch in batches:
        host_overhead._room(batch, False)
    policy, ours, oracle, extra = host_overhead._classes(cell)
    lanes = []
    with harness.harness_patches(extra):
        for batch in batches:
            scen, plan = host_overhead.scenario(batch, STEPS, mixed=False, seeded_share=0.0)
            for cls in (oracle, ours):
                recorded = host_overhead._recorded_hooks(cls, policy, extra, scen, plan, "trivial")
                prep = host_overhead._prepare(cls, policy, extra, scen, plan)
                lanes.append(host_overhead._Lane(prep, recorded))
        yield lanes


def _steps_in_turn(cold: bool, monkeypatch) -> tuple[list, list, list]:
    """The lanes (both runners at B 4 and 8) driven once: ``(lane, scheduler output)`` in the order
    their steps ran, the lanes, and each lane's figures."""
    monkeypatch.setattr(host_overhead, "COLD_CACHES", cold)
    order = []
    with _lanes(host_overhead.CELLS["plain"], [4, 8]) as lanes:
        for index, lane in enumerate(lanes):
            runner = lane.prep.runner
            original = runner._preprocess

            def preprocess(sched, num_tokens, *args, _index=index, _original=original, **kwargs):
                order.append((_index, sched))
                return _original(sched, num_tokens, *args, **kwargs)

            runner._preprocess = preprocess
        figures = host_overhead._drive_interleaved(lanes)
    assert all(runner_s > 0 and hooks_s > 0 for runner_s, hooks_s in figures)
    return order, lanes, figures


def test_cold_lanes_take_turns_a_step_at_a_time_each_step_once_in_order(monkeypatch):
    order, lanes, _ = _steps_in_turn(True, monkeypatch)
    n = len(lanes)
    assert len(order) == STEPS * n
    turns = [order[k * n : (k + 1) * n] for k in range(STEPS)]
    for k, turn in enumerate(turns):
        # Step k of every lane before any lane's step k + 1, each lane's k-th prepared output.
        assert sorted(index for index, _ in turn) == list(range(n))
        assert all(sched is lanes[index].prep.outputs[k][1] for index, sched in turn)
    # The turns are drawn anew: no lane always follows the same one.
    assert len({tuple(index for index, _ in turn) for turn in turns}) > 1


def test_warm_lanes_run_their_steps_in_one_block_each_in_order(monkeypatch):
    order, lanes, _ = _steps_in_turn(False, monkeypatch)
    n = len(lanes)
    blocks = [order[i * STEPS : (i + 1) * STEPS] for i in range(n)]
    assert sorted(block[0][0] for block in blocks) == list(range(n))
    for block in blocks:
        index = block[0][0]
        assert [sched for _, sched in block] == [sched for _, sched in lanes[index].prep.outputs]
        assert {i for i, _ in block} == {index}


def test_each_step_replays_the_hook_calls_that_step_made():
    with _lanes(host_overhead.CELLS["omni_talker"], [4]) as (lane, *_):
        recorded = lane.recorded
    assert len(recorded.step_ends) == STEPS
    per_step = [recorded.step_calls(k) for k in range(STEPS)]
    assert [call for calls in per_step for call in calls] == recorded.calls
    # A per-row talker step calls the row hook once a row and the predictor once.
    assert [len(calls) for calls in per_step] == [4 + 1] * STEPS


def test_the_marginal_cost_is_each_repeats_own_slope_between_the_two_largest_batches(monkeypatch):
    figures = iter(
        [
            # repeat 1: (oracle 4, omnigen 4, oracle 8, omnigen 8) as (runner s, hook s) per lane
            [(4.0, 1.0), (2.0, 1.0), (8.0, 1.0), (3.0, 1.0)],
            # repeat 2: the machine twice as slow
            [(8.0, 1.0), (4.0, 1.0), (16.0, 1.0), (6.0, 1.0)],
            # repeat 3: omnigen's B = 4 lane slowed down alone
            [(4.0, 1.0), (3.0, 1.0), (8.0, 1.0), (3.0, 1.0)],
        ]
    )
    monkeypatch.setattr(host_overhead, "_drive_interleaved", lambda lanes: next(figures))
    found = host_overhead.measure_batches(host_overhead.CELLS["plain"], [4, 8], lambda _: 1, 3)
    per = {4: 1e6 / 4, 8: 1e6 / 8}
    # omnigen's slopes, seconds over 4 more requests: 3 - 2, 6 - 4, 3 - 3; their median 1 s / 4
    # (the slope between the medians, 3 and 3 s, would be 0).
    assert found[8]["omnigen_marginal_us"] == pytest.approx(1.0 / 4 * 1e6)
    assert found[8]["oracle_marginal_us"] == pytest.approx(4.0 / 4 * 1e6)
    assert found[4]["omnigen_us"] == pytest.approx(3.0 * per[4])
    assert found[8]["ratio"] == pytest.approx(3.0 / 8.0)
    assert "omnigen_marginal_us" not in found[4]


@pytest.mark.parametrize("cell", ["plain", "omni_talker"])
def test_every_ablation_runs(cell):
    names = (*host_overhead._ablations(), "all")
    r = host_overhead.measure(host_overhead.CELLS[cell], 4, 2, 1, without=names)
    for name in ("oracle", "omnigen", *(f"without_{name}" for name in names)):
        assert math.isfinite(r[f"{name}_us"]) and r[f"{name}_hook_us"] > 0


def test_the_host_layout_ablation_is_the_merge_less_its_two_reads():
    """Through ``ablate``, by name: the merge's own switch (``buffers.HOST_LAYOUT``), read once a
    call; the product's merge itself, no copy of it, and every layout stored as it is."""
    merge = buffers.merge_updates
    strided, plain = torch.arange(6.0).reshape(3, 2).t(), torch.ones(2)
    saved = host_overhead.ablate(["host_layout"])
    try:
        assert buffers.merge_updates is merge, "the runner's own merge runs, switched"
        buffer: dict = {}
        request = SimpleNamespace()
        update = {"h": {"strided": strided, "plain": plain}, "n": 1}
        buffers.merge_updates([buffer], [request], [update], frozenset())
    finally:
        host_overhead.restore(saved)
    assert buffer["h"]["strided"] is strided, "stored as it is: its layout no longer read"
    assert buffer == {"h": {"strided": strided, "plain": plain}, "n": 1}
    assert request.additional_information_cpu is buffer
    assert buffers.HOST_LAYOUT is True, "restored"
    # Switched back on, the same merge keeps vllm-omni's layout: a contiguous copy of the strided one.
    again: dict = {}
    buffers.merge_updates([again], [SimpleNamespace()], [{"h": {"strided": strided}}], frozenset())
    assert again["h"]["strided"] is not strided and again["h"]["strided"].is_contiguous()
    assert torch.equal(again["h"]["strided"], strided)


def test_every_clause_at_once_leaves_no_merge():
    """``all`` with both ``host_layout`` and ``merges``: the merges' no-op is what stays."""
    every = [name for name in host_overhead._ablations() if name not in host_overhead.NOT_CLAUSES]
    saved = host_overhead.ablate(every)
    try:
        buffer: dict = {}
        buffers.merge_updates([buffer], [SimpleNamespace()], [{"h": {"x": torch.ones(1)}}], frozenset())
        assert buffer == {}
    finally:
        host_overhead.restore(saved)
