"""Declared model classes: recorded by the build, loaded by ``omnigen.models`` with clear errors."""

from __future__ import annotations

import importlib.util

import pytest

from omnigen import api, models


def test_the_built_package_records_what_the_config_declares():
    found = models.declared("qwen3_tts")
    prefix = "vllm_omni.model_executor.models.qwen3_tts."
    assert found.archs == {
        "qwen3_tts": "Qwen3TTSTalkerForConditionalGeneration",
        "code2wav": "Qwen3TTSCode2Wav",
    }
    assert found.classes == {
        "Qwen3TTSCode2Wav": prefix + "qwen3_tts_code2wav.Qwen3TTSCode2Wav",
        "Qwen3TTSTalkerForConditionalGeneration": prefix
        + "qwen3_tts_talker.Qwen3TTSTalkerForConditionalGeneration",
    }
    assert found.config_class == prefix + "configuration_qwen3_tts.Qwen3TTSConfig"
    assert found.model_type == "qwen3_tts"
    assert found.provider == "vllm-omni" and "omnigen[vllm-omni]" in found.install
    assert found.request_builder == "omnigen.requests.qwen3_tts.Qwen3TTSRequestBuilder"
    # The plan (plan.yaml) says the same as the package.
    assert models.Declared.from_plan(api.model_plan("qwen3_tts")) == found


def test_a_missing_provider_names_the_stages_the_classes_and_the_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm_omni" else real_find_spec(name, *a),
    )
    monkeypatch.setattr(models, "_registered", set())
    with pytest.raises(models.ModelClassError) as info:
        models.register("qwen3_tts")
    message = str(info.value)
    assert "qwen3_tts (vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker." in message
    assert (
        "code2wav (vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav.Qwen3TTSCode2Wav)" in message
    )
    assert "pip install 'omnigen[vllm-omni]'" in message


def _mine(path: str) -> models.Declared:
    return models.Declared(
        model="mine",
        package="nowhere",
        archs={"talker": "MyTalker"},
        classes={"MyTalker": path},
        provider="mine-provider",
        install="pip install mine-provider",
        config_class=None,
        model_type=None,
        request_builder=None,
    )


def test_a_class_that_does_not_load_names_its_stage_and_path():
    # The provider's module is not installed: the message says how to install it.
    with pytest.raises(models.ModelClassError) as info:
        models.register_declared(_mine("mine_provider.talker.MyTalker"))
    assert "stage talker runs MyTalker as mine_provider.talker.MyTalker" in str(info.value)
    assert "install it: pip install mine-provider" in str(info.value)
    # The module is there but has no such class: installing would not help, so no such advice.
    with pytest.raises(models.ModelClassError) as info:
        models.register_declared(_mine("omnigen_testing.tiny_omni.NoSuchClass"))
    assert "stage talker runs MyTalker as omnigen_testing.tiny_omni.NoSuchClass" in str(info.value)
    assert "AttributeError" in str(info.value) and "install" not in str(info.value)


def test_a_package_built_before_the_declarations_says_rebuild(tmp_path, monkeypatch):
    package = tmp_path / "old_tree" / "old_model"
    package.mkdir(parents=True)
    (tmp_path / "old_tree" / "__init__.py").write_text("")
    (package / "__init__.py").write_text('STAGES = ("talker",)\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(models.ModelClassError, match="omnigen build model=old_model"):
        models.declared("old_model", "old_tree")
    with pytest.raises(models.ModelClassError, match="no built package"):
        models.declared("never_built", "old_tree")


def test_the_environment_names_models_and_variant_trees(monkeypatch):
    registered = []
    monkeypatch.setattr(models, "register", lambda model, package: registered.append((package, model)))
    monkeypatch.setenv(models.ENV, " qwen3_tts, my.tree:my_model ,")
    assert models.register_from_env() == ["qwen3_tts", "my.tree:my_model"]
    assert registered == [("omnigen.generated", "qwen3_tts"), ("my.tree", "my_model")]
    assert models.env_value("qwen3_tts") == "qwen3_tts"
    assert models.env_value("my_model", "my.tree") == "my.tree:my_model"


def test_config_class_and_model_type_go_together():
    from omnigen.pipeline import ConfigError

    with pytest.raises(ConfigError, match="config_class and model_type go together"):
        api.model_plan("qwen3_tts", ["model.checkpoint.model_type=null"])
    with pytest.raises(ConfigError, match="is not a dotted path"):
        api.model_plan("qwen3_tts", ["model.stages.code2wav.model_class='not a path'"])


def test_checkpoint_strings_that_would_break_the_generated_package_are_refused():
    from omnigen.pipeline import ConfigError

    with pytest.raises(ConfigError, match="checkpoint.provider: 'two lines' is not a distribution name"):
        api.model_plan("fish_speech", ["model.checkpoint.provider='two lines'"])
    with pytest.raises(ConfigError, match="checkpoint.install: .* must be one line"):
        api.model_plan("fish_speech", ["model.checkpoint.install=' '"])
