"""Host cost of a decode step's ``_preprocess`` in instructions: omnigen's runner vs vllm-omni 0.30's.

The same steps, runners and trivial hooks as ``benchmarks/host_overhead.py``, counted by valgrind
(callgrind) instead of timed: an instruction count does not move with the load of a shared
machine, so two runs of the same code give the same figure and a change of a per cent shows at
once, where the timed benchmark needs many interleaved repeats to see ten. Instructions are not
time (a cache miss or an allocation costs more than its instructions, and the garbage collector
runs where allocations happen to cross its threshold), so the timed benchmark stays the measure
of the targets; this one compares code.

    .venv/bin/python benchmarks/instructions.py                      # B = 256, the batched cells
    .venv/bin/python benchmarks/instructions.py --batch 1 256 --cells plain
    .venv/bin/python benchmarks/instructions.py --cells omni_talker \\
        --parts phases.StepJournal phases.row_output phases.merge_batch_updates
    .venv/bin/python benchmarks/instructions.py --floors           # also floors.py's floors, counted

It runs itself under ``valgrind --tool=callgrind`` (Debian's ``valgrind``; a five-line helper is
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

``--floors`` also counts ``benchmarks/floors.py``'s floors of each batched cell, its whole step's
floor and omnigen's code for the same work, each alone on the cell's steady step (one that calls
the model less the model's own calls, as a runner), and sets the floors against each cell's
budget (its ratio target, set at B = 256, times vllm-omni's count): the timed floors' verdicts,
without the noise of a shared machine.
"""

from __future__ import annotations

import argparse
import ctypes
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
sys.path.insert(0, str(ROOT))
# vllm-omni (the baseline) is installed beside omnigen: keep its vLLM plugin from patching vLLM.
os.environ.setdefault("VLLM_PLUGINS", "omnigen")

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


# -- The launcher: compile the helper, run this file under valgrind, read the dumps. -------------


def build_helper(folder: Path) -> Path:
    """The helper library (callgrind's client requests as C functions), compiled into ``folder``."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit(
            "benchmarks/instructions.py: no C compiler (cc or gcc) to build its callgrind helper"
        )
    source, library = folder / "cg_helper.c", folder / "cg_helper.so"
    source.write_text(HELPER)
    command = [compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(source)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            "benchmarks/instructions.py: could not compile its callgrind helper (valgrind/callgrind.h "
            f"comes with Debian's valgrind package):\n{done.stderr}"
        )
    return library


def launch(argv: list[str]) -> list[dict[str, Any]]:
    """Run this file's measurement under callgrind; each counted pass as a row (``read_dumps``)."""
    if shutil.which("valgrind") is None:
        raise SystemExit(
            "benchmarks/instructions.py: valgrind is not installed (Debian: apt-get install valgrind)"
        )
    with tempfile.TemporaryDirectory(prefix="omnigen-instructions-") as tmp:
        folder = Path(tmp)
        env = {**os.environ, DUMPS: str(folder), HELPER_LIBRARY: str(build_helper(folder))}
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--collect-atstart=no",
            f"--callgrind-out-file={folder}/cg.%p",
            sys.executable,
            str(Path(__file__).resolve()),
            *argv,
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-6000:])
            raise SystemExit(
                f"benchmarks/instructions.py: the run under valgrind failed (exit {done.returncode})"
            )
        return read_dumps(folder)


_LABEL = re.compile(r"^desc: Trigger: Client Request: (.*)$", re.M)
_SUMMARY = re.compile(r"^summary: (\d+)$", re.M)


def read_dumps(folder: Path) -> list[dict[str, Any]]:
    """Each dump's label (the JSON object the measurement wrote) with its ``instructions``."""
    rows = []
    # cg.PID.N, N the dump's number: in the order they were written.
    for dump in sorted(folder.glob("cg.*.*"), key=lambda path: int(path.suffix[1:])):
        text = dump.read_text()
        label, summary = _LABEL.search(text), _SUMMARY.search(text)
        if label and summary:
            rows.append({**json.loads(label.group(1)), "instructions": int(summary.group(1))})
    return rows


def per_request(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Instructions per request per step: each runner's (its whole calls less its hook calls)
    and each part's, the switching's cost per counted call taken off."""
    calibration = next(row for row in rows if row["pass"] == "calibration")
    per_call = calibration["instructions"] / calibration["calls"]
    counted = {}
    for row in rows:
        if row["pass"] != "calibration":
            net = row["instructions"] - (per_call * row["calls"] if row["pass"] != "total" else 0)
            counted[row["cell"], row["batch"], row["side"], row["part"], row["pass"]] = (net, row["steps"])
    results = []
    for (cell, batch, side, part, kind), (net, steps) in counted.items():
        if kind == "hooks":
            continue
        if kind == "total":
            net -= counted[cell, batch, side, part, "hooks"][0]
        results.append(
            {"cell": cell, "batch": batch, "side": side, "part": part, "per_request": net / (steps * batch)}
        )
    return results


def report(results: list[dict[str, Any]]) -> None:
    from benchmarks.host_overhead import CELLS

    oracle = {(r["cell"], r["batch"]): r["per_request"] for r in results if r["side"] == "vllm-omni"}
    names = [_name(r) for r in results]
    width = max(34, *map(len, names))
    print(f"{'cell':42} {'B':>4} {'runner / part':{width}} {'instr/request':>13} {'of vllm-omni':>12}")
    for r, name in zip(results, names, strict=True):
        share = r["per_request"] / oracle[r["cell"], r["batch"]]
        print(
            f"{CELLS[r['cell']].label:42} {r['batch']:>4} {name:{width}} {r['per_request']:>13,.0f} {share:>12.3f}"
        )
    _report_budgets(results, oracle)


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
    from vllm.utils.gc_utils import freeze_gc_heap

    from benchmarks import host_overhead
    from tests.oracle import harness

    # Instrumented (valgrind's slow mode) only while counting: building the runners is most of
    # the work, and counts nothing.
    cg.start()
    counted_noop = cg.counted(_noop)
    cg.restart()
    for _ in range(CALIBRATION_CALLS):
        counted_noop()
    cg.dump(**{"pass": "calibration"})
    cg.stop()
    for key in args.cells:
        cell = host_overhead.CELLS[key]
        for batch in args.batch:
            host_overhead._room(batch, False)
            policy, ours, oracle, extra = host_overhead._classes(cell)
            scen, plan = host_overhead.scenario(
                batch, args.warm + args.steps, mixed=False, seeded_share=cell.seeded_share
            )
            passes = [("vllm-omni", oracle, None, kind) for kind in ("total", "hooks")]
            passes += [("omnigen", ours, None, kind) for kind in ("total", "hooks")]
            passes += [("omnigen", ours, part, "part") for part in args.parts]
            for side, cls, part, kind in passes:
                with harness.harness_patches(extra):
                    prep = host_overhead._prepare(cls, policy, extra, scen, plan)
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
                        owner, attr = _resolve(part)
                        saved = (owner, attr, getattr(owner, attr))
                        setattr(owner, attr, cg.counted(saved[2]))
                    freeze_gc_heap()
                    cg.start()
                    try:
                        cg.restart()
                        with host_overhead.step_mode():
                            for step, out in steps:
                                harness._apply_step(runner, prep.state, step)
                                if kind == "total":
                                    cg.toggle()
                                runner._preprocess(out, step.num_input_tokens)
                                if kind == "total":
                                    cg.toggle()
                        cg.dump(
                            **{
                                "pass": kind,
                                "cell": key,
                                "batch": batch,
                                "side": side,
                                "part": part,
                                "steps": len(steps),
                            }
                        )
                    finally:
                        cg.stop()
                        gc.unfreeze()
                        if saved:
                            setattr(*saved)
            if args.floors:
                _measure_floors(args, cg, key, batch)


def _measure_floors(args: argparse.Namespace, cg: Callgrind, key: str, batch: int) -> None:
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
            gc.collect()
            gc.freeze()
            cg.start()
            try:
                cg.restart()
                with host_overhead.step_mode():
                    for _ in range(args.steps):
                        if kind == "total":
                            cg.toggle()
                        call(step)
                        if kind == "total":
                            cg.toggle()
                label = {"cell": key, "batch": batch, "side": side, "part": name, "steps": args.steps}
                cg.dump(**{"pass": kind, **label})
            finally:
                cg.stop()
                gc.unfreeze()
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


def main() -> None:
    from benchmarks import host_overhead
    from benchmarks.host_overhead import CELLS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=list(BATCHED), choices=list(CELLS))
    parser.add_argument("--batch", type=int, nargs="+", default=[256])
    parser.add_argument("--steps", type=int, default=4, help="steady steps counted per pass")
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
        help="also count benchmarks/floors.py's floors and omnigen's code for the same work (batched cells)",
    )
    host_overhead.add_step_mode_argument(parser)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    host_overhead.set_step_mode(args)
    if os.environ.get(DUMPS):
        measure(args, Callgrind(os.environ[HELPER_LIBRARY]))
        return
    for part in args.parts:
        _resolve(part)
    results = per_request(launch(sys.argv[1:]))
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
