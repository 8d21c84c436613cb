"""The spec and the plan check what they may never say when they are built (a planner bug, not a
user's error: a user's mistake is a finding with its key, reported before any of this)."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from omnigen import paths, pipeline
from omnigen.plan import MTPPlan
from omnigen.schema import DecodeBatch, Device, FinalOutput, MTPGraph, PerRowGenerators, StageKind, Transport
from omnigen.spec import build_spec

CHOICES = {
    "device": Device,
    "kind": StageKind,
    "final_output": FinalOutput,
    "decode_batch": DecodeBatch,
    "transport": Transport,
}


@pytest.mark.parametrize("model", paths.model_names())
def test_choices_stay_enums_in_the_plan_and_are_their_values_in_plan_yaml(model):
    plan = pipeline.model_plan(model)
    assert isinstance(plan.device, Device)
    written = yaml.safe_load((paths.generated_dir() / model / "plan.yaml").read_text())
    for stage in plan.stages:
        for name, enum in CHOICES.items():
            assert isinstance(getattr(stage, name), enum), (model, stage.stage, name)
        if stage.mtp is not None:
            assert stage.mtp.graph in (MTPGraph.safe, MTPGraph.unsafe)
            assert isinstance(stage.mtp.per_row_generators, PerRowGenerators)
        capabilities = written["stages"][stage.stage]["capabilities"]
        assert capabilities["kind"] == stage.kind.value and type(capabilities["kind"]) is str
        assert capabilities["decode_batch"] == stage.decode_batch.value
        assert written["stages"][stage.stage]["pipeline"]["transport"] == stage.transport.value


def talker():
    return pipeline.model_plan("omnigen_tiny").stage("talker")


@pytest.mark.parametrize("name", sorted(CHOICES))
def test_a_plan_with_a_choice_as_text_is_refused(name):
    with pytest.raises(
        TypeError, match=f"plan of omnigen_tiny.talker: {name} must be a {CHOICES[name].__name__}"
    ):
        dataclasses.replace(talker(), **{name: getattr(talker(), name).value})


@pytest.mark.parametrize(
    ("changes", "rule"),
    [
        ({"producer": False, "next_stage_input": None}, "accumulates_full_payload needs a producer"),
        ({"mtp": None}, "decode_batch mtp needs an MTP"),
        ({"kind": StageKind.generation}, "an MTP runs on an autoregressive stage"),
        ({"clauses": ("8.2", "1.1")}, "clauses are known, unique and in CLAUSES order"),
        ({"clauses": ("1.1", "no-such-clause")}, "clauses are known, unique and in CLAUSES order"),
        (
            {"defers_full_payload_d2h": True},
            "defers_full_payload_d2h needs accumulates_full_payload and request_end_payload",
        ),
    ],
)
def test_a_plan_that_breaks_an_implication_is_refused_naming_it(changes, rule):
    stage = talker()
    assert (
        stage.accumulates_full_payload
        and stage.decode_batch is DecodeBatch.mtp
        and not stage.request_end_payload
    )
    with pytest.raises(ValueError, match=f"plan of omnigen_tiny.talker: .*{rule}"):
        dataclasses.replace(stage, **changes)


def test_an_mtp_plan_holds_a_resolved_graph_policy():
    mtp = talker().mtp
    with pytest.raises(ValueError, match="resolved to safe or unsafe"):
        dataclasses.replace(mtp, graph=MTPGraph.auto)
    with pytest.raises(TypeError, match="per_row_generators must be a PerRowGenerators"):
        dataclasses.replace(mtp, per_row_generators="never")
    assert isinstance(mtp, MTPPlan)


def test_a_spec_with_a_choice_as_text_is_refused():
    build = build_spec(pipeline.compose_config("omnigen_tiny"), "omnigen_tiny")
    stage = build.model.stages[0]
    with pytest.raises(TypeError, match=f"spec of stage {stage.name}: kind must be a StageKind"):
        dataclasses.replace(stage, kind="ar")
