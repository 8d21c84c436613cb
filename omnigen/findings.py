"""What is wrong with a config, where, and how to fix it: one ``Finding`` per problem (issue 9).

The shape check (``shape.py``) and the semantic check (``spec.py``) both report ``Finding``s, and
every one reaches the user in one report, each naming the file read, or the override that caused it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Finding:
    """One problem: where (``file:line:col``, the file, or an override), the dotted key, the fix."""

    where: str
    key: str
    problem: str

    def __str__(self) -> str:
        text = (
            f"{self.where}: {shown_key(self.key)}: {self.problem}"
            if self.key
            else f"{self.where}: {self.problem}"
        )
        # One finding is one line, whatever text of the config it quotes.
        return " ".join(text.splitlines())


def shown_key(key: str) -> str:
    """A dotted key as written, or quoted with escapes where it holds space or control characters."""
    plain = key.isprintable() and not any(ch.isspace() for ch in key)
    return key if plain and "'" not in key else repr(key)


def report(findings: Sequence[Finding]) -> str:
    """One finding on its line; several under a heading, one per line, in the order found."""
    if len(findings) == 1:
        return str(findings[0])
    return f"{len(findings)} problems in the config:\n" + "\n".join(f"  {f}" for f in findings)


def blame_overrides(
    findings: Iterable[Finding], overrides: Sequence[tuple[str, str]], source: str
) -> list[Finding]:
    """Name the override behind each finding whose key it set (or set a key under, or above).

    ``overrides`` are ``(dotted key under model., the override as typed)``; ``source`` the model file.
    """
    blamed = []
    for finding in findings:
        culprit = next((text for key, text in overrides if _related(key, finding.key)), None)
        if culprit is not None:
            finding = replace(finding, where=f"override {culprit!r} (on {source})")
        blamed.append(finding)
    return blamed


def _related(a: str, b: str) -> bool:
    return bool(a and b) and (a == b or _under(a, b) or _under(b, a))


def _under(key: str, parent: str) -> bool:
    """``key`` is a key or list item inside ``parent`` (``a.b.c`` and ``a.b[0]`` are inside ``a.b``)."""
    return key.startswith((f"{parent}.", f"{parent}["))
