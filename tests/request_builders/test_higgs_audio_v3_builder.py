"""Higgs Audio v3's request builder on the tiny checkpoint's config and tokenizer (no vllm-omni:
the differential test against its serving layer is tests/oracle/test_higgs_audio_v3_builder.py).

Expected prompts are spelled from the case's vocabulary (``testing/real/cases/higgs_audio_v3.py``:
``<unk>`` 0, the words from 1, the specials after them), not by the tokenizer the builder uses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omnigen.requests.base import RequestError, SpeechInput
from omnigen.requests.higgs_audio_v3 import (
    CLONING_REFUSED,
    UNUSED_OPTIONS,
    HiggsAudioV3RequestBuilder,
)
from omnigen_testing.real.cases import higgs_audio_v3 as tiny


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def checkpoint(folder: Path, **changes) -> Path:
    """The case's config and tokenizer; ``changes`` update config.json (None removes a key)."""
    tiny.write_checkpoint(folder)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return folder


@pytest.fixture
def higgs(tmp_path: Path) -> HiggsAudioV3RequestBuilder:
    return HiggsAudioV3RequestBuilder(checkpoint(tmp_path / "ck"), default_max_tokens=2048)


def word_ids(text: str) -> list[int]:
    return [tiny.WORDS.index(word) + 1 if word in tiny.WORDS else 0 for word in text.split()]


def test_the_prompt_is_the_text_between_the_specials(higgs) -> None:
    built = higgs.build(SpeechInput(input="hello world the lazy dog"))
    assert built.prompt == {
        "prompt_token_ids": [tiny.TTS, tiny.TEXT, *word_ids("hello world the lazy dog"), tiny.AUDIO]
    }
    assert built.payload == {}
    assert built.max_tokens is None  # the configured budget (serve.sampling.talker.max_tokens)
    assert built.sampling == {"stop_token_ids": [tiny.EOS, tiny.AUDIO_END]}


def test_unknown_words_are_the_tokenizers_unknown_id(higgs) -> None:
    ids = higgs.build(SpeechInput(input="Hello from omnigen.")).prompt["prompt_token_ids"]
    assert ids == [tiny.TTS, tiny.TEXT, 0, 0, 0, tiny.AUDIO]


def test_max_new_tokens_is_the_talkers_budget(higgs) -> None:
    assert higgs.build(SpeechInput(input="hello", max_new_tokens=30)).max_tokens == 30


@pytest.mark.parametrize("text", ["", "   ", "\n"])
def test_empty_input(higgs, text: str) -> None:
    with pytest.raises(RequestError) as info:
        higgs.build(SpeechInput(input=text))
    assert info.value.field == "input"


def test_voices(higgs) -> None:
    assert higgs.voices() == [] and higgs.default_voice() is None
    for voice in ("default", "Default"):
        assert (
            higgs.build(SpeechInput(input="hello", voice=voice)).prompt
            == higgs.build(SpeechInput(input="hello")).prompt
        )
    with pytest.raises(RequestError) as info:
        higgs.build(SpeechInput(input="hello", voice="alloy"))
    assert info.value.field == "voice" and info.value.allowed == ["default"]
    assert "no built-in voices" in str(info.value)


def test_voice_cloning_is_refused_saying_why(higgs, tmp_path: Path) -> None:
    from tests.request_builders import data_uri, wav_bytes

    for ref_text in (None, "hello world"):
        with pytest.raises(RequestError) as info:
            higgs.build(SpeechInput(input="hello", ref_audio=data_uri(wav_bytes(1.0)), ref_text=ref_text))
        assert info.value.field == "ref_audio" and str(info.value) == f"ref_audio: {CLONING_REFUSED}"
    assert "torchaudio" in CLONING_REFUSED and "HiggsAudioV2TokenizerModel" in CLONING_REFUSED
    with pytest.raises(RequestError) as info:
        higgs.build(SpeechInput(input="hello", ref_text="hello world"))
    assert info.value.field == "ref_text"


@pytest.mark.parametrize(
    "name,value",
    [
        ("language", "English"),
        ("instructions", "a calm voice"),
        ("task_type", "Base"),
        ("x_vector_only_mode", False),
        ("speaker_embedding", (0.0, 1.0)),
        ("non_streaming_mode", True),
    ],
)
def test_options_the_model_does_not_have_are_refused(higgs, name: str, value) -> None:
    assert name in UNUSED_OPTIONS
    with pytest.raises(RequestError) as info:
        higgs.build(SpeechInput(input="hello", **{name: value}))
    assert info.value.field == name


def test_sample_rate_is_the_checkpoints(tmp_path: Path) -> None:
    assert HiggsAudioV3RequestBuilder(checkpoint(tmp_path / "a")).sample_rate() == 24000
    assert HiggsAudioV3RequestBuilder(checkpoint(tmp_path / "b", sample_rate=16000)).sample_rate() == 16000
    # HiggsAudioV3Config's default when config.json names none.
    assert HiggsAudioV3RequestBuilder(checkpoint(tmp_path / "c", sample_rate=None)).sample_rate() == 24000


def test_stop_ids_come_from_the_checkpoint(tmp_path: Path) -> None:
    # No eos_token_id in config.json: the tokenizer's eos token.
    folder = checkpoint(tmp_path / "ck", eos_token_id=None)
    assert HiggsAudioV3RequestBuilder(folder).stop_token_ids == [tiny.EOS, tiny.AUDIO_END]
    folder = checkpoint(tmp_path / "ck2", eos_token_id=7)
    assert HiggsAudioV3RequestBuilder(folder).stop_token_ids == [7, tiny.AUDIO_END]


def test_bad_checkpoints_are_refused_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json is missing"):
        HiggsAudioV3RequestBuilder(tmp_path)
    with pytest.raises(ValueError, match="model_type is 'qwen3_tts', not 'higgs_multimodal_qwen3'"):
        HiggsAudioV3RequestBuilder(checkpoint(tmp_path / "q", model_type="qwen3_tts"))
    folder = checkpoint(tmp_path / "t")
    data = json.loads((folder / "tokenizer.json").read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<|tts|>"]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"lacks the added tokens <\|tts\|>"):
        HiggsAudioV3RequestBuilder(folder)


def test_serve_settings_of_a_checkpoint_folder(tmp_path: Path) -> None:
    """``omnigen run``/``serve`` with ``serve.checkpoint=DIR``: conf/serve/higgs_audio_v3.yaml is
    chosen, one folder serves both stages (each its own architecture), code2wav's context is lifted
    past the backbone's positions, and the sample rate is the checkpoint's."""
    from omnigen import pipeline
    from omnigen.pipeline_commands import serve_overrides
    from omnigen.serving.settings import read_settings, sampling_of

    folder = checkpoint(tmp_path / "ck", sample_rate=22050)
    overrides = serve_overrides("higgs_audio_v3", [f"serve.checkpoint={folder}"])
    assert overrides[0] == "serve=higgs_audio_v3"
    cfg = pipeline.compose_config("higgs_audio_v3", overrides)
    plan = pipeline.plan_from_config(cfg, "higgs_audio_v3", overrides)
    settings = read_settings(cfg, plan)
    assert settings.stage_models == {"talker": str(folder), "code2wav": str(folder)}
    assert isinstance(settings.builder, HiggsAudioV3RequestBuilder)
    assert settings.sample_rate == 22050
    assert settings.engine_kwargs["talker"]["hf_overrides"] == {"architectures": [tiny.ARCH]}
    assert settings.engine_kwargs["code2wav"]["hf_overrides"] == {
        "text_config": {"max_position_embeddings": 65536},
        "architectures": [tiny.CODE2WAV_ARCH],
    }
    built = settings.builder.build(SpeechInput(input="hello world"))
    talker = sampling_of(settings, plan, 7, built.max_tokens, built.sampling)["talker"]
    assert (talker.temperature, talker.top_p, talker.top_k, talker.max_tokens) == (1.0, 0.95, 50, 2048)
    assert talker.stop_token_ids == [tiny.EOS, tiny.AUDIO_END] and talker.seed == 7
    assert not talker.ignore_eos and not talker.detokenize


def test_module_imports_nothing_heavy() -> None:
    code = (
        "import sys, omnigen.requests.higgs_audio_v3\n"
        "heavy = {'torch', 'transformers', 'numpy', 'soundfile', 'vllm', 'vllm_omni'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
