"""Qwen3-TTS: a speech request to the talker's (stage ``qwen3_tts``) prompt and payload.

The talker builds its prefill embeddings itself from the payload (vllm-omni's
``additional_information``: text, task, language, speaker, instruct, reference audio); its
prompt is only placeholder ids, as many as the embeddings it will build. This builder produces
what vllm-omni 0.30's speech serving layer sends for the same request (its Qwen3-TTS adapter and
the sampling override after it), from the checkpoint folder alone:

- ``config.json``: ``tts_model_type`` (the one task the checkpoint serves), ``talker_config``'s
  ``spk_id`` (voices), ``codec_language_id`` (languages), ``spk_is_dialect``, ``hidden_size``;
- the text tokenizer in the folder (prompt length and the Base codec budget);
- ``speech_tokenizer/config.json``: ``output_sample_rate`` (the audio code2wav writes) and
  ``encode_downsample_rate`` (codec frames per second of a reference clip).

Where vllm-omni falls back silently (an estimate that fails becomes 2048 placeholders, a voice
the task cannot use is dropped, a missing language table becomes a default list), this builder
raises ``RequestError`` naming the field.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from omnigen.requests.base import BuiltRequest, RequestBuilder, RequestError, SpeechInput

TASKS = ("CustomVoice", "VoiceDesign", "Base")
PLACEHOLDER_ID = 1
"""The prompt's placeholder id (vllm-omni's adapter sends ``[1] * n``; the talker replaces the
rows with its own embeddings and the ids with codec_pad)."""
DEFAULT_MAX_NEW_TOKENS = 2048
MAX_NEW_TOKENS = 4096
MAX_INSTRUCTIONS_CHARS = 500
REF_AUDIO_SECONDS = (1.0, 30.0)
DEFAULT_VOICE = "default"
"""OpenAI clients must send a voice: this one means the model's default (unless it is a speaker)."""
BASE_MIN_CODEC_FRAMES = 192
BASE_CODEC_FRAMES_PER_TEXT_TOKEN = 12
EFFECTIVE_MAX_TOKENS_KEY = "_qwen3_tts_effective_max_tokens"
REF_AUDIO_ARTIFACT_KEY = "_qwen3_tts_ref_audio_cache_key"

_VARIANTS = {"customvoice": "CustomVoice", "voicedesign": "VoiceDesign", "base": "Base"}


# -- the chat templates the talker tokenizes (the official Qwen3-TTS prompt layout) -------------


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def ref_text_template(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


def instruct_text(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n"


# -- prompt length ------------------------------------------------------------------------------


class PromptLengthError(ValueError):
    """The payload does not determine the talker's prompt length; ``field`` names the cause."""

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        super().__init__(message)


def _one(value: Any, default: Any = None) -> Any:
    """A payload value: payload entries are one-item lists, nested ones may be bare."""
    if isinstance(value, list):
        return value[0] if value else default
    return default if value is None else value


def _sized(value: Any, axis: int) -> int | None:
    """Length of a list, or of an array/tensor along ``axis`` (None: neither or empty)."""
    if isinstance(value, list):
        return len(value) if value else None
    shape = getattr(value, "shape", None)
    if shape is None:
        return None
    try:
        return int(shape[axis]) if len(shape) else None
    except (TypeError, IndexError, ValueError):
        return None


def prompt_length(
    payload: Mapping[str, Any],
    *,
    task: str,
    count_tokens: Callable[[str], int],
    codec_language_id: Mapping[str, int] | None,
    spk_is_dialect: Mapping[str, Any] | None,
    ref_code_frames: Callable[[Any], int | None] | None = None,
) -> int:
    """How many rows the talker's prefill embeddings have for ``payload`` (its prompt length).

    The talker's prompt, row by row: the instruct turn (when there is one), the three-token role
    header, the codec prefix (the think tags, 3 or 4 with a language id, a speaker slot for
    CustomVoice and Base, then the codec pad under tts_bos), then the text conditioning: the
    whole text plus tts_eos and a codec_bos row when not streaming, its first token when
    streaming, and for Base in-context cloning codec_bos plus the reference's codec frames
    (plus, when not streaming, the reference transcript's and the text's ids and tts_eos).
    Raises ``PromptLengthError`` when the payload does not determine it.
    """
    text = _one(payload.get("text"), "")
    text = text if isinstance(text, str) else ""
    language = _one(payload.get("language"), "Auto")
    language = language if isinstance(language, str) else "Auto"
    speaker = _one(payload.get("speaker"), "")
    speaker = speaker.lower().strip() if isinstance(speaker, str) else ""
    instruct = _one(payload.get("instruct"), "")
    instruct = instruct if isinstance(instruct, str) else ""
    mode = _one(payload.get("non_streaming_mode"))
    non_streaming = mode if isinstance(mode, bool) else task in ("CustomVoice", "VoiceDesign")

    length = count_tokens(instruct_text(instruct)) if instruct.strip() else 0

    language_id = None
    if codec_language_id:
        if language.lower() != "auto":
            language_id = codec_language_id.get(language.lower())
        if language_id is None and spk_is_dialect and speaker and language.lower() in ("chinese", "auto"):
            dialect = spk_is_dialect.get(speaker)
            if isinstance(dialect, str) and dialect:
                language_id = codec_language_id.get(dialect)
    think_tags = 3 if language_id is None else 4
    speaker_slot = 1 if task in ("CustomVoice", "Base") else 0
    length += 3 + think_tags + speaker_slot + 1

    assistant = count_tokens(assistant_text(text))
    if assistant < 8:
        raise PromptLengthError("input", f"the text's chat template is {assistant} tokens, fewer than 8")
    whole_text = assistant - 6  # text ids (template minus 8) + tts_eos + the codec_bos row
    if task in ("CustomVoice", "VoiceDesign"):
        return max(2, length + (whole_text if non_streaming else 1))
    if task != "Base":
        return max(2, length)

    clone = _one(payload.get("voice_clone_prompt"))
    clone = clone if isinstance(clone, dict) else None
    in_context = not bool(_one(payload.get("x_vector_only_mode"), False))
    if clone is not None and isinstance(_one(clone.get("icl_mode")), bool):
        in_context = _one(clone.get("icl_mode"))
    if not in_context:
        return max(2, length + (whole_text if non_streaming else 1))

    # Inside voice_clone_prompt values are per-item: ref_code is (frames, codebooks) as is.
    frames = _sized(clone.get("ref_code"), 0) if clone is not None else None
    if frames is None and _one(payload.get("ref_code_length")) is not None:
        try:
            frames = int(_one(payload.get("ref_code_length")))
        except (TypeError, ValueError):
            frames = None
    if frames is None and ref_code_frames is not None:
        frames = ref_code_frames(payload.get("ref_audio"))
    if frames is None:
        raise PromptLengthError(
            "ref_audio", "in-context cloning needs the reference's codec frame count (ref_code or ref_audio)"
        )
    codec_rows = 1 + int(frames)
    if not non_streaming:
        return max(2, length + codec_rows)

    ref_ids = _one(payload.get("ref_ids"))
    if ref_ids is None and clone is not None:
        ref_ids = clone.get("ref_ids") or clone.get("ref_id")
    if ref_ids is None:
        transcript = _one(payload.get("ref_text"), "")
        if (not isinstance(transcript, str) or not transcript.strip()) and clone is not None:
            transcript = _one(clone.get("ref_text"), "")
        if not isinstance(transcript, str) or not transcript.strip():
            raise PromptLengthError(
                "ref_text", "non-streaming in-context cloning needs the reference transcript"
            )
        ref_len = count_tokens(ref_text_template(transcript))
    else:
        ref_len = _sized(ref_ids, -1) or 0
    # The talker keeps the transcript's ids without its 3-token header and 2-token tail, the
    # text's without the 3-token header and 5-token tail, then tts_eos.
    text_rows = max(0, ref_len - 5) + max(0, assistant - 8) + 1
    return max(2, length + text_rows + codec_rows)


# -- reference audio ----------------------------------------------------------------------------


def _local_path(source: str) -> Path | None:
    """The file a ``file://`` URI or a bare path names (None: not a local reference)."""
    parsed = urlparse(source)
    scheme = parsed.scheme.lower()
    if scheme == "file":
        if parsed.netloc.lower() not in ("", "localhost"):
            raise RequestError("ref_audio", f"file URI with a remote host {parsed.netloc!r}")
        return Path(url2pathname(parsed.path))
    if scheme == "":
        return Path(source)
    return None


def decode_ref_audio(source: str) -> tuple[Any, int, str]:
    """``(mono float32 samples, sample rate, source key)`` of a ``data:`` URI or local file.

    The samples are the file's own, at its own rate (the talker resamples), channels averaged;
    1 to 30 seconds. The source key identifies the reference as vllm-omni's serving layer keys
    it: a hash of the string, with the file's mtime and size for a local file.
    """
    import numpy as np
    import soundfile

    allowed = ["a base64 data: URI", "a file:// URI", "a local file path"]
    key_source = source
    if source[:5].lower() == "data:":
        header, comma, data = source[5:].partition(",")
        if not comma:
            raise RequestError("ref_audio", "data: URI without ',' before its data", allowed)
        _, semicolon, encoding = header.rpartition(";")
        if not semicolon or encoding != "base64":
            raise RequestError("ref_audio", "only base64 data: URIs are decoded", allowed)
        try:
            blob: Any = io.BytesIO(base64.b64decode(data, validate=True))
        except (binascii.Error, ValueError) as exc:
            raise RequestError("ref_audio", f"data: URI is not valid base64 ({exc})", allowed) from None
    else:
        path = _local_path(source)
        if path is None:
            raise RequestError("ref_audio", f"{urlparse(source).scheme}: references are not fetched", allowed)
        if not path.is_file():
            raise RequestError("ref_audio", f"no such file: {path}", allowed)
        stat = path.stat()
        key_source = f"{source}:{stat.st_mtime_ns}:{stat.st_size}"
        blob = path
    try:
        with soundfile.SoundFile(blob) as f:
            rate = int(f.samplerate)
            samples = f.read(dtype="float32", always_2d=False).T
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise RequestError("ref_audio", f"cannot decode the audio ({exc})") from None
    if samples.ndim > 1:  # (channels, frames): average the channels
        samples = np.mean(samples, axis=tuple(range(samples.ndim - 1)))
    samples = np.array(samples, dtype=np.float32, order="C", copy=True)
    seconds = len(samples) / rate if rate > 0 else 0.0
    low, high = REF_AUDIO_SECONDS
    if seconds < low or seconds > high:
        raise RequestError(
            "ref_audio",
            f"the clip is {seconds:.1f} s; voice cloning needs {low:.0f} to {high:.0f} s of speech",
        )
    return samples, rate, hashlib.sha1(key_source.encode("utf-8")).hexdigest()


def ref_audio_artifact_key(samples: Any, rate: int) -> str:
    """The talker's key for a reference's cached codes and speaker embedding: a hash of the
    rate, the sample count and the float32 samples."""
    import numpy as np

    flat = np.asarray(samples, dtype=np.float32).reshape(-1)
    digest = hashlib.sha1()
    digest.update(int(rate).to_bytes(4, byteorder="little", signed=False))
    digest.update(int(flat.size).to_bytes(8, byteorder="little", signed=False))
    digest.update(flat.tobytes(order="C"))
    return digest.hexdigest()


def cache_salt(parts: Sequence[Any], payload: Mapping[str, Any]) -> str:
    """The prompt's prefix-cache salt: the placeholder ids are the same for every request of a
    length, so the salt hashes the conditioning they stand for (as vllm-omni's serving layer)."""
    digest = hashlib.sha256()
    keys = (
        "voice_created_at",
        "task_type",
        "speaker",
        "ref_text",
        "x_vector_only_mode",
        "ref_audio_cache_key",
        "ref_audio_2_cache_key",
    )
    for value in [*parts, *(payload.get(key) for key in keys)]:
        digest.update(b"\x00")
        if value is not None:
            digest.update(repr(value).encode("utf-8"))
    return digest.hexdigest()[:32]


# -- the builder --------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"Qwen3-TTS checkpoint: {path} is missing") from None
    if not isinstance(data, dict):
        raise ValueError(f"Qwen3-TTS checkpoint: {path} is not a JSON object")
    return data


class Qwen3TTSRequestBuilder(RequestBuilder):
    """Speech requests for a Qwen3-TTS checkpoint (CustomVoice, VoiceDesign or Base)."""

    model = "qwen3_tts"

    def __init__(self, checkpoint: str | Path, *, default_max_tokens: int | None = None) -> None:
        super().__init__(checkpoint, default_max_tokens=default_max_tokens)
        config = _read_json(self.checkpoint / "config.json")
        kind = config.get("tts_model_type")
        variant = _VARIANTS.get(re.sub(r"[^a-z]", "", kind.lower())) if isinstance(kind, str) else None
        if variant is None:
            raise ValueError(
                f"Qwen3-TTS checkpoint {self.checkpoint}: config.json tts_model_type is {kind!r}, "
                "not one of custom_voice, voice_design, base"
            )
        self.task: str = variant
        talker = config.get("talker_config") or {}
        speakers: Mapping[str, Any] = {}
        for key in ("spk_id", "speaker_id"):
            if isinstance(talker.get(key), dict) and talker[key]:
                speakers = talker[key]
                break
        self._speakers = [str(name).lower() for name in speakers]
        languages = talker.get("codec_language_id")
        self.codec_language_id: dict[str, int] = dict(languages) if isinstance(languages, Mapping) else {}
        dialects = talker.get("spk_is_dialect")
        self.spk_is_dialect: dict[str, Any] = dict(dialects) if isinstance(dialects, Mapping) else {}
        self.hidden_size = int(talker.get("hidden_size", 1024))  # Qwen3TTSTalkerConfig's default
        self.codec_eos_token_id = int(talker.get("codec_eos_token_id", 4198))  # the same class's default
        speech = self.checkpoint / "speech_tokenizer" / "config.json"
        self._speech_config = _read_json(speech) if speech.is_file() else None
        self._codec_frame_rate_hz = config.get("codec_frame_rate_hz")

    # -- what the checkpoint offers ---------------------------------------------------------

    def voices(self) -> list[str]:
        return list(self._speakers) if self.task == "CustomVoice" else []

    def default_voice(self) -> str | None:
        voices = self.voices()
        return voices[0] if voices else None

    def languages(self) -> list[str]:
        return sorted({str(name).title() for name in self.codec_language_id} | {"Auto"})

    def sample_rate(self) -> int:
        if self._speech_config is None:
            raise ValueError(
                f"Qwen3-TTS checkpoint {self.checkpoint}: speech_tokenizer/config.json is missing"
            )
        return int(self._speech_config.get("output_sample_rate", 24000))  # the tokenizer config's default

    def codec_frame_rate(self) -> float | None:
        """Codec frames per second of reference audio (None: the checkpoint does not say)."""
        speech = self._speech_config or {}
        rate, downsample = speech.get("output_sample_rate"), speech.get("encode_downsample_rate")
        if rate and downsample and downsample > 0:
            return float(rate) / float(downsample)
        return float(self._codec_frame_rate_hz) if self._codec_frame_rate_hz is not None else None

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.checkpoint), padding_side="left", local_files_only=True)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, padding=False)["input_ids"])

    def ref_code_frames(self, samples: int, rate: int) -> int | None:
        """Codec frames the talker's encoder makes of ``samples`` at ``rate`` (as vllm-omni
        estimates them: ceil(seconds x frame rate), in floating point)."""
        frame_rate = self.codec_frame_rate()
        if frame_rate is None or rate <= 0 or samples <= 0:
            return None
        return math.ceil(samples / rate * frame_rate)

    # -- one request ------------------------------------------------------------------------

    def engine_modules(self, request: SpeechInput) -> tuple[str, ...]:
        # The talker turns reference audio into a speaker embedding through a mel filterbank of
        # torchaudio's (melscale_fbanks), and resamples it with vLLM's AudioResampler, whose
        # default method is torchaudio's; a precomputed speaker_embedding needs neither.
        return ("torchaudio",) if request.ref_audio is not None else ()

    def build(self, request: SpeechInput) -> BuiltRequest:
        voice = request.voice
        if voice is not None and voice.lower() == DEFAULT_VOICE and DEFAULT_VOICE not in self._speakers:
            voice = None
        voice = voice.lower() if voice is not None else None

        # The task the request names (vllm-omni: ref_audio/ref_text imply Base); None: the checkpoint's.
        named_task = request.task_type
        if named_task is None and (request.ref_audio is not None or request.ref_text is not None):
            named_task = "Base"
        task = named_task or self.task
        if task not in TASKS:
            raise RequestError("task_type", f"unknown task {task!r}", [self.task])
        if task != self.task:
            cause = " (ref_audio and ref_text are Base's)" if request.task_type is None else ""
            raise RequestError(
                "task_type", f"this Qwen3-TTS checkpoint serves {self.task}, not {task}{cause}", [self.task]
            )

        if not request.input or not request.input.strip():
            raise RequestError("input", "the text is empty")

        language = request.language.title() if request.language is not None else None
        if language is not None and language not in self.languages():
            raise RequestError("language", f"unknown language {request.language!r}", self.languages())

        if task == "CustomVoice":
            if not self._speakers:
                raise RequestError(
                    "voice", "this CustomVoice checkpoint has no speakers (talker_config.spk_id)", []
                )
            if voice is not None and voice not in self._speakers:
                raise RequestError("voice", f"unknown voice {request.voice!r}", self.voices())
        elif voice is not None:
            why = (
                "designs the voice from instructions"
                if task == "VoiceDesign"
                else "clones the voice of ref_audio"
            )
            raise RequestError("voice", f"{task} {why}: omit voice", [DEFAULT_VOICE])

        x_vector_only = request.x_vector_only_mode
        embedding: list[float] | None = None
        if request.speaker_embedding is not None:
            embedding = self._embedding(request, task)
            x_vector_only = True

        if task == "Base":
            if request.ref_audio is None and embedding is None:
                raise RequestError("ref_audio", "Base clones a voice: send ref_audio (or speaker_embedding)")
            if x_vector_only:
                if request.ref_text is not None:
                    raise RequestError(
                        "ref_text", "x_vector_only_mode clones from the speaker embedding alone"
                    )
            elif not request.ref_text or not request.ref_text.strip():
                raise RequestError(
                    "ref_text", "Base needs the transcript of ref_audio unless x_vector_only_mode is true"
                )
        else:
            for name in ("ref_audio", "ref_text", "x_vector_only_mode"):
                if getattr(request, name) is not None:
                    raise RequestError(name, f"only Base uses it; this request is {task}")

        if task == "VoiceDesign" and not request.instructions:
            raise RequestError("instructions", "VoiceDesign needs instructions describing the voice")
        if request.instructions and len(request.instructions) > MAX_INSTRUCTIONS_CHARS:
            raise RequestError(
                "instructions", f"{len(request.instructions)} characters; at most {MAX_INSTRUCTIONS_CHARS}"
            )
        if request.max_new_tokens is not None and not 1 <= request.max_new_tokens <= MAX_NEW_TOKENS:
            raise RequestError(
                "max_new_tokens", f"{request.max_new_tokens} is not within 1 to {MAX_NEW_TOKENS}"
            )

        # The payload, key by key in the order vllm-omni's adapter writes it.
        payload: dict[str, Any] = {
            "text": [request.input],
            "task_type": [task],
            "language": [language or "Auto"],
        }
        if voice is not None:
            payload["speaker"] = [voice]
            payload["voice_created_at"] = [0]  # built-in speakers; uploads carry their time
        elif task == "CustomVoice":
            payload["speaker"] = [self._speakers[0]]
        payload["instruct"] = [request.instructions if request.instructions is not None else ""]
        if request.ref_text is not None:
            payload["ref_text"] = [request.ref_text]
        if embedding is not None:
            payload["voice_clone_prompt"] = [{"ref_spk_embedding": embedding}]
            payload["x_vector_only_mode"] = [True]
        elif request.x_vector_only_mode is not None:
            payload["x_vector_only_mode"] = [request.x_vector_only_mode]
        payload["max_new_tokens"] = [
            request.max_new_tokens if request.max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS
        ]
        if request.non_streaming_mode is not None:
            payload["non_streaming_mode"] = [request.non_streaming_mode]
        elif task == "VoiceDesign":
            payload["non_streaming_mode"] = [True]
        if request.ref_audio is not None:
            samples, rate, source_key = decode_ref_audio(request.ref_audio)
            payload["ref_audio_cache_key"] = source_key
            payload[REF_AUDIO_ARTIFACT_KEY] = [ref_audio_artifact_key(samples, rate)]
            frames = self.ref_code_frames(len(samples), rate)
            if frames is not None:
                payload["ref_code_length"] = [frames]
            payload["ref_audio"] = [[samples.tolist(), rate]]

        try:
            length = prompt_length(
                payload,
                task=task,
                count_tokens=self.count_tokens,
                codec_language_id=self.codec_language_id,
                spk_is_dialect=self.spk_is_dialect,
            )
        except PromptLengthError as exc:
            if exc.field == "ref_audio":
                raise RequestError(
                    "ref_audio",
                    f"{exc}; the checkpoint gives no codec frame rate "
                    "(speech_tokenizer/config.json output_sample_rate and encode_downsample_rate)",
                ) from None
            raise RequestError(exc.field, str(exc)) from None

        max_tokens = self._token_budget(request, task)
        if max_tokens is not None:
            payload[EFFECTIVE_MAX_TOKENS_KEY] = [max_tokens]

        salt_parts = (
            request.input,
            named_task,
            language,
            voice,
            request.ref_text,
            request.ref_audio,
            request.instructions,
            x_vector_only,
            embedding,
        )
        prompt = {
            "prompt_token_ids": [PLACEHOLDER_ID] * length,
            "cache_salt": cache_salt(salt_parts, payload),
        }
        # The talker ends a take with its codec EOS (vllm-omni's pipeline hard-codes 2150, the
        # released checkpoints' id; the serving layer itself sets no stop ids).
        sampling = {"stop_token_ids": [self.codec_eos_token_id]}
        return BuiltRequest(prompt=prompt, payload=payload, max_tokens=max_tokens, sampling=sampling)

    def _embedding(self, request: SpeechInput, task: str) -> list[float]:
        values = request.speaker_embedding
        if task != "Base":
            raise RequestError("speaker_embedding", f"only Base uses it; this request is {task}")
        if request.ref_audio is not None:
            raise RequestError("speaker_embedding", "send either speaker_embedding or ref_audio, not both")
        if request.x_vector_only_mode is False:
            raise RequestError(
                "speaker_embedding", "a speaker embedding clones in x_vector_only_mode, not in context"
            )
        try:
            embedding = [float(value) for value in values]  # type: ignore[union-attr]
        except (TypeError, ValueError):
            raise RequestError("speaker_embedding", "must be one flat list of numbers") from None
        if not all(math.isfinite(value) for value in embedding):
            raise RequestError("speaker_embedding", "values must be finite")
        if len(embedding) != self.hidden_size:
            raise RequestError(
                "speaker_embedding",
                f"{len(embedding)} values; the talker needs {self.hidden_size} (its hidden size)",
            )
        return embedding

    def _token_budget(self, request: SpeechInput, task: str) -> int | None:
        """The talker's max_tokens: the request's max_new_tokens; for Base without it, the
        configured budget capped at max(192, 12 x text tokens) (a Base talker that misses its
        codec EOS runs to the cap); else the configured budget."""
        if request.max_new_tokens is not None:
            budget: int | None = request.max_new_tokens
        elif task == "Base" and (text_tokens := self.count_tokens(request.input)) > 0:
            budget = max(BASE_MIN_CODEC_FRAMES, text_tokens * BASE_CODEC_FRAMES_PER_TEXT_TOKEN)
            if self.default_max_tokens is not None:
                budget = min(budget, int(self.default_max_tokens))
        else:
            budget = self.default_max_tokens
        return max(1, int(budget)) if budget is not None else None
