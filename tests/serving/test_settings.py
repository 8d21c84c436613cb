"""``omnigen run``/``serve``'s settings: one checkpoint for every stage, per-model serve configs,
per-stage sampling, and each bad setting named with its fix."""

from __future__ import annotations

import pytest

from omnigen import api, pipeline
from omnigen.pipeline_commands import serve_overrides
from omnigen.serving.settings import SettingsError, read_settings, sampling_of


def _settings(model: str, overrides: list[str]):
    overrides = serve_overrides(model, overrides)
    cfg = pipeline.compose_config(model, overrides)
    return read_settings(cfg, api.served_model(model, overrides)), overrides


@pytest.fixture()
def checkpoint(tmp_path):
    from omnigen_testing.checkpoints import write_qwen3_tts

    return write_qwen3_tts(tmp_path / "ckpt", "custom_voice")


def test_the_models_serve_config_is_chosen_and_one_folder_serves_every_stage(checkpoint):
    settings, overrides = _settings("qwen3_tts", [f"serve.checkpoint={checkpoint}"])
    assert overrides[0] == "serve=qwen3_tts"
    assert settings.stage_models == {"qwen3_tts": str(checkpoint), "code2wav": str(checkpoint)}
    # Each stage's engine builds its own architecture from the one folder.
    assert settings.engine_kwargs["qwen3_tts"]["hf_overrides"] == {
        "architectures": ["Qwen3TTSTalkerForConditionalGeneration"]
    }
    assert settings.engine_kwargs["code2wav"]["hf_overrides"] == {"architectures": ["Qwen3TTSCode2Wav"]}
    # The sample rate is the checkpoint's (speech_tokenizer/config.json), not a serve default.
    assert settings.sample_rate == 24000
    assert settings.builder is not None and "ryan" in settings.builder.voices()


def test_serve_models_stage_works_as_the_readme_writes_it(checkpoint, tmp_path):
    other = tmp_path / "elsewhere"
    settings, _ = _settings(
        "qwen3_tts",
        [
            f"serve.models.qwen3_tts={checkpoint}",
            f"serve.models.code2wav={other}",
            "serve.engine.dtype=bfloat16",
        ],
    )
    assert settings.stage_models == {"qwen3_tts": str(checkpoint), "code2wav": str(other)}
    assert settings.engine_kwargs["code2wav"]["dtype"] == "bfloat16"


def test_a_stage_without_a_checkpoint_says_how_to_give_one():
    with pytest.raises(SettingsError) as info:
        _settings("qwen3_tts", [])
    assert "serve.models.qwen3_tts: no checkpoint for stage 'qwen3_tts'; set serve.checkpoint=DIR" in str(
        info.value
    )
    assert "serve.models.code2wav" in str(info.value)


def test_a_folder_that_is_not_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(SettingsError, match="is not a checkpoint folder .no config.json."):
        _settings("qwen3_tts", [f"serve.checkpoint={tmp_path}"])


def test_sampling_fields_and_stages_are_checked(checkpoint):
    with pytest.raises(SettingsError) as info:
        _settings(
            "qwen3_tts",
            [
                f"serve.checkpoint={checkpoint}",
                "serve.sampling.qwen3_tts.top_kk=5",
                "serve.sampling.talker.top_k=5",
            ],
        )
    message = str(info.value)
    assert "serve.sampling.qwen3_tts.top_kk: not a SamplingParams field" in message
    assert "serve.sampling.talker: qwen3_tts has no stage 'talker'" in message


def test_per_stage_sampling_then_the_builder_then_the_request(checkpoint):
    settings, _ = _settings(
        "qwen3_tts", [f"serve.checkpoint={checkpoint}", "serve.sampling.qwen3_tts.top_k=7"]
    )
    plan = api.served_model("qwen3_tts")
    found = sampling_of(settings, plan, seed=5, max_tokens=9, first_stage={"stop_token_ids": [150]})
    talker = found["qwen3_tts"]
    assert (talker.temperature, talker.top_k, talker.min_tokens, talker.repetition_penalty) == (
        0.9,
        7,
        2,
        1.05,
    )
    assert talker.max_tokens == 9 and talker.seed == 5 and talker.extra_args == {"tts_local_seed": 5}
    assert talker.stop_token_ids == [150] and not talker.ignore_eos and not talker.detokenize
    assert found["code2wav"].max_tokens == 1


def test_a_model_without_a_builder_refuses_options_it_does_not_have():
    from omnigen.requests.base import RequestError, SpeechInput
    from omnigen.serving.settings import build_request

    settings, _ = _settings("omnigen_tiny", [])
    assert build_request(settings, SpeechInput(input="hi")).prompt == {"prompt_token_ids": [114, 115]}
    with pytest.raises(RequestError, match="voice: omnigen_tiny takes no voice"):
        build_request(settings, SpeechInput(input="hi", voice="ryan"))


def test_a_real_model_without_a_request_builder_is_refused_not_fed_raw_text(tmp_path):
    with pytest.raises(SettingsError, match="fish_speech: omnigen has no request builder for Fish Speech"):
        _settings("fish_speech", [f"serve.checkpoint={tmp_path}"])


def test_requests_the_engines_cannot_run_here_or_files_outside_the_allowed_folder_are_refused(
    checkpoint, tmp_path, monkeypatch
):
    from omnigen.providers import vllm_omni
    from omnigen.requests.base import RequestError, SpeechInput
    from omnigen.serving.settings import build_request

    base = tmp_path / "base"
    from omnigen_testing.checkpoints import write_qwen3_tts

    write_qwen3_tts(base, "base")
    clip = tmp_path / "clips" / "me.wav"
    clip.parent.mkdir()
    import numpy as np
    import soundfile

    soundfile.write(clip, np.zeros(24000, dtype=np.float32), 24000)
    speech = SpeechInput(input="hello world", ref_audio=str(clip), ref_text="hello world")

    settings, _ = _settings("qwen3_tts", [f"serve.checkpoint={base}"])
    monkeypatch.setattr(vllm_omni, "module_installed", lambda name: name != "torchaudio")
    with pytest.raises(
        RequestError, match="ref_audio: this request needs torchaudio in the stages' processes"
    ):
        build_request(settings, speech)

    monkeypatch.setattr(vllm_omni, "module_installed", lambda name: True)
    with pytest.raises(
        RequestError, match="ref_audio: a local file is read only under serve.allowed_local_media_path"
    ):
        build_request(settings, speech, from_network=True)
    assert build_request(settings, speech).payload["ref_audio"]  # omnigen run: the user's own file
    allowed, _ = _settings(
        "qwen3_tts", [f"serve.checkpoint={base}", f"serve.allowed_local_media_path={clip.parent}"]
    )
    assert build_request(allowed, speech, from_network=True).payload["ref_audio"]
    elsewhere, _ = _settings(
        "qwen3_tts", [f"serve.checkpoint={base}", f"serve.allowed_local_media_path={base}"]
    )
    with pytest.raises(RequestError, match="allowed_local_media_path"):
        build_request(elsewhere, speech, from_network=True)


def test_a_budget_under_the_floor_lowers_the_floor(checkpoint):
    settings, _ = _settings("qwen3_tts", [f"serve.checkpoint={checkpoint}"])
    talker = sampling_of(settings, api.served_model("qwen3_tts"), seed=None, max_tokens=1)["qwen3_tts"]
    assert (talker.max_tokens, talker.min_tokens) == (1, 1)
    assert settings.builder.default_max_tokens == 4096
