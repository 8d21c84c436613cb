"""Writing builds: one model into a tree (the committed one or a variant), or every model at once.

What was written is logged (``omnigen.build``), one line per file at INFO; ``-q`` hides it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from omnigen import paths, pipeline, render, variants
from omnigen.plan import COMMITTED_PACKAGE, ModelPlan

log = logging.getLogger("omnigen.build")


def package_tree(model: str | None, *, into_package: bool) -> Path:
    """The package's own ``generated/``, where a build without ``out=`` goes, if it may go there.

    Only omnigen's own models belong there (``omnigen.generated`` lists conf/'s models), and an
    installed omnigen's tree is inside site-packages: it is rewritten only when asked.
    """
    if model is not None and not paths.is_shipped_model(model):
        raise pipeline.ConfigError(
            f"{paths.shown(paths.model_file(model))}: a model of your own is built into a folder of "
            f"your own, not into omnigen's generated/ (which holds conf/'s models): add out=DIR, e.g. "
            f"omnigen build -cd {paths.shown(paths.model_file(model).parent.parent)} model={model} out=my_runners"
        )
    if paths.is_installed() and not into_package:
        raise pipeline.ConfigError(
            f"this omnigen is installed: its generated/ is {paths.generated_dir()}, inside site-packages; "
            "build into a folder of your own with out=DIR, or pass --into-package to rewrite the installed tree"
        )
    return paths.generated_dir()


def build_model(
    plan: ModelPlan, overrides: Sequence[str], root: Path, *, files_level: int = logging.INFO
) -> render.TreeReport:
    """Render one model and write it under ``root``; remove its stale files and configless models.

    A variant tree (any package but the committed one) also gets its build record.
    """
    if plan.package == COMMITTED_PACKAGE and variants.is_committed_tree(root):
        files = pipeline.model_files(plan, overrides, package_init=True)
        known = set(paths.shipped_model_names())
    else:
        record = variants.updated_record(root, plan.package, plan.name, list(overrides))
        files = variant_files(plan, overrides, record)
        known = set(record.models)
    configless = (
        [p.name for p in root.iterdir() if p.is_dir() and p.name not in known and not p.name.startswith(".")]
        if root.is_dir()
        else []
    )
    report = render.write_tree(root, files, scope=[plan.name, *configless])
    log_report(report, root, files_level=files_level)
    if plan.package != COMMITTED_PACKAGE:
        log.info(
            "omnigen: %s imports as %s (PYTHONPATH=%s)",
            paths.shown(root),
            plan.package,
            _import_root(root, plan.package),
        )
    return report


def _import_root(root: Path, package: str) -> Path:
    folder = root.resolve()
    for _ in package.split("."):
        folder = folder.parent
    return folder


def variant_files(plan: ModelPlan, overrides: Sequence[str], record: variants.BuildRecord) -> dict[str, str]:
    """One model's files in a variant tree, with the tree's package init and build record."""
    files = render.model_files(plan, tuple(overrides))
    files["__init__.py"] = render.render_package_init(sorted(record.models))
    files[variants.RECORD] = record.text()
    return render.finish(files)


def every_model_files(
    package: str | None = None, progress: Callable[[int, str], None] | None = None
) -> dict[str, str]:
    """Every model of conf/ as one tree: the committed one (``package`` None, what
    ``pipeline.all_files`` makes) or a variant tree under ``package``.

    Every model is planned before anything is written, and a build of every model is all or
    nothing: if any model's config is bad, the ``ConfigError`` names every bad model, each with
    its problems, and none is built (the tree's package init lists every model, and a tree of
    some models rebuilt and others not would match no state of conf/). The good ones build one
    by one: ``omnigen build model=NAME``.
    """
    models = paths.shipped_model_names()
    files: dict[str, str] = {}
    problems: list[tuple[str, str]] = []
    for i, name in enumerate(models):
        if progress is not None:
            progress(i, name)
        try:
            plan = pipeline.model_plan(name)
        except pipeline.ConfigError as exc:
            problems.append((name, str(exc)))
            continue
        files.update(render.model_files(plan if package is None else plan.in_package(package)))
    if problems:
        raise pipeline.ConfigError(every_model_problems(problems, len(models)))
    files["__init__.py"] = render.render_package_init(models)
    if package is not None:
        files[variants.RECORD] = variants.BuildRecord(package, {m: [] for m in models}, []).text()
    return render.finish(files)


def every_model_problems(problems: Sequence[tuple[str, str]], count: int) -> str:
    """One message for the bad models of a build of every model: each model, then its problems."""
    lines = [
        f"{len(problems)} of {count} models have config problems, so none was built (a build of "
        "every model is all or nothing); fix them, or build the others one by one with "
        "omnigen build model=NAME:"
    ]
    for name, message in problems:
        first, *rest = message.splitlines()
        lines.append(f"  model={name}: {first}")
        lines += [f"    {line.strip()}" for line in rest]
    return "\n".join(lines)


def build_all(root: Path) -> render.TreeReport:
    """Every model of conf/ into the committed tree, logging each model as it is planned."""
    report = render.write_tree(root, every_model_files(progress=_progress), scope=None)
    log_report(report, root)
    return report


def build_all_variant(root: Path, package: str) -> render.TreeReport:
    """Every model of conf/ into ``root`` as one variant tree under ``package``."""
    report = render.write_tree(root, every_model_files(package, progress=_progress), scope=None)
    log_report(report, root)
    return report


def _progress(i: int, name: str) -> None:
    log.info("omnigen: [%d/%d] %s", i + 1, len(paths.shipped_model_names()), name)


def log_report(report: render.TreeReport, root: Path, *, files_level: int = logging.INFO) -> None:
    log.info(
        "omnigen: %d written, %d unchanged, %d removed under %s",
        len(report.written),
        len(report.unchanged),
        len(report.removed),
        paths.shown(root),
    )
    for rel in report.written:
        log.log(files_level, "  wrote   %s", rel)
    for rel in report.removed:
        log.log(files_level, "  removed %s", rel)
