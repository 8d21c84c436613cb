"""Configs: the schema is documented, every group option composes, bad configs say where and how to fix."""

from __future__ import annotations

import itertools
from dataclasses import fields

from omnigen import paths, pipeline
from omnigen.schema import SCHEMA_CLASSES, field_docs


def test_every_schema_field_has_a_docstring():
    docs = field_docs()
    for cls in SCHEMA_CLASSES:
        for f in fields(cls):
            assert docs[cls.__name__].get(f.name), f"{cls.__name__}.{f.name} has no docstring"


def _group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (paths.conf_dir() / group).glob("*.yaml"))


def test_every_option_of_every_group_composes():
    groups = sorted(p.name for p in paths.conf_dir().iterdir() if p.is_dir())
    # hydra/ holds omnigen's options of Hydra's own groups (job_logging, hydra_logging).
    assert groups == ["device", "graph", "hydra", "model", "serve"]
    assert sorted(p.name for p in (paths.conf_dir() / "hydra").iterdir()) == ["hydra_logging", "job_logging"]
    for model, device, graph in itertools.product(
        _group_options("model"), _group_options("device"), _group_options("graph")
    ):
        plan = pipeline.model_plan(model, [f"device={device}", f"graph={graph}"])
        assert plan.device == device
        for stage in plan.stages:
            if stage.mtp and graph != "as_configured":
                assert stage.mtp.graph == {"eager": "unsafe", "full": "safe"}[graph]


# Bad configs, bad overrides and unreadable files: tests/corpus/, run by tests/test_corpus.py.


def test_field_docs_reads_the_docstring_under_each_field_and_nothing_else(monkeypatch):
    """A field's doc is the string literal right under it, whitespace folded; a field followed by
    another field, by code, by a field whose default is a string, or by nothing has none."""
    import inspect

    source = '''
class Section:
    documented: int = 1
    """Two   words,
    over two lines."""
    undocumented: int = 2
    before_code: int = 3
    ignored = 4
    before_a_string_default: int = 5
    tag: str = "not a docstring"
    last: int = 6
'''
    monkeypatch.setattr(inspect, "getsource", lambda module: source)
    assert field_docs()["Section"] == {
        "documented": "Two words, over two lines.",
        "undocumented": "",
        "before_code": "",
        "before_a_string_default": "",
        "tag": "",
        "last": "",
    }
