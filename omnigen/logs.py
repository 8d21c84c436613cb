"""Logging for every command from one config: ``conf/hydra/job_logging/omnigen.yaml``.

Inside a Hydra job (``omnigen build model=...``) Hydra applies ``hydra/job_logging`` itself (so a
user's ``hydra/job_logging=...`` or ``hydra.verbose`` applies); the other commands apply the same
file here. Results (tables, configs, verdicts) go to stdout; what happens on the way to stderr.
"""

from __future__ import annotations

import logging
import logging.config

import yaml

from omnigen import paths

log = logging.getLogger("omnigen")


def configure(*, quiet: bool = False, verbose: bool = False, timestamps: bool = False) -> None:
    """Apply omnigen's logging config; ``timestamps`` for the long-running ``run`` and ``serve``."""
    config = yaml.safe_load((paths.conf_dir() / "hydra" / "job_logging" / "omnigen.yaml").read_text())
    if timestamps:
        config["formatters"]["omnigen"]["format"] = "%(asctime)s %(name)s: %(message)s"
    if quiet:
        config["root"]["level"] = "WARNING"
    if verbose:
        config["root"]["level"] = "DEBUG"
    logging.config.dictConfig(config)


def quiet_overrides(quiet: bool) -> list[str]:
    """What ``-q`` adds to a Hydra job's overrides."""
    return ["hydra.job_logging.root.level=WARNING"] if quiet else []
