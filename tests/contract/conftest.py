"""Fixtures of the contract tests (docs/contract.md sections 1-5 and 6's cleanup).

Only what must be patched is: the platform's forward context and full-graph wrapper lookup
(through ``omnigen.runtime.vllm_api``, where generated code reaches them), and
``_determine_batch_execution_and_padding`` per runner (see ``_support.rig``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm.config import vllm as vllm_config_module

from omnigen.runtime import vllm_api
from omnigen_testing.contract_support import TARGETS, FakeForwardContext, FakeGraphWrapper, Recorder
from omnigen_testing.tiny_omni import TALKER_ARCH, write_tiny_config

OPTIMIZED_SCRIPT = Path(__file__).with_name("optimized_check.py")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny omni talker's checkpoint folder, for vLLM's own engine config (a module's own
    ``checkpoint`` fixture takes precedence)."""
    return write_tiny_config(tmp_path_factory.mktemp("ckpt"), TALKER_ARCH)


@pytest.fixture
def gpu_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's V1/V2 selection as on a CUDA machine: Triton importable, no environment setting."""
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest) -> str:
    """The generated target a test drives (one clause, two targets): ``v1``, the V1 runner, or
    ``v2``, the Model Runner V2 target's model state through V2's own seams."""
    return request.param


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def ctx(monkeypatch: pytest.MonkeyPatch, recorder: Recorder) -> FakeForwardContext:
    """``vllm_api.set_forward_context`` replaced by a recording context manager."""
    fake = FakeForwardContext(recorder)
    monkeypatch.setattr(vllm_api, "set_forward_context", fake)
    return fake


class GraphPlatform:
    """Controls what ``vllm_api.full_graph_wrapper_cls()`` gives: a fake wrapper class, or an error."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.lookups = 0
        self.allow()

    def allow(self) -> None:
        def lookup() -> type:
            self.lookups += 1
            return FakeGraphWrapper

        self.monkeypatch.setattr(vllm_api, "full_graph_wrapper_cls", lookup)

    def forbid(self) -> None:
        """Any lookup of the wrapper class fails the test (CONTRACT 2.2: unsafe never looks)."""

        def lookup() -> type:
            self.lookups += 1
            raise AssertionError("the full-graph wrapper class was looked up")

        self.monkeypatch.setattr(vllm_api, "full_graph_wrapper_cls", lookup)

    def for_policy(self, graph: str) -> None:
        self.allow() if graph == "safe" else self.forbid()


@pytest.fixture
def graph(monkeypatch: pytest.MonkeyPatch) -> GraphPlatform:
    return GraphPlatform(monkeypatch)


# -- the `python -O` check runs in a subprocess started early, beside the rest of the suite ----


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    if any(item.name.startswith("test_invalid_batches_raise_under_python_O") for item in items):
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        config._omnigen_optimized = subprocess.Popen(  # noqa: S603
            [sys.executable, "-O", str(OPTIMIZED_SCRIPT)],
            cwd=str(Path(__file__).parents[2]),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )


@pytest.fixture
def optimized_run(request: pytest.FixtureRequest) -> tuple[int, str]:
    proc = getattr(request.config, "_omnigen_optimized", None)
    assert proc is not None, "the python -O subprocess was not started"
    out, _ = proc.communicate(timeout=240)
    return proc.returncode, out


def pytest_unconfigure(config: pytest.Config) -> None:
    proc = getattr(config, "_omnigen_optimized", None)
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
