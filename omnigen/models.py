"""A built model's declared classes, registered with vLLM in every process that serves it.

``conf/model/<model>.yaml`` names each stage's model class (``stages.S.model_class``), the
checkpoint's HF config class and who provides them (``checkpoint``); ``omnigen build`` records
them in the model's package (``omnigen.generated.<model>``: ``MODEL_CLASSES``, ``CONFIG_CLASS``,
...). ``register`` reads that record and registers exactly those classes: with vLLM's
``ModelRegistry`` (as classes: a class registered by name is inspected in a fresh interpreter,
which would import the provider's package and its patches) and the config class with
transformers' ``AutoConfig`` and vLLM's config registry.

Which models a process registers: the driver calls ``register`` itself before it starts the
engines, and starts them with ``OMNIGEN_MODELS`` naming the model, which omnigen's vLLM plugin
(``omnigen.plugin``) reads in every engine-core and worker process. ``vllm serve`` with a
generated worker: set ``OMNIGEN_MODELS=<model>`` and ``VLLM_PLUGINS=omnigen``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from omnigen.built import COMMITTED_PACKAGE

ENV = "OMNIGEN_MODELS"
"""Comma-separated models (``qwen3_tts``, or ``package:model`` for a variant tree) whose
declared classes omnigen's plugin registers in a vLLM process."""

_registered: set[tuple[str, str]] = set()


class ModelClassError(RuntimeError):
    """A declared class that cannot be loaded; the message names the stage, the class and the fix."""


@dataclass(frozen=True)
class Declared:
    """What a built model's package declares about the classes it serves."""

    model: str
    package: str
    archs: dict[str, str]
    """stage -> the architecture vLLM builds for it."""
    classes: dict[str, str]
    """arch -> dotted class path (the stages' and the extra ones)."""
    provider: str | None
    install: str | None
    config_class: str | None
    model_type: str | None
    request_builder: str | None

    @classmethod
    def from_plan(cls, plan: Any) -> Declared:
        """The same declarations read from a ``BuiltModel`` (or the ``ModelPlan`` it was built from)."""
        return cls(
            model=plan.name,
            package=plan.package,
            archs={s.stage: s.arch for s in plan.stages},
            classes=plan.model_classes,
            provider=plan.checkpoint.provider,
            install=plan.checkpoint.install,
            config_class=plan.checkpoint.config_class,
            model_type=plan.checkpoint.model_type,
            request_builder=plan.checkpoint.request_builder,
        )

    def stages_of(self, arch: str) -> list[str]:
        return [stage for stage, a in self.archs.items() if a == arch] or ["(a part another stage builds)"]


def declared(model: str, package: str = COMMITTED_PACKAGE) -> Declared:
    """The declarations of ``package.model`` (a package ``omnigen build`` wrote)."""
    module = _built_package(model, package)
    if not hasattr(module, "MODEL_CLASSES"):
        raise ModelClassError(
            f"{package}.{model} was built before models declared their classes; rebuild it: "
            f"omnigen build model={model}"
        )
    return Declared(
        model=model,
        package=package,
        archs=dict(module.ARCHS),
        classes=dict(module.MODEL_CLASSES),
        provider=module.PROVIDER,
        install=module.PROVIDER_INSTALL,
        config_class=module.CONFIG_CLASS,
        model_type=module.MODEL_TYPE,
        request_builder=module.REQUEST_BUILDER,
    )


def _built_package(model: str, package: str) -> ModuleType:
    try:
        return importlib.import_module(f"{package}.{model}")
    except ModuleNotFoundError as exc:
        raise ModelClassError(
            f"{model}: no built package {package}.{model} ({exc}); build it: omnigen build model={model}"
        ) from exc


def register(model: str, package: str = COMMITTED_PACKAGE) -> Declared:
    """Register ``model``'s declared classes in this process (idempotent)."""
    return register_declared(declared(model, package))


def register_declared(found: Declared) -> Declared:
    """Register what ``found`` declares in this process (idempotent per model and package)."""
    package, model = found.package, found.model
    if (package, model) in _registered:
        return found
    uses_vllm_omni = any(path.startswith("vllm_omni.") for path in _class_paths(found))
    if uses_vllm_omni:
        _check_provider(found)
        from omnigen.providers import vllm_omni

        vllm_omni.prepare()
    loaded = {arch: _load(found, path, arch) for arch, path in found.classes.items()}
    from vllm import ModelRegistry

    for arch, cls in loaded.items():
        ModelRegistry.register_model(arch, cls)
    if found.config_class is not None:
        _register_config(found)
    if uses_vllm_omni:
        from omnigen.providers import vllm_omni

        vllm_omni.after_import()
    _registered.add((package, model))
    return found


def register_from_env() -> list[str]:
    """Register every model ``OMNIGEN_MODELS`` names; returns them."""
    done = []
    for entry in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
        package, _, model = entry.rpartition(":")
        register(model, package or COMMITTED_PACKAGE)
        done.append(entry)
    return done


def env_value(model: str, package: str = COMMITTED_PACKAGE) -> str:
    """``OMNIGEN_MODELS``'s entry for ``model`` in ``package``."""
    return model if package == COMMITTED_PACKAGE else f"{package}:{model}"


def _class_paths(found: Declared) -> list[str]:
    return [*found.classes.values(), *([found.config_class] if found.config_class else [])]


def _check_provider(found: Declared) -> None:
    if importlib.util.find_spec("vllm_omni") is not None:
        return
    stages = ", ".join(f"{stage} ({found.classes.get(arch, arch)})" for stage, arch in found.archs.items())
    raise ModelClassError(
        f"{found.model}: its stages run {found.provider or 'vllm-omni'}'s model classes, which is not "
        f"installed: {stages}. Install it: {found.install or 'pip install vllm-omni'}"
    )


def _load(found: Declared, path: str, arch: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        stages = ", ".join(found.stages_of(arch))
        # The provider's own module missing: say how to install it; anything else (a package the
        # provider's module needs) is the exception's own message, on one line.
        missing = getattr(exc, "name", None) or ""
        install = (
            f"; install it: {found.install}"
            if found.install and missing.startswith(module_name.split(".")[0])
            else ""
        )
        raise ModelClassError(
            f"{found.model}: stage {stages} runs {arch} as {path}, which does not load: "
            f"{type(exc).__name__}: {' '.join(str(exc).split())}{install}"
        ) from exc


def _register_config(found: Declared) -> None:
    from transformers import AutoConfig
    from vllm.transformers_utils import config as vllm_config

    assert found.config_class is not None and found.model_type is not None
    cls = _load(found, found.config_class, found.model_type)
    try:
        AutoConfig.register(found.model_type, cls, exist_ok=True)
    except ValueError as exc:  # a config class whose own model_type differs
        raise ModelClassError(
            f"{found.model}: checkpoint.config_class {found.config_class} cannot be registered as "
            f"model_type {found.model_type!r}: {exc}"
        ) from exc
    # vLLM reads a checkpoint's config through its own registry before transformers' AutoConfig.
    vllm_config._CONFIG_REGISTRY[found.model_type] = cls
