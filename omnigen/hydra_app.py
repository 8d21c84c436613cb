"""``omnigen build model=NAME ...`` as a Hydra application (overrides, --multirun, --cfg, --help)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from omnigen import paths, pipeline, render
from omnigen.schema import register_configs

# Overrides that pick what to build or where, not how the runners look.
_NOT_IN_HEADER = ("model=", "out=")


def run(args: list[str]) -> int:
    """Run the Hydra app with ``args`` as its command line; returns the exit status."""
    register_configs()
    saved = sys.argv
    sys.argv = ["omnigen build", *args]
    try:
        _build_task()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = saved
    return 0


def _variant_folder(override_dirname: str) -> str:
    """A folder name that says which sweep cell it holds, e.g. ``model=qwen3_tts,mtp_graph=unsafe``."""
    return re.sub(r"[^A-Za-z0-9_.,=+-]", "_", override_dirname) or "default"


@hydra.main(version_base="1.3", config_path=str(paths.conf_dir()), config_name="config")
def _build_task(cfg: DictConfig) -> None:
    # Errors are raised, never sys.exit: a --multirun sweep reports a failed cell and goes on.
    hydra_cfg = HydraConfig.get()
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith(_NOT_IN_HEADER)]
    plan = pipeline.plan_from_config(
        cfg, hydra_cfg.runtime.choices.get("model"), list(hydra_cfg.overrides.task)
    )
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    from omnigen import cli

    if cfg.out is None:
        if multirun:
            raise pipeline.ConfigError(
                "--multirun builds one variant per sweep cell: name a folder for them with out=DIR"
            )
        root = paths.generated_dir()
        if overrides:
            print(
                f"omnigen: note: overrides {overrides} change the committed generated/{plan.name}; "
                "`omnigen check` will call it stale until conf/ says the same (or build with out=DIR)"
            )
    else:
        root = Path(hydra.utils.to_absolute_path(cfg.out))
        if multirun:
            root = root / _variant_folder(hydra_cfg.job.override_dirname)
    try:
        cli.build_model(plan, overrides, root, include_package_init=True)
    except render.OutputFolderError as exc:
        if multirun:
            raise
        # A single build refused before it wrote anything: the message, not a traceback.
        print(f"omnigen build: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
