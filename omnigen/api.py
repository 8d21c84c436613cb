"""In-process API: a runner class for ``(model, stage, overrides)`` without touching ``generated/``.

Tests and sweeps use it to get variants of a stage (``mtp.graph=unsafe``, another decode
batching, ...) straight from the configs: compose, plan, render in memory, load.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig

from omnigen import built, pipeline
from omnigen.built import BuiltModel
from omnigen.plan import ModelPlan, StagePlan

__all__ = [
    "RUNNER_OVERRIDES",
    "model_plan",
    "model_state_class",
    "runner_class",
    "runner_overrides",
    "runner_v2_class",
    "served_model",
    "stage_plan",
    "stage_source",
    "stage_v2_source",
    "worker_class",
    "worker_cls_name",
]

_modules: dict[tuple[str, str, tuple[str, ...]], types.ModuleType] = {}


def model_plan(model: str, overrides: Sequence[str] = ()) -> ModelPlan:
    return pipeline.model_plan(model, tuple(overrides))


def stage_plan(model: str, stage: str, overrides: Sequence[str] = ()) -> StagePlan:
    return model_plan(model, overrides).stage(stage)


def stage_source(model: str, stage: str, overrides: Sequence[str] = ()) -> str:
    """The stage module's source exactly as ``omnigen build`` would write it."""
    plan = model_plan(model, overrides)
    plan.stage(stage)  # a clear KeyError for an unknown stage
    files = pipeline.model_files(plan, tuple(overrides))
    return files[f"{model}/{stage}.py"]


def stage_v2_source(model: str, stage: str, overrides: Sequence[str] = ()) -> str:
    """The stage's Model Runner V2 target module source exactly as ``omnigen build`` writes it."""
    plan = model_plan(model, overrides)
    plan.stage(stage)
    files = pipeline.model_files(plan, tuple(overrides))
    return files[f"{model}/{stage}_v2.py"]


def _load(name: str, label: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = label
    sys.modules[name] = module
    try:
        exec(compile(source, module.__file__, "exec"), module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _module(
    model: str, stage: str, overrides: Sequence[str], files: dict[str, str] | None = None
) -> types.ModuleType:
    """The variant's stage module, rendered in this process (from ``files``, the model's rendered
    files, where the caller has them) and kept for the process's life."""
    key = (model, stage, tuple(overrides))
    module = _modules.get(key)
    if module is not None:
        return module
    source = files[f"{model}/{stage}.py"] if files is not None else stage_source(model, stage, overrides)
    digest = hashlib.sha256("\0".join(key[2]).encode()).hexdigest()[:12]
    name = f"omnigen._variants.{model}.{stage}_{digest}"
    label = f"<omnigen {model}.{stage} {' '.join(overrides)}>"
    module = _load(name, label, source)
    # The variant's V2 target is its worker module's `_v2` sibling, made when first imported
    # (its parents exist as empty packages, so the import system reaches the finder below).
    v2_source = None if files is None else files.get(f"{model}/{stage}_v2.py")
    _V2Finder.pending[f"{name}_v2"] = (model, stage, tuple(overrides), label, v2_source)
    parent = name
    while "." in parent:
        parent = parent.rsplit(".", 1)[0]
        if parent not in sys.modules:
            package = types.ModuleType(parent)
            package.__path__ = []
            sys.modules[parent] = package
    _modules[key] = module
    return module


def _v2_module(model: str, stage: str, overrides: Sequence[str]) -> types.ModuleType:
    name = f"{_module(model, stage, overrides).__name__}_v2"
    module = sys.modules.get(name)
    if module is None:
        module = importlib.import_module(name)
    return module


class _V2Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a variant's ``<stage>_v2`` module (rendered in memory) by name, as the variant's
    worker does when it builds the V2 target."""

    pending: dict[str, tuple[str, str, tuple[str, ...], str, str | None]] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.pending:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        model, stage, overrides, label, source = self.pending[module.__name__]
        module.__file__ = label.replace(">", " (V2 target)>")
        if source is None:
            source = stage_v2_source(model, stage, overrides)
        exec(compile(source, module.__file__, "exec"), module.__dict__)


sys.meta_path.append(_V2Finder())


def runner_class(model: str, stage: str, overrides: Sequence[str] = ()) -> type:
    """The generated runner class of ``model``'s ``stage`` under ``overrides`` (Hydra syntax)."""
    plan = stage_plan(model, stage, overrides)
    return getattr(_module(model, stage, overrides), plan.runner_class)


def runner_v2_class(model: str, stage: str, overrides: Sequence[str] = ()) -> type:
    """The stage's generated Model Runner V2 runner class under ``overrides`` (imports vLLM's V2)."""
    plan = stage_plan(model, stage, overrides)
    assert plan.v2 is not None
    if not overrides:
        return getattr(importlib.import_module(plan.v2_module), plan.v2.runner_class)
    return getattr(_v2_module(model, stage, overrides), plan.v2.runner_class)


def model_state_class(model: str, stage: str, overrides: Sequence[str] = ()) -> type:
    """The stage's generated Model Runner V2 model state class under ``overrides``."""
    plan = stage_plan(model, stage, overrides)
    assert plan.v2 is not None
    return runner_v2_class(model, stage, overrides).MODEL_STATE


def worker_class(model: str, stage: str, overrides: Sequence[str] = ()) -> type:
    plan = stage_plan(model, stage, overrides)
    return getattr(_module(model, stage, overrides), plan.worker_class)


def worker_cls_name(model: str, stage: str, overrides: Sequence[str] = ()) -> str:
    """The ``worker_cls`` string for vLLM: the committed module without overrides, else the variant's.

    A variant lives in ``sys.modules`` only, so vLLM must build its worker in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the CPU executor then runs the worker in process).
    """
    plan = stage_plan(model, stage, overrides)
    if not overrides:
        return f"{plan.module}.{plan.worker_class}"
    return f"{_module(model, stage, overrides).__name__}.{plan.worker_class}"


# Overrides that change the generated runners; the rest (serve.*) only say how to run them.
RUNNER_OVERRIDES = ("model.", "+model.", "~model.", "++model.", "device=", "graph=", "mtp_graph=")


def runner_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides among ``overrides`` that change the model's plan or generated runners."""
    return [o for o in overrides if o.startswith(RUNNER_OVERRIDES)]


def served_model(model: str, overrides: Sequence[str] = (), *, cfg: DictConfig | None = None) -> BuiltModel:
    """What ``omnigen run``/``serve`` and ``Pipeline.from_model`` serve: the built package's model
    (``generated/<model>/plan.yaml``), or with overrides that change the plan, that variant.

    A variant whose generated modules equal the committed ones (an override of a serving key, such
    as an edge's transport) is served by the committed workers in every mode; one that changes a
    module is rendered in this process (``in_memory``: ``serve.mode=inproc`` only). ``cfg``: the
    config the caller composed with the same overrides (composed here otherwise); the variant is
    planned and rendered once.
    """
    overrides = runner_overrides(overrides)
    if not overrides:
        return built.load(model)
    if cfg is None:
        plan = model_plan(model, overrides)
    else:
        plan = pipeline.plan_from_config(cfg, model, overrides)
    files = pipeline.model_files(plan, tuple(overrides))
    changed = _changed_modules(plan.name, files)
    # A changed package __init__ (the declared classes) is the whole model's: every stage's
    # processes would register the committed classes, so every worker is the variant's.
    variant = [
        s for s in plan.stages if f"{model}/{s.stage}.py" in changed or f"{model}/__init__.py" in changed
    ]
    workers = {
        s.stage: f"{_module(model, s.stage, overrides, files).__name__}.{s.worker_class}" for s in variant
    }
    return BuiltModel.from_plan_dict(plan.as_dict(), workers=workers or None)


def _changed_modules(model: str, files: dict[str, str]) -> set[str]:
    """The generated ``.py`` files (paths under the package) of a variant's rendered ``files`` that
    differ from the committed tree's, header comments aside (they name the overrides)."""
    root = built.plan_file(model).parent.parent
    changed = set()
    for path, source in files.items():
        committed = root / path
        if path.endswith(".py") and (
            not committed.is_file() or _code(committed.read_text()) != _code(source)
        ):
            changed.add(path)
    return changed


def _code(source: str) -> str:
    """A generated module less its header comment."""
    lines = source.splitlines()
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return "\n".join(lines)
