"""Configs: the schema is documented, every group option composes, bad configs say where and how to fix."""

from __future__ import annotations

import itertools
import shutil
from dataclasses import fields
from pathlib import Path

import pytest

from omnigen import paths, pipeline
from omnigen.schema import SCHEMA_CLASSES, field_docs

BAD = Path(__file__).parent / "bad_configs"


def test_every_schema_field_has_a_docstring():
    docs = field_docs()
    for cls in SCHEMA_CLASSES:
        for f in fields(cls):
            assert docs[cls.__name__].get(f.name), f"{cls.__name__}.{f.name} has no docstring"


def _group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (paths.conf_dir() / group).glob("*.yaml"))


def test_every_option_of_every_group_composes():
    groups = sorted(p.name for p in paths.conf_dir().iterdir() if p.is_dir())
    assert groups == ["device", "graph", "model"]
    for model, device, graph in itertools.product(
        _group_options("model"), _group_options("device"), _group_options("graph")
    ):
        plan = pipeline.model_plan(model, [f"device={device}", f"graph={graph}"])
        assert plan.device == device
        for stage in plan.stages:
            if stage.mtp and graph != "as_configured":
                assert stage.mtp.graph == {"eager": "unsafe", "full": "safe"}[graph]


@pytest.fixture
def conf_with(tmp_path, monkeypatch):
    """A copy of conf/ with one more model file in it, used as the config root."""
    root = tmp_path / "conf"
    shutil.copytree(paths.conf_dir(), root)
    monkeypatch.setattr(paths, "conf_dir", lambda: root)

    def add(path: Path) -> str:
        shutil.copy(path, root / "model" / path.name)
        return path.stem

    return add


@pytest.mark.parametrize("case", sorted(BAD.glob("*.yaml")), ids=lambda p: p.stem)
def test_bad_config_names_file_key_and_fix(case, conf_with):
    expected = [
        line.removeprefix("# expect: ").strip()
        for line in case.read_text().splitlines()
        if line.startswith("# expect: ")
    ]
    assert expected, f"{case.name} states no expected message"
    model = conf_with(case)
    with pytest.raises(pipeline.ConfigError) as info:
        pipeline.model_plan(model)
    message = str(info.value)
    for text in expected:
        assert text in message


def test_all_findings_are_reported_at_once(conf_with):
    model = conf_with(BAD / "duplicate_order_and_bad_gpu_key.yaml")
    with pytest.raises(pipeline.ConfigError) as info:
        pipeline.model_plan(model)
    assert str(info.value).count("conf/model/duplicate_order_and_bad_gpu_key.yaml:") == 2


def test_overrides_are_validated_like_files():
    with pytest.raises(
        pipeline.ConfigError, match=r"override 'model.stages.talker.mtp.graph=maybe'.*Invalid value"
    ):
        pipeline.model_plan("qwen3_omni", ["model.stages.talker.mtp.graph=maybe"])
    with pytest.raises(pipeline.ConfigError, match="stages.talker.mtp.bogus"):
        pipeline.model_plan("qwen3_omni", ["+model.stages.talker.mtp.bogus=1"])


BOMB = b"a: &a [x, x, x, x, x, x, x, x, x]\n" + b"".join(
    b"%s: &%s [%s]\n"
    % (chr(98 + i).encode(), chr(98 + i).encode(), b", ".join([b"*" + chr(97 + i).encode()] * 9))
    for i in range(8)
)

YAML_FAULTS = {
    "syntax": (
        b"name: syntax\nstages:\n  talker: {order: 0, kind: ar\n",
        "conf/model/syntax.yaml:4:1: while parsing a flow mapping",
    ),
    "duplicate": (
        b"name: duplicate\nname: duplicate\n",
        "conf/model/duplicate.yaml:2:1: while reading a mapping key 'name' appears twice (first at line 1)",
    ),
    "tab": (
        b"name: tab\nstages:\n\ttalker: {}\n",
        "conf/model/tab.yaml:3:1: while scanning for the next token found character '\\t'",
    ),
    "nul": (b"name: nul\x00\n", "conf/model/nul.yaml:1:10: a NUL byte"),
    "latin1": (
        b"name: latin1\ntitle: B\xe9d\n",
        "conf/model/latin1.yaml:2:9: byte 0xe9 is not UTF-8; save the file as UTF-8",
    ),
    "bomb": (BOMB, "anchors and aliases are not allowed in an omnigen config"),
    "deep": (b"name: deep\nx: " + b"{a: " * 40 + b"1" + b"}" * 40 + b"\n", "nested deeper than 16 levels"),
    "list": (b"- name: list\n", "conf/model/list.yaml: the file holds a list, not a mapping of keys"),
}


@pytest.mark.parametrize("fault", sorted(YAML_FAULTS))
def test_unreadable_model_files_are_clear_errors_with_line_and_column(fault, conf_with, tmp_path):
    """Issue 9: YAML-level faults escaped as tracebacks, and an alias bomb hung; now each is one
    message naming the file, line and column, within a second."""
    import time

    content, expected = YAML_FAULTS[fault]
    source = tmp_path / f"{fault}.yaml"
    source.write_bytes(content)
    name = conf_with(source)
    started = time.perf_counter()
    with pytest.raises(pipeline.ConfigError) as err:
        pipeline.model_plan(name)
    assert expected in str(err.value)
    assert time.perf_counter() - started < 5
