"""One side of the differential test: run cases through vLLM on CPU and write their traces.

    python -m omnigen_testing.real.run_side --side oracle|omnigen --cases a,b,c --out trace.json

All cases run in this one process, one engine at a time (vLLM's import is paid once). The
environment is set here, before vLLM is imported (``harness.side_environment``). A case that
crashes is recorded in the trace (``error``, ``runner_errors``); the process still exits 0 once
the trace is written, so the comparison can report it. ``--cases`` defaults to every module in
``testing/real/cases``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys
import tempfile
import time
from pathlib import Path

CASES_PACKAGE = "omnigen_testing.real.cases"


def all_case_names() -> list[str]:
    package = importlib.import_module(CASES_PACKAGE)
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))


def load_case_module(name: str):
    return importlib.import_module(f"{CASES_PACKAGE}.{name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", required=True, choices=("oracle", "omnigen"))
    parser.add_argument("--cases", default="", help="comma-separated case module names (default: all)")
    parser.add_argument(
        "--variants",
        default="",
        help="comma-separated CASE~PERTURBATION runs added after the cases (harness.PERTURBATIONS)",
    )
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--work-dir", type=Path, default=None, help="where the tiny checkpoints go")
    args = parser.parse_args(argv)

    from omnigen_testing.real import harness

    os.environ.update(harness.side_environment(args.side))
    if str(harness.REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(harness.REPO_ROOT))

    t0 = time.perf_counter()
    names = [n for n in args.cases.split(",") if n] or all_case_names()
    trace: dict = {"side": args.side, "cases": {}, "setup_error": None}
    try:
        harness.prepare_side(args.side)
    except Exception as exc:  # recorded; every case is then reported as not run
        import traceback

        trace["setup_error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-4000:]}"
    trace["vllm_patched"] = None if trace["setup_error"] else harness.vllm_patched()

    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix=f"omnigen-real-{args.side}-"))
    runs = [(name, None) for name in names]
    runs += [tuple(v.split("~", 1)) for v in args.variants.split(",") if v]
    for name, perturb in runs:
        key = f"{name}~{perturb}" if perturb else name
        if trace["setup_error"]:
            trace["cases"][key] = {
                "case": name,
                "error": {"stage": "side setup", "message": trace["setup_error"]},
            }
            continue
        try:
            module = load_case_module(name)
            case = module.CASE
        except Exception as exc:
            trace["cases"][key] = {
                "case": name,
                "error": {"stage": "import case", "type": type(exc).__name__, "message": str(exc)},
            }
            continue
        print(f"[{args.side}] {key} ...", file=sys.stderr, flush=True)
        result = harness.run_case(args.side, case, work_dir, perturb=perturb)
        # What the stage must produce, stated by the case module (optional): see test_real_models.
        result["expect"] = getattr(module, "EXPECT", None)
        trace["cases"][key] = result
        print(
            f"[{args.side}] {key}: {len(result.get('steps', []))} steps, "
            f"error={(result.get('error') or {}).get('type')}, {result.get('wall_s')}s",
            file=sys.stderr,
            flush=True,
        )
        # Written after every case, so a later hard crash still leaves the earlier traces.
        args.out.write_text(json.dumps(trace, allow_nan=True))
    trace["wall_s"] = round(time.perf_counter() - t0, 2)
    args.out.write_text(json.dumps(trace, allow_nan=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
