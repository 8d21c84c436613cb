"""Qwen3-TTS's request builder on tiny checkpoints (no vllm-omni: the differential test against
its serving layer is tests/oracle/test_request_builders.py).

Prompt lengths are counted by hand with the case's word-level tokenizer (one token per word,
``<|im_start|>``, ``<|im_end|>`` and each newline): the chat template of a text of w words is
w + 8 tokens, an instruct turn of w words w + 5, a reference transcript's w + 5.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from omnigen.requests.base import RequestError, SpeechInput
from omnigen.requests.qwen3_tts import (
    EFFECTIVE_MAX_TOKENS_KEY,
    PLACEHOLDER_ID,
    REF_AUDIO_ARTIFACT_KEY,
    PromptLengthError,
    Qwen3TTSRequestBuilder,
    prompt_length,
)
from tests.request_builders import CODEC_FRAME_RATE, data_uri, qwen3_tts_checkpoint, wav_bytes


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def builder(
    tmp_path: Path, variant: str, default_max_tokens: int | None = 4096, **changes
) -> Qwen3TTSRequestBuilder:
    folder = qwen3_tts_checkpoint(tmp_path / variant, variant, **changes)
    return Qwen3TTSRequestBuilder(folder, default_max_tokens=default_max_tokens)


@pytest.fixture
def custom(tmp_path: Path) -> Qwen3TTSRequestBuilder:
    return builder(tmp_path, "custom_voice")


@pytest.fixture
def design(tmp_path: Path) -> Qwen3TTSRequestBuilder:
    return builder(tmp_path, "voice_design")


@pytest.fixture
def base(tmp_path: Path) -> Qwen3TTSRequestBuilder:
    return builder(tmp_path, "base")


def length(built) -> int:
    ids = built.prompt["prompt_token_ids"]
    assert set(ids) == {PLACEHOLDER_ID}
    return len(ids)


def refused(builder_: Qwen3TTSRequestBuilder, **fields) -> RequestError:
    with pytest.raises(RequestError) as info:
        builder_.build(SpeechInput(**fields))
    return info.value


# -- what the checkpoint offers -----------------------------------------------------------------


def test_custom_voice_checkpoint_offers_its_speakers_and_languages(custom: Qwen3TTSRequestBuilder) -> None:
    assert custom.task == "CustomVoice"
    assert custom.voices() == ["alice", "bob", "chen"]  # config order, lowercased
    assert custom.default_voice() == "alice"
    assert custom.languages() == ["Auto", "Chinese", "English", "Sichuan_Dialect"]
    assert custom.sample_rate() == 24000
    assert custom.codec_frame_rate() == CODEC_FRAME_RATE


def test_other_variants_have_no_named_voices(
    design: Qwen3TTSRequestBuilder, base: Qwen3TTSRequestBuilder
) -> None:
    # The VoiceDesign checkpoint's config still lists a speaker: its task cannot use it.
    assert (design.task, design.voices(), design.default_voice()) == ("VoiceDesign", [], None)
    assert (base.task, base.voices(), base.default_voice()) == ("Base", [], None)
    assert design.languages() == ["Auto", "Chinese", "English"]


def test_sample_rate_and_frame_rate_come_from_the_speech_tokenizer(tmp_path: Path) -> None:
    b = builder(tmp_path, "base", speech={"output_sample_rate": 16000, "encode_downsample_rate": 1280})
    assert b.sample_rate() == 16000
    assert b.codec_frame_rate() == 12.5


def test_without_a_language_table_only_auto_is_allowed(tmp_path: Path) -> None:
    b = builder(tmp_path, "voice_design", talker={"codec_language_id": None})
    assert b.languages() == ["Auto"]
    error = refused(b, input="hello", language="English", instructions="a calm voice")
    assert (error.field, error.allowed) == ("language", ["Auto"])


@pytest.mark.parametrize("kind", [None, "omni", 3])
def test_checkpoint_without_a_known_variant_is_refused(tmp_path: Path, kind) -> None:
    folder = qwen3_tts_checkpoint(tmp_path / "ck", "base", config={"tts_model_type": kind})
    with pytest.raises(ValueError, match="tts_model_type"):
        Qwen3TTSRequestBuilder(folder)


@pytest.mark.parametrize("spelling", ["CustomVoice", "custom-voice", "CUSTOM_VOICE"])
def test_variant_spellings(tmp_path: Path, spelling: str) -> None:
    folder = qwen3_tts_checkpoint(tmp_path / "ck", spelling)
    assert Qwen3TTSRequestBuilder(folder).task == "CustomVoice"


# -- CustomVoice --------------------------------------------------------------------------------


def test_custom_voice_default_request(custom: Qwen3TTSRequestBuilder) -> None:
    built = custom.build(SpeechInput(input="hello world"))
    assert built.payload == {
        "text": ["hello world"],
        "task_type": ["CustomVoice"],
        "language": ["Auto"],
        "speaker": ["alice"],
        "instruct": [""],
        "max_new_tokens": [2048],
        EFFECTIVE_MAX_TOKENS_KEY: [4096],
    }
    assert list(built.payload) == [
        "text",
        "task_type",
        "language",
        "speaker",
        "instruct",
        "max_new_tokens",
        EFFECTIVE_MAX_TOKENS_KEY,
    ]
    # role 3 + think tags 3 + speaker 1 + codec pad 1, then the text non-streaming: 10 - 6.
    assert length(built) == 8 + 4
    assert built.max_tokens == 4096
    assert built.sampling == {"stop_token_ids": [150]}  # talker_config.codec_eos_token_id
    assert isinstance(built.prompt["cache_salt"], str) and len(built.prompt["cache_salt"]) == 32


@pytest.mark.parametrize("voice", ["Bob", "BOB", "bob"])
def test_voice_is_case_insensitive(custom: Qwen3TTSRequestBuilder, voice: str) -> None:
    built = custom.build(SpeechInput(input="hello", voice=voice, language="english"))
    assert built.payload["speaker"] == ["bob"]
    assert built.payload["voice_created_at"] == [0]
    assert built.payload["language"] == ["English"]
    assert length(built) == 3 + 4 + 1 + 1 + 3  # a language id: four think tags


@pytest.mark.parametrize("voice", ["default", "Default"])
def test_default_voice_is_the_first_speaker(custom: Qwen3TTSRequestBuilder, voice: str) -> None:
    assert (
        custom.build(SpeechInput(input="hello", voice=voice)).payload
        == custom.build(SpeechInput(input="hello")).payload
    )


def test_dialect_speaker_gets_its_dialect_id(custom: Qwen3TTSRequestBuilder) -> None:
    # Auto: three think tags, but chen speaks sichuan_dialect, whose language id makes four.
    assert length(custom.build(SpeechInput(input="hello", voice="bob"))) == 8 + 3
    for language in ("Auto", None, "Chinese", "English", "Sichuan_Dialect"):
        assert length(custom.build(SpeechInput(input="hello", voice="chen", language=language))) == 9 + 3


def test_streaming_prompt_holds_the_first_text_token(custom: Qwen3TTSRequestBuilder) -> None:
    built = custom.build(SpeechInput(input="the quick brown fox", non_streaming_mode=False))
    assert built.payload["non_streaming_mode"] == [False]
    assert length(built) == 8 + 1
    explicit = custom.build(SpeechInput(input="the quick brown fox", non_streaming_mode=True))
    assert length(explicit) == 8 + 12 - 6


def test_instructions_are_a_user_turn(custom: Qwen3TTSRequestBuilder) -> None:
    built = custom.build(SpeechInput(input="hello", instructions="a calm voice"))
    assert built.payload["instruct"] == ["a calm voice"]
    assert length(built) == 8 + 8 + 3
    # Whitespace-only instructions add no turn, as the talker builds none.
    assert length(custom.build(SpeechInput(input="hello", instructions="  "))) == 8 + 3


def test_max_new_tokens_is_the_budget(custom: Qwen3TTSRequestBuilder, tmp_path: Path) -> None:
    built = custom.build(SpeechInput(input="hello", max_new_tokens=77))
    assert built.payload["max_new_tokens"] == [77]
    assert built.payload[EFFECTIVE_MAX_TOKENS_KEY] == [77]
    assert built.max_tokens == 77
    unconfigured = builder(tmp_path / "u", "custom_voice", default_max_tokens=None)
    plain = unconfigured.build(SpeechInput(input="hello"))
    assert plain.max_tokens is None and EFFECTIVE_MAX_TOKENS_KEY not in plain.payload


def test_cache_salt_follows_the_conditioning(custom: Qwen3TTSRequestBuilder) -> None:
    a = custom.build(SpeechInput(input="hello world", voice="alice"))
    b = custom.build(SpeechInput(input="hello world", voice="bob"))
    assert length(a) == length(b)
    assert a.prompt["cache_salt"] != b.prompt["cache_salt"]
    assert (
        a.prompt["cache_salt"]
        == custom.build(SpeechInput(input="hello world", voice="ALICE")).prompt["cache_salt"]
    )


# -- VoiceDesign --------------------------------------------------------------------------------


def test_voice_design_known_lengths(design: Qwen3TTSRequestBuilder) -> None:
    # testing/real/cases/qwen3_tts_talker.py's requests: 23 and 8.
    built = design.build(
        SpeechInput(input="the quick brown fox jumps", language="English", instructions="a calm voice")
    )
    assert built.payload == {
        "text": ["the quick brown fox jumps"],
        "task_type": ["VoiceDesign"],
        "language": ["English"],
        "instruct": ["a calm voice"],
        "max_new_tokens": [2048],
        "non_streaming_mode": [True],
        EFFECTIVE_MAX_TOKENS_KEY: [4096],
    }
    assert length(built) == 23
    streaming = design.build(
        SpeechInput(input="hello world the lazy dog over", instructions="x", non_streaming_mode=False)
    )
    assert length(streaming) == 6 + 3 + 3 + 1 + 1


def test_voice_design_task_may_be_named(design: Qwen3TTSRequestBuilder) -> None:
    named = design.build(SpeechInput(input="hello", instructions="deep", task_type="VoiceDesign"))
    implied = design.build(SpeechInput(input="hello", instructions="deep"))
    assert named.payload == implied.payload


# -- Base ---------------------------------------------------------------------------------------


def test_base_in_context_streaming(base: Qwen3TTSRequestBuilder) -> None:
    uri = data_uri(wav_bytes(2.0))
    built = base.build(SpeechInput(input="the quick brown fox", ref_audio=uri, ref_text="hello world"))
    payload = built.payload
    assert list(payload) == [
        "text",
        "task_type",
        "language",
        "instruct",
        "ref_text",
        "max_new_tokens",
        "ref_audio_cache_key",
        REF_AUDIO_ARTIFACT_KEY,
        "ref_code_length",
        "ref_audio",
        EFFECTIVE_MAX_TOKENS_KEY,
    ]
    assert payload["task_type"] == ["Base"] and payload["ref_text"] == ["hello world"]
    [[samples, rate]] = payload["ref_audio"]
    assert rate == 24000 and len(samples) == 48000 and isinstance(samples, list)
    assert payload["ref_code_length"] == [25]
    # Base streams by default: codec_bos + 25 reference frames after the 8-row prefix.
    assert length(built) == 8 + 1 + 25
    # Budget: max(192, 12 x 4 text tokens) under the configured 4096.
    assert built.max_tokens == 192 and payload[EFFECTIVE_MAX_TOKENS_KEY] == [192]


def test_base_in_context_non_streaming(base: Qwen3TTSRequestBuilder) -> None:
    uri = data_uri(wav_bytes(2.0))
    built = base.build(
        SpeechInput(
            input="the quick brown fox", ref_audio=uri, ref_text="hello world", non_streaming_mode=True
        )
    )
    # + transcript (7 - 5) + text (12 - 8) + tts_eos.
    assert length(built) == 8 + 1 + 25 + 2 + 4 + 1


def test_base_x_vector_only(base: Qwen3TTSRequestBuilder) -> None:
    built = base.build(
        SpeechInput(input="hello world", ref_audio=data_uri(wav_bytes(1.5)), x_vector_only_mode=True)
    )
    assert built.payload["x_vector_only_mode"] == [True]
    assert "ref_text" not in built.payload
    assert built.payload["ref_code_length"] == [math.ceil(1.5 * CODEC_FRAME_RATE)]
    assert length(built) == 8 + 1
    assert length(base.build(SpeechInput(input="hello world", ref_audio=data_uri(wav_bytes(1.5)), x_vector_only_mode=True, non_streaming_mode=True))) == 8 + 4  # fmt: skip


def test_base_speaker_embedding(base: Qwen3TTSRequestBuilder) -> None:
    built = base.build(SpeechInput(input="hello", task_type="Base", speaker_embedding=tuple([0.5] * 128)))
    assert built.payload["voice_clone_prompt"] == [{"ref_spk_embedding": [0.5] * 128}]
    assert built.payload["x_vector_only_mode"] == [True]
    assert "ref_audio" not in built.payload
    assert length(built) == 9


def test_base_reference_from_files(base: Qwen3TTSRequestBuilder, tmp_path: Path) -> None:
    # A stereo 16 kHz file: channels averaged, its own rate kept (the talker resamples).
    clip = tmp_path / "ref.wav"
    clip.write_bytes(wav_bytes(1.25, rate=16000, channels=2, subtype="FLOAT"))
    import numpy as np
    import soundfile

    stereo, _ = soundfile.read(clip, dtype="float32")
    for source in (str(clip), clip.as_uri()):
        built = base.build(SpeechInput(input="hello", ref_audio=source, ref_text="hello world"))
        [[samples, rate]] = built.payload["ref_audio"]
        assert rate == 16000 and len(samples) == 20000
        assert np.array_equal(np.asarray(samples, dtype=np.float32), stereo.T.mean(axis=0))
        assert built.payload["ref_code_length"] == [math.ceil(20000 / 16000 * CODEC_FRAME_RATE)]
    # The file's key changes with the file; a data URI's is its text's hash.
    assert (
        built.payload["ref_audio_cache_key"]
        != base.build(SpeechInput(input="hello", ref_audio=str(clip), ref_text="hello world")).payload[
            "ref_audio_cache_key"
        ]
    )


def test_base_uses_the_checkpoint_frame_rate(tmp_path: Path) -> None:
    b = builder(tmp_path, "base", speech={"encode_downsample_rate": 16})  # the case's own: 1500 Hz
    built = b.build(SpeechInput(input="hello", ref_audio=data_uri(wav_bytes(1.0)), ref_text="hello"))
    assert built.payload["ref_code_length"] == [1500]
    assert length(built) == 8 + 1 + 1500


def test_base_without_a_frame_rate_is_refused(tmp_path: Path) -> None:
    b = builder(tmp_path, "base", speech={"encode_downsample_rate": None})
    error = refused(b, input="hello", ref_audio=data_uri(wav_bytes(1.0)), ref_text="hello")
    assert error.field == "ref_audio" and "frame rate" in str(error)
    # x-vector-only cloning does not need one.
    assert (
        length(
            b.build(SpeechInput(input="hello", ref_audio=data_uri(wav_bytes(1.0)), x_vector_only_mode=True))
        )
        == 9
    )
    # config.json's codec_frame_rate_hz is the fallback.
    c = builder(
        tmp_path / "c", "base", speech={"encode_downsample_rate": None}, config={"codec_frame_rate_hz": 25}
    )
    assert c.build(SpeechInput(input="hello", ref_audio=data_uri(wav_bytes(1.0)), ref_text="hello")).payload[
        "ref_code_length"
    ] == [25]


def test_base_budget(base: Qwen3TTSRequestBuilder, tmp_path: Path) -> None:
    words = " ".join(["hello"] * 20)  # 20 tokens: 240 frames
    uri = data_uri(wav_bytes(1.0))
    assert base.build(SpeechInput(input=words, ref_audio=uri, ref_text="hello")).max_tokens == 240
    small = builder(tmp_path / "s", "base", default_max_tokens=200)
    assert small.build(SpeechInput(input=words, ref_audio=uri, ref_text="hello")).max_tokens == 200
    unconfigured = builder(tmp_path / "u", "base", default_max_tokens=None)
    assert unconfigured.build(SpeechInput(input=words, ref_audio=uri, ref_text="hello")).max_tokens == 240
    assert (
        base.build(SpeechInput(input=words, ref_audio=uri, ref_text="hello", max_new_tokens=9)).max_tokens
        == 9
    )


# -- refusals -----------------------------------------------------------------------------------


def test_task_must_match_the_checkpoint(custom, design, base) -> None:
    for b, other in ((custom, "Base"), (design, "CustomVoice"), (base, "VoiceDesign")):
        error = refused(b, input="hello", task_type=other, instructions="x")
        assert (error.field, error.allowed) == ("task_type", [b.task])
    error = refused(custom, input="hello", task_type="Narrator")
    assert (error.field, error.allowed) == ("task_type", ["CustomVoice"])
    # ref_text implies Base.
    error = refused(custom, input="hello", ref_text="hello")
    assert error.field == "task_type" and "Base" in str(error)


@pytest.mark.parametrize("text", ["", "   "])
def test_empty_input(custom, text: str) -> None:
    assert refused(custom, input=text).field == "input"


def test_unknown_voice_names_the_voices(custom) -> None:
    error = refused(custom, input="hello", voice="alloy")
    assert (error.field, error.allowed) == ("voice", ["alice", "bob", "chen"])
    assert "alice, bob, chen" in str(error)


def test_voice_outside_custom_voice(design, base) -> None:
    error = refused(design, input="hello", instructions="deep", voice="alice")
    assert (error.field, error.allowed) == ("voice", ["default"])
    error = refused(base, input="hello", voice="alice", ref_audio=data_uri(wav_bytes(1.0)), ref_text="hi")
    assert (error.field, error.allowed) == ("voice", ["default"])
    assert (
        design.build(SpeechInput(input="hello", instructions="deep", voice="default")).payload.get("speaker")
        is None
    )


def test_custom_voice_without_speakers(tmp_path: Path) -> None:
    b = builder(tmp_path, "custom_voice", talker={"spk_id": None})
    assert b.voices() == []
    assert refused(b, input="hello").field == "voice"


def test_unknown_language_names_the_languages(custom) -> None:
    error = refused(custom, input="hello", language="Klingon")
    assert (error.field, error.allowed) == ("language", ["Auto", "Chinese", "English", "Sichuan_Dialect"])


def test_instructions(design, custom) -> None:
    assert refused(design, input="hello").field == "instructions"
    assert refused(design, input="hello", instructions="").field == "instructions"
    error = refused(custom, input="hello", instructions="x" * 501)
    assert error.field == "instructions" and "500" in str(error)
    assert length(custom.build(SpeechInput(input="hello", instructions="x" * 500))) == 8 + 6 + 3


@pytest.mark.parametrize("value", [0, -1, 4097])
def test_max_new_tokens_range(custom, value: int) -> None:
    assert refused(custom, input="hello", max_new_tokens=value).field == "max_new_tokens"


def test_base_only_fields(custom, design) -> None:
    uri = data_uri(wav_bytes(1.0))
    assert refused(custom, input="hello", task_type="CustomVoice", ref_audio=uri).field == "ref_audio"
    assert (
        refused(design, input="hello", instructions="x", x_vector_only_mode=False).field
        == "x_vector_only_mode"
    )
    assert refused(custom, input="hello", speaker_embedding=(0.0,) * 128).field == "speaker_embedding"


def test_base_needs_a_voice_to_clone(base) -> None:
    assert refused(base, input="hello").field == "ref_audio"
    uri = data_uri(wav_bytes(1.0))
    assert refused(base, input="hello", ref_audio=uri).field == "ref_text"
    assert refused(base, input="hello", ref_audio=uri, ref_text="  ").field == "ref_text"
    assert (
        refused(base, input="hello", ref_audio=uri, ref_text="hi", x_vector_only_mode=True).field
        == "ref_text"
    )


@pytest.mark.parametrize(
    ("embedding", "extra"),
    [
        ((0.0,) * 127, {}),
        ((float("nan"),) * 128, {}),
        (((0.0,) * 128,), {}),
        ((0.0,) * 128, {"x_vector_only_mode": False}),
        ((0.0,) * 128, {"ref_audio": "REF"}),
    ],
)
def test_bad_speaker_embedding(base, embedding, extra) -> None:
    if extra.get("ref_audio") == "REF":
        extra = {"ref_audio": data_uri(wav_bytes(1.0))}
    assert refused(base, input="hello", task_type="Base", speaker_embedding=embedding, **extra).field == (
        "speaker_embedding"
    )


@pytest.mark.parametrize(
    "source",
    [
        "https://example.com/a.wav",
        "ftp://example.com/a.wav",
        "data:audio/wav,plain",
        "data:audio/wav;base64,@@@",
        "data:audio/wav;base64",
        data_uri(b"not audio at all"),
        data_uri(wav_bytes(0.5)),
        data_uri(wav_bytes(31.0, rate=8000)),
        "/nonexistent/ref.wav",
        "file://otherhost/ref.wav",
    ],
)
def test_bad_ref_audio(base, source: str) -> None:
    error = refused(base, input="hello", ref_audio=source, ref_text="hello")
    assert error.field == "ref_audio"


def test_ref_audio_duration_bounds_are_inclusive(base) -> None:
    for seconds in (1.0, 30.0):
        built = base.build(
            SpeechInput(
                input="hi", ref_audio=data_uri(wav_bytes(seconds, rate=8000)), x_vector_only_mode=True
            )
        )
        assert len(built.payload["ref_audio"][0][0]) == int(seconds * 8000)


# -- the length function itself -----------------------------------------------------------------


def count(text: str) -> int:
    from omnigen_testing.real.cases.qwen3_tts_talker import tokenize

    return len(tokenize(text))


def test_prompt_length_reads_the_voice_clone_prompt() -> None:
    base = {"text": ["hello world"], "x_vector_only_mode": [False]}
    kwargs = {"task": "Base", "count_tokens": count, "codec_language_id": {}, "spk_is_dialect": {}}
    # ref_code (frames x codebooks) sets the frame count as is.
    clone = {"voice_clone_prompt": [{"ref_code": [[0, 0]] * 40}]}
    assert prompt_length({**base, **clone}, **kwargs) == 8 + 41
    # icl_mode False overrides x_vector_only_mode.
    xvec = {"voice_clone_prompt": [{"icl_mode": False}]}
    assert prompt_length({**base, **xvec}, **kwargs) == 9
    # Tokenized ref_ids instead of ref_text when not streaming.
    ids = {"ref_code_length": [10], "ref_ids": [[0] * 12], "non_streaming_mode": [True]}
    assert prompt_length({**base, **ids}, **kwargs) == 8 + 11 + 7 + 2 + 1
    with pytest.raises(PromptLengthError) as info:
        prompt_length({**base, "non_streaming_mode": [True], "ref_code_length": [3]}, **kwargs)
    assert info.value.field == "ref_text"
    with pytest.raises(PromptLengthError) as info:
        prompt_length(base, **kwargs)
    assert info.value.field == "ref_audio"


def test_module_imports_nothing_heavy() -> None:
    code = (
        "import sys, omnigen.requests.qwen3_tts\n"
        "heavy = {'torch', 'transformers', 'numpy', 'soundfile', 'vllm', 'vllm_omni'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_config_json_is_read_as_written(tmp_path: Path) -> None:
    folder = qwen3_tts_checkpoint(tmp_path / "ck", "custom_voice")
    config = json.loads((folder / "config.json").read_text())
    assert list(config["talker_config"]["spk_id"]) == ["Alice", "bob", "chen"]
    assert Qwen3TTSRequestBuilder(folder).voices() == ["alice", "bob", "chen"]
