"""``omnigen explain``: a model's stages, graph, serve lines, decisions and clauses; ``--keys``.

Tables are Rich's, wrapped to the terminal's width when stdout is a terminal (or to ``--width``);
written to a pipe or a file they are not wrapped, one row a line, so ``grep`` finds a whole reason.
``--format json`` gives the same facts as data.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from omnigen import keys
from omnigen.plan import CLAUSES, ModelPlan

_UNWRAPPED = 100_000


def width() -> int:
    """The terminal's width (``COLUMNS`` overrides it, as everywhere); no limit for a pipe or a file."""
    if not sys.stdout.isatty():
        return _UNWRAPPED
    return shutil.get_terminal_size().columns


def table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], *, columns: int | None = None, whole: int = 1
) -> str:
    """A plain-text table; cells wrap (at word boundaries) so that no line exceeds ``columns``.

    The first ``whole`` columns (names, keys) are never broken; the others wrap.
    """
    columns = columns or width()
    grid = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, safe_box=True, header_style="")
    for i, header in enumerate(headers):
        # The prose column (reasons, meanings) gets the most room when the table must wrap.
        ratio = 3 if i == len(headers) - 1 else 1
        grid.add_column(
            header, overflow="fold", no_wrap=i < whole, ratio=ratio if columns < _UNWRAPPED else None
        )
    for row in rows:
        grid.add_row(*[str(c) for c in row])
    buffer = io.StringIO()
    Console(file=buffer, width=columns, color_system=None, highlight=False, emoji=False, markup=False).print(
        grid, crop=False
    )
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


def explain_text(plan: ModelPlan, *, columns: int | None = None) -> str:
    out = [
        f"{plan.title} ({plan.name}) from {plan.source}",
        *_wrapped(
            f"arch {plan.arch}; async_chunk={str(plan.async_chunk).lower()}; device={plan.device}; "
            f"package {plan.package}",
            columns,
        ),
        "",
        table(
            ["#", "stage", "kind", "runner", "worker"],
            [[str(i), s.stage, s.kind, s.runner_class, s.worker_class] for i, s in enumerate(plan.stages)],
            columns=columns,
        ),
        "",
        *_wrapped(
            "Model Runner V2 targets (<stage>_v2.py, beside each V1 runner; the worker builds one where "
            "vllm_api.runner_target says V2: vLLM without its V1 runner, or vLLM that chose V2 and has "
            "every seam the target uses):",
            columns,
        ),
        table(
            ["stage", "model state", "V2 runner", "state hooks", "full graphs", "jit warm-up", "rope"],
            [
                [
                    s.stage,
                    s.v2.state_class,
                    s.v2.runner_class,
                    " ".join(s.v2.state_hooks),
                    s.v2.full_graph,
                    "on" if s.v2.jit_warmup else "off",
                    s.v2.rope_state,
                ]
                for s in plan.stages
                if s.v2 is not None
            ],
            columns=columns,
        ),
        "",
        *_wrapped(
            "Stage graph (each edge: the glue function that makes the next request, the payload's transport):",
            columns,
        ),
        *_stage_graph(plan),
        "",
        *_wrapped(
            "Serve each stage with its generated worker and omnigen's scheduler (the output channel, 8.1):",
            columns,
        ),
        *[f"  {s.stage}: {s.serve_command}" for s in plan.stages],
        *_wrapped(
            f"Or the whole pipeline: omnigen run model={plan.name} ... / omnigen serve model={plan.name} ...",
            columns,
        ),
        "",
        "Decisions:",
        table(
            ["stage", "decision", "value", "config keys", "reason"],
            [
                [s.stage, d.name, _value(d.value), ", ".join(d.keys), d.reason]
                for s in plan.stages
                for d in s.decisions
            ],
            columns=columns,
            whole=2,
        ),
        "",
        *_wrapped(
            "Contract clauses per stage (each target carries every clause of its stage: V1 on the runner's "
            "methods, V2 on the seams docs/model-runner-v2.md maps them to):",
            columns,
        ),
        table(
            ["stage", "target", "clauses"],
            [[s.stage, target, " ".join(s.clauses)] for s in plan.stages for target in ("v1", "v2")],
            columns=columns,
        ),
        "",
        *_wrapped("Clause legend: " + "; ".join(f"{k} {v}" for k, v in CLAUSES.items()), columns),
    ]
    return "\n".join(out)


def _wrapped(text: str, columns: int | None) -> list[str]:
    columns = columns or width()
    return [text] if columns >= _UNWRAPPED else textwrap.wrap(text, columns, subsequent_indent="  ")


def explain_json(plan: ModelPlan) -> str:
    data = plan.as_dict()
    data["package"] = plan.package
    for stage in plan.stages:
        data["stages"][stage.stage]["targets"] = {
            "v1": {"module": stage.module, "runner_class": stage.runner_class},
            "v2": {
                "module": stage.v2_module,
                "state_class": stage.v2.state_class,
                "runner_class": stage.v2.runner_class,
            }
            if stage.v2
            else None,
        }
    data["stage_graph"] = _stage_graph(plan)
    return json.dumps(data, indent=2, default=str)


def keys_text(*, columns: int | None = None) -> str:
    rows = [
        [k.path, k.type, "???" if k.required else _value(k.default), " | ".join(k.choices), k.doc]
        for k in keys.schema_keys()
    ]
    return table(["key", "type", "default", "choices", "what it means"], rows, columns=columns, whole=1)


def keys_json() -> str:
    return json.dumps([k.as_dict() for k in keys.schema_keys()], indent=2, default=str)


def _stage_graph(plan: ModelPlan) -> list[str]:
    lines = []
    for stage, following in zip(plan.stages, plan.stages[1:], strict=False):
        if stage.next_stage_input:
            glue = stage.next_stage_input
        elif following.input_function:
            glue = f"{following.input_function} (the consumer's input_function)"
        else:
            lines.append(
                f"  {stage.stage} -- (no glue: the next stage gets no request from it) -- {following.stage}"
            )
            continue
        lines.append(f"  {stage.stage} --[{glue}, {stage.transport}]--> {following.stage}")
    for stage in plan.stages[:-1]:
        if stage.final_output != "none":
            lines.append(f"  {stage.stage} --> caller ({stage.final_output}, besides feeding the next stage)")
    last = plan.stages[-1]
    published = "every key" if last.published_keys is None else ", ".join(last.published_keys) or "nothing"
    lines.append(f"  {last.stage} --> caller ({last.final_output}; publishes {published})")
    return lines


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "-"
    if isinstance(value, list | tuple | dict) and not value:
        return "[]" if not isinstance(value, dict) else "{}"
    return str(value)
