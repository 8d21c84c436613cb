"""The default group runs on unpatched vLLM (issue 7: nothing in the test path changes vLLM globally).

Importing vllm-omni (the comparison oracle) runs its ``patch.py``, which swaps vLLM's request and
output classes in every loaded ``vllm`` module. The oracle's own tests are marked ``oracle`` and run
in a pytest process of their own (``scripts/test``); the engine-level comparison imports vllm-omni
only in its oracle subprocess (``tests/e2e/real``). ``tests/conftest.py`` looks after every test and
every collected module, in any order; the tests below run its hooks in a pytest of their own on
tests that do import a ``vllm_omni`` (a stand-in module: what is checked is that it was loaded),
and check that the run fails naming the culprit, and that an oracle test may load it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")

IMPORTS_IT = """
import sys, types

def load_vllm_omni():
    sys.modules["vllm_omni"] = types.ModuleType("vllm_omni")
"""


def test_no_default_test_so_far_imported_vllm_omni():
    loaded = sorted(name for name in sys.modules if name == "vllm_omni" or name.startswith("vllm_omni."))
    assert not loaded, f"the default test process imported vllm-omni (patches vLLM): {loaded[:5]}"


def run_pytest(folder: Path, files: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """pytest on ``files`` (name -> source) with omnigen's tests/conftest.py, in a process of its own."""
    (folder / "conftest.py").write_text(CONFTEST.read_text())
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    oracle: x\n    e2e: x\n")
    for name, source in files.items():
        (folder / name).write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=folder,
        # Only the hooks under test: the installed plugins (Hypothesis, ...) would double the time.
        env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_test_that_imports_vllm_omni_fails_the_run_by_name_wherever_it_runs(tmp_path):
    # The culprit runs last (after any test that would look at sys.modules itself), in the middle
    # of its module, and the tests after it pass: only the hook can name it.
    files = {
        "test_a_first.py": "def test_clean():\n    pass\n",
        "test_b_culprit.py": IMPORTS_IT + "\ndef test_before():\n    pass\n\n"
        "def test_imports_the_oracle():\n    load_vllm_omni()\n\n"
        "def test_after():\n    pass\n",
    }
    run = run_pytest(tmp_path, files)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "4 passed, 1 error" in run.stdout, run.stdout
    assert "ERROR test_b_culprit.py::test_imports_the_oracle" in run.stdout, run.stdout
    assert "test_b_culprit.py::test_imports_the_oracle imported vllm_omni" in run.stdout, run.stdout


def test_a_fixture_or_a_module_at_collection_that_imports_it_is_named_too(tmp_path):
    fixture = IMPORTS_IT + (
        "import pytest\n\n@pytest.fixture(scope='module')\ndef oracle():\n    load_vllm_omni()\n\n"
        "def test_uses_it(oracle):\n    pass\n"
    )
    run = run_pytest(tmp_path, {"test_fixture.py": fixture})
    assert run.returncode == 1 and "test_fixture.py::test_uses_it imported vllm_omni" in run.stdout, (
        run.stdout
    )

    collected = tmp_path / "collected"
    collected.mkdir()
    files = {"test_at_import.py": IMPORTS_IT + "load_vllm_omni()\n\ndef test_x():\n    pass\n"}
    run = run_pytest(collected, files)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "collecting test_at_import.py imported vllm_omni" in run.stdout, run.stdout


def test_oracle_tests_may_import_it(tmp_path):
    files = {
        "test_oracle.py": IMPORTS_IT + "import pytest\n\n@pytest.mark.oracle\ndef test_oracle():\n"
        "    load_vllm_omni()\n\n@pytest.mark.oracle\ndef test_next():\n    pass\n"
    }
    run = run_pytest(tmp_path, files)
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout + run.stderr
