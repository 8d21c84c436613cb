"""The whole flow in process: compose a model's config, check it, plan it, render its files.

The CLI, the in-process API and the tests all go through these functions, so a
config error reads the same everywhere: ``conf/model/x.yaml: key: problem; fix``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from omnigen import paths, render, shape
from omnigen.config_files import ConfigFileError, read_model_file
from omnigen.findings import Finding, blame_overrides, report
from omnigen.plan import ModelPlan, plan_build
from omnigen.schema import register_configs
from omnigen.spec import SpecError, build_spec, model_source


class ConfigError(ValueError):
    """A config that does not compose or does not hold together; the message says where and how to fix it."""


def check_model_name(model: str, overrides: Sequence[str] = (), *, sweeps_allowed: bool = False) -> None:
    """``model`` names a config in conf/model whose file, with ``overrides``, has the schema's shape.

    Everything checkable before Hydra composes is checked here and reported at once as a
    ``ConfigError``: the file's bytes and YAML, then every unknown or missing key, wrong type and
    bad choice in the file and in the overrides (with ``sweeps_allowed``, a sweep's values one by one).
    """
    known = paths.model_names()
    if model not in known:
        raise ConfigError(
            f"conf/model/{model}.yaml: no such model config; pick one of: {', '.join(known)}"
            f"{shape.did_you_mean(model, known)} (or add the file; a model of your own goes in "
            f"DIR/model/{model}.yaml with `-cd DIR`, or a folder listed in ${paths.CONFIG_PATH_ENV})"
        )
    source = model_source(model)
    try:
        node = read_model_file(paths.model_file(model), source)
        parsed = shape.parse_overrides(overrides)
    except (ConfigFileError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc
    findings = shape.check_model_document(node, source, shape.override_sets(parsed))
    findings += shape.check_overrides(
        parsed, shape.stage_names(node), _group_options(), sweeps_allowed=sweeps_allowed
    )
    if findings:
        raise ConfigError(report(findings))


def _group_options() -> dict[str, list[str]]:
    return {group: paths.group_options(group) for group in shape.GROUPS}


def compose_config(model: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Compose ``conf/config.yaml`` with ``model=<model>`` and the overrides, as Hydra would."""
    check_model_name(model, overrides)
    register_configs()
    hydra_state = GlobalHydra.instance()
    if hydra_state.is_initialized():
        hydra_state.clear()
    try:
        with initialize_config_dir(config_dir=str(paths.conf_dir()), version_base="1.3"):
            return compose(
                config_name="config", overrides=[*search_path_override(), f"model={model}", *overrides]
            )
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(_explain_compose_error(model, overrides, exc)) from exc
    finally:
        if GlobalHydra.instance().is_initialized():
            GlobalHydra.instance().clear()


def search_path_override() -> list[str]:
    """The user's config folders for Hydra's compose (``hydra.searchpath``), as ``-cd`` adds them."""
    extra = paths.extra_config_dirs()
    return [f"hydra.searchpath=[{','.join(f'file://{d}' for d in extra)}]"] if extra else []


def _explain_compose_error(model: str, overrides: Sequence[str], exc: BaseException) -> str:
    cause: BaseException | None = exc
    while cause is not None and not getattr(cause, "full_key", None):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        cause = exc
    key = str(getattr(cause, "full_key", "") or "").removeprefix("model.")
    message = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    origin = model_source(model)
    from_override = [o for o in overrides if key and key in o]
    if from_override:
        origin = f"override {from_override[0]!r} (on {model_source(model)})"
    where = f"{origin}: {key}" if key else origin
    return f"{where}: {message}; {_fix_hint(cause)}"


def _fix_hint(cause: BaseException) -> str:
    if isinstance(cause, MissingMandatoryValue):
        return "set this key (omnigen/schema.py documents it)"
    if isinstance(cause, ConfigKeyError | ConfigAttributeError):
        return "no such key here: check the spelling against omnigen/schema.py, or remove it"
    if isinstance(cause, ValidationError):
        return "use one of the allowed values (omnigen/schema.py documents each key)"
    return "fix the config (omnigen/schema.py documents every key)"


def model_plan(model: str, overrides: Sequence[str] = ()) -> ModelPlan:
    cfg = compose_config(model, overrides)
    return plan_from_config(cfg, model, overrides)


def plan_from_config(
    cfg: DictConfig, file_stem: str | None = None, overrides: Sequence[str] = ()
) -> ModelPlan:
    """The plan of a composed config; ``file_stem`` is the model config that was read.

    A finding about a key an override set names that override.
    """
    try:
        return plan_build(build_spec(cfg, file_stem))
    except SpecError as exc:
        source = model_source(file_stem or str(cfg.model.get("name", "?")))
        keys = [
            (o.key_or_group.removeprefix("model."), o.input_line) for o in shape.parse_overrides(overrides)
        ]
        # An override's finding names the override; the file's own, its line and column.
        findings = _with_positions(blame_overrides(exc.findings, keys, source), file_stem, source)
        raise ConfigError(report(findings)) from exc


def _with_positions(findings: list[Finding], file_stem: str | None, source: str) -> list[Finding]:
    """The findings of the file read, each at the line and column of its key where the file has it."""
    path = paths.model_file(file_stem) if file_stem else None
    if path is None or not path.is_file():
        return findings
    positions = shape.key_positions(read_model_file(path, source))
    placed = []
    for finding in findings:
        if finding.where == source and finding.key in positions:
            line, column = positions[finding.key]
            finding = dataclasses.replace(finding, where=f"{source}:{line}:{column}")
        placed.append(finding)
    return placed


def model_files(
    plan: ModelPlan, overrides: Sequence[str] = (), *, package_init: bool = False
) -> dict[str, str]:
    """Every file of one model, rendered, formatted and gated, keyed by path under generated/.

    ``package_init`` adds the tree's root ``__init__.py`` (it lists every configured model).
    """
    files = render.model_files(plan, tuple(overrides))
    if package_init:
        files["__init__.py"] = render.render_package_init(paths.shipped_model_names())
    return render.finish(files)


def all_files(progress: Callable[[int, str], None] | None = None) -> dict[str, str]:
    """The whole committed tree: every model from conf/ without overrides, plus the package init.

    ``progress(i, name)`` is called as each model is planned.
    """
    files: dict[str, str] = {}
    models = paths.shipped_model_names()
    for i, name in enumerate(models):
        if progress is not None:
            progress(i, name)
        files.update(render.model_files(model_plan(name)))
    files["__init__.py"] = render.render_package_init(models)
    return render.finish(files)
