"""What every request builder takes and gives (``conf/model/*.yaml``: ``request_builder``).

A builder is made once per served pipeline from the first stage's checkpoint folder and
answers, for each request, the first stage's prompt, the payload that stage's runner receives
with it (vllm-omni's ``additional_information``: the model reads it from the request's buffer)
and the per-stage sampling the request asks for. It refuses a request it cannot serve with a
``RequestError`` that names the field and what is allowed: nothing is silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


class RequestError(ValueError):
    """A request field the model cannot serve; ``field`` names it (an HTTP body's key)."""

    def __init__(self, field_name: str, message: str, allowed: list[Any] | None = None) -> None:
        self.field = field_name
        self.allowed = allowed
        text = f"{field_name}: {message}"
        if allowed is not None:
            text += f" (allowed: {', '.join(map(str, allowed))})"
        super().__init__(text)


@dataclass(frozen=True)
class SpeechInput:
    """One speech request as the HTTP API and ``omnigen run`` take it (OpenAI's
    ``/v1/audio/speech`` fields plus vllm-omni's TTS options)."""

    input: str
    voice: str | None = None
    """A speaker of the checkpoint (``GET /v1/audio/voices``); None: the model's default."""
    language: str | None = None
    instructions: str | None = None
    task_type: str | None = None
    """The model's task (Qwen3-TTS: CustomVoice, VoiceDesign, Base); None: what the checkpoint is."""
    ref_audio: str | None = None
    """Reference audio for voice cloning: a ``data:`` URI or a local file path."""
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None
    """Voice cloning from the reference's speaker embedding alone (no ``ref_text``)."""
    speaker_embedding: tuple[float, ...] | None = None
    """A precomputed speaker embedding to clone instead of ``ref_audio`` (one flat vector)."""
    non_streaming_mode: bool | None = None
    """How the model lays out its prompt (Qwen3-TTS: all text at prefill, or fed step by step);
    not HTTP streaming. None: the model's default for the task."""
    max_new_tokens: int | None = None
    seed: int | None = None


@dataclass(frozen=True)
class ChatInput:
    """One chat request as ``POST /v1/chat/completions`` and ``omnigen run`` take it (OpenAI's
    chat fields the model reads; sampling fields are the serving layer's)."""

    messages: tuple[Mapping[str, Any], ...]
    """OpenAI chat messages: ``{"role": ..., "content": text | [parts] | None}``."""
    voice: str | None = None
    """A voice of the checkpoint (``GET /v1/audio/voices``); None: the model's default."""
    language: str | None = None
    max_tokens: int | None = None
    """The first stage's token budget (None: the configured one)."""


@dataclass
class BuiltRequest:
    """What the pipeline submits for one request."""

    prompt: dict[str, Any]
    """The first stage's prompt: ``{"prompt_token_ids": [...]}`` (or ``{"prompt": text}``)."""
    payload: dict[str, Any] = field(default_factory=dict)
    """The first stage's payload: reaches its runner as the request's buffer (``{}``: none)."""
    max_tokens: int | None = None
    """The first autoregressive stage's token budget for this request (None: the serve default)."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """Further ``SamplingParams`` fields of the first stage the checkpoint decides (its stop ids)."""
    stage_sampling: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per later stage, ``SamplingParams`` fields the checkpoint decides (a talker's stop ids)."""


class RequestBuilder:
    """Base of every model's builder; subclasses set ``model`` and override ``build`` (a speech
    model) or ``build_chat`` (a chat model, ``api = "chat"``)."""

    model: ClassVar[str] = ""
    api: ClassVar[str] = "speech"
    """The requests the model takes: ``speech`` (``POST /v1/audio/speech``, ``SpeechInput``,
    ``build``) or ``chat`` (``POST /v1/chat/completions``, ``ChatInput``, ``build_chat``)."""

    def __init__(self, checkpoint: str | Path, *, default_max_tokens: int | None = None) -> None:
        self.checkpoint = Path(checkpoint)
        self.default_max_tokens = default_max_tokens
        """The first AR stage's configured ``max_tokens`` (its default sampling), for builders
        that cap or record the budget per request; None: not configured."""

    def voices(self) -> list[str]:
        """The voices ``SpeechInput.voice`` may name (empty: the model has no named voices)."""
        return []

    def default_voice(self) -> str | None:
        return None

    def languages(self) -> list[str]:
        """The languages ``SpeechInput.language`` may name (empty: the field is refused)."""
        return []

    def sample_rate(self) -> int:
        """Samples per second of the audio the pipeline's last stage writes, from the checkpoint."""
        raise NotImplementedError

    def build(self, request: SpeechInput) -> BuiltRequest:
        raise NotImplementedError

    def build_chat(self, request: ChatInput) -> BuiltRequest:
        raise NotImplementedError

    def engine_modules(self, request: SpeechInput) -> tuple[str, ...]:
        """Optional packages the stages' processes need to run this request (the serving layer
        refuses the request where one is not installed, instead of failing it in an engine)."""
        return ()
