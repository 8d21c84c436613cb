"""A model config file read before Hydra sees it: bytes, YAML syntax, shape (issue 9).

Hydra and OmegaConf load YAML with PyYAML and let its errors escape as tracebacks; an alias bomb
(nested anchors) makes them expand for as long as memory lasts. A model config is the one file a
user writes, so it is read here first, as YAML's own safe loader reads it but with anchors and
aliases refused (no omnigen config needs them), duplicate keys refused and nesting bounded, and
every problem is reported as ``conf/model/x.yaml:LINE:COL: what is wrong; how to fix it``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 256 * 1024
MAX_DEPTH = 16


# Byte-order marks of the encodings an editor may save in; UTF-32's first, as UTF-16's is its prefix.
_WIDE_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)


class ConfigFileError(ValueError):
    """A model config file that is not a YAML mapping omnigen can read."""


def read_model_file(path: Path, shown_as: str) -> yaml.Node | None:
    """The file's YAML node tree (``None`` for an empty file), with every node's line and column.

    Raises ``ConfigFileError`` naming ``shown_as``, line and column for any unreadable content.
    """
    data = path.read_bytes()
    if len(data) > MAX_BYTES:
        raise ConfigFileError(
            f"{shown_as}: {len(data)} bytes; a model config is at most {MAX_BYTES} bytes: remove what it "
            "does not need"
        )
    for bom, encoding in _WIDE_BOMS:
        if data.startswith(bom):
            raise ConfigFileError(
                f"{shown_as}: the file is {encoding}; a config is UTF-8 text: save it as UTF-8"
            )
    if b"\0" in data:
        line, column = _position(data, data.index(b"\0"))
        raise ConfigFileError(f"{shown_as}:{line}:{column}: a NUL byte; a config is UTF-8 text: remove it")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, column = _position(data, exc.start)
        raise ConfigFileError(
            f"{shown_as}:{line}:{column}: byte 0x{data[exc.start]:02x} is not UTF-8; save the file as UTF-8"
        ) from exc
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        # Constructing the document finds duplicate keys; the node tree is what is checked next.
        document = None if node is None else loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{shown_as}:{mark.line + 1}:{mark.column + 1}" if mark else shown_as
        problem = " ".join(str(part) for part in (exc.context, exc.problem) if part)
        raise ConfigFileError(f"{where}: {problem}; fix the YAML there") from exc
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"{shown_as}: {exc}; fix the YAML") from exc
    finally:
        loader.dispose()
    if document is not None and not isinstance(document, dict):
        raise ConfigFileError(
            f"{shown_as}: the file holds a {type(document).__name__}, not a mapping of keys "
            "(name:, title:, arch:, stages:, ...)"
        )
    return node


def _position(data: bytes, offset: int) -> tuple[int, int]:
    """1-based line and column of byte ``offset``."""
    before = data[:offset]
    return before.count(b"\n") + 1, offset - (before.rfind(b"\n") + 1) + 1


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader without anchors or aliases, duplicate keys or deep nesting."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent) or getattr(self.peek_event(), "anchor", None):
            event = self.peek_event()
            raise yaml.constructor.ConstructorError(
                None,
                None,
                "anchors and aliases are not allowed in an omnigen config: write the values out",
                event.start_mark,
            )
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.constructor.ConstructorError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"key {key!r} appears twice (first at line {seen[key].line + 1}); keep one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)
