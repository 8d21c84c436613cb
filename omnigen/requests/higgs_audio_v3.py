"""Higgs Audio v3: a speech request to the talker's (stage ``talker``) prompt.

The talker reads real token ids: ``<|tts|> <|text|> {the text's ids} <|audio|>`` (the zero-shot
prompt of vllm-omni 0.30's ``higgs_audio_v3_tokenizer.py``), with no payload; once the last
prompt token is ``<|audio|>`` its own sampler writes one delay-pattern frame of codes a step.
This builder produces what vllm-omni's speech serving layer sends for such a request (its Higgs
Audio v3 adapter, ``tts_adapters/higgs_audio_v3.py``, and the sampling override after it), from
the checkpoint folder alone:

- ``tokenizer.json``/``tokenizer_config.json``: the text's ids and the specials ``<|tts|>``,
  ``<|text|>``, ``<|audio|>`` (added tokens; the talker's config class resolves the same ones);
- ``config.json``: ``sample_rate`` (the audio code2wav writes) and ``eos_token_id``.

What vllm-omni accepts and this builder refuses, naming the field (HTTP 400), rather than drop:

- ``voice``: vllm-omni's Higgs voices are uploaded ones only (``POST /v1/audio/voices``), which
  omnigen does not take; ``default`` (or none) is the model's own voice;
- ``ref_audio`` (voice cloning): vllm-omni encodes the reference in its serving process with
  transformers' ``HiggsAudioV2TokenizerModel``, whose module imports torchaudio and which
  resamples every clip to its semantic model's rate with ``torchaudio.functional.resample``;
  omnigen does not implement that encoding (see ``CLONING_REFUSED``);
- ``ref_text`` without ``ref_audio`` (vllm-omni drops it), and the options the Higgs adapter
  never reads: ``language``, ``instructions``, ``task_type``, ``x_vector_only_mode``,
  ``speaker_embedding``, ``non_streaming_mode``.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

from omnigen.requests.base import BuiltRequest, RequestBuilder, RequestError, SpeechInput

MODEL_TYPE = "higgs_multimodal_qwen3"
TTS, TEXT, AUDIO = "<|tts|>", "<|text|>", "<|audio|>"
AUDIO_END = "<|audio_end|>"
"""The audio end marker; the talker stops at it as at eos (vllm-omni's pipeline lists both)."""
DEFAULT_VOICE = "default"
DEFAULT_SAMPLE_RATE = 24000  # HiggsAudioV3Config's default
UNUSED_OPTIONS = (
    "language",
    "instructions",
    "task_type",
    "x_vector_only_mode",
    "speaker_embedding",
    "non_streaming_mode",
)
CLONING_REFUSED = (
    "Higgs Audio v3 voice cloning encodes the reference in the serving process with transformers' "
    "HiggsAudioV2TokenizerModel (vllm-omni's adapter; its checkpoint is k2-fsa/OmniVoice's "
    "audio_tokenizer), which needs torchaudio (its module imports it, and it resamples every clip "
    "with torchaudio.functional.resample); omnigen does not implement that encoding, so it serves "
    "the model's own voice only: omit ref_audio"
)


def _read_config(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"Higgs Audio v3 checkpoint: {path} is missing") from None
    if not isinstance(data, dict):
        raise ValueError(f"Higgs Audio v3 checkpoint: {path} is not a JSON object")
    if data.get("model_type") != MODEL_TYPE:
        raise ValueError(
            f"Higgs Audio v3 checkpoint {checkpoint}: config.json model_type is "
            f"{data.get('model_type')!r}, not {MODEL_TYPE!r}"
        )
    return data


class HiggsAudioV3RequestBuilder(RequestBuilder):
    """Speech requests for a Higgs Audio v3 checkpoint (text in the model's own voice)."""

    model = "higgs_audio_v3"

    def __init__(self, checkpoint: str | Path, *, default_max_tokens: int | None = None) -> None:
        super().__init__(checkpoint, default_max_tokens=default_max_tokens)
        self._config = _read_config(self.checkpoint)
        added = dict(self.tokenizer.get_added_vocab())
        missing = [token for token in (TTS, TEXT, AUDIO) if token not in added]
        if missing:
            raise ValueError(
                f"Higgs Audio v3 checkpoint {self.checkpoint}: its tokenizer lacks the added tokens "
                f"{', '.join(missing)} (the talker's prompt is <|tts|> <|text|> ... <|audio|>)"
            )
        self.tts_id, self.text_id, self.audio_id = added[TTS], added[TEXT], added[AUDIO]
        eos = self._config.get("eos_token_id", self.tokenizer.eos_token_id)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is None:
            raise ValueError(
                f"Higgs Audio v3 checkpoint {self.checkpoint}: neither config.json nor the tokenizer "
                "names an eos token (the talker ends a take with it)"
            )
        stops = [int(eos)]
        if AUDIO_END in added and added[AUDIO_END] not in stops:
            stops.append(added[AUDIO_END])
        self.stop_token_ids = stops

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.checkpoint), local_files_only=True)

    # -- what the checkpoint offers ---------------------------------------------------------

    def voices(self) -> list[str]:
        return []

    def sample_rate(self) -> int:
        return int(self._config.get("sample_rate", DEFAULT_SAMPLE_RATE))

    # -- one request ------------------------------------------------------------------------

    def prompt_ids(self, text: str) -> list[int]:
        """``<|tts|> <|text|> {text ids} <|audio|>``."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return [self.tts_id, self.text_id, *ids, self.audio_id]

    def build(self, request: SpeechInput) -> BuiltRequest:
        if not request.input or not request.input.strip():
            raise RequestError("input", "the text is empty")
        if request.voice is not None and request.voice.lower() != DEFAULT_VOICE:
            raise RequestError(
                "voice",
                f"unknown voice {request.voice!r}: Higgs Audio v3 has no built-in voices (vllm-omni "
                "serves uploaded ones, which omnigen does not take)",
                [DEFAULT_VOICE],
            )
        if request.ref_audio is not None:
            raise RequestError("ref_audio", CLONING_REFUSED)
        if request.ref_text is not None:
            raise RequestError("ref_text", "the transcript of ref_audio; this request has no ref_audio")
        for name in UNUSED_OPTIONS:
            if getattr(request, name) is not None:
                raise RequestError(name, "Higgs Audio v3 takes no such option (its prompt is the text alone)")
        if request.max_new_tokens is not None and request.max_new_tokens < 1:
            raise RequestError("max_new_tokens", f"{request.max_new_tokens} is not a positive token budget")
        return BuiltRequest(
            prompt={"prompt_token_ids": self.prompt_ids(request.input)},
            max_tokens=request.max_new_tokens,
            # The talker's sampler forces eos once its delay pattern has ramped down; vllm-omni's
            # pipeline also stops at <|audio_end|> (pipeline.py hard-codes the released ids,
            # 151643 and 151671; these are this checkpoint's).
            sampling={"stop_token_ids": list(self.stop_token_ids)},
        )
