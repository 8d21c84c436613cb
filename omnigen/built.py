"""A model as ``omnigen build`` wrote it, read back: what serving starts from.

``omnigen run``/``serve`` and the pipeline read a model's stages, their workers, glue, transports
and streaming edges, and its declared classes from the built package's ``plan.yaml`` (the
committed ``generated/<model>/plan.yaml``, or a tree built with ``out=DIR``), never by composing
and planning the model's config again. The one exception is a run with overrides that change the
generated runners (``model.*``): ``omnigen.api.served_model`` renders that variant in memory and
hands the pipeline the same ``BuiltModel``, made from the variant's plan.

Nothing here imports the generator (``schema``, ``spec``, ``plan``, ``render``): the layer
contracts in ``.importlinter`` hold serving to that.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from omnigen.streams import StreamSpec

COMMITTED_PACKAGE = "omnigen.generated"
SCHEDULER_CLS = "omnigen.runtime.scheduler.OmniScheduler"
"""The scheduler every generated stage runs with (``--scheduler-cls``)."""


class BuiltModelError(LookupError):
    """No built package (or an outdated one) for a model; says how to build it."""


@dataclass(frozen=True)
class BuiltCheckpoint:
    """How the model's real checkpoints are served (the plan's ``checkpoint`` section)."""

    provider: str | None = None
    install: str | None = None
    model_type: str | None = None
    config_class: str | None = None
    request_builder: str | None = None
    synthetic: str | None = None


@dataclass(frozen=True)
class BuiltStage:
    """One stage as the pipeline runs it."""

    model: str
    stage: str
    order: int
    module: str
    runner_class: str
    worker_class: str
    kind: str
    arch: str
    final_output: str
    next_stage_input: str | None
    input_function: str | None
    transport: str
    devices: str | None
    published_keys: tuple[str, ...] | None
    """The payload keys each step publishes; None: every key (a full-payload producer)."""
    model_class: str | None
    stream: StreamSpec | None
    worker_cls: str
    """vLLM's ``worker_cls``: the built module's worker, or an in-memory variant's."""
    in_memory: bool = False
    """The worker is a variant rendered in this process only (``serve.mode=inproc`` alone)."""

    def __post_init__(self) -> None:
        if self.kind not in ("ar", "generation"):
            raise ValueError(f"stage {self.stage!r}: kind {self.kind!r} is neither ar nor generation")
        if not self.worker_cls.endswith(f".{self.worker_class}"):
            raise ValueError(f"stage {self.stage!r}: worker_cls {self.worker_cls!r} is not its worker class")

    @property
    def is_generation(self) -> bool:
        return self.kind == "generation"

    def variant_refusal(self, mode: str) -> str:
        """Why ``mode`` cannot start this stage's in-memory variant worker, and the fix."""
        return (
            f"serve.mode={mode} starts each engine in processes of their own, which import the built "
            f"package, and the overrides change {self.model}'s generated {self.model}/{self.stage}.py: "
            f"build them into conf/ (omnigen build model={self.model}), or use serve.mode=inproc"
        )


@dataclass(frozen=True)
class BuiltModel:
    name: str
    title: str
    arch: str
    source: str
    async_chunk: bool
    package: str
    checkpoint: BuiltCheckpoint
    model_classes: dict[str, str]
    """Every ``arch -> dotted class path`` the model declares (registered where it is served)."""
    stages: tuple[BuiltStage, ...]

    def __post_init__(self) -> None:
        orders = [s.order for s in self.stages]
        if not self.stages or orders != sorted(orders) or len(set(orders)) != len(orders):
            raise ValueError(f"{self.name}: stages must be a non-empty list in strictly ascending order")

    def stage(self, name: str) -> BuiltStage:
        for stage in self.stages:
            if stage.stage == name:
                return stage
        known = ", ".join(s.stage for s in self.stages)
        raise KeyError(f"model {self.name!r} has no stage {name!r}; its stages are: {known}")

    @classmethod
    def from_plan_dict(cls, plan: dict[str, Any], workers: dict[str, str] | None = None) -> BuiltModel:
        """The model of a ``plan.yaml`` mapping; ``workers``: stage -> an in-memory variant's
        ``worker_cls`` (None: the built modules' own workers)."""
        name = plan["model"]
        checkpoint = dict(plan["checkpoint"])
        model_classes = dict(checkpoint.pop("model_classes") or {})
        stages = []
        for stage, entry in plan["stages"].items():
            capabilities, pipeline = entry["capabilities"], entry["pipeline"]
            stream = pipeline["stream"]
            published = pipeline["published_keys"]
            built_worker = f"{entry['module']}.{entry['worker_class']}"
            stages.append(
                BuiltStage(
                    model=name,
                    stage=stage,
                    order=entry["order"],
                    module=entry["module"],
                    runner_class=entry["runner_class"],
                    worker_class=entry["worker_class"],
                    kind=capabilities["kind"],
                    arch=capabilities["arch"],
                    final_output=capabilities["final_output"],
                    next_stage_input=pipeline["next_stage_input"],
                    input_function=pipeline["input_function"],
                    transport=pipeline["transport"],
                    devices=pipeline["devices"],
                    published_keys=None if published is None else tuple(published),
                    model_class=pipeline["model_class"],
                    stream=None if stream is None else StreamSpec.from_dict(stream),
                    worker_cls=(workers or {}).get(stage, built_worker),
                    in_memory=stage in (workers or {}),
                )
            )
        return cls(
            name=name,
            title=plan["title"],
            arch=plan["arch"],
            source=plan["source"],
            async_chunk=plan["async_chunk"],
            package=stages[0].module.rsplit(".", 2)[0],
            checkpoint=BuiltCheckpoint(**checkpoint),
            model_classes=model_classes,
            stages=tuple(stages),
        )


def plan_file(model: str, package: str = COMMITTED_PACKAGE) -> Path:
    """Where ``package``'s ``<model>/plan.yaml`` is (found by import, not imported)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BuiltModelError(f"no built package {package!r}: build one with omnigen build")
    return Path(next(iter(spec.submodule_search_locations))) / model / "plan.yaml"


def load(model: str, package: str = COMMITTED_PACKAGE) -> BuiltModel:
    """The model ``omnigen build`` wrote under ``package``."""
    path = plan_file(model, package)
    if not path.is_file():
        raise BuiltModelError(
            f"{model}: {package} has no built model {model} ({path}); build it: omnigen build model={model}"
        )
    plan = yaml.safe_load(path.read_text())
    if "pipeline" not in next(iter(plan["stages"].values())):
        raise BuiltModelError(
            f"{path} was built by an older omnigen; rebuild it: omnigen build model={model}"
        )
    return BuiltModel.from_plan_dict(plan)
