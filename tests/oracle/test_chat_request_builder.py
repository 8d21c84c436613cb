"""Differential test: omnigen's chat request builder (Qwen3-Omni) against vllm-omni 0.30's chat
serving layer on vLLM's renderer.

The tiny Qwen3-Omni checkpoint's config and tokenizer (``testing/checkpoints/qwen3_omni.py``) are
written twice: as written (a chat template that loops over content parts: vLLM's ``openai``
content format) and with a template that prints ``message['content']`` whole (vLLM's ``string``
format, where a message's text parts are joined with newlines). For each, the same chat requests go
to omnigen's ``Qwen3OmniRequestBuilder.build_chat`` and to vllm-omni's own path:
``OmniOpenAIServingChat._preprocess_chat`` on vLLM's ``ChatCompletionRequest``, rendered by vLLM's
``HfRenderer`` for the checkpoint (template resolution, content-format detection, message parsing,
``apply_chat_template``, tokenization), with only the engine client stood in for. Where both accept
a request, the thinker's prompt ids and the payload (vllm-omni's ``additional_information``: the
speaker) must be equal; where one refuses, the request must fall under a difference named in
``DIFFERENCES``, in the direction it states.

vllm-omni is imported only here (it patches vLLM process-wide): the oracle group runs in a pytest
process of its own (``-m oracle``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnigen.requests.base import ChatInput, RequestError
from omnigen.requests.qwen3_omni import Qwen3OmniRequestBuilder
from omnigen_testing.checkpoints import qwen3_omni as checkpoint
from omnigen_testing.checkpoints.qwen3_tts import CHAT_TEMPLATE as STRING_TEMPLATE

if importlib.util.find_spec("vllm_omni") is None:
    pytest.skip(
        "vllm-omni (the comparison oracle) is not installed: it is tied to vLLM 0.30 (requirements/vllm-0.30)",
        allow_module_level=True,
    )
pytestmark = pytest.mark.oracle

ARCH = "Qwen3OmniMoeForConditionalGeneration"
MODEL_CLASS = f"vllm_omni.model_executor.models.qwen3_omni.qwen3_omni.{ARCH}"

# Each: (which side refuses, the field omnigen names, why).
DIFFERENCES: dict[str, tuple[str, str, str]] = {
    "default_voice": (
        "vllm-omni",
        "voice",
        "OpenAI clients send a voice with every audio request; omnigen takes 'default' as the model's "
        "default voice (as its speech route does), vllm-omni refuses it as an unknown speaker",
    ),
    "language": (
        "omnigen",
        "language",
        "vllm-omni passes language to the talker, which reads none; omnigen refuses it",
    ),
}


def _folder(root: Path, template: str | None) -> Path:
    folder = checkpoint.write_qwen3_omni(root, weights=False)
    if template is not None:
        path = folder / "tokenizer_config.json"
        config = json.loads(path.read_text())
        config["chat_template"] = template
        path.write_text(json.dumps(config))
    return folder


class Side:
    """One checkpoint, both builders: omnigen's and vllm-omni's serving layer on vLLM's renderer."""

    def __init__(self, folder: Path) -> None:
        from omnigen_testing.real import harness

        harness.install_standins()
        import vllm_omni  # noqa: F401  (the oracle's own process: its patch is expected)

        harness.register_case(SimpleNamespace(arch=ARCH, model_class=MODEL_CLASS), folder)
        from vllm.config import ModelConfig, VllmConfig
        from vllm.renderers import renderer_from_config
        from vllm_omni.entrypoints.openai.serving_chat import OmniOpenAIServingChat

        model_config = ModelConfig(
            model=str(folder),
            tokenizer=str(folder),
            trust_remote_code=True,
            language_model_only=True,
            max_model_len=512,
        )
        server = OmniOpenAIServingChat.__new__(OmniOpenAIServingChat)
        server.model_config = model_config
        server.renderer = renderer_from_config(VllmConfig(model_config=model_config))
        server.engine_client = SimpleNamespace(stage_configs=[], model_config=model_config, errored=False)
        server._supported_speakers = None
        self.server = server
        self.builder = Qwen3OmniRequestBuilder(folder)

    def oracle(
        self, messages: list[dict[str, Any]], voice: str | None, language: str | None
    ) -> dict[str, Any] | str:
        """vllm-omni's engine prompt, or its refusal's text."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        fields: dict[str, Any] = {"model": "qwen3_omni", "messages": messages}
        if voice is not None:
            fields["voice"] = voice
        if language is not None:
            fields["language"] = language
        try:
            request = ChatCompletionRequest(**fields)
            _, (prompt,) = asyncio.run(
                self.server._preprocess_chat(
                    request,
                    request.messages,
                    default_template=None,
                    default_template_content_format="auto",
                    default_template_kwargs=None,
                    renderer=self.server.renderer,
                    add_generation_prompt=True,
                    continue_final_message=False,
                    add_special_tokens=False,
                )
            )
        except ValueError as exc:
            return str(exc)
        return dict(prompt)

    def check(
        self, messages: list[dict[str, Any]], voice: str | None = None, language: str | None = None
    ) -> str:
        try:
            built: Any = self.builder.build_chat(
                ChatInput(messages=tuple(messages), voice=voice, language=language)
            )
        except RequestError as exc:
            built = exc
        theirs = self.oracle(messages, voice, language)
        if isinstance(built, RequestError) and isinstance(theirs, str):
            return "both refuse"
        if not isinstance(built, RequestError) and not isinstance(theirs, str):
            assert built.prompt["prompt_token_ids"] == list(theirs["prompt_token_ids"]), messages
            assert built.payload == (theirs.get("additional_information") or {}), (voice, theirs)
            return "both accept"
        refuser = "omnigen" if isinstance(built, RequestError) else "vllm-omni"
        named = set()
        if voice is not None and voice.strip().lower() == "default":
            named.add("default_voice")
        if language is not None:
            named.add("language")
        explained = [name for name in named if DIFFERENCES[name][0] == refuser]
        assert explained, (
            f"{refuser} alone refuses {messages!r} voice={voice!r}: {built if refuser == 'omnigen' else theirs}"
        )
        if isinstance(built, RequestError):
            assert built.field == DIFFERENCES[explained[0]][1], built
        return f"{refuser} refuses"


@pytest.fixture(scope="module", params=["openai", "string"])
def side(request, tmp_path_factory):
    template = None if request.param == "openai" else STRING_TEMPLATE
    found = Side(_folder(tmp_path_factory.mktemp(request.param), template))
    assert found.builder.content_format == request.param
    return found


CASES = [
    ([{"role": "user", "content": "hello world what is your name"}], "Ethan"),
    (
        [{"role": "system", "content": "you are good"}, {"role": "user", "content": "sing a song"}],
        " chelsie ",
    ),
    (
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "tell me a story"},
                    {"type": "text", "text": "about the sea"},
                ],
            }
        ],
        None,
    ),
    (
        [
            {"role": "user", "content": "what is this"},
            {"role": "assistant", "content": "it is a song"},
            {"role": "user", "content": [{"type": "text", "text": "sing it\nplease"}]},
        ],
        "AIDEN",
    ),
    ([{"role": "user", "content": "hello"}, {"role": "assistant", "content": None}], None),
    ([{"role": "user", "content": []}], None),
    ([{"role": "user", "content": "unknown words zebra quokka"}], "ethan"),
]


@pytest.mark.parametrize(("messages", "voice"), CASES)
def test_prompts_and_voices_equal_vllm_omnis(side, messages, voice):
    assert side.check(messages, voice) == "both accept"


def test_refusals(side):
    hello = [{"role": "user", "content": "hello"}]
    assert side.check(hello, "alloy") == "both refuse"
    assert side.check(hello, "default") == "vllm-omni refuses"
    assert side.check(hello, None, "English") == "omnigen refuses"


WORDS = [*checkpoint.WORDS[:20], "zebra", "\n", "  ", "Hello"]
TEXT = st.lists(st.sampled_from(WORDS), min_size=0, max_size=6).map(" ".join)
CONTENT = st.one_of(
    TEXT, st.lists(TEXT.map(lambda text: {"type": "text", "text": text}), min_size=0, max_size=3)
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": CONTENT}
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    messages=st.lists(MESSAGE, min_size=1, max_size=4),
    voice=st.sampled_from([None, "ethan", "Chelsie", " aiden"]),
)
def test_generated_conversations(side, messages, voice):
    assert side.check(messages, voice) == "both accept"
