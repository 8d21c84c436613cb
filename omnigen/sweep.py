"""A sweep people can read: one line per cell and a CSV of cells x decisions.

Hydra's multirun runs the cells (``hydra_app.build_task`` each); every cell is recorded here,
and when Hydra is done ``finish`` prints one line per cell (``ok`` with the decisions that differ
between the sweep's cells, or ``failed`` with the message), writes ``DIR/omnigen-sweep.csv`` and
returns how many cells failed (the exit status).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import re
from pathlib import Path

import click

from omnigen import variants

log = logging.getLogger("omnigen.sweep")

CSV_NAME = "omnigen-sweep.csv"
_MAX_EXIT = 100  # an exit status above 255 would wrap; more failures than this still say "many"


@dataclasses.dataclass
class Cell:
    name: str
    overrides: list[str]
    ok: bool = False
    message: str = ""
    root: Path | None = None
    package: str = ""


@dataclasses.dataclass
class _State:
    cells: list[Cell] = dataclasses.field(default_factory=list)
    into_package: bool = False
    sweep_root: Path | None = None


_state = _State()


def start(*, into_package: bool = False) -> None:
    _state.cells = []
    _state.into_package = into_package


def into_package() -> bool:
    return _state.into_package


def record(cell: Cell, *, multirun: bool) -> None:
    _state.cells.append(cell)
    if multirun:
        log.info("omnigen: cell %d %s: %s", len(_state.cells), cell.name, "ok" if cell.ok else "failed")


def cell_folder(override_dirname: str) -> str:
    """A cell's folder, also a package name: ``graph=eager,model=qwen3_tts`` -> ``graph_eager__model_qwen3_tts``."""
    name = "__".join(re.sub(r"\W", "_", part) for part in override_dirname.split(",")) or "default"
    return name if name[0].isalpha() else f"cell_{name}"


def set_sweep_root(root: Path) -> None:
    _state.sweep_root = root


def finish(*, multirun: bool) -> int:
    """After a sweep: its summary and CSV, and how many cells failed (a single build: 0)."""
    cells, root = _state.cells, _state.sweep_root
    _state.cells, _state.sweep_root = [], None
    if not multirun:
        return 0
    decisions = {c.name: variants.plan_decisions(c.root) if c.ok and c.root else {} for c in cells}
    differing = _differing(decisions)
    for cell in cells:
        if cell.ok:
            found = decisions[cell.name]
            shown = ", ".join(f"{k}={_value(found[k])}" for k in differing if k in found)
            click.echo(f"ok      {cell.name}  ({cell.package})" + (f"  {shown}" if shown else ""))
        else:
            first, *rest = cell.message.splitlines() or [""]
            click.echo(f"failed  {cell.name}  {first}")
            for line in rest:
                click.echo(f"          {line}")
    failed = sum(not c.ok for c in cells)
    summary = f"{len(cells) - failed} ok, {failed} failed"
    if root is not None and cells:
        table = root / CSV_NAME
        try:
            table.write_text(_csv(cells, decisions), encoding="utf-8")
            summary += f"; cells x decisions: {table}"
        except OSError as exc:
            log.error("omnigen: cannot write %s: %s", table, exc.strerror or exc)
    click.echo(summary)
    return min(failed, _MAX_EXIT)


def _differing(decisions: dict[str, dict[str, dict]]) -> list[str]:
    """The decisions whose value is not the same in every cell that has them."""
    keys = sorted({k for found in decisions.values() for k in found})
    return [k for k in keys if len({repr(f[k]["value"]) for f in decisions.values() if k in f}) > 1]


def _value(decision: dict) -> str:
    value = decision["value"]
    if isinstance(value, list | dict):
        return json.dumps(value, sort_keys=True)
    if isinstance(value, bool):
        return str(value).lower()
    return "-" if value is None else str(value)


def _csv(cells: list[Cell], decisions: dict[str, dict[str, dict]]) -> str:
    keys = sorted({k for found in decisions.values() for k in found})
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["cell", "overrides", "status", "package", "message", *keys])
    for cell in cells:
        found = decisions[cell.name]
        writer.writerow(
            [
                cell.name,
                " ".join(cell.overrides),
                "ok" if cell.ok else "failed",
                cell.package,
                cell.message.splitlines()[0] if cell.message else "",
                *[_value(found[k]) if k in found else "" for k in keys],
            ]
        )
    return buffer.getvalue()
