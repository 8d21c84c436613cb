"""``omnigen``: build, check and explain the generated runners.

omnigen build                          every model of conf/model into generated/
omnigen build model=NAME [overrides]   one model (Hydra: overrides, --multirun, --cfg job, --help)
omnigen check                          generated/ matches conf/ and templates/ (never writes)
omnigen explain model=NAME [overrides] the model's stages and every decision with its reason
omnigen run model=NAME [serve.*=...]   every stage in order on one prompt; writes the audio (WAV)
omnigen serve model=NAME [serve.*=...] the whole pipeline behind an HTTP API (/v1/audio/speech)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from omnigen import paths, pipeline, render
from omnigen.plan import CLAUSES, ModelPlan

USAGE = __doc__ or ""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE.strip())
        print(f"\nmodels: {', '.join(paths.model_names())}")
        return 0
    command, rest = args[0], args[1:]
    try:
        if command == "build":
            return build_command(rest)
        if command == "check":
            return check_command(rest)
        if command == "explain":
            return explain_command(rest)
        if command in ("run", "serve"):
            return pipeline_command(command, rest)
    except pipeline.ConfigError as exc:
        print(f"omnigen {command}: {exc}", file=sys.stderr)
        return 2
    except render.RenderError as exc:
        print(f"omnigen {command}: {exc}", file=sys.stderr)
        return 3
    except render.OutputFolderError as exc:
        print(f"omnigen {command}: {exc}", file=sys.stderr)
        return 2
    print(f"omnigen: unknown command {command!r}; run `omnigen --help`", file=sys.stderr)
    return 2


# -- build ------------------------------------------------------------------------------------------


BUILD_HELP = """omnigen build: generate the runner and worker classes of a model from conf/model/NAME.yaml

usage:
  omnigen build                               every model into generated/
  omnigen build model=NAME [key=value ...]    one model into generated/ (or out=DIR)
  omnigen build -m model=A,B key=x,y out=DIR  a sweep: one folder per cell under DIR
  omnigen build model=NAME --cfg job          print the composed config, build nothing

models (model=NAME): {models}
devices (device=NAME): auto, cuda, cpu
MTP graph presets (graph=NAME): as_configured, eager, full

Any config key can be overridden, e.g. model.stages.talker.mtp.graph=unsafe; the keys, their
allowed values and what they mean are in omnigen/schema.py (omnigen explain shows the decisions).
Hydra's own options: omnigen build --hydra-help"""


def build_command(args: list[str]) -> int:
    if not args:
        return build_all(paths.generated_dir())
    if args[0] in ("-h", "--help"):
        print(BUILD_HELP.format(models=", ".join(paths.model_names())))
        return 0
    model, overrides = _split_model(args)
    hydra_flags = {"-m", "--multirun", "--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i"}
    if model is not None and not hydra_flags.intersection(args) and "," not in model:
        # One model, one run: compose here first so a bad config gets omnigen's message
        # (file, key, fix) instead of Hydra's; then Hydra runs the task as usual.
        pipeline.model_plan(model, [o for o in overrides if not o.startswith(("out=", "hydra"))])
    elif model is not None:
        # A sweep or a Hydra flag: Hydra composes each cell itself, so each model it names is
        # checked here first with the overrides, as a single run's would be; the overrides are
        # those Hydra's own argument parser finds (a flag's value is not one).
        from hydra._internal.utils import get_args_parser

        hydra_overrides = [
            o for o in get_args_parser().parse_args(args).overrides if not o.startswith("model=")
        ]
        for name in model.split(","):
            pipeline.check_model_name(name, hydra_overrides, sweeps_allowed=True)
    from omnigen import hydra_app

    return hydra_app.run(args)


def _split_model(args: list[str]) -> tuple[str | None, list[str]]:
    model = None
    rest = []
    for arg in args:
        if arg.startswith("model="):
            model = arg.split("=", 1)[1]
        elif not arg.startswith("-"):
            rest.append(arg)
    return model, rest


def build_all(root: Path) -> int:
    files = pipeline.all_files()
    report = render.write_tree(root, files, scope=None)
    _print_report(report, root)
    return 0


def build_model(plan: ModelPlan, overrides: Sequence[str], root: Path, *, include_package_init: bool) -> None:
    """Render one model and write it under ``root``; remove its stale files and configless models."""
    files = pipeline.model_files(plan, overrides, package_init=include_package_init)
    known = set(paths.model_names())
    configless = (
        [p.name for p in root.iterdir() if p.is_dir() and p.name not in known] if root.is_dir() else []
    )
    report = render.write_tree(root, files, scope=[plan.name, *configless])
    _print_report(report, root)


def _print_report(report: render.TreeReport, root: Path) -> None:
    print(
        f"omnigen: {len(report.written)} written, {len(report.unchanged)} unchanged, "
        f"{len(report.removed)} removed under {_display(root)}"
    )
    for rel in report.written:
        print(f"  wrote   {rel}")
    for rel in report.removed:
        print(f"  removed {rel}")


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve())) or "."
    except ValueError:
        return str(path)


# -- check ------------------------------------------------------------------------------------------


def check_command(args: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="omnigen check", description="Compare generated/ with conf/ and templates/."
    )
    parser.add_argument(
        "--root", type=Path, default=None, help="tree to check (default: the package's generated/)"
    )
    ns = parser.parse_args(args)
    root = ns.root or paths.generated_dir()
    report = render.check_tree(root, pipeline.all_files())
    if report.ok:
        print(f"omnigen check: {_display(root)} is up to date")
        return 0
    models: set[str] = set()
    for rel in report.missing:
        print(f"missing:  generated/{rel}")
        models.add(rel.split("/", 1)[0])
    for rel, diff in report.stale.items():
        print(f"stale:    generated/{rel}")
        print(diff, end="" if diff.endswith("\n") else "\n")
        models.add(rel.split("/", 1)[0])
    for rel in report.orphaned:
        print(f"orphaned: generated/{rel}")
    for rel in report.interrupted:
        print(f"interrupted build: generated/{rel} (a build was killed; the next build finishes it)")
    print("fix: omnigen build   (regenerates every model; removes orphaned files)")
    for model in sorted(m for m in models if m in paths.model_names()):
        print(f"     or omnigen build model={model}")
    return 1


# -- run and serve ----------------------------------------------------------------------------------

# Overrides that change the generated runners, which the pipeline composes again; the rest
# (serve.*) only say how to run them.
_RUNNER_OVERRIDES = ("model.", "+model.", "~model.", "device=", "graph=", "mtp_graph=")


def pipeline_command(command: str, args: list[str]) -> int:
    """``omnigen run`` / ``omnigen serve``: compose, check, start one engine per stage."""
    import logging

    from omnigen.serving.pipeline import Pipeline, PipelineError
    from omnigen.serving.settings import SettingsError, prompt_of, read_settings, sampling_of

    model, overrides = _split_model(args)
    if model is None:
        print(
            f"omnigen {command}: say which model: omnigen {command} model=NAME [serve.KEY=VALUE ...]",
            file=sys.stderr,
        )
        print(f"models: {', '.join(paths.model_names())}", file=sys.stderr)
        return 2
    cfg = pipeline.compose_config(model, overrides)
    plan = pipeline.plan_from_config(cfg, model, overrides)
    try:
        settings = read_settings(cfg, plan)
    except SettingsError as exc:
        print(f"omnigen {command}: {exc}", file=sys.stderr)
        return 2
    if command == "serve" and settings.mode != "mp":
        print(
            "omnigen serve: serves requests concurrently with one engine per process: set serve.mode=mp",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    runner_overrides = [o for o in overrides if o.startswith(_RUNNER_OVERRIDES)]
    try:
        pipe = Pipeline.from_model(
            model,
            settings.stage_models,
            mode=settings.mode,
            engine_kwargs=settings.engine_kwargs,
            overrides=runner_overrides,
        )
    except ValueError as exc:
        print(f"omnigen {command}: {exc}", file=sys.stderr)
        return 2
    with pipe:
        if command == "serve":
            from omnigen.serving.http import serve

            serve(pipe, settings)
            return 0
        try:
            prompt = prompt_of(settings, settings.prompt, settings.prompt_token_ids)
            (out,) = pipe.generate([prompt], sampling_of(settings, plan, settings.seed))
        except (PipelineError, SettingsError) as exc:
            print(f"omnigen run: {exc}", file=sys.stderr)
            return 1
    for stage, text in out.text.items():
        print(f"{stage}: {text}")
    if out.audio is not None:
        from omnigen.serving.audio import wav_bytes

        Path(settings.output).write_bytes(wav_bytes(out.audio, settings.sample_rate))
        seconds = out.audio.numel() / settings.sample_rate
        print(f"omnigen run: wrote {settings.output} ({seconds:.3f} s of audio at {settings.sample_rate} Hz)")
    print("per stage: " + ", ".join(f"{stage} {s:.3f} s" for stage, s in out.seconds.items()))
    return 0


# -- explain ----------------------------------------------------------------------------------------


def explain_command(args: list[str]) -> int:
    model, overrides = _split_model(args)
    if model is None:
        print("omnigen explain: say which model: omnigen explain model=NAME [overrides]", file=sys.stderr)
        print(f"models: {', '.join(paths.model_names())}", file=sys.stderr)
        return 2
    print(explain_text(pipeline.model_plan(model, overrides)))
    return 0


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=False)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def explain_text(plan: ModelPlan) -> str:
    out = [
        f"{plan.title} ({plan.name}) from {plan.source}",
        f"arch {plan.arch}; async_chunk={str(plan.async_chunk).lower()}; device={plan.device}",
        "",
        _table(
            ["#", "stage", "kind", "runner", "worker"],
            [[str(i), s.stage, s.kind, s.runner_class, s.worker_class] for i, s in enumerate(plan.stages)],
        ),
        "",
        "Stage graph (each edge: the glue function that makes the next request, the payload's transport):",
        *_stage_graph(plan),
        "",
        "Serve each stage with its generated worker and omnigen's scheduler (the output channel, 8.1):",
        *[f"  {s.stage}: {s.serve_command}" for s in plan.stages],
        f"Or the whole pipeline: omnigen run model={plan.name} ... / omnigen serve model={plan.name} ...",
        "",
        "Decisions:",
        _table(
            ["stage", "decision", "value", "reason", "config keys"],
            [
                [s.stage, d.name, _value(d.value), d.reason, ", ".join(d.keys)]
                for s in plan.stages
                for d in s.decisions
            ],
        ),
        "",
        "Contract clauses per stage:",
        _table(
            ["stage", "clauses"],
            [[s.stage, " ".join(s.clauses)] for s in plan.stages],
        ),
        "",
        "Clause legend: " + "; ".join(f"{k} {v}" for k, v in CLAUSES.items()),
    ]
    return "\n".join(out)


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


def _value(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "-"
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
