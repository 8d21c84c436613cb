"""omnigen's ``vllm.general_plugins`` entry point: declared, loadable, and what vLLM loads.

The engine tests (``test_engine.py``) register nothing by hand: the tiny architectures
are known to vLLM only because it loads this entry point.
"""

from __future__ import annotations

import importlib.metadata

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
    from omnigen.testing.tiny_omni import TINY_ARCHS

    monkeypatch.setenv("VLLM_PLUGINS", "omnigen")
    plugins = load_plugins_by_group(GROUP)
    assert list(plugins) == ["omnigen"]
    assert plugins["omnigen"] is omnigen.plugin.register
    plugins["omnigen"]()
    plugins["omnigen"]()  # idempotent
    assert set(TINY_ARCHS) <= set(ModelRegistry.get_supported_archs())
