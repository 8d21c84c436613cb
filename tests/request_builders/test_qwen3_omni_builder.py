"""Qwen3-Omni's request builder on the tiny checkpoint's config and tokenizer: chat messages to the
thinker's prompt ids, the voice to its payload, the talker's stop id; every refusal names its field.
(``tests/oracle/test_chat_request_builder.py`` compares the prompts with vLLM's chat path.)"""

from __future__ import annotations

import json

import pytest

from omnigen.requests.base import ChatInput, RequestError
from omnigen.requests.chat import content_format
from omnigen.requests.qwen3_omni import Qwen3OmniRequestBuilder
from omnigen_testing.checkpoints import qwen3_omni as checkpoint
from omnigen_testing.checkpoints.qwen3_tts import CHAT_TEMPLATE as STRING_TEMPLATE

IM_START, IM_END = checkpoint.SPECIAL_TOKENS["<|im_start|>"], checkpoint.SPECIAL_TOKENS["<|im_end|>"]
NL, USER, SYSTEM, ASSISTANT = checkpoint.NEWLINE, checkpoint.USER, checkpoint.SYSTEM, checkpoint.ASSISTANT
VOCAB = checkpoint.vocabulary()


def word(text: str) -> int:
    return VOCAB[text]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return checkpoint.write_qwen3_omni(tmp_path_factory.mktemp("q3omni"), weights=False)


@pytest.fixture(scope="module")
def builder(folder):
    return Qwen3OmniRequestBuilder(folder, default_max_tokens=2048)


def chat(*messages, **fields) -> ChatInput:
    return ChatInput(messages=tuple(messages), **fields)


def test_messages_render_through_the_checkpoints_template(builder):
    built = builder.build_chat(chat({"role": "user", "content": "hello world"}))
    generation = [IM_START, ASSISTANT, NL]
    assert built.prompt == {
        "prompt_token_ids": [IM_START, USER, NL, word("hello"), word("world"), IM_END, NL, *generation]
    }
    assert built.payload == {} and built.max_tokens == 2048
    # The talker stops at the checkpoint's codec EOS (the released id).
    assert built.stage_sampling == {"talker": {"stop_token_ids": [2150]}}


def test_parts_system_and_turns(builder):
    built = builder.build_chat(
        chat(
            {"role": "system", "content": [{"type": "text", "text": "you are good"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": " world"}],
            },
            {"role": "assistant", "content": None},
        )
    )
    ids = built.prompt["prompt_token_ids"]
    assert ids[:3] == [IM_START, SYSTEM, NL]
    # The template joins a message's text parts as they are (openai content format).
    assert [IM_START, USER, NL, word("hello"), word("world"), IM_END] == ids[8:14]
    # The assistant's empty turn, then the generation prompt.
    assert ids[-8:] == [IM_START, ASSISTANT, NL, IM_END, NL, IM_START, ASSISTANT, NL]


def test_the_content_format_is_read_from_the_template():
    assert content_format(checkpoint.CHAT_TEMPLATE) == "openai"
    assert content_format(STRING_TEMPLATE) == "string"
    assert (
        content_format("{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}")
        == "openai"
    )
    assigned = "{% set ms = messages[1:] %}{% for m in ms %}{% for c in m['content'] | list %}x{% endfor %}{% endfor %}"
    assert content_format(assigned) == "openai"
    macro = (
        "{% macro show(items) %}{% for c in items %}{{ c.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ show(m.content) }}{% endfor %}"
    )
    assert content_format(macro) == "openai"
    assert content_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "string"
    assert content_format("{% for m in messages %}{{ m.content") == "string"  # does not parse


def test_a_string_template_gets_the_parts_joined_with_newlines(folder, tmp_path):
    other = tmp_path / "string_template"
    other.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (other / name).write_bytes((folder / name).read_bytes())
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = STRING_TEMPLATE
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    built = Qwen3OmniRequestBuilder(other).build_chat(
        chat(
            {
                "role": "user",
                "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}],
            }
        )
    )
    assert built.prompt["prompt_token_ids"][3:6] == [word("hello"), NL, word("world")]


def test_the_voice_goes_to_the_payload_lower_cased(builder):
    assert builder.voices() == ["aiden", "chelsie", "ethan"]
    assert builder.default_voice() == "aiden"  # the talker's: the first key of speaker_id
    built = builder.build_chat(chat({"role": "user", "content": "hi"}, voice=" Ethan "))
    assert built.payload == {"speaker": ["ethan"]}
    for none in (None, "default", ""):
        assert builder.build_chat(chat({"role": "user", "content": "hi"}, voice=none)).payload == {}


@pytest.mark.parametrize(
    ("messages", "fields", "says"),
    [
        ((), {}, "messages: no message"),
        (
            ({"role": "user", "content": "hi"},),
            {"voice": "alloy"},
            "voice: unknown voice 'alloy' (allowed: aiden, chelsie, ethan)",
        ),
        (
            ({"role": "user", "content": "hi"},),
            {"language": "English"},
            "language: Qwen3-Omni's talker takes no language",
        ),
        (
            ({"role": "tool", "content": "hi"},),
            {},
            "messages[0].role: 'tool' is not a role this server takes (allowed: system, user, assistant)",
        ),
        (({"role": "user", "content": "hi", "name": "x"},), {}, "messages[0].name: not a message field"),
        (
            ({"role": "user", "content": 3},),
            {},
            "messages[0].content: a string, a list of content parts, or null",
        ),
        (
            ({"role": "user", "content": [{"type": "text", "text": 3}]},),
            {},
            "messages[0].content[0].text: a text part's text must be a string",
        ),
        (
            ({"role": "user", "content": [{"type": "text", "text": "a", "cache": 1}]},),
            {},
            "messages[0].content[0].cache: not a text part's field",
        ),
        (
            ({"role": "user", "content": [{"type": "file"}]},),
            {},
            "messages[0].content[0].type: 'file' is not a content part type",
        ),
        ((["hi"]), {}, "messages[0]: a message is an object"),
        (
            ({"role": "user", "content": "hi"},),
            {"max_tokens": 0},
            "max_tokens: 0 is not a positive token budget",
        ),
    ],
)
def test_refusals_name_the_field(builder, messages, fields, says):
    with pytest.raises(RequestError) as info:
        builder.build_chat(chat(*messages, **fields))
    assert says in str(info.value)


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "audio_url", "video_url"])
def test_media_parts_are_refused_with_the_reason(builder, kind):
    with pytest.raises(RequestError) as info:
        builder.build_chat(chat({"role": "user", "content": [{"type": kind, kind: {"url": "data:,"}}]}))
    message = str(info.value)
    assert message.startswith(f"messages[0].content[0].type: '{kind}' content is not served")
    assert "language_model_only" in message and "Qwen3OmniMoeProcessor" in message


def test_what_the_checkpoint_says(folder, tmp_path):
    builder = Qwen3OmniRequestBuilder(folder)
    assert builder.sample_rate() == 24000 and builder.api == "chat"

    def variant(name, change):
        other = tmp_path / name
        other.mkdir()
        for file in ("tokenizer.json", "tokenizer_config.json"):
            (other / file).write_bytes((folder / file).read_bytes())
        config = json.loads((folder / "config.json").read_text())
        change(config)
        (other / "config.json").write_text(json.dumps(config))
        return other

    rate = variant("rate", lambda c: c["code2wav_config"].update(output_sample_rate=16000))
    assert Qwen3OmniRequestBuilder(rate).sample_rate() == 16000
    thinker_only = variant("thinker_only", lambda c: c.update(enable_audio_output=False))
    with pytest.raises(ValueError, match="enable_audio_output is false"):
        Qwen3OmniRequestBuilder(thinker_only)
    mute = variant("no_speakers", lambda c: c["talker_config"].pop("speaker_id"))
    with pytest.raises(RequestError, match="voice: this checkpoint has no voices"):
        Qwen3OmniRequestBuilder(mute).build_chat(chat({"role": "user", "content": "hi"}, voice="ethan"))
    no_template = variant("no_template", lambda c: None)
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has no chat template"):
        Qwen3OmniRequestBuilder(no_template)
