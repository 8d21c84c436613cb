"""``omnigen new model NAME``: a starting config with every key of the schema, each documented.

The file is ``DIR/model/NAME.yaml``: one stage with every stage key at its default, each key
under a comment with its docstring, type and choices from ``schema.py``. It builds as written
(``omnigen build -cd DIR model=NAME out=my_runners``); edit it from there.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import yaml

from omnigen import keys
from omnigen.plan import camel

_PLACEHOLDERS = {"order": 0, "kind": "ar"}


def model_yaml(name: str, stage: str) -> str:
    lines = [
        f"# {name}: a model of your own for omnigen (written by `omnigen new model {name}`).",
        "# Every key of omnigen/schema.py is here with its default; delete what you do not change.",
        f"# Build it: omnigen build -cd DIR model={name} out=my_runners   (DIR holds model/{name}.yaml)",
        "# Every key and its meaning: omnigen explain --keys",
    ]
    for key in keys.schema_keys():
        if not key.path.startswith("model."):
            continue
        path = key.path.removeprefix("model.").replace("stages.STAGE", f"stages.{stage}")
        depth = path.count(".")
        indent = "  " * depth
        leaf = path.rsplit(".", 1)[-1]
        if key.type.startswith("dict[str, ") and path != "stages":
            lines += _comment(key, indent)
            lines.append(f"{indent}{leaf}: {{}}")
            continue
        if key.type == "section" or key.type.startswith("dict[str, "):
            lines += _comment(key, indent)
            lines.append(f"{indent}{leaf}:")
            if path == "stages":
                lines.append(f"{indent}  {stage}:")
            continue
        lines += _comment(key, indent)
        lines.append(f"{indent}{leaf}: {_yaml_value(_value(key, name, leaf))}")
    return "\n".join(lines) + "\n"


def _value(key: keys.Key, name: str, leaf: str) -> Any:
    if not key.required:
        return key.default
    if key.path == "model.name":
        return name
    if key.path == "model.title":
        return name
    if key.path == "model.arch":
        return f"{camel(name)}ForConditionalGeneration"
    return _PLACEHOLDERS[leaf]


def _comment(key: keys.Key, indent: str) -> list[str]:
    facts = [key.type]
    if key.choices:
        facts.append("one of " + " | ".join(key.choices))
    if key.required:
        facts.append("required")
    text = f"{key.doc} ({'; '.join(facts)})" if key.doc else f"({'; '.join(facts)})"
    return [f"{indent}# {line}" for line in textwrap.wrap(text, width=max(40, 96 - len(indent)))]


def _yaml_value(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def write(name: str, folder: Path, *, stage: str, force: bool) -> Path:
    if not name.isidentifier():
        raise ValueError(f"model name {name!r}: use a Python identifier (letters, digits, _), e.g. my_tts")
    if not stage.isidentifier():
        raise ValueError(f"--stage {stage!r}: use a Python identifier, e.g. talker")
    target = folder / "model" / f"{name}.yaml"
    if target.exists() and not force:
        raise FileExistsError(f"{target} exists; pass --force to replace it, or pick another name")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(model_yaml(name, stage), encoding="utf-8")
    return target
