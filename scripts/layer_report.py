"""Lines per layer, the largest functions and the largest templates of a commit (issue 37's report).

    .venv/bin/python scripts/layer_report.py [REV ...]     (default: HEAD)

Reads the commit's tracked files (``git show``), so any commit can be measured side by side with
another. A layer is a set of paths (``LAYERS``); lines are physical lines of ``.py``/``.j2`` files.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS: dict[str, tuple[str, ...]] = {
    "generator (schema, spec, plan, render, streams)": (
        "omnigen/schema.py",
        "omnigen/serve_schema.py",
        "omnigen/spec.py",
        "omnigen/plan.py",
        "omnigen/render.py",
        "omnigen/streams.py",
    ),
    "templates": ("templates/*",),
    "generated": ("generated/*",),
    "runtime": ("omnigen/runtime/*",),
    "glue": ("omnigen/glue/*",),
    "requests": ("omnigen/requests/*",),
    "serving (+ built, models, plugin, providers)": (
        "omnigen/serving/*",
        "omnigen/built.py",
        "omnigen/models.py",
        "omnigen/plugin.py",
        "omnigen/providers/*",
    ),
    "test support (omnigen_testing)": ("testing/*", "omnigen/testing/*"),
    "cli and the rest of omnigen": ("omnigen/*",),
    "tests": ("tests/*",),
    "benchmarks": ("benchmarks/*",),
}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _layer(path: str) -> str | None:
    for name, patterns in LAYERS.items():  # the first match: order LAYERS from narrow to broad
        if any(fnmatch.fnmatch(path, pattern) for pattern in patterns):
            return name
    return None


def report(rev: str) -> None:
    files = [f for f in _git("ls-tree", "-r", "--name-only", rev).splitlines() if f.endswith((".py", ".j2"))]
    lines: dict[str, int] = dict.fromkeys(LAYERS, 0)
    functions: list[tuple[int, str]] = []
    templates: list[tuple[int, str]] = []
    for path in files:
        layer = _layer(path)
        if layer is None:
            continue
        text = _git("show", f"{rev}:{path}")
        lines[layer] += text.count("\n")
        if path.endswith(".j2"):
            templates.append((text.count("\n"), f"{path} ({text.count('{% if')} if-blocks)"))
        elif path.startswith("omnigen/") and not path.startswith("omnigen/testing/"):
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    functions.append((node.end_lineno - node.lineno + 1, f"{path}:{node.lineno} {node.name}"))
    print(f"== {rev} ({_git('rev-parse', '--short', rev).strip()})")
    for name, count in lines.items():
        print(f"  {count:7d}  {name}")
    print("  largest product functions:")
    for count, where in sorted(functions, reverse=True)[:8]:
        print(f"  {count:7d}  {where}")
    print("  templates:")
    for count, where in sorted(templates, reverse=True):
        print(f"  {count:7d}  {where}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("revs", nargs="*", default=["HEAD"], help="commits to measure (default: HEAD)")
    for rev in parser.parse_args().revs:
        report(rev)


if __name__ == "__main__":
    main()
