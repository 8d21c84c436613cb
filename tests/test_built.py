"""Serving starts from the built package: ``omnigen.built`` reads ``generated/<model>/plan.yaml``
back, and serving never composes or plans a model (also held statically by ``.importlinter``)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omnigen import api, built, paths, pipeline

SERVING_FIELDS = (
    "stage",
    "order",
    "module",
    "runner_class",
    "worker_class",
    "arch",
    "next_stage_input",
    "input_function",
    "transport",
    "devices",
    "published_keys",
    "model_class",
    "stream",
    "is_generation",
)


@pytest.mark.parametrize("model", paths.shipped_model_names())
def test_the_built_model_is_what_its_plan_decides(model):
    plan = pipeline.model_plan(model)
    served = built.load(model)
    assert (served.name, served.title, served.package) == (plan.name, plan.title, plan.package)
    assert served.model_classes == plan.model_classes
    assert served.checkpoint.request_builder == plan.checkpoint.request_builder
    assert served.checkpoint.synthetic == plan.checkpoint.synthetic
    assert [s.stage for s in served.stages] == [s.stage for s in plan.stages]
    for ours, decided in zip(served.stages, plan.stages, strict=True):
        for name in SERVING_FIELDS:
            assert getattr(ours, name) == getattr(decided, name), f"{model}.{ours.stage}.{name}"
        assert (ours.kind, ours.final_output) == (decided.kind, decided.final_output)
        assert ours.worker_cls == f"{decided.module}.{decided.worker_class}" and not ours.in_memory


def test_a_missing_or_outdated_built_model_says_how_to_build_it(tmp_path, monkeypatch):
    with pytest.raises(built.BuiltModelError, match=r"no built model nosuch.*omnigen build model=nosuch"):
        built.load("nosuch")
    # A tree built before plan.yaml recorded what the pipeline runs.
    plan = yaml.safe_load(built.plan_file("omnigen_tiny").read_text())
    for stage in plan["stages"].values():
        del stage["pipeline"]
    old = tmp_path / "omnigen_tiny" / "plan.yaml"
    old.parent.mkdir()
    old.write_text(yaml.safe_dump(plan))
    monkeypatch.setattr(built, "plan_file", lambda model, package=built.COMMITTED_PACKAGE: old)
    with pytest.raises(
        built.BuiltModelError, match=r"older omnigen; rebuild it: omnigen build model=omnigen_tiny"
    ):
        built.load("omnigen_tiny")


def test_a_variant_that_changes_no_module_is_the_built_one():
    kept = api.served_model("omnigen_tiny", ["model.stages.talker.transport=inline", "serve.max_tokens=3"])
    assert kept.stage("talker").transport == "inline" != built.load("omnigen_tiny").stage("talker").transport
    assert not any(s.in_memory for s in kept.stages)
    assert api.served_model("omnigen_tiny", ["serve.max_tokens=3"]) == built.load("omnigen_tiny")


def test_a_variant_is_composed_planned_and_rendered_once(monkeypatch):
    """``omnigen run``'s path: the caller's composed config is planned once, each file rendered
    once, and the changed stage's worker is the rendered module's (its V2 target included)."""
    from omnigen import pipeline, render

    overrides = ["model.stages.talker.sampler=model", "serve.max_tokens=3"]
    cfg = pipeline.compose_config("omnigen_tiny", overrides)
    calls = {"compose": 0, "render": 0}
    compose, render_files = pipeline.compose_config, render.model_files

    def counted_compose(*args, **kwargs):
        calls["compose"] += 1
        return compose(*args, **kwargs)

    def counted_render(*args, **kwargs):
        calls["render"] += 1
        return render_files(*args, **kwargs)

    monkeypatch.setattr(pipeline, "compose_config", counted_compose)
    monkeypatch.setattr(render, "model_files", counted_render)
    variant = api.served_model("omnigen_tiny", overrides, cfg=cfg)
    assert calls == {"compose": 0, "render": 1}
    talker = variant.stage("talker")
    assert talker.in_memory and not variant.stage("code2wav").in_memory
    module_name, worker_name = talker.worker_cls.rsplit(".", 1)
    worker_module = importlib.import_module(module_name)
    assert hasattr(worker_module, worker_name)
    # sampler=model: the variant's runner has the model's own sampler (7.4); the committed one has not.
    plan = pipeline.plan_from_config(cfg, "omnigen_tiny")
    runner_name = plan.stage("talker").runner_class
    assert "_sample" in vars(getattr(worker_module, runner_name))
    committed = importlib.import_module("omnigen.generated.omnigen_tiny.talker")
    assert "_sample" not in vars(getattr(committed, runner_name))
    v2 = importlib.import_module(f"{module_name}_v2")
    assert calls["render"] == 1, "the V2 target comes from the same rendering"
    assert v2.__file__ == "<omnigen omnigen_tiny.talker model.stages.talker.sampler=model (V2 target)>"


def test_starting_serving_loads_no_generator():
    """Importing the server, the driver and the settings, and reading a built model, loads none
    of the modules that compose or plan a config."""
    code = (
        "import sys\n"
        "import omnigen.serving.http, omnigen.serving.pipeline, omnigen.serving.settings\n"
        "from omnigen import built\n"
        "built.load('qwen3_omni')\n"
        "gen = ('omnigen.schema', 'omnigen.spec', 'omnigen.plan', 'omnigen.render', 'omnigen.pipeline',"
        " 'omnigen.api', 'hydra')\n"
        "print(sorted(m for m in sys.modules if m.startswith(gen)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[1],
        timeout=300,
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
