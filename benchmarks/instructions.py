"""``benchmarks/host_cost.py instructions``: host cost of a decode step's ``_preprocess`` in
instructions, omnigen's runner against vllm-omni 0.30's (the baseline, counted in the same run).

The same steps, runners and trivial hooks as ``host_cost.py wall`` (``benchmarks/host_overhead.py``),
counted by valgrind (callgrind) instead of timed: an instruction count does not move with the load
of a shared machine, so two runs of the same code give the same figure and a change of a per cent
shows at once, where the timed benchmark needs many interleaved repeats to see ten. Instructions
are not time (a cache miss or an allocation costs more than its instructions, and the garbage
collector runs where allocations happen to cross its threshold), so the timed benchmark stays the
measure of the targets; this one compares code.

Measures: instructions per request per step in ``_preprocess`` (callgrind), hooks counted apart.
Baseline: vllm-omni 0.30's runner on the same steps, counted in the same run.
Takes: about a minute a cell and runner at B = 256 here (two cells with ``--without``: 4-6
  minutes), plus half a minute to start; ``--cold`` and ``--floors`` several times that. Needs valgrind and a C compiler.
Writes: the table to stdout; with ``--json PATH`` every figure to a data file. ``--check`` counts
  what ``benchmarks/results/instructions_thresholds.json`` names and fails if omnigen's count rose
  past its tolerance (docs/measurements.md); ``--record`` rewrites that file.

    .venv/bin/python benchmarks/host_cost.py instructions                      # B = 256, the batched cells
    .venv/bin/python benchmarks/host_cost.py instructions --batch 1 256 --cells plain
    .venv/bin/python benchmarks/host_cost.py instructions --cells omni_talker \\
        --parts phases.StepJournal phases.row_output buffers.merge_updates
    .venv/bin/python benchmarks/host_cost.py instructions --floors           # also the floors, counted
    .venv/bin/python benchmarks/host_cost.py instructions --cold --cells plain  # caches simulated, emptied per step
    .venv/bin/python benchmarks/host_cost.py instructions --cells plain --without journal merges
    .venv/bin/python benchmarks/host_cost.py instructions --check            # the stored-threshold gate
    .venv/bin/python benchmarks/host_cost.py instructions --cells plain --keep-dumps /tmp/dumps  # by function:
    callgrind_annotate --inclusive=yes /tmp/dumps/cg.PID.N                          # one pass's dump

It runs ``host_cost.py`` under ``valgrind --tool=callgrind`` (Debian's ``valgrind``; a five-line helper is
compiled against its ``valgrind/callgrind.h`` with ``cc``), instrumenting only the counted steps
and collecting only inside the measured calls. Per cell, B and runner: ``--steps`` steady decode
steps after ``--warm`` uncounted ones (Python 3.11 specializes a code path once it has run a few
times, and a step of one row runs each path once), the GC heap frozen first (as
``host_overhead`` does), in two passes on fresh runners: the whole ``_preprocess`` calls, then only
the hook calls inside them (the model's hooks and its code predictor); the runner's figure is the
first less the second. A part (``--parts``, a function or method by its path; ``phases.X`` is
``omnigen.runtime.phases.X``) is counted alone the same way, collection on only inside it. Each
counted call also counts part of the switching on and off; what that costs per call is measured
on an empty function and taken off.

``--cold`` also simulates the caches (callgrind's ``--cache-sim``, this machine's level 1 and
level 3, the last level valgrind models) and empties them before every counted step and call, by
writing a buffer twice the last level's size, counted by no one: what a step costs when the
forward pass and the scheduler ran between it and the runner's previous step. Each figure then
also has its level 1 and last-level misses a request and cachegrind's cycle estimate
(instructions + 10 x level-1 misses + 100 x last-level misses): the worst case of the timed
``--cold-caches`` of ``host_overhead`` (nothing is left in any level), without the noise. The
estimate weighs level-1 instruction misses (``I1`` in ``--json``) at 10 cycles, which this
machine's level 2 mostly catches: on the runners' steps the timed cold ratios come nearer the
estimate without them, instructions + 10 x ``D1`` + 100 x ``LL`` (docs/measurements.md).

``--floors`` also counts the floors mode's (``benchmarks/floors.py``) floors of each batched cell, its whole step's
floor and omnigen's code for the same work, each alone on the cell's steady step (one that calls
the model less the model's own calls, as a runner), and sets the floors against each cell's
budget (its ratio target, set at B = 256, times vllm-omni's count): the timed floors' verdicts,
without the noise of a shared machine.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENTRY = ROOT / "benchmarks" / "host_cost.py"
"""The tool this mode runs under valgrind (``host_cost.py instructions ...``, the same arguments)."""
THRESHOLDS = ROOT / "benchmarks" / "results" / "instructions_thresholds.json"
"""The stored counts ``--check`` compares a run with (``--record`` writes them)."""

BATCHED = ("tts_mtp", "tts_mtp_seeded", "plain", "omni_talker")
DUMPS = "OMNIGEN_INSTRUCTIONS_DUMPS"
"""Set in the process valgrind runs (to the dump folder): it measures instead of launching."""
HELPER_LIBRARY = "OMNIGEN_INSTRUCTIONS_HELPER"
HELPER = """#include <valgrind/callgrind.h>
void omnigen_cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void omnigen_cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
void omnigen_cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void omnigen_cg_zero(void) { CALLGRIND_ZERO_STATS; }
void omnigen_cg_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""
CALIBRATION_CALLS = 1000
COLD = "OMNIGEN_INSTRUCTIONS_COLD"
"""Set (to the last level's size in bytes) in the process valgrind runs: empty the caches per step."""
LEVEL_1 = (32 * 1024, 8, 64)
LAST_LEVEL = (32 * 1024 * 1024, 16, 64)
"""This machine's caches (``lscpu``: AMD EPYC, 32 KiB 8-way level 1 data and instructions a core,
32 MiB level 3), as valgrind's ``--D1``/``--I1`` and ``--LL`` take them: size, ways, line."""
MISSES = {"D1": ("D1mr", "D1mw"), "LL": ("DLmr", "DLmw", "ILmr"), "I1": ("I1mr",), "LL_code": ("ILmr",)}
"""The simulated events summed into each reported miss count (``LL_code``: the last level's misses
on machine code, the interpreter's and torch's, part of ``LL``; bytecode is data)."""


# -- The launcher: compile the helper, run this file under valgrind, read the dumps. -------------


def build_helper(folder: Path) -> Path:
    """The helper library (callgrind's client requests as C functions), compiled into ``folder``."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("host_cost.py instructions: no C compiler (cc or gcc) to build its callgrind helper")
    source, library = folder / "cg_helper.c", folder / "cg_helper.so"
    source.write_text(HELPER)
    command = [compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(source)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            "host_cost.py instructions: could not compile its callgrind helper (valgrind/callgrind.h "
            f"comes with Debian's valgrind package):\n{done.stderr}"
        )
    return library


def launch(argv: list[str], cold: bool = False, keep: Path | None = None) -> list[dict[str, Any]]:
    """Run this mode's measurement under callgrind (``host_cost.py`` with ``argv``, which starts with
    ``instructions``); each counted pass as a row (``read_dumps``).
    ``cold``: with the caches simulated, and emptied before every counted step; ``keep``: a
    folder (``check_keep_folder``) to copy the dumps into, for ``callgrind_annotate``."""
    if shutil.which("valgrind") is None:
        raise SystemExit(
            "host_cost.py instructions: valgrind is not installed (Debian: apt-get install valgrind)"
        )
    with tempfile.TemporaryDirectory(prefix="omnigen-instructions-") as tmp:
        folder = Path(tmp)
        env = {**os.environ, DUMPS: str(folder), HELPER_LIBRARY: str(build_helper(folder))}
        caches = []
        if cold:
            env[COLD] = str(LAST_LEVEL[0])
            level_1 = ",".join(map(str, LEVEL_1))
            caches = ["--cache-sim=yes", f"--D1={level_1}", f"--I1={level_1}"]
            caches.append(f"--LL={','.join(map(str, LAST_LEVEL))}")
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--collect-atstart=no",
            *caches,
            f"--callgrind-out-file={folder}/cg.%p",
            sys.executable,
            str(ENTRY),
            *argv,
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-6000:])
            raise SystemExit(
                f"host_cost.py instructions: the run under valgrind failed (exit {done.returncode})"
            )
        if keep is not None:
            keep_dumps(folder, keep)
        return read_dumps(folder)


def check_keep_folder(folder: Path) -> None:
    """Stop before anything runs unless ``folder`` is new or empty: the kept dumps go in beside
    nothing of anyone else's, and no file already there is overwritten."""
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise SystemExit(
            f"host_cost.py instructions: --keep-dumps {folder} is not a new or empty folder;"
            " name a new one (nothing there is overwritten)"
        )


def keep_dumps(folder: Path, keep: Path) -> None:
    """Copy the run's callgrind dumps (``cg.PID.N``, one a counted pass, its label in its
    ``desc: Trigger`` line) from ``folder`` into ``keep``."""
    keep.mkdir(parents=True, exist_ok=True)
    dumps = _dumps_in_order(folder)
    for dump in dumps:
        shutil.copy2(dump, keep / dump.name)
    print(f"kept {len(dumps)} callgrind dumps in {keep} (callgrind_annotate FILE; each names its pass)")


def _dumps_in_order(folder: Path) -> list[Path]:
    """The run's dumps, ``cg.PID.N`` (N the dump's number), in the order they were written."""
    return sorted(folder.glob("cg.*.*"), key=lambda path: int(path.suffix[1:]))


_LABEL = re.compile(r"^desc: Trigger: Client Request: (.*)$", re.M)
_EVENTS = re.compile(r"^events: (.*)$", re.M)
_SUMMARY = re.compile(r"^summary: ([\d ]+)$", re.M)


def read_dumps(folder: Path) -> list[dict[str, Any]]:
    """Each dump's label (the JSON object the measurement wrote) with its ``events`` (``Ir``, the
    instructions, and with the caches simulated their misses) and its ``instructions``."""
    rows = []
    for dump in _dumps_in_order(folder):
        text = dump.read_text()
        label, names, summary = _LABEL.search(text), _EVENTS.search(text), _SUMMARY.search(text)
        if label and names and summary:
            counts = [*map(int, summary.group(1).split())]
            # A cost line may leave out its trailing zeros.
            events = {
                name: counts[i] if i < len(counts) else 0 for i, name in enumerate(names.group(1).split())
            }
            rows.append({**json.loads(label.group(1)), "events": events, "instructions": events["Ir"]})
    return rows


def per_request(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Instructions per request per step (``per_request``): each runner's (its whole calls less
    its hook calls) and each part's, the switching's cost per counted call taken off. With the
    caches simulated, the same for their misses (``D1``, ``LL``, ``I1``: ``MISSES``) and
    cachegrind's cycle estimate (``cycles``)."""
    calibration = next(row for row in rows if row["pass"] == "calibration")
    figures = [name for name in _FIGURES if _figure(calibration, name) is not None]
    per_call = {name: _figure(calibration, name) / calibration["calls"] for name in figures}
    counted = {}
    for row in rows:
        if row["pass"] != "calibration":
            net = {
                name: _figure(row, name) - (per_call[name] * row["calls"] if row["pass"] != "total" else 0)
                for name in figures
            }
            counted[row["cell"], row["batch"], row["side"], row["part"], row["pass"]] = (net, row["steps"])
    results = []
    for (cell, batch, side, part, kind), (net, steps) in counted.items():
        if kind == "hooks":
            continue
        if kind == "total":
            hooks = counted[cell, batch, side, part, "hooks"][0]
            net = {name: value - hooks[name] for name, value in net.items()}
        result = {"cell": cell, "batch": batch, "side": side, "part": part}
        for name, value in net.items():
            result["per_request" if name == "Ir" else name] = value / (steps * batch)
        results.append(result)
    return results


_FIGURES = ("Ir", *MISSES, "cycles")


def _figure(row: dict[str, Any], name: str) -> float | None:
    """One of ``_FIGURES`` of a dump, None where the caches were not simulated."""
    events = row["events"]
    if name == "Ir":
        return events["Ir"]
    if "D1mr" not in events:
        return None
    if name == "cycles":
        # cachegrind's estimate (``cg_annotate``'s): a level-1 miss 10 cycles, a last-level one 100.
        return events["Ir"] + 10 * (_figure(row, "D1") + _figure(row, "I1")) + 100 * _figure(row, "LL")
    return sum(events[event] for event in MISSES[name])


def report(results: list[dict[str, Any]]) -> None:
    from benchmarks.host_overhead import CELLS

    oracle = {(r["cell"], r["batch"]): r for r in results if r["side"] == "vllm-omni"}
    names = [_name(r) for r in results]
    width = max(34, *map(len, names))
    caches = "cycles" in results[0]
    header = f"{'cell':42} {'B':>4} {'runner / part':{width}} {'instr/request':>13} {'of vllm-omni':>12}"
    if caches:
        header += f" {'D1 miss':>8} {'LL miss':>8} {'est. cycles':>11} {'of vllm-omni':>12}"
    print(header)
    for r, name in zip(results, names, strict=True):
        base = oracle[r["cell"], r["batch"]]
        line = (
            f"{CELLS[r['cell']].label:42} {r['batch']:>4} {name:{width}} {r['per_request']:>13,.0f}"
            f" {r['per_request'] / base['per_request']:>12.3f}"
        )
        if caches:
            line += (
                f" {r['D1']:>8,.1f} {r['LL']:>8,.1f} {r['cycles']:>11,.0f}"
                f" {r['cycles'] / base['cycles']:>12.3f}"
            )
        print(line)
    _report_budgets(results, {at: r["per_request"] for at, r in oracle.items()})


def _name(row: dict[str, Any]) -> str:
    if row["side"] in ("floor", "omnigen code"):
        return f"{row['side']}: {row['part']}"
    return row["part"] or row["side"]


def _report_budgets(results: list[dict[str, Any]], oracle: dict[tuple[str, int], float]) -> None:
    """With ``--floors``: each cell's floors, summed and as its whole step's, against its budget
    (target x vllm-omni), in instructions a request."""
    from benchmarks.floors import TARGETS

    sums: dict[tuple[str, int], float] = {}
    whole: dict[tuple[str, int], float] = {}
    for r in results:
        if r["side"] == "floor":
            at = (r["cell"], r["batch"])
            if r["part"] == WHOLE_STEP:
                whole[at] = r["per_request"]
            else:
                sums[at] = sums.get(at, 0.0) + r["per_request"]
    for (cell, batch), total in sums.items():
        budget = TARGETS[cell] * oracle[cell, batch]
        print(
            f"{cell} B={batch}: budget {budget:,.0f} instructions a request ({TARGETS[cell]} x vllm-omni's); "
            f"the floors sum to {total:,.0f} ({total / budget:.2f}x), the whole step's floor "
            f"{whole[cell, batch]:,.0f} ({whole[cell, batch] / budget:.2f}x)"
        )


# -- The measurement, in the process valgrind runs. -----------------------------------------------


class Callgrind:
    """Callgrind's client requests through the helper (``ctypes.PyDLL``: no GIL released per call)."""

    def __init__(self, library: str) -> None:
        lib = ctypes.PyDLL(library)
        self.start, self.stop = lib.omnigen_cg_start, lib.omnigen_cg_stop
        self.toggle, self.zero = lib.omnigen_cg_toggle, lib.omnigen_cg_zero
        self._dump = lib.omnigen_cg_dump
        self._dump.argtypes = [ctypes.c_char_p]
        self.calls = 0
        """Counted calls since the last ``zero``."""

    def dump(self, **label: Any) -> None:
        self._dump(json.dumps({**label, "calls": self.calls}).encode())

    def restart(self) -> None:
        self.zero()
        self.calls = 0

    def counted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with collection switched on around each call (and off again)."""
        toggle = self.toggle

        def counted_call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            toggle()
            try:
                return fn(*args, **kwargs)
            finally:
                toggle()

        return counted_call


def _noop() -> None:
    pass


def cache_emptier() -> Callable[[], None]:
    """With ``--cold`` (``COLD`` set), what empties the simulated caches before a counted step: it
    reads and writes every line of a buffer twice the last level's size (numpy, one thread: each
    write is one the simulator sees), with collection off; otherwise nothing."""
    size = os.environ.get(COLD)
    if not size:
        return _noop
    import numpy as np

    lines = np.zeros(2 * int(size) // 8, dtype=np.uint64)

    def empty_caches() -> None:
        np.add(lines, 1, out=lines)

    return empty_caches


def _count_hooks(cg: Callgrind, runner: Any) -> None:
    """Collection on inside the model's hooks and its code predictor."""
    from benchmarks.host_overhead import HOOKS

    model = runner.model
    for name in HOOKS:
        hook = getattr(model, name, None)
        if callable(hook):
            setattr(model, name, cg.counted(hook))
    if getattr(model, "talker_mtp", None) is not None:
        model.talker_mtp = cg.counted(model.talker_mtp)
        if hasattr(runner, "talker_mtp"):
            # The runner took the predictor when it was built (2.1).
            runner.talker_mtp = model.talker_mtp


def _resolve(part: str) -> tuple[Any, str]:
    """Where ``part`` lives and its name there: ``phases.row_output`` is ``omnigen.runtime.phases``'s
    ``row_output``; a full path names a module's function or a class's method
    (``vllm.v1.worker.gpu_model_runner.GPUModelRunner._preprocess``)."""
    names = part.split(".")
    if len(names) == 2:
        names.insert(0, "omnigen.runtime")
        names = [f"{names[0]}.{names[1]}", names[2]]
    for split in range(len(names) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(names[:split]))
        except ImportError:
            continue
        for name in names[split:-1]:
            owner = getattr(owner, name, None)
        if callable(getattr(owner, names[-1], None)):
            return owner, names[-1]
        break
    raise SystemExit(f"--parts {part}: no such function or method")


def measure(args: argparse.Namespace, cg: Callgrind) -> None:
    """Every counted pass, each dumped under a label naming what it counted."""
    from benchmarks import host_overhead
    from omnigen_testing.oracle import harness

    # Instrumented (valgrind's slow mode) only while counting: building the runners is most of
    # the work, and counts nothing.
    cg.start()
    counted_noop = cg.counted(_noop)
    cg.restart()
    for _ in range(CALIBRATION_CALLS):
        counted_noop()
    cg.dump(**{"pass": "calibration"})
    cg.stop()
    empty_caches = cache_emptier()
    for key in args.cells:
        cell = host_overhead.CELLS[key]
        for batch in args.batch:
            host_overhead._room(batch, False)
            policy, ours, oracle, extra = host_overhead._classes(cell)
            scen, plan = host_overhead.scenario(
                batch, args.warm + args.steps, mixed=False, seeded_share=cell.seeded_share
            )
            passes = [("vllm-omni", oracle, None, kind, ()) for kind in ("total", "hooks")]
            passes += [("omnigen", ours, None, kind, ()) for kind in ("total", "hooks")]
            passes += [("omnigen", ours, part, "part", ()) for part in args.parts]
            passes += [
                (f"omnigen without {name}", ours, None, kind, (name,))
                for name in args.without
                for kind in ("total", "hooks")
            ]
            for side, cls, part, kind, ablation in passes:
                label = {"pass": kind, "cell": key, "batch": batch, "side": side, "part": part}
                ablated = host_overhead.ablate(list(ablation))
                try:
                    with harness.harness_patches(extra):
                        prep = host_overhead._prepare(cls, policy, extra, scen, plan)
                        _count_pass(args, cg, prep, label, empty_caches)
                finally:
                    host_overhead.restore(ablated)
            if args.floors:
                _measure_floors(args, cg, key, batch, empty_caches)


def _count_pass(
    args: argparse.Namespace,
    cg: Callgrind,
    prep: Any,
    label: dict[str, Any],
    empty_caches: Callable[[], None],
) -> None:
    """One counted pass on a prepared runner: its warm steps uncounted, then its steady steps
    counted as ``label["pass"]`` says (``total``: the runner's ``_preprocess`` calls; ``hooks``:
    the model's hooks inside them; ``part``: ``label["part"]`` alone), dumped under ``label``."""
    from benchmarks import host_overhead
    from omnigen_testing.oracle import harness

    kind = label["pass"]
    runner = prep.runner
    warm, steps = prep.outputs[: args.warm], prep.outputs[args.warm :]
    with host_overhead.step_mode():
        for step, out in warm:
            harness._apply_step(runner, prep.state, step)
            runner._preprocess(out, step.num_input_tokens)
    if kind == "hooks":
        _count_hooks(cg, runner)
    saved = None
    if kind == "part":
        owner, attr = _resolve(label["part"])
        saved = (owner, attr, getattr(owner, attr))
        setattr(owner, attr, cg.counted(saved[2]))
    # vLLM's own bookkeeping of a step (``_apply_step``) runs after the caches are emptied, as it
    # warms what it touches (the requests, the input batch) for the step, and is not counted.
    counted = [
        (
            functools.partial(harness._apply_step, runner, prep.state, step),
            runner._preprocess,
            (out, step.num_input_tokens),
        )
        for step, out in steps
    ]
    try:
        _count_steps(cg, {**label, "steps": len(steps)}, counted, empty_caches)
    finally:
        if saved:
            setattr(*saved)


def _count_steps(
    cg: Callgrind,
    label: dict[str, Any],
    steps: list[tuple[Callable[[], Any] | None, Callable[..., Any], tuple[Any, ...]]],
    empty_caches: Callable[[], None],
) -> None:
    """The counting of a pass, a runner's or a floor's, dumped under ``label``: the GC heap frozen
    (as vLLM freezes it after warm-up), then per step ``(prepare, call, args)`` the caches
    emptied, ``prepare()`` (uncounted) and ``call(*args)``, collection toggled on around the call
    for a ``total`` pass (a ``hooks`` or ``part`` pass collects only inside its wrapped calls)."""
    from vllm.utils.gc_utils import freeze_gc_heap

    from benchmarks import host_overhead

    total = label["pass"] == "total"
    freeze_gc_heap()
    cg.start()
    try:
        cg.restart()
        with host_overhead.step_mode():
            for prepare, call, call_args in steps:
                empty_caches()
                if prepare is not None:
                    prepare()
                if total:
                    cg.toggle()
                call(*call_args)
                if total:
                    cg.toggle()
        cg.dump(**label)
    finally:
        cg.stop()
        gc.unfreeze()


def _measure_floors(
    args: argparse.Namespace, cg: Callgrind, key: str, batch: int, empty_caches: Callable[[], None]
) -> None:
    """``benchmarks/floors.py``'s floors of ``key`` (and its whole step's) and omnigen's code for
    the same work, each counted alone on the cell's steady step, as a part is. One that calls the
    model (the hook calls, the whole step) is counted as a runner is: its whole calls less the
    model's hook calls inside them, in a second pass."""
    from benchmarks import floors, host_overhead

    if key not in floors.CELL_FLOORS:
        return
    step = floors.steady_step(key, batch)
    pieces = [("floor", name, floors.FLOORS[name][1]) for name in floors.CELL_FLOORS[key]]
    pieces.append(("floor", WHOLE_STEP, floors.whole_step))
    pieces += [("omnigen code", label, fn) for label, (_, fn) in floors.omnigen_code_for(key).items()]
    for side, name, fn in pieces:
        step.recorder.calls.clear()
        with step.recorder.recording(), host_overhead.step_mode():
            fn(step)
        calls_model = bool(step.recorder.calls)
        with host_overhead.step_mode():
            for _ in range(args.warm):
                fn(step)
        for kind in ("total", "hooks") if calls_model else ("part",):
            saved = _count_model_hooks(cg, step.model) if kind == "hooks" else []
            call = cg.counted(fn) if kind == "part" else fn
            label = {
                "pass": kind,
                "cell": key,
                "batch": batch,
                "side": side,
                "part": name,
                "steps": args.steps,
            }
            try:
                _count_steps(cg, label, [(None, call, (step,))] * args.steps, empty_caches)
            finally:
                for owner, attr, original in saved:
                    if original is _ABSENT:
                        delattr(owner, attr)  # the class's method again
                    else:
                        setattr(owner, attr, original)


WHOLE_STEP = "whole step (every clause, fewest passes)"


def _count_model_hooks(cg: Callgrind, model: Any) -> list[tuple[Any, str, Any]]:
    """Collection on inside ``model``'s hooks and code predictor; what to put back. (Not shared
    with ``_count_hooks``, though it wraps the same attributes: routed through here, the runner
    passes counted both runners 1.0-1.2k instructions a request lower on the talker, most likely
    because reading ``model.__dict__`` in the hooks pass alone turns off CPython 3.11's inline
    attribute values for that model, so its hooks' attribute reads cost more there than in the
    total pass. Here the floors' ``HookRecorder`` has read it before anything is counted.)"""
    from benchmarks.host_overhead import HOOKS

    saved = []
    for name in (*HOOKS, "talker_mtp"):
        hook = getattr(model, name, None)
        if callable(hook):
            saved.append((model, name, model.__dict__.get(name, _ABSENT)))
            setattr(model, name, cg.counted(hook))
    return saved


_ABSENT = object()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``host_cost.py instructions``'s own switches (``--cells``, ``--batch``, ``--steps``, ``--json``
    and ``--outside-inference-mode`` are every mode's: ``host_cost.common_arguments``)."""
    from benchmarks import host_overhead

    parser.set_defaults(cells=list(BATCHED), batch=[256], steps=4)
    parser.add_argument(
        "--warm", type=int, default=8,
        help="steps run before counting: Python specializes a code path after it has run a few times",
    )  # fmt: skip
    parser.add_argument(
        "--parts",
        nargs="+",
        default=[],
        help="omnigen runtime functions to count alone, e.g. phases.row_output",
    )
    parser.add_argument(
        "--floors",
        action="store_true",
        help="also count the floors mode's floors and omnigen's code for the same work (batched cells)",
    )
    parser.add_argument(
        "--without",
        nargs="+",
        default=[],
        choices=list(host_overhead._ablations()),
        help="also count omnigen without each of these contract mechanisms (wall's --ablate)",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="also simulate the caches, emptied before every counted step, and report their misses",
    )
    parser.add_argument(
        "--keep-dumps",
        type=Path,
        metavar="DIR",
        help="also keep callgrind's dumps in DIR (new or empty), one a counted pass, for callgrind_annotate",
    )
    gate = parser.add_mutually_exclusive_group()
    gate.add_argument(
        "--check",
        action="store_true",
        help=f"the CI gate: count the stored cells and fail if omnigen's count rose past {THRESHOLDS.name}'s tolerance",
    )
    gate.add_argument(
        "--record",
        action="store_true",
        help=f"count the stored cells and rewrite {THRESHOLDS.name} (after a deliberate change)",
    )


def run(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """``host_cost.py instructions``: in the process valgrind runs, count; otherwise launch that
    process and report its figures (rows), or check or record them against ``THRESHOLDS``."""
    if os.environ.get(DUMPS):
        measure(args, Callgrind(os.environ[HELPER_LIBRARY]))
        return None
    argv = list(args.argv)
    if args.check or args.record:
        stored = load_thresholds()
        argv = ["instructions", *stored["argv"]]
    for part in args.parts:
        _resolve(part)
    if args.keep_dumps is not None:
        check_keep_folder(args.keep_dumps)
    results = per_request(launch(argv, cold=args.cold, keep=args.keep_dumps))
    report(results)
    if args.record:
        record_thresholds(results)
    elif args.check:
        failures = check_thresholds(results, load_thresholds())
        if failures:
            raise SystemExit("host_cost.py instructions --check failed:\n  " + "\n  ".join(failures))
        print(f"instructions --check: within {THRESHOLDS.relative_to(ROOT)}'s tolerance", flush=True)
    return results


def load_thresholds(path: Path = THRESHOLDS) -> dict[str, Any]:
    """The stored gate: ``argv`` (what ``--check`` counts), ``tolerance`` (a share) and
    ``per_request`` (``"cell B side": instructions a request``, both runners)."""
    if not path.exists():
        raise SystemExit(f"{path}: no stored thresholds; write them with host_cost.py instructions --record")
    return json.loads(path.read_text())


def _key(row: dict[str, Any]) -> str:
    return f"{row['cell']} B={row['batch']} {row['side']}"


def check_thresholds(results: list[dict[str, Any]], stored: dict[str, Any]) -> list[str]:
    """What fails the gate, worded for the log: omnigen's count a request above its stored figure by
    more than the tolerance, or vllm-omni's moved by more than it either way (vllm-omni's runner is
    fixed code: its count moves only when the interpreter, torch or vLLM did, and then every stored
    figure is stale: re-record). A count that fell passes (record it to keep the gain)."""
    tolerance = stored["tolerance"]
    found = {_key(row): row["per_request"] for row in results if row["part"] is None}
    failures = []
    for key, expected in stored["per_request"].items():
        if key not in found:
            failures.append(f"{key}: not counted (the stored argv no longer produces it)")
            continue
        change = found[key] / expected - 1
        if key.endswith("vllm-omni") and abs(change) > tolerance:
            failures.append(
                f"{key}: {found[key]:,.0f} instructions a request against {expected:,.0f} stored "
                f"({change:+.1%}): the baseline moved, so the interpreter, torch or vLLM changed; "
                "re-record with host_cost.py instructions --record"
            )
        elif not key.endswith("vllm-omni") and change > tolerance:
            failures.append(
                f"{key}: {found[key]:,.0f} instructions a request against {expected:,.0f} stored "
                f"({change:+.1%}, tolerance {tolerance:.0%}): omnigen's runner costs more; find the "
                "cause (--parts, --keep-dumps) or, if it is deliberate, re-record with --record"
            )
    return failures


def record_thresholds(results: list[dict[str, Any]], path: Path = THRESHOLDS) -> None:
    """Rewrite the stored figures, keeping the stored ``argv``, ``tolerance`` and ``why``."""
    stored = load_thresholds(path)
    stored["per_request"] = {
        _key(row): round(row["per_request"], 1) for row in results if row["part"] is None
    }
    path.write_text(json.dumps(stored, indent=1) + "\n")
    print(f"recorded: {path}", flush=True)
