"""``omnigen``: the command line, on Click, with Hydra behind ``build``.

omnigen build [HYDRA FLAGS] [model=NAME] [OVERRIDES]  every model, one model, or a sweep (-m)
omnigen check [--root DIR]                           a tree == what conf/ and templates/ make?
omnigen diff A [B]                                   two built trees or cells, decision by decision
omnigen explain model=NAME [OVERRIDES] | --keys      stages, serve lines, decisions; every key
omnigen new model NAME                               a documented starting config of your own
omnigen run / serve model=NAME [serve.KEY=VALUE]     a whole pipeline on one prompt / over HTTP
omnigen completion bash|zsh                          the tab-completion script
"""

from __future__ import annotations

import errno
import importlib.metadata
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import click

from omnigen import completion, logs, paths, pipeline, render, shape, variants

log = logging.getLogger("omnigen")


def _prepare_engine_process() -> None:
    """In a process that ``omnigen run``/``serve`` spawned for an engine (``OMNIGEN_MODELS`` set),
    register the model's declared classes as this module is imported. On CPU vLLM starts engine
    cores with ``spawn``; the child imports the parent's main module (this one) and only then
    unpickles its ``VllmConfig``, whose ``hf_config`` may be a provider's class (vllm-omni's
    ``Qwen3TTSConfig``). Unpickled first, that class imports vllm-omni as a package (its
    ``patch.py`` runs) and omnigen's plugin then refuses the process (``ProviderPatchedVllm``)."""
    import multiprocessing

    # A spawned child is named before it imports this module ("MainProcess" is every other).
    if multiprocessing.current_process().name != "MainProcess" and os.environ.get("OMNIGEN_MODELS"):
        from omnigen import models

        models.register_from_env()


_prepare_engine_process()


def _models_and_groups(formatter: click.HelpFormatter) -> None:
    rows = [("model=NAME", ", ".join(paths.model_names()))]
    rows += [(f"{g}=OPTION", ", ".join(paths.group_options(g))) for g in shape.GROUPS if g != "model"]
    rows.append(
        ("KEY=VALUE", "any config key, e.g. model.stages.talker.mtp.graph=unsafe (omnigen explain --keys)")
    )
    with formatter.section("Models and config groups"):
        formatter.write_dl(rows)


class _WithModels(click.Command):
    """A command whose help ends with the models and config groups on the search path."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_epilog(ctx, formatter)
        _models_and_groups(formatter)


class _GroupWithModels(click.Group):
    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_epilog(ctx, formatter)
        _models_and_groups(formatter)


def _set_quiet(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if value:
        ctx.ensure_object(dict)["quiet"] = True
    return value


def _quiet(ctx: click.Context) -> bool:
    root = ctx.find_root()
    return bool((root.obj or {}).get("quiet")) or bool((ctx.obj or {}).get("quiet"))


quiet_option = click.option(
    "-q", "--quiet", is_flag=True, expose_value=False, callback=_set_quiet, help="Only warnings and errors."
)


def _complete_overrides(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[str]:
    words = list(ctx.params.get("overrides") or ())
    config_dirs = [d for d in (ctx.params.get("config_dir"),) if d]
    found = completion.complete_overrides(
        config_dirs, words, incomplete, multirun=bool(ctx.params.get("multirun"))
    )
    return found


overrides_argument = click.argument(
    "overrides", nargs=-1, type=click.UNPROCESSED, shell_complete=_complete_overrides
)


@click.group(
    cls=_GroupWithModels, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@click.version_option(importlib.metadata.version("omnigen"), "--version", "-V", prog_name="omnigen")
@quiet_option
@click.option("-v", "--verbose", is_flag=True, help="Debug messages too.")
@click.pass_context
def app(ctx: click.Context, verbose: bool) -> None:
    """Hydra configs -> one generated vLLM runner class per model and stage.

    Overrides are Hydra's (key=value, +key=value, ~key, -m for sweeps); `omnigen COMMAND --help`
    lists each command's options, the models and the config groups.
    """
    ctx.ensure_object(dict)["verbose"] = verbose
    logs.configure(quiet=_quiet(ctx), verbose=verbose)


# -- build ------------------------------------------------------------------------------------------


def _hydra_options(command):
    """Hydra's own flags, read from Hydra's argument parser (names, choices, help)."""
    from hydra._internal.utils import get_args_parser

    own_help = {
        "shell_completion": "Hydra's -sc: `-sc install=bash|zsh` prints omnigen's completion script "
        "(the same as `omnigen completion SHELL`).",
        "config_path": "Hydra's primary config folder instead of omnigen's conf/ (a relative path is "
        "taken from the working directory).",
        "config_dir": "A folder of configs of your own (DIR/model/NAME.yaml, ...) added to the search path.",
    }
    for action in reversed(get_args_parser()._actions):
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        names = sorted(action.option_strings, key=len, reverse=True)
        help_text = own_help.get(action.dest, str(action.help).split("\n")[0])
        if action.nargs == 0:
            option = click.option(*names, action.dest, is_flag=True, help=help_text)
        elif action.nargs == "?":
            option = click.option(
                *names,
                action.dest,
                type=click.Choice(action.choices),
                is_flag=False,
                flag_value=action.const,
                default=None,
                help=help_text,
            )
        else:
            kind = (
                click.Choice(action.choices)
                if action.choices
                else click.Path()
                if action.dest in ("config_path", "config_dir")
                else str
            )
            option = click.option(*names, action.dest, type=kind, default=None, help=help_text)
        command = option(command)
    return command


def _hydra_argv(options: dict[str, object]) -> list[str]:
    """The Hydra flags given, back as Hydra's argument parser reads them."""
    from hydra._internal.utils import get_args_parser

    argv: list[str] = []
    for action in get_args_parser()._actions:
        value = options.get(action.dest)
        if not action.option_strings or value in (None, False):
            continue
        flag = max(action.option_strings, key=len)
        if action.dest in ("config_path", "config_dir"):
            value = os.path.abspath(str(value))
        argv += (
            [flag] if value is True else [f"{flag}={value}"] if action.nargs == "?" else [flag, str(value)]
        )
    return argv


@app.command(cls=_WithModels, context_settings={"ignore_unknown_options": True})
@_hydra_options
@click.version_option(
    importlib.metadata.version("omnigen"),
    "--version",
    prog_name="omnigen",
    message=f"%(prog)s, version %(version)s (Hydra {importlib.metadata.version('hydra-core')})",
)
@click.option(
    "--into-package",
    is_flag=True,
    help="Let a build without out=DIR rewrite an installed omnigen's generated/ (inside site-packages).",
)
@quiet_option
@overrides_argument
@click.pass_context
def build(ctx: click.Context, overrides: tuple[str, ...], into_package: bool, **hydra_flags: object) -> int:
    """Generate runner and worker classes from the configs.

    \b
    omnigen build                                 every model of conf/ into generated/
    omnigen build model=NAME [KEY=VALUE ...]      one model (into generated/, or out=DIR)
    omnigen build model=NAME out=DIR [package=P]  a variant: an importable package (DIR's name, or P)
    omnigen build -m model=A,B graph=x,y out=DIR  a sweep: one package per cell under DIR, a line
                                                  each, DIR/omnigen-sweep.csv; exit status = failed cells
    omnigen build -cd DIR model=mine out=OUT      a model of your own (DIR/model/mine.yaml)
    omnigen build model=NAME --cfg job            the composed config; builds nothing
    """
    if hydra_flags.get("shell_completion"):
        return _hydra_shell_completion(overrides)
    config_dirs = [str(d) for d in (hydra_flags.get("config_dir"), hydra_flags.get("config_path")) if d]
    paths.set_extra_config_dirs([Path(d) for d in config_dirs])
    parsed = _parse(overrides)
    models = _models(parsed)
    multirun = bool(hydra_flags.get("multirun"))
    showing = hydra_flags.get("cfg") or hydra_flags.get("info") or hydra_flags.get("hydra_help")
    if not models and not hydra_flags.get("experimental_rerun"):
        if hydra_flags.get("info") == "plugins" or hydra_flags.get("hydra_help"):
            pass  # Hydra answers these without composing a model
        elif showing or multirun:
            flag = "--cfg" if hydra_flags.get("cfg") else "--info" if hydra_flags.get("info") else "-m"
            raise click.UsageError(
                f"{flag} needs a model to compose: add model=NAME (models: {', '.join(paths.model_names())}); "
                "--info plugins needs none"
            )
        else:
            return _build_every_model(parsed, into_package)
    rest = [o.input_line for o in parsed if o.key_or_group != "model"]
    _check_models(models, [o for o in rest if not o.startswith(("out=", "package="))], multirun)
    if multirun and not any(o.key_or_group == "out" for o in parsed):
        raise click.UsageError("-m builds one variant per sweep cell: name a folder for them with out=DIR")
    from omnigen import hydra_app

    # Folders of OMNIGEN_CONFIG_PATH reach Hydra as its search path, as -cd does.
    searchpath = pipeline.search_path_override()
    argv = [*_hydra_argv(hydra_flags), *overrides, *searchpath, *logs.quiet_overrides(_quiet(ctx))]
    return hydra_app.run(argv, into_package=into_package)


def _check_models(models: list[str], overrides: list[str], multirun: bool) -> None:
    """Every model named, with the overrides, as a single run checks it, before Hydra runs; in a
    sweep of several models, every model that refuses them is named with its problems."""
    problems = []
    for name in models:
        try:
            pipeline.check_model_name(name, overrides, sweeps_allowed=multirun)
        except pipeline.ConfigError as exc:
            if len(models) == 1:
                raise
            problems.append((name, str(exc)))
    if problems:
        lines = [
            f"{len(problems)} of the {len(models)} models this sweep names refuse its overrides, so "
            "nothing was built; give a model its own overrides in a run of its own "
            "(omnigen build -m model=NAME ...):"
        ]
        for name, message in problems:
            first, *more = message.splitlines()
            lines += [f"  model={name}: {first}", *(f"    {line.strip()}" for line in more)]
        raise pipeline.ConfigError("\n".join(lines))


def _parse(overrides: Sequence[str]):
    try:
        return shape.parse_overrides(overrides)
    except ValueError as exc:
        raise pipeline.ConfigError(str(exc)) from exc


def _models(parsed) -> list[str]:
    """The models an override list names: ``model=a`` or a sweep ``model=a,b`` (Hydra's parsing)."""
    for override in parsed:
        if override.key_or_group == "model" and override.package is None and not override.is_delete():
            if override.is_sweep_override():
                return [str(v) for v in override.sweep_string_iterator()]
            return [str(override.value())]
    return []


def _build_every_model(parsed, into_package: bool) -> int:
    """``omnigen build [out=DIR [package=P]]``: every model of conf/, as committed or as a variant tree."""
    from omnigen import building

    where = {o.key_or_group: str(o.value()) for o in parsed if o.key_or_group in ("out", "package")}
    others = [o.input_line for o in parsed if o.key_or_group not in where]
    if others:
        raise click.UsageError(
            f"overrides {others} apply to one model's config: add model=NAME "
            "(or sweep with -m model=A,B ... out=DIR)"
        )
    if "out" not in where:
        if "package" in where:
            raise click.UsageError("package=NAME names a variant tree: add out=DIR")
        building.build_all(building.package_tree(None, into_package=into_package))
        return 0
    root = Path(where["out"]).absolute()
    building.build_all_variant(root, variants.package_for(root, where.get("package")))
    return 0


def _hydra_shell_completion(overrides: Sequence[str]) -> int:
    """Hydra's documented ``eval "$(APP -sc install=bash)"``, answered with omnigen's completion."""
    for word in overrides:
        key, _, shell = word.partition("=")
        if key in ("install", "uninstall") and shell in completion.SHELLS:
            if key == "install":
                click.echo(completion.script(app, shell))
            else:
                click.echo("complete -r omnigen" if shell == "bash" else "compdef -d omnigen")
            return 0
    raise click.UsageError(
        "use -sc install=bash or -sc install=zsh (prints the script to eval), or `omnigen completion SHELL`"
    )


# -- check ------------------------------------------------------------------------------------------


@app.command()
@click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Tree to check (default: the package's generated/). A variant is checked against the "
    "overrides recorded in its omnigen-build.yaml.",
)
@quiet_option
def check(root: Path | None) -> int:
    """Compare a tree with what conf/ and templates/ generate (never writes)."""
    from omnigen import building

    root = root or paths.generated_dir()
    record = variants.read_record(root)
    if record is None:
        files = building.every_model_files()
        fix = [
            "fix: omnigen build   (regenerates every model; removes orphaned files; finishes an interrupted build)"
        ]
        fix_models = set(paths.shipped_model_names())
    else:
        files = _variant_tree(record)
        fix = [
            f"fix: rebuild it, e.g. omnigen build model={m} {' '.join(o)} out={root}"
            for m, o in record.models.items()
        ]
        fix_models = set()
    report = render.check_tree(root, files)
    shown = paths.shown(root)
    label = "generated" if record is None else root.name  # how the lines below name the tree
    if report.ok:
        what = f" (variant {record.package}: {', '.join(record.models)})" if record else ""
        click.echo(f"omnigen check: {shown} is up to date{what}")
        return 0
    models: set[str] = set()
    for rel in report.missing:
        click.echo(f"missing:  {label}/{rel}")
        models.add(rel.split("/", 1)[0])
    for rel, diff in report.stale.items():
        click.echo(f"stale:    {label}/{rel}")
        click.echo(diff, nl=not diff.endswith("\n"))
        models.add(rel.split("/", 1)[0])
    for rel in report.orphaned:
        click.echo(
            f"orphaned: {label}/{rel}   (omnigen wrote it and no longer generates it: a build removes it)"
        )
    for rel in report.foreign:
        click.echo(f"foreign:  {label}/{rel}   (not omnigen's: no build removes or changes it)")
    for rel in report.interrupted:
        then = "finishes that build" if rel == render.PENDING else "removes it"
        click.echo(
            f"interrupted build: {label}/{rel} (left by a build that was killed; the next build {then})"
        )
    if report.refused is not None:
        click.echo(f"a build would refuse this folder: {report.refused.problem}")
        if report.refused.fix:
            click.echo(f"fix: {report.refused.fix}")
    elif report.missing or report.stale or report.orphaned or report.interrupted:
        for line in fix:
            click.echo(line)
        for model in sorted(models & fix_models):
            click.echo(f"     or omnigen build model={model}")
    if report.foreign:
        click.echo(
            f"foreign files: move them out of {shown} yourself, or delete them (omnigen build leaves them where they are)"
        )
    return 1


def _variant_tree(record: variants.BuildRecord) -> dict[str, str]:
    """What a variant tree holds when rebuilt from its record."""
    from omnigen import building

    paths.set_extra_config_dirs([Path(d) for d in record.config_dirs])
    files: dict[str, str] = {}
    for model, overrides in record.models.items():
        plan = pipeline.model_plan(model, overrides).in_package(record.package)
        files.update(building.variant_files(plan, overrides, record))
    return files


# -- diff -------------------------------------------------------------------------------------------


@app.command()
@click.argument("first", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("second", type=click.Path(exists=True, file_okay=False, path_type=Path), required=False)
@click.option("--all", "show_all", is_flag=True, help="Every decision, not only those that differ.")
@quiet_option
def diff(first: Path, second: Path | None, show_all: bool) -> int:
    """What two built trees (variants, sweep cells) differ in, decision by decision.

    SECOND defaults to the committed generated/. Exit status 1 when they differ.
    """
    from omnigen import explain

    second = second or paths.generated_dir()
    a, b = variants.plan_decisions(first), variants.plan_decisions(second)
    if not a:
        raise click.UsageError(
            f"{first}: no MODEL/plan.yaml here; point at a tree omnigen built (out=DIR or a sweep cell)"
        )
    shared_models = {k.split("/", 1)[0] for k in a} & {k.split("/", 1)[0] for k in b}
    keys = sorted(k for k in set(a) | set(b) if k.split("/", 1)[0] in shared_models)
    rows = []
    for key in keys:
        left, right = a.get(key), b.get(key)
        same = left is not None and right is not None and left["value"] == right["value"]
        if same and not show_all:
            continue
        model, stage, name = key.split("/", 2)
        rows.append(
            [
                f"{model}/{stage}",
                name,
                explain._value(left["value"]) if left else "(none)",
                explain._value(right["value"]) if right else "(none)",
                (left or right)["reason"]
                if same
                else (right or {}).get("reason", "")
                if not left
                else left["reason"],
            ]
        )
    for label, root in (("A", first), ("B", second)):
        record = variants.read_record(root)
        said = (
            "the committed tree"
            if record is None and variants.is_committed_tree(root)
            else (
                f"package {record.package}; "
                + "; ".join(f"{m}: {' '.join(o) or '(no overrides)'}" for m, o in record.models.items())
                if record
                else "no build record"
            )
        )
        click.echo(f"{label}: {paths.shown(root)} ({said})")
    if not shared_models:
        click.echo("no model in common")
        return 1
    differing = [r for r in rows if r[2] != r[3]]
    if not rows:
        click.echo("same decisions in every stage")
        return 0
    click.echo(explain.table(["stage", "decision", "A", "B", "why (A's reason)"], rows))
    return 1 if differing else 0


# -- explain ----------------------------------------------------------------------------------------


@app.command(cls=_WithModels, context_settings={"ignore_unknown_options": True})
@click.option("--keys", "list_keys", is_flag=True, help="Every config key: type, default, choices, meaning.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option(
    "--width",
    type=click.IntRange(40),
    default=None,
    help="Wrap tables to this width (default: the terminal's).",
)
@click.option(
    "-cd", "--config-dir", type=click.Path(file_okay=False), help="A folder of configs of your own."
)
@click.option(
    "out",
    "--out",
    type=click.Path(file_okay=False),
    help="Name the modules as a variant built into DIR would.",
)
@quiet_option
@overrides_argument
def explain(
    overrides: tuple[str, ...],
    list_keys: bool,
    fmt: str,
    width: int | None,
    config_dir: str | None,
    out: str | None,
) -> int:
    """A model's stages, stage graph, serve lines and every decision with its reason."""
    from omnigen import explain as explaining

    if list_keys:
        click.echo(explaining.keys_json() if fmt == "json" else explaining.keys_text(columns=width))
        return 0
    paths.set_extra_config_dirs([Path(config_dir)] if config_dir else [])
    parsed = _parse(overrides)
    models = _models(parsed)
    if len(models) != 1:
        raise click.UsageError(
            f"say which model: omnigen explain model=NAME [overrides] (models: {', '.join(paths.model_names())})"
        )
    plan = pipeline.model_plan(models[0], [o.input_line for o in parsed if o.key_or_group != "model"])
    if out:
        plan = plan.in_package(variants.package_for(Path(out), None))
    click.echo(
        explaining.explain_json(plan) if fmt == "json" else explaining.explain_text(plan, columns=width)
    )
    return 0


# -- new --------------------------------------------------------------------------------------------


@app.group()
def new() -> None:
    """Start a config of your own."""


@new.command("model")
@click.argument("name")
@click.option(
    "-cd",
    "--config-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    show_default=True,
    help="Writes CONFIG_DIR/model/NAME.yaml.",
)
@click.option(
    "--stage", default="talker", show_default=True, help="The name of the one stage it starts with."
)
@click.option("--force", is_flag=True, help="Replace an existing file.")
@quiet_option
def new_model(name: str, config_dir: Path, stage: str, force: bool) -> int:
    """A commented starting config with every key of the schema, each documented."""
    from omnigen import newmodel

    if paths.is_installed() and config_dir.resolve().is_relative_to(paths.conf_dir().parent):
        raise click.UsageError(
            f"{config_dir} is inside the installed omnigen; write your config elsewhere (-cd DIR)"
        )
    try:
        target = newmodel.write(name, config_dir, stage=stage, force=force)
    except (ValueError, FileExistsError) as exc:
        raise click.UsageError(str(exc)) from exc
    shown = paths.shown(config_dir)
    log.info(
        "omnigen: wrote %s; build it with: omnigen build -cd %s model=%s out=%s_runners",
        paths.shown(target),
        shown,
        name,
        name,
    )
    return 0


# -- run and serve ----------------------------------------------------------------------------------


@app.command("run", cls=_WithModels, context_settings={"ignore_unknown_options": True})
@click.option(
    "-cd", "--config-dir", type=click.Path(file_okay=False), help="A folder of configs of your own."
)
@quiet_option
@overrides_argument
def run_command(overrides: tuple[str, ...], config_dir: str | None) -> int:
    """Every stage in order on one prompt (serve.prompt); writes the audio as WAV (serve.output)."""
    return _pipeline("run", overrides, config_dir)


@app.command("serve", cls=_WithModels, context_settings={"ignore_unknown_options": True})
@click.option(
    "-cd", "--config-dir", type=click.Path(file_okay=False), help="A folder of configs of your own."
)
@quiet_option
@overrides_argument
def serve_command(overrides: tuple[str, ...], config_dir: str | None) -> int:
    """The whole pipeline behind an HTTP API (POST /v1/audio/speech, /v1/omnigen/generate)."""
    return _pipeline("serve", overrides, config_dir)


def _pipeline(command: str, overrides: Sequence[str], config_dir: str | None) -> int:
    from omnigen import pipeline_commands

    ctx = click.get_current_context()
    logs.configure(
        quiet=_quiet(ctx), verbose=bool((ctx.find_root().obj or {}).get("verbose")), timestamps=True
    )

    paths.set_extra_config_dirs([Path(config_dir)] if config_dir else [])
    parsed = _parse(overrides)
    models = _models(parsed)
    if len(models) != 1:
        raise click.UsageError(
            f"say which model: omnigen {command} model=NAME [serve.KEY=VALUE ...] "
            f"(models: {', '.join(paths.model_names())})"
        )
    return pipeline_commands.run(
        command, models[0], [o.input_line for o in parsed if o.key_or_group != "model"]
    )


# -- completion -------------------------------------------------------------------------------------


@app.command("completion")
@click.argument("shell", type=click.Choice(sorted(completion.SHELLS)))
def completion_command(shell: str) -> int:
    """Print the tab-completion script: eval "$(omnigen completion bash)" (or zsh) in your shell's rc."""
    click.echo(completion.script(app, shell))
    return 0


# -- entry point ------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """The ``omnigen`` console script; returns the exit status."""
    completion.register()
    logging.raiseExceptions = False  # a log line to a closed pipe is dropped, not a traceback
    args = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args if a in app.commands), "")
    try:
        status = app.main(args=args, prog_name="omnigen", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("omnigen: aborted", err=True)
        return 130
    except (pipeline.ConfigError, render.OutputFolderError, variants.VariantError) as exc:
        click.echo(f"omnigen {command}: {exc}".replace("omnigen : ", "omnigen: "), err=True)
        return 2
    except render.RenderError as exc:
        click.echo(f"omnigen {command}: {exc}".replace("omnigen : ", "omnigen: "), err=True)
        return 3
    except BrokenPipeError:
        return _closed_pipe()
    except OSError as exc:
        if exc.errno == errno.EPIPE:
            return _closed_pipe()
        raise
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return _closed_pipe()
    return status if isinstance(status, int) else 0


def _closed_pipe() -> int:
    """The reader went away (``omnigen --help | head -1``): stop quietly, as ``cat`` does."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by a closed pipe


if __name__ == "__main__":
    sys.exit(main())
