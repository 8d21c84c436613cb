"""Audio as an OpenAI-style speech API answers it: a whole file in one of six formats, or a stream.

The model's audio is floats in [-1, 1] (a 1-D NumPy array or torch tensor) at its sample rate.
Every answer starts from the same 16-bit samples, made by one function (:func:`to_pcm16`: clip
to [-1, 1], scale by 32767, round half to even), so a streamed body and the whole response agree
byte for byte:

- **Whole responses** (:func:`encode`): ``response_format`` ``wav`` (soundfile, 16-bit), ``pcm``
  (the raw 16-bit little-endian mono samples), and through PyAV ``flac`` (16-bit, lossless),
  ``mp3`` (LAME), ``opus`` (libopus in an Ogg file) and ``aac`` (FFmpeg's AAC encoder, ADTS
  frames), each lossy one at its encoder's defaults (measured at 24 kHz: LAME's VBR, libopus
  64 kb/s, AAC 69 kb/s). An encoder that cannot take the model's rate (Opus takes 8, 12, 16, 24
  or 48 kHz) gets the audio resampled by PyAV's ``av.AudioResampler`` to its next rate up (48 kHz
  for Opus at 22.05 or 44.1 kHz); :class:`EncodedAudio` says the rate the file holds. Opus
  decoders play at 48 kHz whatever the rate. Nothing here writes a codec's bytes by hand.
- **Streams** (:func:`open_stream`): ``stream_format`` ``audio`` answers a raw body, ``pcm``
  (16-bit samples as they come) or ``wav`` (a 44-byte header whose RIFF and data sizes are
  0xFFFFFFFF, "unknown", as OpenAI and vllm-omni stream WAV, then the samples); ``sse`` answers
  ``text/event-stream`` frames ``data: {"type": "speech.audio.delta", "audio": BASE64}`` and a
  closing ``data: {"type": "speech.audio.done", "usage": {...}}``, OpenAI's event shapes. A
  delta's bytes are what the raw stream of the same ``response_format`` would send (``pcm``: the
  samples; ``wav``: the first delta starts with the streaming header, as vllm-omni sends it).
- **Speed** (OpenAI's ``speed``, 0.25 to 4.0) is honoured, for whole responses and streams
  alike: :class:`Tempo` runs FFmpeg's ``atempo`` filter (pitch kept) through PyAV's filter graph.
  ``atempo`` keeps its state between frames, so a stream gets a graph of its own; :class:`Tempo`
  feeds it fixed-size frames however the chunks come, so a stream at a speed matches the whole
  response at that speed sample for sample (at the cost of holding back up to 2047 samples).

A bad ``response_format``, ``stream_format`` or ``speed`` is a
:class:`~omnigen.requests.base.RequestError` (a ``ValueError``) naming the field and what is
allowed; :func:`open_stream` and :func:`check_request` check everything before any audio exists,
so the HTTP layer can refuse with 400 before a pipeline runs.
"""

from __future__ import annotations

import base64
import io
import json
import math
import numbers
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import av
import numpy as np
import soundfile

from omnigen.requests.base import RequestError

RESPONSE_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
"""OpenAI's ``response_format`` values, all served."""
MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
"""Each format's ``Content-Type`` (``opus`` is an Ogg Opus file, as OpenAI and vllm-omni send it)."""
STREAM_FORMATS = ("audio", "sse")
"""OpenAI's ``stream_format``: a raw audio body, or server-sent events."""
STREAMED_FORMATS = ("pcm", "wav")
"""The ``response_format`` values a stream can carry (the others need the whole audio first)."""
SSE_MEDIA_TYPE = "text/event-stream"
SPEED_RANGE = (0.25, 4.0)
"""OpenAI's range of ``speed`` (1.0: as the model made it)."""

PCM16_SCALE = 32767.0
STREAMING_WAV_SIZE = b"\xff\xff\xff\xff"
"""The RIFF and data chunk size of a streamed WAV file: not known when the header goes out."""

# response_format -> (PyAV encoder, FFmpeg container) for the lossy formats.
_AV_CODECS = {
    "flac": ("flac", "flac"),
    "mp3": ("libmp3lame", "mp3"),
    "opus": ("libopus", "ogg"),
    "aac": ("aac", "adts"),
}
LOSSY_FORMATS = ("mp3", "opus", "aac")
"""Formats whose files cannot be empty: a response without samples is refused for them."""
_ATEMPO_MIN = 0.5
"""The slowest one ``atempo`` filter goes (FFmpeg 8); slower speeds chain several."""


@dataclass(frozen=True)
class EncodedAudio:
    """A whole response: its bytes, ``Content-Type``, and the sample rate the bytes hold."""

    data: bytes
    media_type: str
    sample_rate: int
    response_format: str


@dataclass(frozen=True)
class SpeechUsage:
    """What the closing ``speech.audio.done`` event reports (OpenAI's ``usage`` object)."""

    input_tokens: int
    output_tokens: int

    def as_dict(self) -> dict[str, int]:
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "total_tokens": self.input_tokens + self.output_tokens,
        }


def check_response_format(response_format: str) -> str:
    """``response_format`` as served (lower case), or a ``RequestError`` listing the formats."""
    name = response_format.lower() if isinstance(response_format, str) else response_format
    if name not in RESPONSE_FORMATS:
        raise RequestError("response_format", f"{response_format!r} is not a format", list(RESPONSE_FORMATS))
    return name


def check_speed(speed: float) -> float:
    """``speed`` as a float in OpenAI's range 0.25 to 4.0, or a ``RequestError`` naming it."""
    low, high = SPEED_RANGE
    if isinstance(speed, bool) or not isinstance(speed, numbers.Real) or not math.isfinite(speed):
        raise RequestError("speed", f"{speed!r} is not a number; give one from {low} to {high}")
    if not low <= speed <= high:
        raise RequestError("speed", f"{speed!r} is outside {low} to {high} (1.0: as the model made it)")
    return float(speed)


def check_request(
    response_format: str, speed: float = 1.0, stream_format: str | None = None
) -> tuple[str, float]:
    """Check a request's output fields before anything runs: ``(response_format, speed)``.

    ``stream_format`` None answers a whole file (any of :data:`RESPONSE_FORMATS`); ``audio`` or
    ``sse`` a stream, which carries ``pcm`` or ``wav`` only.
    """
    name = check_response_format(response_format)
    speed = check_speed(speed)
    if stream_format is not None:
        if stream_format not in STREAM_FORMATS:
            raise RequestError(
                "stream_format", f"{stream_format!r} is not a stream format", list(STREAM_FORMATS)
            )
        if name not in STREAMED_FORMATS:
            raise RequestError(
                "response_format",
                f"{name!r} cannot be streamed (it needs the whole audio); stream pcm or wav, "
                "or ask for the whole file without streaming",
                list(STREAMED_FORMATS),
            )
    return name, speed


def mono_float32(samples: Any) -> np.ndarray:
    """``samples`` (a NumPy array or torch tensor, mono) as a 1-D float32 NumPy array.

    A shape with more than one non-unit axis (several channels) is refused, as are NaN and
    infinite samples (a model fault, not something to round into clicks).
    """
    if hasattr(samples, "detach"):  # a torch tensor, on any device and of any float dtype
        samples = samples.detach().to("cpu").float().numpy()
    array = np.asarray(samples, dtype=np.float32)
    if sum(size != 1 for size in array.shape) > 1:
        raise ValueError(f"audio of shape {tuple(array.shape)} is not mono: give one channel (a 1-D array)")
    array = array.reshape(-1)
    if not np.isfinite(array).all():
        bad = int(array.size - np.isfinite(array).sum())
        raise ValueError(
            f"audio: {bad} of {array.size} samples are NaN or infinite; the model's output is broken"
        )
    return array


def to_pcm16(samples: Any) -> np.ndarray:
    """The one float -> 16-bit conversion of every answer: clip to [-1, 1], x 32767, round (half
    to even), as little-endian int16."""
    audio = mono_float32(samples)
    return np.round(np.clip(audio, -1.0, 1.0) * np.float32(PCM16_SCALE)).astype("<i2")


def pcm16_bytes(samples: Any) -> bytes:
    """``samples`` as raw PCM16 little-endian mono bytes (``response_format`` ``pcm``)."""
    return to_pcm16(samples).tobytes()


def encode(
    samples: Any, sample_rate: int, response_format: str = "wav", *, speed: float = 1.0
) -> EncodedAudio:
    """The whole response for ``samples`` at ``sample_rate`` in ``response_format``, at ``speed``.

    ``wav``/``flac``/``pcm`` hold exactly :func:`to_pcm16`'s samples at ``sample_rate``; ``mp3``,
    ``opus`` and ``aac`` are encoded by PyAV from those samples (resampled with
    ``av.AudioResampler`` where the encoder needs another rate, e.g. Opus at 22.05 kHz -> 24 kHz).
    ``speed`` other than 1.0 runs :class:`Tempo` (FFmpeg's ``atempo``) first. No samples at all
    make an empty ``pcm``, a header-only ``wav`` or ``flac``, and a ``ValueError`` for the lossy
    formats (their encoders write no file for nothing).
    """
    name, speed = check_request(response_format, speed)
    rate = _check_sample_rate(sample_rate)
    audio = mono_float32(samples)
    if speed != 1.0:
        tempo = Tempo(rate, speed)
        audio = np.concatenate([tempo.push(audio), tempo.finish()])
    pcm = to_pcm16(audio)
    if name in LOSSY_FORMATS and not pcm.size:
        raise ValueError(
            f"no audio samples to encode: an {name} file cannot be empty (wav, flac and pcm can)"
        )
    if name == "pcm":
        data, out_rate = pcm.tobytes(), rate
    elif name == "wav":
        data, out_rate = _soundfile_bytes(pcm, rate, "WAV"), rate
    else:
        data, out_rate = _av_bytes(pcm, rate, *_AV_CODECS[name])
    return EncodedAudio(data, MEDIA_TYPES[name], out_rate, name)


def streaming_wav_header(sample_rate: int) -> bytes:
    """The 44-byte header of a streamed 16-bit mono WAV file: the header soundfile writes for the
    whole file, with its RIFF and data sizes set to 0xFFFFFFFF (unknown until the stream ends),
    the convention OpenAI and vllm-omni stream WAV with and that soundfile, FFmpeg and browsers
    read to the end of the body."""
    header = _soundfile_bytes(np.zeros(0, dtype="<i2"), _check_sample_rate(sample_rate), "WAV")
    if len(header) != 44 or header[:4] != b"RIFF" or header[36:40] != b"data":
        raise RuntimeError(f"soundfile wrote an unexpected WAV header ({len(header)} bytes: {header[:48]!r})")
    return header[:4] + STREAMING_WAV_SIZE + header[8:40] + STREAMING_WAV_SIZE


class Tempo:
    """Audio at ``speed`` times its pace with its pitch kept: FFmpeg's ``atempo`` filter in a
    PyAV filter graph (``av.filter.Graph``), fed float32 mono frames.

    One instance per request: :meth:`push` returns what the filter has ready so far (possibly
    nothing), :meth:`finish` the rest. The output's length is the input's divided by ``speed``
    to within a few per cent (measured at 24 kHz, 2 to 3 s: 0.99 to 1.01 of it from 0.25 to
    4.0). Speeds below 0.5, one filter's limit, chain equal ``atempo`` steps (0.25 = 0.5 x 0.5).

    The filter is fed frames of :data:`BLOCK` samples whatever the caller's chunks are (the last
    frame takes the remainder, so a frame is never shorter than a block unless the whole input
    is): ``atempo``'s output depends on its input frames' sizes (measured: a first frame of one
    sample changes the samples that follow; one sample at speed 4 makes it fail with ENOMEM, its
    output frame rounding to zero samples). So a stream cut anyhow gives the whole answer's
    samples exactly, and holds back at most ``2 * BLOCK - 1`` input samples until more come.

    ``atempo`` keeps up to a window of its input when the input ends (measured: 176 samples at
    16 kHz and speed 0.5 came out empty, 1000 came out as 1000): :meth:`finish` feeds a fifth of
    a second of silence after the audio and cuts the output to ``round(input / speed)`` samples.
    """

    BLOCK = 1024
    """Samples per frame fed to the filter (43 ms at 24 kHz)."""

    def __init__(self, sample_rate: int, speed: float) -> None:
        self.sample_rate = _check_sample_rate(sample_rate)
        self.speed = check_speed(speed)
        self._time_base = Fraction(1, self.sample_rate)
        self._pts = 0
        self._taken = 0
        self._given = 0
        self._pending = np.zeros(0, dtype=np.float32)
        self._finished = False
        self._graph = av.filter.Graph()
        node = self._graph.add_abuffer(
            format="flt", sample_rate=self.sample_rate, layout="mono", time_base=self._time_base
        )
        steps = 1
        while self.speed ** (1 / steps) < _ATEMPO_MIN:
            steps += 1
        for _ in range(steps):
            step = self._graph.add("atempo", tempo=repr(self.speed ** (1 / steps)))
            node.link_to(step)
            node = step
        pinned = self._graph.add("aformat", sample_fmts="flt", channel_layouts="mono")
        node.link_to(pinned)
        sink = self._graph.add("abuffersink")
        pinned.link_to(sink)
        self._graph.configure()

    def push(self, samples: Any) -> np.ndarray:
        """Feed the next samples; return the float32 samples the filter has ready."""
        if self._finished:
            raise RuntimeError("Tempo.push after finish: make a new Tempo for a new request")
        audio = mono_float32(samples)
        self._taken += audio.size
        self._pending = np.concatenate([self._pending, audio])
        # Keep at least a block back: the last frame must not be shorter than one.
        blocks = max(0, self._pending.size // self.BLOCK - 1)
        for index in range(blocks):
            self._feed(self._pending[index * self.BLOCK : (index + 1) * self.BLOCK])
        self._pending = self._pending[blocks * self.BLOCK :]
        return self._ready()

    def finish(self) -> np.ndarray:
        """End the input; return the samples the filter still held."""
        if self._finished:
            raise RuntimeError("Tempo.finish called twice")
        self._finished = True
        flush = np.zeros(self.sample_rate // 5, dtype=np.float32)
        tail = np.concatenate([self._pending, flush])
        blocks = max(tail.size // self.BLOCK - 1, 0)  # whole blocks, then the rest (one to two blocks)
        for index in range(blocks):
            self._feed(tail[index * self.BLOCK : (index + 1) * self.BLOCK])
        self._feed(tail[blocks * self.BLOCK :])
        self._pending = self._pending[:0]
        self._graph.push(None)
        wanted = max(round(self._taken / self.speed) - self._given, 0)
        out = self._drain()[:wanted]
        self._given += out.size
        return out

    def _feed(self, audio: np.ndarray) -> None:
        frame = av.AudioFrame.from_ndarray(audio.reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate = self.sample_rate
        frame.time_base = self._time_base
        frame.pts = self._pts
        self._pts += audio.size
        self._graph.push(frame)

    def _drain(self) -> np.ndarray:
        out = []
        while True:
            try:
                frame = self._graph.pull()
            except (av.error.BlockingIOError, av.error.EOFError):
                break
            out.append(frame.to_ndarray().reshape(-1))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)

    def _ready(self) -> np.ndarray:
        """What ``push`` hands out: never past the take's final length."""
        out = self._drain()[: max(round(self._taken / self.speed) - self._given, 0)]
        self._given += out.size
        return out


class AudioStream:
    """A raw streamed body (``stream_format`` ``audio``): ``pcm`` or ``wav`` with a streaming header.

    :meth:`write` each chunk of float samples as it comes and send what it returns; then send
    :meth:`finish`'s bytes (the tail ``speed``'s filter still held). A ``wav`` stream's header
    goes out with the first bytes returned, so even a stream without samples is a WAV file.
    """

    def __init__(self, response_format: str, sample_rate: int, *, speed: float = 1.0) -> None:
        self.response_format, speed = check_request(response_format, speed, "audio")
        self.sample_rate = _check_sample_rate(sample_rate)
        self.media_type = MEDIA_TYPES[self.response_format]
        self._header = streaming_wav_header(self.sample_rate) if self.response_format == "wav" else b""
        self._tempo = Tempo(self.sample_rate, speed) if speed != 1.0 else None
        self._finished = False

    def write(self, samples: Any) -> bytes:
        """The bytes to send for the next chunk (may be empty while ``speed``'s filter fills)."""
        if self._finished:
            raise RuntimeError("write after finish: the stream has ended")
        audio = self._tempo.push(samples) if self._tempo is not None else mono_float32(samples)
        return self._take_header() + pcm16_bytes(audio)

    def finish(self, usage: SpeechUsage | None = None) -> bytes:
        """The last bytes of the body. A raw body has no place for ``usage`` (only SSE sends it)."""
        if self._finished:
            raise RuntimeError("finish called twice")
        self._finished = True
        tail = self._tempo.finish() if self._tempo is not None else np.zeros(0, dtype=np.float32)
        return self._take_header() + pcm16_bytes(tail)

    def _take_header(self) -> bytes:
        header, self._header = self._header, b""
        return header


class SseStream:
    """A server-sent-event stream (``stream_format`` ``sse``), OpenAI's ``/v1/audio/speech`` events.

    :meth:`write` returns a ``data: {"type": "speech.audio.delta", "audio": BASE64}\\n\\n`` frame
    (or nothing when the chunk made no bytes); :meth:`finish` any last delta and the closing
    ``data: {"type": "speech.audio.done", "usage": {...}}\\n\\n``. Every delta is PCM16
    (mono, little endian, at ``sample_rate``), for ``pcm`` and ``wav`` alike: an event stream
    has no file to put a WAV header at the front of (vllm-omni sends one in the first delta).
    """

    media_type = SSE_MEDIA_TYPE

    def __init__(self, response_format: str, sample_rate: int, *, speed: float = 1.0) -> None:
        check_request(response_format, speed, "sse")
        self.response_format = check_response_format(response_format)
        self._audio = AudioStream("pcm", sample_rate, speed=speed)
        self.sample_rate = self._audio.sample_rate

    def write(self, samples: Any) -> bytes:
        return self._delta(self._audio.write(samples))

    def finish(self, usage: SpeechUsage | None = None) -> bytes:
        """The last delta (if any) and ``speech.audio.done`` with ``usage`` (required here)."""
        if usage is None:
            raise ValueError("an SSE stream ends with speech.audio.done, which carries usage: pass it")
        tail = self._delta(self._audio.finish())
        return tail + _sse_frame({"type": "speech.audio.done", "usage": usage.as_dict()})

    @staticmethod
    def _delta(data: bytes) -> bytes:
        if not data:
            return b""
        return _sse_frame({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})


def open_stream(
    stream_format: str, response_format: str, sample_rate: int, *, speed: float = 1.0
) -> AudioStream | SseStream:
    """The writer of a streamed answer; refuses a bad ``stream_format``, ``response_format`` or
    ``speed`` (``RequestError``) before any audio exists. Its ``media_type`` is the
    ``Content-Type`` to answer with."""
    check_request(response_format, speed, stream_format)
    if stream_format == "sse":
        return SseStream(response_format, sample_rate, speed=speed)
    return AudioStream(response_format, sample_rate, speed=speed)


def sse_error(message: str) -> bytes:
    """The event that ends an SSE stream which failed after its first audio: the audio sent so
    far is incomplete (``action: discard``)."""
    return _sse_frame(
        {
            "type": "speech.audio.error",
            "error": {"message": message, "type": "server_error"},
            "action": "discard",
        }
    )


def _sse_frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _check_sample_rate(sample_rate: int) -> int:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int | np.integer) or sample_rate <= 0:
        raise ValueError(f"sample_rate {sample_rate!r}: a positive whole number of Hz")
    return int(sample_rate)


def _soundfile_bytes(pcm: np.ndarray, sample_rate: int, container: str) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, pcm, sample_rate, format=container, subtype="PCM_16")
    return buffer.getvalue()


def _encoder_rate(codec: av.codec.Codec, sample_rate: int) -> int:
    """``sample_rate`` if the encoder takes it, else its next rate up (its highest if none is)."""
    rates = codec.audio_rates
    if not rates or sample_rate in rates:
        return sample_rate
    higher = [rate for rate in rates if rate >= sample_rate]
    return min(higher) if higher else max(rates)


def _av_bytes(pcm: np.ndarray, sample_rate: int, codec_name: str, container: str) -> tuple[bytes, int]:
    """``pcm`` encoded by PyAV's ``codec_name`` into an FFmpeg ``container``: (bytes, its rate)."""
    rate = _encoder_rate(av.codec.Codec(codec_name, "w"), sample_rate)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(codec_name, rate=rate, layout="mono")
        out.start_encoding()  # the container's header even when no packet follows
        # To the encoder's rate and sample format; the encoder cuts its own frame sizes.
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout="mono", rate=rate)
        frames = []
        if pcm.size:
            frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = sample_rate
            frame.time_base = Fraction(1, sample_rate)
            frame.pts = 0
            frames = resampler.resample(frame)
        for frame in [*frames, *resampler.resample(None)]:
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buffer.getvalue(), rate
