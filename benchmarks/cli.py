"""Wall time of omnigen commands, this checkout against another commit, interleaved in one run.

Measures: wall time of omnigen's CLI commands (``--help``, a build, a sweep build, ``explain``,
  ``check``), each a fresh process.
Baseline: the same commands from the commit given by ``--baseline`` (its tracked files, run with
  this venv's Python).
Takes: about half a minute a repeat (ten commands of 1-4 s each), 2-4 minutes with ``--repeats 5``.
Writes: a table of medians and ratios to stdout; no data file.

    .venv/bin/python benchmarks/cli.py --baseline a96bc38 --repeats 5

The baseline is the commit's tracked files (``git archive``) in a temporary folder, run with this
venv's Python (``python -m omnigen.cli`` from each tree, so each imports its own ``omnigen``).
Each repeat runs every command once on each side, alternating which side goes first; the table
gives the medians and the ratio this/baseline (the machine is shared: compare ratios).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = [
    ["--help"],
    ["build", "model=qwen3_omni", "out={tmp}/o/v"],
    ["build", "-m", "model=qwen3_tts", "graph=eager,full", "out={tmp}/s/sweep"],
    ["explain", "model=qwen3_omni"],
    ["check"],
]


def _export(ref: str, into: Path) -> Path:
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def _time(tree: Path, args: list[str], tmp: Path) -> float:
    argv = [a.format(tmp=tmp) for a in args]
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "omnigen.cli", *argv], cwd=tree, capture_output=True, text=True
    )
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(
            f"{tree}: omnigen {' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-2000:]}"
        )
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", required=True, help="a commit, e.g. the merge base")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="omnigen-bench-") as scratch:
        base = _export(args.baseline, Path(scratch) / "baseline")
        sides = {"this": ROOT, "baseline": base}
        times: dict[tuple[str, int], list[float]] = {}
        for repeat in range(args.repeats):
            order = list(sides.items()) if repeat % 2 == 0 else list(sides.items())[::-1]
            for i, command in enumerate(COMMANDS):
                for side, tree in order:
                    out = Path(scratch) / f"{side}-{repeat}-{i}"
                    out.mkdir()
                    times.setdefault((side, i), []).append(_time(tree, command, out))
        print(f"median of {args.repeats} (s); this = {ROOT.name} working tree, baseline = {args.baseline}")
        print(f"{'command':<60} {'baseline':>9} {'this':>9} {'this/baseline':>14}")
        for i, command in enumerate(COMMANDS):
            b = statistics.median(times[("baseline", i)])
            t = statistics.median(times[("this", i)])
            shown = "omnigen " + " ".join(command).replace("{tmp}/", "")
            print(f"{shown:<60} {b:>9.2f} {t:>9.2f} {t / b:>14.2f}")


if __name__ == "__main__":
    main()
