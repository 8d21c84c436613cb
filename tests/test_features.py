"""omnigen.features, the one-switch stage features: each declared once, the rest derived from it.

A flag's config key must be a documented boolean stage key, its value must reach the plan as the
config set it, its clauses must be the plan's exactly when it is on, and a flag the spec or the plan
has no field for must fail when omnigen is imported, not when a template first reads it.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from omnigen import features, pipeline, render
from omnigen import plan as plan_module
from omnigen.keys import schema_keys
from omnigen.paths import model_names

STAGE_KEYS = {key.path: key for key in schema_keys()}


@pytest.mark.parametrize("flag", features.FLAGS, ids=lambda flag: flag.name)
def test_each_flags_key_is_a_documented_boolean_stage_key(flag):
    key = STAGE_KEYS.get(f"model.stages.STAGE.{flag.key}")
    assert key is not None, f"{flag.name}: no stage key {flag.key}"
    assert key.type == "bool" and key.doc, (flag.name, key.type, key.doc)


def test_flags_are_unique_and_their_clauses_are_the_contracts():
    names = [flag.name for flag in features.FLAGS]
    assert len(names) == len(set(names))
    for flag in features.FLAGS:
        assert set(flag.clauses) <= set(plan_module.CLAUSES), flag.name


@pytest.mark.parametrize("model", model_names())
def test_each_flag_reaches_the_plan_as_configured_and_brings_exactly_its_clauses(model):
    config = pipeline.compose_config(model)
    for stage in pipeline.model_plan(model).stages:
        stage_conf = config.model.stages[stage.stage]
        generation = stage.kind == "generation"
        for flag in features.FLAGS:
            configured = OmegaConf.select(stage_conf, flag.key)
            expected = bool(configured) and (generation or not flag.generation_only)
            assert getattr(stage, flag.name) is expected, (model, stage.stage, flag.name)
            # No other feature brings a flag's clauses, so they are there exactly when it is on.
            present = [clause for clause in flag.clauses if clause in stage.clauses]
            assert present == (list(flag.clauses) if expected else []), (model, stage.stage, flag.name)


def test_toggling_a_flag_by_its_key_changes_the_plan_and_the_generated_docstring():
    """The derived paths, end to end: the key in, the plan field, the clause and the wording out."""
    before = pipeline.model_plan("omnigen_tiny").stage("talker")
    assert not before.decode_step_metadata and "1.2" not in before.clauses
    after = pipeline.model_plan(
        "omnigen_tiny", ["model.stages.talker.outputs.decode_step_metadata=true"]
    ).stage("talker")
    assert after.decode_step_metadata and "1.2" in after.clauses
    assert "decode-step metadata hooks" in render._summary(after)
    assert "decode-step metadata hooks" not in render._summary(before)


def test_a_flag_the_plan_has_no_field_for_fails_at_import(monkeypatch):
    monkeypatch.setattr(
        plan_module, "FLAGS", (*features.FLAGS, features.Flag("no_such_feature", "outputs.multimodal"))
    )
    with pytest.raises(TypeError, match=r"no_such_feature.*StageSpec has no field"):
        plan_module._check_flag_fields()
