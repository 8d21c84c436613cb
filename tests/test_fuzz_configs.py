"""Generated configs (issue 9, item 6): each is a clear error or code that compiles, lints and imports.

Hypothesis mutates the shipped model configs (sets, deletes and adds keys, renames stages) with
valid, invalid and hostile values, writes each as a model file, and runs it through the path a
user's build takes (YAML preflight, shape check, Hydra, spec, plan, render with ruff format,
ruff check and the compile gate). A refused config must be a ``ConfigError`` whose every line is
a finding in the documented form; a built one must import (every generated module executed in a
fresh module) and name no text of the config outside a validated identifier or a literal.
Marked ``fuzz`` (500 configs take about two minutes): scripts/test runs it.
"""

from __future__ import annotations

import copy
import re
import shutil
import types
from collections import Counter

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnigen import paths, pipeline
from omnigen.schema import ENUMS, SCHEMA_CLASSES

pytestmark = pytest.mark.fuzz

MODELS = {p.stem: yaml.safe_load(p.read_text()) for p in sorted((paths.conf_dir() / "model").glob("*.yaml"))}
SCHEMA_KEYS = sorted({f for cls in SCHEMA_CLASSES for f in cls.__dataclass_fields__})
ENUM_VALUES = sorted({member.value for enum in ENUMS for member in enum})
HOSTILE = [
    "coding:utf-7 +AAo-open('/tmp/pwned', 'w')",
    "coding:bogus",
    "two\nlines",
    'x"""; import os',
    "x'); import os; ('",
    "caf\u00e9",
    "__init__",
    "plan",
    "class",
    "a.b",
    "a..b",
    "_private",
    "",
    " ",
    "\t",
    "x" * 120,
    "hf_text_config.hidden_size",
    "codes.audio",
    "talker",
]
# What a finding looks like: where (the file, at a line and column or not, or an override), then
# the key and the problem; several findings come under a count.
FINDING = re.compile(r"(conf/model/fuzz\.yaml(:\d+:\d+)?|override .+?): .+")

values = st.one_of(
    st.booleans(),
    st.none(),
    st.integers(-3, 120),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from(ENUM_VALUES),
    st.sampled_from(HOSTILE),
    st.text(max_size=12),
    st.lists(st.sampled_from(["codes", "audio", "hidden", "x y", "1", "codes.audio"]), max_size=3),
    st.dictionaries(st.sampled_from(SCHEMA_KEYS[:8]), st.booleans(), max_size=2),
)
keys = st.one_of(
    st.sampled_from(SCHEMA_KEYS), st.sampled_from(HOSTILE), st.text(max_size=8), st.integers(0, 3)
)


def _paths(node: object, prefix: tuple = ()) -> list[tuple]:
    """Every path to a mapping entry or list item of a plain YAML document."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            found.append((*prefix, key))
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.append((*prefix, i))
            found += _paths(value, (*prefix, i))
    return found


def _parent(doc: dict, path: tuple) -> object:
    node: object = doc
    for part in path[:-1]:
        node = node[part]  # type: ignore[index]
    return node


def _same_kind(value: object) -> st.SearchStrategy:
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.integers(0, 12)
    if isinstance(value, float):
        return st.floats(0.05, 2.0)
    if isinstance(value, str):
        return st.sampled_from([value, *ENUM_VALUES, "talker", "hf_text_config.hidden_size"])
    return st.just(value)


@st.composite
def configs(draw: st.DrawFn) -> dict:
    doc = copy.deepcopy(MODELS[draw(st.sampled_from(sorted(MODELS)))])
    doc["name"] = "fuzz"
    for _ in range(draw(st.integers(0, 3))):
        targets = _paths(doc)
        op = draw(st.sampled_from(["set", "delete", "add", "rename_stage"]))
        if op == "rename_stage" and isinstance(doc.get("stages"), dict) and doc["stages"]:
            old = draw(st.sampled_from(sorted(doc["stages"], key=str)))
            doc["stages"][draw(keys)] = doc["stages"].pop(old)
        elif op == "add":
            mappings = [()] + [p for p in targets if isinstance(_parent(doc, (*p, None)), dict)]
            where = draw(st.sampled_from(mappings))
            node = _parent(doc, (*where, None))
            node[draw(keys)] = draw(values)  # type: ignore[index]
        elif targets:
            path = draw(st.sampled_from(targets))
            parent = _parent(doc, path)
            if op == "delete":
                del parent[path[-1]]  # type: ignore[union-attr]
            else:
                current = parent[path[-1]]  # type: ignore[index]
                # Half the time a value of the same kind, so that many configs build.
                parent[path[-1]] = draw(st.one_of(_same_kind(current), values))  # type: ignore[index]
    return doc


@pytest.fixture(scope="module")
def conf_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz") / "conf"
    shutil.copytree(paths.conf_dir(), root)
    return root


def _import(source: str, rel: str) -> None:
    module = types.ModuleType(f"omnigen._fuzz.{rel.replace('/', '_').removesuffix('.py')}")
    exec(compile(source.encode("utf-8"), f"generated/{rel}", "exec"), module.__dict__)  # noqa: S102


def test_every_generated_config_is_a_clear_error_or_code_that_imports(conf_root, monkeypatch):
    monkeypatch.setattr(paths, "conf_dir", lambda: conf_root)
    target = conf_root / "model" / "fuzz.yaml"
    counts: Counter[str] = Counter()

    @settings(
        max_examples=500,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(doc=configs())
    def one_config(doc: dict) -> None:
        counts["configs"] += 1
        target.write_text(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False))
        try:
            plan = pipeline.model_plan("fuzz")
        except pipeline.ConfigError as exc:
            message = str(exc)
            lines = message.splitlines()
            findings = lines[1:] if re.fullmatch(r"\d+ problems in the config:", lines[0]) else lines
            assert findings and all(FINDING.fullmatch(line.strip()) for line in findings), message
            counts["refused"] += 1
            return
        files = pipeline.model_files(plan)  # ruff format, ruff check and compile(), or RenderError
        for rel, source in files.items():
            if rel.endswith(".py"):
                _import(source, rel)
        counts["built"] += 1

    one_config()
    print(f"fuzzed configs: {dict(counts)}")
    # Both outcomes are exercised: a fuzzer that only ever builds (or only refuses) tests nothing.
    assert counts["configs"] >= 500
    assert counts["built"] >= 50 and counts["refused"] >= 200, counts
