"""``omnigen build model=NAME ...``: Hydra's own argument parser, compose, run and multirun.

The ``build`` command hands its command line to Hydra unchanged (``_run_hydra``, what
``@hydra.main`` calls), so every Hydra flag means what Hydra documents. The task below builds one
cell; it never raises for a bad config or folder: in a sweep a failed cell is a line of the
summary (``sweep.py``), in a single run a message and exit status 2.

Hydra makes its run folder (``hydra.run.dir``; a sweep's: ``hydra.sweep.dir``) before it runs the
task; ``OutputFolderGuard``, a Hydra callback every build adds, refuses one inside omnigen's
generated/ or the build's own out= folder before Hydra makes it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from hydra._internal.utils import _run_hydra, get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from omnigen import building, paths, pipeline, render, sweep, variants
from omnigen.schema import register_configs

log = logging.getLogger("omnigen.build")

# Overrides that pick what to build or where, not how the runners look.
_NOT_IN_HEADER = ("model=", "out=", "package=")


def run(args: list[str], *, into_package: bool = False) -> int:
    """Run Hydra with ``args`` as its command line; the exit status (a sweep: its failed cells)."""
    parser = get_args_parser()
    parsed = parser.parse_args(args)
    parsed.overrides = [*parsed.overrides, f"++hydra.callbacks.omnigen_output_folders._target_={_GUARD}"]
    register_configs()
    sweep.start(into_package=into_package)
    try:
        _run_hydra(
            args=parsed,
            args_parser=parser,
            task_function=build_task,
            config_path=str(paths.conf_dir()),
            config_name="config",
        )
    except _Refused as exc:
        sweep.finish(multirun=False)
        raise pipeline.ConfigError(exc.message) from None
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return sweep.finish(multirun=parsed.multirun)


class _Refused(SystemExit):
    """A refusal from inside Hydra, before any job ran: a ``SystemExit``, so that Hydra lets it
    through untouched (it prints a traceback for any ``Exception``); ``run`` reports it."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message


class OutputFolderGuard(Callback):
    """Refuses a Hydra run or sweep folder inside a tree omnigen writes, before Hydra makes it."""

    def on_run_start(self, config: DictConfig, **kwargs: object) -> None:
        _refuse_hydra_folder(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: object) -> None:
        _refuse_hydra_folder(config, "hydra.sweep.dir")


_GUARD = f"{__name__}.{OutputFolderGuard.__name__}"


def _refuse_hydra_folder(config: DictConfig, key: str) -> None:
    """Refuse ``key`` (Hydra's run or sweep folder) inside generated/ or the build's out= folder.

    Hydra would make the folder there, an empty folder of no one's in a tree of generated files
    (a model folder, if it is named like one), before omnigen's own checks run."""
    HydraConfig.instance().set_config(config)  # for ${hydra:...} in the value (Hydra sets it again)
    try:
        value = str(OmegaConf.select(config, key))
    except Exception:  # noqa: BLE001 - a value that does not resolve: Hydra reports it itself
        return
    where = Path(value).resolve()
    trees = [("omnigen's generated tree", paths.generated_dir())]
    out = OmegaConf.select(config, "out", default=None)
    if out is not None:
        trees.append((f"the output folder (out={out})", Path(str(out))))
    for label, tree in trees:
        tree = tree.resolve()
        if where == tree or where.is_relative_to(tree):
            raise _Refused(
                f"{key}={value} is inside {label}, {paths.shown(tree)}: Hydra would make its "
                f"{'sweep' if 'sweep' in key else 'run'} folder there, among the files omnigen writes; "
                f"nothing was built. Point {key} outside it, or leave it unset (Hydra's folders then "
                "go under $TMPDIR/omnigen-hydra)"
            )


def build_task(cfg: DictConfig) -> sweep.Cell:
    """One cell: plan the composed config and write its files; failures become the cell's message."""
    hydra_cfg = HydraConfig.get()
    task_overrides = list(hydra_cfg.overrides.task)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    cell = sweep.Cell(
        name=hydra_cfg.job.override_dirname or "default",
        overrides=[o for o in task_overrides if not o.startswith(("out=", "package="))],
    )
    try:
        cell.root, cell.package = _build(cfg, hydra_cfg, task_overrides, multirun)
        cell.ok = True
    except (pipeline.ConfigError, render.RenderError, render.OutputFolderError, variants.VariantError) as exc:
        cell.message = str(exc)
        if not multirun:
            log.error("omnigen build: %s", exc)
            raise SystemExit(3 if isinstance(exc, render.RenderError) else 2) from None
    sweep.record(cell, multirun=multirun)
    return cell


def _build(
    cfg: DictConfig, hydra_cfg: DictConfig, task_overrides: list[str], multirun: bool
) -> tuple[Path, str]:
    model = hydra_cfg.runtime.choices.get("model")
    overrides = [o for o in task_overrides if not o.startswith(_NOT_IN_HEADER)]
    plan = pipeline.plan_from_config(cfg, model, task_overrides)
    if cfg.out is None:
        if multirun:
            raise pipeline.ConfigError(
                "--multirun builds one variant per sweep cell: name a folder for them with out=DIR"
            )
        root = building.package_tree(model, into_package=sweep.into_package())
        if overrides:
            log.warning(
                "omnigen: note: overrides %s change the committed generated/%s; `omnigen check` will "
                "call it stale until conf/ says the same (or build with out=DIR)",
                overrides,
                plan.name,
            )
    else:
        root = Path(hydra.utils.to_absolute_path(cfg.out))
    package = variants.package_for(root, cfg.package)
    if multirun:
        sweep.set_sweep_root(root)
        folder = sweep.cell_folder(hydra_cfg.job.override_dirname)
        root, package = root / folder, variants.cell_package(package, folder)
    building.build_model(
        plan.in_package(package), overrides, root, files_level=logging.DEBUG if multirun else logging.INFO
    )
    return root, package
