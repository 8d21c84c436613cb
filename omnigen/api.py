"""In-process API: a runner class for ``(model, stage, overrides)`` without touching ``generated/``.

Tests and sweeps use it to get variants of a stage (``mtp.graph=unsafe``, another decode
batching, ...) straight from the configs: compose, plan, render in memory, load.
"""

from __future__ import annotations

import hashlib
import sys
import types
from collections.abc import Sequence

from omnigen import pipeline
from omnigen.plan import ModelPlan, StagePlan

__all__ = ["model_plan", "runner_class", "stage_plan", "stage_source", "worker_class", "worker_cls_name"]

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


def _module(model: str, stage: str, overrides: Sequence[str]) -> types.ModuleType:
    key = (model, stage, tuple(overrides))
    module = _modules.get(key)
    if module is not None:
        return module
    source = stage_source(model, stage, overrides)
    digest = hashlib.sha256("\0".join(key[2]).encode()).hexdigest()[:12]
    name = f"omnigen._variants.{model}.{stage}_{digest}"
    module = types.ModuleType(name)
    module.__file__ = f"<omnigen {model}.{stage} {' '.join(overrides)}>"
    sys.modules[name] = module
    try:
        exec(compile(source, module.__file__, "exec"), module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    _modules[key] = module
    return module


def runner_class(model: str, stage: str, overrides: Sequence[str] = ()) -> type:
    """The generated runner class of ``model``'s ``stage`` under ``overrides`` (Hydra syntax)."""
    plan = stage_plan(model, stage, overrides)
    return getattr(_module(model, stage, overrides), plan.runner_class)


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
