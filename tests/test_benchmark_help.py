"""Every benchmark a newcomer can run answers ``--help`` with what it measures, against what
baseline, how long it takes and where it writes (issue 37, item 5).

One subprocess runs every benchmark's ``--help`` in turn (``runpy``, as ``python FILE --help``
runs it): a process each would import torch and vLLM a dozen times over (about 10 s each here),
and a benchmark's imports must not touch this test process (vLLM, the oracle's patches).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
LIBRARIES = {
    "host_overhead.py": "the wall mode of host_cost.py, and where the modes' steps are built",
    "floors.py": "the floors mode of host_cost.py",
    "instructions.py": "the instructions mode of host_cost.py",
}
"""Benchmark modules without a command line of their own, and what runs them."""
HOST_COST_MODES = ("wall", "floors", "instructions")
LABELS = ("Measures:", "Baseline:", "Takes:", "Writes:")

RUNNER = r"""
import contextlib, io, json, runpy, sys
found = {}
for argv in json.loads(sys.argv[1]):
    sys.argv = argv
    out = io.StringIO()
    code = None
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as exit:
            code = exit.code
    found[" ".join(argv)] = {"code": code, "text": out.getvalue()}
print("\n@@HELP@@" + json.dumps(found))
"""


def _commands() -> list[list[str]]:
    commands = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        if path.name in LIBRARIES or path.name == "__init__.py":
            continue
        commands.append([str(path), "--help"])
    commands += [[str(BENCHMARKS / "host_cost.py"), mode, "--help"] for mode in HOST_COST_MODES]
    return commands


@pytest.fixture(scope="module")
def helps() -> dict[str, dict]:
    env = {**os.environ, "VLLM_PLUGINS": "omnigen"}
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(_commands())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.rsplit("@@HELP@@", 1)[1])


def test_every_benchmark_is_a_command_or_a_named_library():
    """A new benchmark file either has a command line (and so is in ``helps``) or is named here."""
    for path in BENCHMARKS.glob("*.py"):
        text = path.read_text()
        has_main = '__name__ == "__main__"' in text
        if path.name == "__init__.py":
            continue
        if path.name in LIBRARIES:
            assert not has_main, f"{path.name}: runs as host_cost.py's mode, not on its own"
        else:
            assert has_main, f"{path.name}: no command line; give it one or add it to LIBRARIES"


@pytest.mark.parametrize("argv", _commands(), ids=lambda argv: " ".join(Path(a).name for a in argv))
def test_help_says_what_against_what_how_long_and_where(helps, argv):
    found = helps[" ".join(argv)]
    assert found["code"] in (0, None), f"exit {found['code']}"
    text = found["text"]
    for label in LABELS:
        assert label in text, f"--help does not say {label!r}"
    writes = text[text.index("Writes:") :].split("\n\n")[0]
    # Names its output: a data file's path, or says there is none and where the figures go.
    assert re.search(r"\.json|\.csv|--json|stdout", writes), writes
