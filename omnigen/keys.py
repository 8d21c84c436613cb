"""Every config key from ``schema.py``: its type, default, choices and docstring.

``omnigen explain --keys`` prints them, ``omnigen new model NAME`` writes them as a commented
starting config; both read the dataclasses and ``schema.field_docs()``, so a key added to the
schema is documented everywhere at once.
"""

from __future__ import annotations

import dataclasses
import typing
from enum import Enum
from typing import Any

from omegaconf import MISSING

from omnigen import schema
from omnigen.shape import unwrap_optional


@dataclasses.dataclass(frozen=True)
class Key:
    path: str
    """Dotted, with ``STAGE`` (or ``NAME``) where a dict's key goes: ``model.stages.STAGE.mtp.graph``."""
    type: str
    default: Any
    """``MISSING`` (``???``) for a key that must be set."""
    choices: tuple[str, ...]
    doc: str
    required: bool

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.path,
            "type": self.type,
            "default": "???" if self.required else self.default,
            "required": self.required,
            "choices": list(self.choices),
            "doc": self.doc,
        }


def _type_name(hint: Any) -> str:
    inner, optional = unwrap_optional(hint)
    origin = typing.get_origin(inner)
    if origin in (list, typing.List):  # noqa: UP006 - the schema spells List for OmegaConf
        name = f"list[{_type_name(typing.get_args(inner)[0])}]"
    elif origin in (dict, typing.Dict):  # noqa: UP006
        key, value = typing.get_args(inner)
        name = f"dict[{_type_name(key)}, {_type_name(value)}]"
    elif isinstance(inner, type) and issubclass(inner, Enum):
        name = "enum"
    elif inner is Any:
        name = "any"
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} | null" if optional else name


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return MISSING
    if isinstance(value, Enum):
        return value.value
    if dataclasses.is_dataclass(value):
        return None
    return value


_DICT_KEY_NAMES = {
    ("ModelConf", "stages"): "STAGE",
    ("ServeConf", "models"): "STAGE",
    ("ServeConf", "stage_engine"): "STAGE",
}


def schema_keys(root: type = schema.OmniGenConfig, prefix: str = "") -> list[Key]:
    """Every key under ``root`` in the schema's order, sections before what they hold."""
    docs = schema.field_docs()
    hints = typing.get_type_hints(root)
    keys: list[Key] = []
    for field in dataclasses.fields(root):
        hint = hints[field.name]
        inner, _ = unwrap_optional(hint)
        path = f"{prefix}{field.name}"
        doc = docs.get(root.__name__, {}).get(field.name, "")
        choices = tuple(m.value for m in inner) if isinstance(inner, type) and issubclass(inner, Enum) else ()
        if dataclasses.is_dataclass(inner):
            keys.append(Key(path, "section", None, (), doc, False))
            keys += schema_keys(inner, f"{path}.")
            continue
        if typing.get_origin(inner) in (dict, typing.Dict):  # noqa: UP006
            value_hint = typing.get_args(inner)[1]
            if dataclasses.is_dataclass(value_hint):
                name = _DICT_KEY_NAMES.get((root.__name__, field.name), "NAME")
                keys.append(Key(path, f"dict[str, {value_hint.__name__}]", {}, (), doc, False))
                keys += schema_keys(value_hint, f"{path}.{name}.")
                continue
        default = _default(field)
        keys.append(Key(path, _type_name(hint), default, choices, doc, default is MISSING))
    return keys
