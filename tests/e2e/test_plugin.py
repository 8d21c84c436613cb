"""omnigen's ``vllm.general_plugins`` entry point: declared, loadable, and what vLLM loads.

The engine tests (``test_engine.py``) register nothing by hand: the tiny architectures
are known to vLLM only because it loads this entry point, which registers the classes of the
models ``OMNIGEN_MODELS`` names (``tests/conftest.py`` names the tiny ones), and nothing else.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

GROUP = "vllm.general_plugins"


def _omnigen_entry_point() -> importlib.metadata.EntryPoint:
    found = [ep for ep in importlib.metadata.entry_points(group=GROUP) if ep.name == "omnigen"]
    assert len(found) == 1, f"omnigen is not declared once in {GROUP}: {found}"
    return found[0]


def test_entry_point_declared_and_loadable():
    """Fast (no vLLM import): the installed metadata names omnigen.plugin:register."""
    import omnigen.plugin

    ep = _omnigen_entry_point()
    assert ep.value == "omnigen.plugin:register"
    assert ep.dist is not None and ep.dist.name == "omnigen"
    assert ep.load() is omnigen.plugin.register


@pytest.mark.e2e
def test_vllm_loads_the_plugin(monkeypatch):
    """vLLM's own plugin loader finds omnigen by name; registering makes the tiny archs known."""
    from vllm import ModelRegistry
    from vllm.plugins import load_plugins_by_group

    import omnigen.plugin
    from omnigen_testing.tiny_omni import TINY_ARCHS

    monkeypatch.setenv("VLLM_PLUGINS", "omnigen")
    plugins = load_plugins_by_group(GROUP)
    assert list(plugins) == ["omnigen"]
    assert plugins["omnigen"] is omnigen.plugin.register
    plugins["omnigen"]()
    plugins["omnigen"]()  # idempotent
    assert set(TINY_ARCHS) <= set(ModelRegistry.get_supported_archs())


_REGISTERED_ARCHS = """
import json
from vllm import ModelRegistry
from vllm.plugins import load_general_plugins
load_general_plugins()
from omnigen_testing.tiny_omni import TINY_ARCHS
supported = set(ModelRegistry.get_supported_archs())
print(json.dumps(sorted(set(TINY_ARCHS) & supported)))
"""


def _tiny_archs_registered(models: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "OMNIGEN_MODELS"}
    env["VLLM_PLUGINS"] = "omnigen"
    if models is not None:
        env["OMNIGEN_MODELS"] = models
    done = subprocess.run(
        [sys.executable, "-c", _REGISTERED_ARCHS], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
def test_the_plugin_registers_only_the_models_named():
    """A user's vLLM process that names no omnigen model gets none of the tiny test classes; one
    that names omnigen_tiny gets exactly the classes its config declares."""
    from omnigen_testing.tiny_omni import CODE2WAV_ARCH, TALKER_ARCH

    assert _tiny_archs_registered(None) == []
    assert _tiny_archs_registered("omnigen_tiny") == sorted([TALKER_ARCH, CODE2WAV_ARCH])
