"""Every test process (and the vLLM processes it starts, which inherit the environment) serves
omnigen's tiny test models: omnigen's vLLM plugin registers the classes of the models
``OMNIGEN_MODELS`` names (``omnigen.models``), and no user process gets them unasked.

And no test outside the oracle's and the engine runs' marks imports vllm-omni (issue 7): its
import runs ``patch.py``, which swaps vLLM's request and output classes in every loaded ``vllm``
module, so every test after it would run on patched vLLM. The hooks below look after each test
(and each collected module) whether ``vllm_omni`` is loaded; the first test or module that loaded
it fails the run, by name, whatever order the tests run in (``tests/test_isolation.py`` shows it).
"""

import os
import sys

import pytest

os.environ.setdefault("OMNIGEN_MODELS", "omnigen_tiny,omnigen_tiny_omni")

ORACLE_PACKAGE = "vllm_omni"
"""Importing any of its modules imports this package first, so one look-up sees them all."""
MAY_IMPORT_ORACLE = ("oracle", "e2e")
"""The marks whose tests may load it: the oracle's own process (``-m oracle``), and the engine runs,
which load vllm-omni's model classes through a bare package that skips ``patch.py``
(``harness.install_bare_vllm_omni``)."""

_loaded_by: list[str] = []
"""Who loaded vllm_omni first in this process, once it is loaded: from then on no later test can be
told apart, so only the first is named."""


def _loaded_now(who: str) -> bool:
    """True when vllm_omni was loaded since the last look, recording ``who`` did it."""
    if _loaded_by or ORACLE_PACKAGE not in sys.modules:
        return False
    _loaded_by.append(who)
    return True


def _message(who: str) -> str:
    loaded = sorted(m for m in sys.modules if m == ORACLE_PACKAGE or m.startswith(ORACLE_PACKAGE + "."))
    return (
        f"{who} imported vllm_omni ({', '.join(loaded[:5])}): importing vllm-omni patches vLLM's classes "
        f"process-wide, so every later test would run on patched vLLM. Import it only in a test marked "
        f"{' or '.join(MAY_IMPORT_ORACLE)}, or in a subprocess."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module that imports vllm_omni when collected: named at the end of collection, if the run
    selects a test that must not see it (the oracle's own process collects its modules too)."""
    yield
    _loaded_now(f"collecting {collector.nodeid or 'the session'}")


def pytest_collection_finish(session):
    if _loaded_by and any(not _may_import(item) for item in session.items):
        session.config.stash[_COLLECTION_VIOLATION] = _message(_loaded_by[0])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """After a test's last phase (teardown: its fixtures, and the module's and session's fixtures
    when it is the last to use them), a test that loaded vllm_omni gets an error naming it."""
    outcome = yield
    if call.when != "teardown" or not _loaded_now(item.nodeid) or _may_import(item):
        return
    report = outcome.get_result()
    report.outcome = "failed"
    report.longrepr = _message(item.nodeid)


def pytest_sessionfinish(session):
    violation = session.config.stash.get(_COLLECTION_VIOLATION, None)
    if violation is None:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"ERROR: {violation}", red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


_COLLECTION_VIOLATION = pytest.StashKey[str]()


def _may_import(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(mark) for mark in MAY_IMPORT_ORACLE)
