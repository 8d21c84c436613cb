"""A config's shape against the schema, every finding at once, before Hydra composes (issue 9).

Hydra and OmegaConf stop at the first key they cannot place or value they cannot convert, and
their message names neither the line nor what was meant. A model config file and the command
line's overrides are checked here first, the file as its YAML node tree (so a finding has a line
and column) and each override as Hydra's own parser reads it: every unknown key with the key it
most likely meant, every missing required key, every value of the wrong type and every enum or
group option outside its choices, in one report. What is left for OmegaConf (a value it converts
differently) still reaches the user through ``pipeline``'s compose-error message.

Semantic checks that span keys (ranges, identifiers, a payload with nowhere to go) belong to
``spec.py``; this module knows only the schema's types.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterable, Sequence
from enum import Enum
from typing import Any

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType, ValueType
from hydra.errors import OverrideParseException
from omegaconf import MISSING

from omnigen.findings import Finding
from omnigen.schema import ModelConf, OmniGenConfig

# Config groups of conf/ and the root key each one sets (graph=NAME sets mtp_graph).
GROUPS = ("model", "device", "graph", "serve")


# -- The model file -----------------------------------------------------------------------------


def check_model_document(
    node: yaml.Node | None, shown_as: str, set_by_overrides: Iterable[str] = ()
) -> list[Finding]:
    """Every shape finding of a model file's node tree; a required key an override sets is not missing."""
    checker = _Checker(shown_as, frozenset(set_by_overrides))
    if node is None:
        checker.missing_keys(ModelConf, set(), "", None)
        return checker.findings
    checker.check(node, ModelConf, "")
    return checker.findings


class _Checker:
    def __init__(self, shown_as: str, set_by_overrides: frozenset[str]):
        self.shown_as = shown_as
        self.set_by_overrides = set_by_overrides
        self.findings: list[Finding] = []
        self._constructor = yaml.SafeLoader("")

    def where(self, node: yaml.Node | None) -> str:
        mark = getattr(node, "start_mark", None)
        return f"{self.shown_as}:{mark.line + 1}:{mark.column + 1}" if mark else self.shown_as

    def add(self, node: yaml.Node | None, key: str, problem: str) -> None:
        self.findings.append(Finding(self.where(node), key, problem))

    def check(self, node: yaml.Node, hint: Any, key: str) -> None:
        hint, optional = unwrap_optional(hint)
        if optional and _is_null(node):
            return
        if dataclasses.is_dataclass(hint):
            self.check_mapping(node, hint, key)
        elif typing.get_origin(hint) is dict:
            self.check_dict(node, typing.get_args(hint)[1], key)
        elif typing.get_origin(hint) is list:
            self.check_list(node, typing.get_args(hint)[0], key)
        else:
            problem = value_problem(self.value(node), hint, optional)
            if problem:
                self.add(node, key, problem)

    def value(self, node: yaml.Node) -> Any:
        return self._constructor.construct_object(node, deep=True)

    def check_mapping(self, node: yaml.Node, cls: type, key: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            self.add(
                node, key or "(file)", f"expected a mapping of {cls.__name__} keys, got {_yaml_kind(node)}"
            )
            return
        hints = typing.get_type_hints(cls)
        present: set[str] = set()
        for key_node, value_node in node.value:
            name = self.value(key_node)
            path = _join(key, str(name))
            if not isinstance(name, str) or name not in hints:
                self.add(key_node, path, unknown_key_problem(str(name), hints, cls))
                continue
            present.add(name)
            self.check(value_node, hints[name], path)
        self.missing_keys(cls, present, key, node)

    def missing_keys(self, cls: type, present: set[str], key: str, node: yaml.Node | None) -> None:
        for f in dataclasses.fields(cls):
            path = _join(key, f.name)
            if (
                f.default is MISSING
                and f.name not in present
                and f"model.{path}" not in self.set_by_overrides
            ):
                self.add(node, path, f"is required and missing; add `{f.name}:` ({_doc_hint(cls, f.name)})")

    def check_dict(self, node: yaml.Node, item_hint: Any, key: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            self.add(node, key, f"expected a mapping of names to entries, got {_yaml_kind(node)}")
            return
        for key_node, value_node in node.value:
            name = self.value(key_node)
            if not isinstance(name, str):
                self.add(key_node, _join(key, str(name)), f"the name {name!r} must be a string: quote it")
                continue
            self.check(value_node, item_hint, _join(key, name))

    def check_list(self, node: yaml.Node, item_hint: Any, key: str) -> None:
        if not isinstance(node, yaml.SequenceNode):
            self.add(node, key, f"expected a list, got {_yaml_kind(node)}: write [a, b]")
            return
        for i, item in enumerate(node.value):
            self.check(item, item_hint, f"{key}[{i}]")


# -- Overrides ----------------------------------------------------------------------------------


def stage_names(node: yaml.Node | None) -> list[str]:
    """The stage names of a model file's node tree (those that are strings)."""
    if not isinstance(node, yaml.MappingNode):
        return []
    for key_node, value_node in node.value:
        if key_node.value == "stages" and isinstance(value_node, yaml.MappingNode):
            return [k.value for k, _ in value_node.value if isinstance(k, yaml.ScalarNode)]
    return []


def key_positions(node: yaml.Node | None, prefix: str = "") -> dict[str, tuple[int, int]]:
    """``{dotted key: (line, column)}`` (1-based) of every key and list item of a node tree."""
    found: dict[str, tuple[int, int]] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = _join(prefix, str(key_node.value))
            found[path] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            found.update(key_positions(value_node, path))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = f"{prefix}[{i}]"
            found[path] = (item.start_mark.line + 1, item.start_mark.column + 1)
            found.update(key_positions(item, path))
    return found


def parse_overrides(overrides: Sequence[str]) -> list[Override]:
    """Hydra's own reading of the overrides; a syntax error is a ``ValueError`` naming the override."""
    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            parsed += parser.parse_overrides([text])
        except OverrideParseException as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else "cannot be parsed"
            raise ValueError(
                f"override {text!r}: {detail}; write key=value (see `omnigen build --help`)"
            ) from exc
    return parsed


def override_sets(overrides: Sequence[Override]) -> set[str]:
    """The dotted keys the overrides give a value (not deletions)."""
    return {o.key_or_group for o in overrides if o.type is not OverrideType.DEL}


def check_overrides(
    overrides: Sequence[Override],
    stage_names: Sequence[str],
    group_options: dict[str, Sequence[str]],
    *,
    sweeps_allowed: bool = False,
) -> list[Finding]:
    """Every override that names no key of the schema, or gives a key a value it cannot hold.

    ``stage_names`` are the stages of the model file; ``group_options`` the options of each group.
    A sweep override (``a,b``) is an error unless ``sweeps_allowed`` (``--multirun``), and is then
    checked value by value.
    """
    findings: list[Finding] = []
    for override in overrides:
        where = f"override {override.input_line!r}"
        key = override.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")) or override.type is OverrideType.DEL:
            continue  # Hydra's own settings, and deletions, are Hydra's to check
        if not key:
            findings.append(Finding(where, "", "has no key; write key=value, e.g. device=cpu"))
            continue
        if override.is_sweep_override() and not sweeps_allowed:
            findings.append(
                Finding(
                    where,
                    key.removeprefix("model."),
                    "is a sweep (several values); run it with -m (--multirun)",
                )
            )
            continue
        values = _override_values(override)
        if key in GROUPS and override.package is None:
            for value in values:
                if key == "model":
                    continue  # the model file itself is read and checked by name
                problem = _choice_problem(value, group_options.get(key, ()), f"{key} option")
                if problem:
                    findings.append(Finding(where, key, problem))
            continue
        hint, problem = _resolve_key(key, stage_names)
        if problem:
            findings.append(Finding(where, key.removeprefix("model."), problem))
            continue
        for value in values:
            problem = _override_value_problem(value, hint)
            if problem:
                findings.append(Finding(where, key.removeprefix("model."), problem))
    return findings


def _override_values(override: Override) -> list[Any]:
    if override.value_type is ValueType.ELEMENT:
        return [override.value()]
    if override.value_type in (ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP):
        return list(override.sweep_iterator())
    return []  # range and interval sweeps: numbers Hydra makes; OmegaConf checks each cell


def _resolve_key(key: str, stage_names: Sequence[str]) -> tuple[Any, str | None]:
    """The schema type of dotted ``key`` of the root config, or why it names nothing."""
    hint: Any = OmniGenConfig
    walked = ""
    parts = key.split(".")
    for i, part in enumerate(parts):
        hint, _ = unwrap_optional(hint)
        if dataclasses.is_dataclass(hint):
            hints = typing.get_type_hints(hint)
            if part not in hints:
                return None, unknown_key_problem(part, hints, hint, under=walked)
            hint = hints[part]
        elif typing.get_origin(hint) is dict:
            if walked == "model.stages" and part not in stage_names:
                # OmegaConf cannot add an entry to a typed dict from the command line.
                return None, (
                    f"the model has no stage {part!r}{did_you_mean(part, stage_names)}; its stages: "
                    f"{', '.join(stage_names) or 'none'} (a new stage is added in the model file; "
                    "an override cannot add one)"
                )
            hint = typing.get_args(hint)[1]
        else:
            return (
                None,
                f"{walked} is a {_type_name(hint)}, not a group of keys: {'.'.join(parts[i:])} is not under it",
            )
        walked = _join(walked, part)
    return hint, None


def _override_value_problem(value: Any, hint: Any) -> str | None:
    hint, optional = unwrap_optional(hint)
    if optional and value is None:
        return None
    if dataclasses.is_dataclass(hint) or typing.get_origin(hint) is dict:
        if isinstance(value, dict):
            node = yaml.representer.SafeRepresenter().represent_data(value)
            checker = _Checker("", frozenset())
            checker.check(node, hint, "")
            return (
                "; ".join(f"{f.key}: {f.problem}" if f.key else f.problem for f in checker.findings) or None
            )
        return f"expected a group of keys ({{key: value, ...}}), got {value!r}"
    if typing.get_origin(hint) is list:
        if not isinstance(value, list):
            return f"expected a list such as [a,b], got {value!r}"
        item = typing.get_args(hint)[0]
        problems = [p for p in (value_problem(v, item, False) for v in value) if p]
        return "; ".join(problems) or None
    return value_problem(value, hint, optional)


# -- Shared rules -------------------------------------------------------------------------------


def value_problem(value: Any, hint: Any, optional: bool) -> str | None:
    """Why ``value`` (as YAML or Hydra's parser read it) cannot be a ``hint``, or None."""
    orelse = " (or null)" if optional else ""
    if isinstance(hint, type) and issubclass(hint, Enum):
        choices = [str(member.value) for member in hint]
        return _choice_problem(value, choices, "value")
    if hint is bool:
        return None if isinstance(value, bool) else f"{_shown(value)} is not true or false{orelse}"
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else f"{_shown(value)} is not a whole number{orelse}"
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        # YAML 1.1 reads 1e-3 (no dot) as text; OmegaConf converts it, and so it is a number here.
        ok = ok or (isinstance(value, str) and _is_float_text(value))
        return None if ok else f"{_shown(value)} is not a number{orelse}"
    if hint is str:
        if isinstance(value, str):
            return None
        return f"{_shown(value)} is {_a_kind(value)}, not text{orelse}: quote it if text is meant"
    return None


def _is_float_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def unknown_key_problem(name: str, hints: dict[str, Any], cls: type, under: str = "") -> str:
    keys = ", ".join(hints)
    here = f" under {under}" if under else f" in {cls.__name__}"
    return f"no such key{here}{did_you_mean(name, hints)}; the keys are: {keys} (omnigen/schema.py documents them)"


def _choice_problem(value: Any, choices: Sequence[str], what: str) -> str | None:
    if isinstance(value, str) and value in choices:
        return None
    return f"{what} {_shown(value)} is not one of: {', '.join(choices)}{did_you_mean(str(value), choices)}"


def _shown(value: Any) -> str:
    """A value as the user wrote it in YAML: true, null, 3, 'text'."""
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else repr(value)


def _a_kind(value: Any) -> str:
    kind = {bool: "true/false", int: "a whole number", float: "a number", list: "a list", dict: "a mapping"}
    return kind.get(type(value), f"a {type(value).__name__}")


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """``Optional[X]`` -> (X, True); any other hint -> (hint, False)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return hint, False


def _is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null"


def _yaml_kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return f"the value {node.value!r}" if node.value else "nothing"


def _type_name(hint: Any) -> str:
    hint, _ = unwrap_optional(hint)
    return getattr(hint, "__name__", str(hint))


def _doc_hint(cls: type, name: str) -> str:
    return f"omnigen/schema.py: {cls.__name__}.{name}"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
