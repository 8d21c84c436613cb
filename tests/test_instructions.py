"""``benchmarks/instructions.py`` (``host_cost.py instructions``): its reading of callgrind's dumps
and its figures a request, the part that runs outside valgrind, on dumps written as callgrind
writes them (its format, the events of a run with and without ``--cache-sim``); and its
stored-threshold gate (``--check``) on figures given to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import instructions

CACHE_EVENTS = "Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw"


def write_dump(folder: Path, number: int, label: dict, events: str, summary: str) -> None:
    """A dump as callgrind writes one at a client request (``cg.PID.N``)."""
    (folder / f"cg.4242.{number}").write_text(
        "# callgrind format\nversion: 1\ncreator: callgrind-3.19.0\npid: 4242\n\n"
        "desc: I1 cache: 32768 B, 64 B, 8-way associative\n"
        f"desc: Trigger: Client Request: {json.dumps(label)}\n\n"
        f"positions: line\nevents: {events}\nsummary: {summary}\n\n"
        "fn=(1) main\n0 1 2 3\n"
        f"totals: {summary}\n"
    )


def step_label(kind: str, side: str, calls: int) -> dict:
    return {
        "pass": kind,
        "cell": "plain",
        "batch": 2,
        "side": side,
        "part": None,
        "steps": 5,
        "calls": calls,
    }


def test_a_dump_without_the_caches_simulated_gives_its_instructions_only(tmp_path):
    write_dump(tmp_path, 1, {"pass": "calibration", "calls": 10}, "Ir", "1000")
    write_dump(tmp_path, 2, step_label("total", "omnigen", 0), "Ir", "30000")
    write_dump(tmp_path, 3, step_label("hooks", "omnigen", 5), "Ir", "10500")

    (result,) = instructions.per_request(instructions.read_dumps(tmp_path))

    # (30,000 less the hooks' 10,500 less their 5 switchings at 100 each) over 5 steps of 2 rows.
    assert result["per_request"] == pytest.approx((30_000 - (10_500 - 500)) / 10)
    assert "cycles" not in result and "LL" not in result


def test_cache_misses_are_taken_a_request_as_instructions_are_and_weighted_into_cycles(tmp_path):
    # Dumps read in the order they were written (cg.PID.10 after cg.PID.9), and a summary that
    # leaves out its trailing zeros (as a cost line may).
    write_dump(tmp_path, 9, {"pass": "calibration", "calls": 10}, CACHE_EVENTS, "1000 0 0 10 20 0 0 0 0")
    write_dump(tmp_path, 10, step_label("total", "omnigen", 0), CACHE_EVENTS, "30000 0 0 100 300 200 7 40 30")
    write_dump(tmp_path, 11, step_label("hooks", "omnigen", 5), CACHE_EVENTS, "10500 0 0 50 110 0 2 10")

    rows = instructions.read_dumps(tmp_path)
    assert [row["pass"] for row in rows] == ["calibration", "total", "hooks"]
    assert rows[2]["events"]["DLmw"] == 0
    (result,) = instructions.per_request(rows)

    # The runner's: the whole calls less the hook calls, those less their switching (per call: 1 I1
    # and 2 D1 misses); level 1 data = D1mr + D1mw, last level = DLmr + DLmw + ILmr.
    d1 = (300 + 200) - (110 - 5 * 2)
    i1 = 100 - (50 - 5 * 1)
    ll = (40 + 30 + 7) - (10 + 0 + 2)
    instr = 30_000 - (10_500 - 5 * 100)
    assert result["per_request"] == pytest.approx(instr / 10)
    assert result["D1"] == pytest.approx(d1 / 10)
    assert result["I1"] == pytest.approx(i1 / 10)
    assert result["LL"] == pytest.approx(ll / 10)
    assert result["LL_code"] == pytest.approx((7 - 2) / 10)
    assert result["cycles"] == pytest.approx((instr + 10 * (d1 + i1) + 100 * ll) / 10)


def test_kept_dumps_go_only_into_a_new_or_empty_folder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    write_dump(run, 2, step_label("total", "omnigen", 0), "Ir", "900")
    write_dump(run, 1, step_label("calibration", "omnigen", 10), "Ir", "50")
    (run / "helper.so").write_text("not a dump")
    kept = tmp_path / "new" / "dumps"
    instructions.check_keep_folder(kept)
    instructions.keep_dumps(run, kept)
    assert sorted(path.name for path in kept.iterdir()) == ["cg.4242.1", "cg.4242.2"]
    assert (kept / "cg.4242.2").read_text() == (run / "cg.4242.2").read_text()
    # A folder holding anything, or a file, is refused before valgrind runs, and left as it was.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for taken in (mine, mine / "notes.txt", kept):
        with pytest.raises(SystemExit, match="not a new or empty folder"):
            instructions.check_keep_folder(taken)
    assert (mine / "notes.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    instructions.check_keep_folder(empty)


def _row(cell: str, side: str, per_request: float, part: str | None = None) -> dict:
    return {"cell": cell, "batch": 256, "side": side, "part": part, "per_request": per_request}


STORED = {
    "argv": ["--cells", "plain"],
    "tolerance": 0.02,
    "per_request": {"plain B=256 vllm-omni": 47_500.0, "plain B=256 omnigen": 15_000.0},
}


def test_the_gate_passes_within_the_tolerance_and_when_omnigen_got_cheaper():
    for omnigen in (15_000.0 * 1.019, 15_000.0, 9_000.0):
        rows = [_row("plain", "vllm-omni", 47_500.0 * 0.99), _row("plain", "omnigen", omnigen)]
        assert instructions.check_thresholds(rows, STORED) == []


def test_the_gate_fails_when_omnigen_costs_more_than_the_tolerance():
    rows = [_row("plain", "vllm-omni", 47_500.0), _row("plain", "omnigen", 15_000.0 * 1.021)]
    (failure,) = instructions.check_thresholds(rows, STORED)
    assert failure.startswith("plain B=256 omnigen: 15,315 instructions a request against 15,000")
    assert "+2.1%" in failure and "omnigen's runner costs more" in failure


def test_the_gate_fails_when_the_baseline_moved_either_way_or_a_figure_is_missing():
    """vllm-omni's runner is fixed code: its count moves only with the environment, and then
    every stored figure is stale (a part's row is not a runner's and is not compared)."""
    for moved in (47_500.0 * 0.97, 47_500.0 * 1.03):
        rows = [_row("plain", "vllm-omni", moved), _row("plain", "omnigen", 15_000.0)]
        (failure,) = instructions.check_thresholds(rows, STORED)
        assert failure.startswith("plain B=256 vllm-omni:") and "re-record" in failure
    rows = [
        _row("plain", "vllm-omni", 47_500.0),
        _row("plain", "omnigen", 15_000.0, part="phases.row_output"),
    ]
    (failure,) = instructions.check_thresholds(rows, STORED)
    assert failure == "plain B=256 omnigen: not counted (the stored argv no longer produces it)"


def test_recording_keeps_the_stored_argv_tolerance_and_reason(tmp_path):
    path = tmp_path / "thresholds.json"
    path.write_text(json.dumps({**STORED, "why": "the reason"}))
    instructions.record_thresholds(
        [_row("plain", "vllm-omni", 47_123.44), _row("plain", "omnigen", 14_000.06)], path
    )
    stored = json.loads(path.read_text())
    assert stored["argv"] == STORED["argv"] and stored["tolerance"] == 0.02 and stored["why"] == "the reason"
    assert stored["per_request"] == {"plain B=256 vllm-omni": 47_123.4, "plain B=256 omnigen": 14_000.1}


def test_the_stored_thresholds_name_what_the_check_counts():
    """The shipped file: both runners of every cell its argv counts (at the default B = 256)."""
    stored = instructions.load_thresholds()
    assert 0 < stored["tolerance"] <= 0.05
    assert stored["argv"][0] == "--cells" and all(not arg.startswith("--") for arg in stored["argv"][1:])
    expected = {f"{cell} B=256 {side}" for cell in stored["argv"][1:] for side in ("vllm-omni", "omnigen")}
    assert set(stored["per_request"]) == expected
