"""Host cost of a decode step's ``_preprocess``: omnigen's generated runner against vllm-omni 0.30's.

Measures: the host cost of ``_preprocess`` per request per step, three ways (the modes below), on
  the same steps (``host_overhead.scenario``: a prefill, then steady decode steps of B requests),
  runners, trivial hooks and cells (``--cells``).
Baseline: vllm-omni 0.30's runner on the same steps, in the same run (so vLLM 0.30 only).
Takes: ``wall --short`` about 3 minutes; ``floors --repeats 1 --steps 2``
  about 2-3 minutes;
  ``instructions --check`` about 4-5 minutes. Each mode's ``--help`` says more.
Writes: each mode's table to stdout; with ``--json PATH`` a data file (``write_data``: the mode,
  its command line, the machine, every figure as a row). ``instructions --check`` reads
  ``benchmarks/results/instructions_thresholds.json``; ``instructions --record`` rewrites it.

Modes:
  wall          thread CPU time of both runners, interleaved in one process; the ratio
                omnigen / vllm-omni is the result (the machine is shared). ``--ablate NAME``
                switches one contract mechanism off by name; ``--clauses`` prices each.
  floors        the least a CPython runner can spend per request on what the contract requires,
                against each batched target of issue 12.
  instructions  the same steps counted by valgrind (callgrind) instead of timed: deterministic
                instructions a request; ``--check`` is the stored-threshold gate.

    .venv/bin/python benchmarks/host_cost.py wall --short            # the figure scripts/test prints
    .venv/bin/python benchmarks/host_cost.py wall --clauses --batch 256 --repeats 5
    .venv/bin/python benchmarks/host_cost.py floors --repeats 1 --steps 2
    .venv/bin/python benchmarks/host_cost.py instructions --cells plain --json /tmp/instr.json
    .venv/bin/python benchmarks/host_cost.py instructions --check    # the stored-threshold gate
    .venv/bin/python benchmarks/host_cost.py MODE --help             # each mode's own switches

Every mode sets ``VLLM_PLUGINS=omnigen`` unless it is set (vllm-omni, the baseline, is installed
beside omnigen; its plugin must not patch vLLM). The three modes were three scripts until
2026-12-06 (``host_overhead.py``, ``floors.py``, ``instructions.py``, now the modes' modules):
docs/measurements.md's older entries name them; the same switches are now ``host_cost.py MODE``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# vllm-omni (the baseline) is installed beside omnigen: keep its vLLM plugin from patching vLLM.
os.environ.setdefault("VLLM_PLUGINS", "omnigen")
# omnigen's plugin registers the tiny test models these runs build (omnigen.models).
os.environ.setdefault("OMNIGEN_MODELS", "omnigen_tiny,omnigen_tiny_omni")

MODES = {
    "wall": ("benchmarks.host_overhead", "thread CPU time of both runners, interleaved (the ratio)"),
    "floors": ("benchmarks.floors", "the least a runner can spend per request, against the targets"),
    "instructions": ("benchmarks.instructions", "deterministic instruction counts (valgrind)"),
}
"""Each mode's module (``add_arguments(parser)`` and ``run(args) -> rows``) and its one-line summary."""


def common_arguments() -> argparse.ArgumentParser:
    """The switches every mode takes (each mode sets its own defaults with ``set_defaults``)."""
    from benchmarks.host_overhead import CELLS

    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("common to every mode")
    group.add_argument("--cells", nargs="+", choices=list(CELLS), help="the cells measured")
    group.add_argument("--batch", type=int, nargs="+", help="batch sizes B (requests in a step)")
    group.add_argument("--steps", type=int, help="steady decode steps measured per figure")
    group.add_argument(
        "--outside-inference-mode", action="store_true",
        help="measure the steps outside torch.inference_mode (vLLM runs them inside it)",
    )  # fmt: skip
    group.add_argument(
        "--json", type=Path, metavar="PATH", help="also write the figures to this data file (write_data)"
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="benchmarks/host_cost.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    for name, (module_name, summary) in MODES.items():
        module = importlib.import_module(module_name)
        sub = modes.add_parser(
            name,
            # A parent's actions are shared by every parser built from it, and each mode's
            # set_defaults writes its defaults into them: a fresh parent per mode.
            parents=[common_arguments()],
            help=summary,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def write_data(path: Path, mode: str, argv: Sequence[str], rows: list[dict[str, Any]]) -> Path:
    """The figures of one run as a JSON data file: ``{"tool", "mode", "argv", "machine", "rows"}``,
    a row a figure as the mode's table prints it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "tool": "benchmarks/host_cost.py",
        "mode": mode,
        "argv": list(argv),
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "rows": rows,
    }
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    from benchmarks import host_overhead

    host_overhead.set_step_mode(args)
    rows = args.run(args)
    if args.json and rows is not None:
        print(f"data: {write_data(args.json, args.mode, argv, rows)}", flush=True)


if __name__ == "__main__":
    main()
