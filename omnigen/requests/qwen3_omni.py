"""Qwen3-Omni: a chat request to the thinker's prompt and payload.

What vllm-omni 0.30's chat serving layer sends the thinker for the same request
(``OmniOpenAIServingChat._preprocess_chat``), from the checkpoint folder alone:

* the prompt: the messages rendered by the checkpoint's chat template into token ids
  (``omnigen.requests.chat``, as vLLM's chat path renders them);
* the payload (vllm-omni's ``additional_information``): ``speaker``, the requested voice
  lower-cased, when one is named; the glue carries it to the talker, which looks it up in
  ``talker_config.speaker_id`` (without one the talker takes the first speaker of that map).

From ``config.json``: ``talker_config.speaker_id`` (the voices), ``talker_config.codec_eos_token_id``
(the talker's stop id; vllm-omni's pipeline hard-codes the released 2150), ``enable_audio_output``
(a thinker-only release, such as the Captioner, has no talker), and the audio's sample rate from
``code2wav_config`` where it states one, else 24000 (vllm-omni's default for this model).

Refused where vllm-omni passes the field on and the model ignores it: ``language`` (the talker
reads none: its speech follows the thinker's text), a voice of a checkpoint without
``talker_config.speaker_id``. Image, audio and video content parts go through the thinker's audio
and vision towers and its multimodal processor (transformers' ``Qwen3OmniMoeProcessor``), which
the serve config does not start (``language_model_only``: the processor's video path needs
torchvision and vllm-omni's audio path torchaudio, neither in omnigen's CPU lock); such a part is
refused naming its type and that reason. ``voice: "default"`` (OpenAI clients send a voice with
every audio request) is the model's default voice, where vllm-omni refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from omnigen.requests.base import BuiltRequest, ChatInput, RequestError
from omnigen.requests.chat import ChatRequestBuilder

DEFAULT_VOICE = "default"
"""OpenAI clients send a voice with every audio request: this one means the model's default."""
DEFAULT_SAMPLE_RATE = 24000
"""vllm-omni's rate for Qwen3-Omni's audio when code2wav_config states none (serving_chat.py)."""
SAMPLE_RATE_KEYS = ("output_sample_rate", "audio_sample_rate", "sample_rate", "sampling_rate", "sr")
"""Where a code2wav config may state its rate (vllm-omni's resolve_audio_sample_rate keys)."""
TALKER = "talker"
MEDIA_MODULES = ("torchvision", "torchaudio")


class Qwen3OmniRequestBuilder(ChatRequestBuilder):
    """Chat requests for a Qwen3-Omni checkpoint (thinker -> talker -> code2wav)."""

    model = "qwen3_omni"
    title = "Qwen3-Omni"

    def __init__(self, checkpoint: str | Path, *, default_max_tokens: int | None = None) -> None:
        super().__init__(checkpoint, default_max_tokens=default_max_tokens)
        config = self.config
        if config.get("enable_audio_output") is False:
            raise ValueError(
                f"Qwen3-Omni checkpoint {self.checkpoint}: config.json enable_audio_output is false, "
                "a thinker-only release (no talker, no code2wav); model=qwen3_omni serves thinker -> "
                "talker -> code2wav"
            )
        talker = config.get("talker_config")
        if not isinstance(talker, Mapping):
            raise ValueError(f"Qwen3-Omni checkpoint {self.checkpoint}: config.json has no talker_config")
        speakers = talker.get("speaker_id")
        self._speakers = [str(name).lower() for name in speakers] if isinstance(speakers, Mapping) else []
        eos = talker.get("codec_eos_token_id", 4198)  # Qwen3OmniMoeTalkerConfig's default
        self.codec_eos_token_id = int(eos)
        code2wav = config.get("code2wav_config")
        self._code2wav = dict(code2wav) if isinstance(code2wav, Mapping) else {}

    @property
    def media_refusal(self) -> str:  # type: ignore[override]
        from omnigen.providers.vllm_omni import module_installed

        missing = [name for name in MEDIA_MODULES if not module_installed(name)]
        why = (
            f" (its video path needs torchvision, vllm-omni's audio path torchaudio: {', '.join(missing)} not installed here)"
            if missing
            else ""
        )
        return (
            "this server runs the thinker on text only (serve config: language_model_only, so no audio "
            "or vision tower and no multimodal processor, transformers' Qwen3OmniMoeProcessor)" + why
        )

    # -- what the checkpoint offers ---------------------------------------------------------

    def voices(self) -> list[str]:
        return list(self._speakers)

    def default_voice(self) -> str | None:
        # The talker's default: the first key of speaker_id (qwen3_omni.py, tts_text_spk_token_ids).
        return self._speakers[0] if self._speakers else None

    def sample_rate(self) -> int:
        for key in SAMPLE_RATE_KEYS:
            value = self._code2wav.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return DEFAULT_SAMPLE_RATE

    # -- one request ------------------------------------------------------------------------

    def build_chat(self, request: ChatInput) -> BuiltRequest:
        if request.language is not None:
            raise RequestError(
                "language",
                "Qwen3-Omni's talker takes no language: its speech follows the thinker's text "
                "(write the language you want in the messages)",
            )
        voice = request.voice.lower().strip() if request.voice is not None else None
        if voice in ("", DEFAULT_VOICE) and DEFAULT_VOICE not in self._speakers:
            voice = None
        if voice is not None:
            if not self._speakers:
                raise RequestError("voice", "this checkpoint has no voices (talker_config.speaker_id)", [])
            if voice not in self._speakers:
                raise RequestError("voice", f"unknown voice {request.voice!r}", sorted(self._speakers))
        built = super().build_chat(request)
        if voice is not None:
            built.payload["speaker"] = [voice]
        # The talker ends its speech at the checkpoint's codec EOS.
        built.stage_sampling[TALKER] = {"stop_token_ids": [self.codec_eos_token_id]}
        return built
