"""The speech API's audio (``omnigen.serving.audio_out``): every ``response_format`` decodes back by
soundfile or PyAV, streams equal the whole answer byte for byte, SSE frames are OpenAI's, and
``speed`` changes the duration by its factor with the pitch kept; bad fields are named."""

from __future__ import annotations

import base64
import io
import json

import av
import numpy as np
import pytest
import soundfile
import torch

from omnigen.requests.base import RequestError
from omnigen.serving import audio_out
from omnigen.serving.audio import wav_bytes
from omnigen.serving.audio_out import (
    MEDIA_TYPES,
    RESPONSE_FORMATS,
    AudioStream,
    SpeechUsage,
    SseStream,
    Tempo,
    encode,
    open_stream,
    pcm16_bytes,
    streaming_wav_header,
    to_pcm16,
)

RATE = 24000
PITCH_HZ = 180.0


def voice(seconds: float, rate: int) -> np.ndarray:
    """A voiced sound: harmonics of 180 Hz under a 3 Hz syllable envelope, sampled at ``rate``."""
    t = np.arange(round(seconds * rate)) / rate
    tone = sum(np.sin(2 * np.pi * PITCH_HZ * k * t) / k for k in (1, 2, 3))
    envelope = 0.55 + 0.45 * np.sin(2 * np.pi * 3.0 * t)
    return (0.4 * envelope * tone).astype(np.float32)


def decode_av(data: bytes) -> tuple[np.ndarray, int, str]:
    """``data`` decoded by PyAV (FFmpeg) to float samples: (samples, rate, container)."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [frame.to_ndarray().reshape(-1) for frame in container.decode(stream)]
        samples = np.concatenate(frames).astype(np.float64) if frames else np.zeros(0)
        if frames and np.issubdtype(frames[0].dtype, np.integer):
            samples /= 32768.0
        return samples, stream.codec_context.sample_rate, container.format.name


def best_correlation(decoded: np.ndarray, reference: np.ndarray, max_lag: int) -> tuple[float, int]:
    """The highest normalised correlation of ``decoded`` with ``reference`` over lags 0..max_lag
    (encoders' priming delays the decoded audio), and that lag."""
    n = min(reference.size, decoded.size - max_lag)
    ref, window = reference[:n], decoded[: n + max_lag]
    size = 1 << (window.size + n).bit_length()
    # dots[lag] = sum_i window[lag + i] * ref[i], for every lag at once (an FFT correlation)
    dots = np.fft.irfft(np.fft.rfft(window, size) * np.conj(np.fft.rfft(ref, size)), size)[: max_lag + 1]
    energy = np.concatenate([[0.0], np.cumsum(window**2)])
    norms = np.sqrt(energy[n : n + max_lag + 1] - energy[: max_lag + 1]) * np.linalg.norm(ref) + 1e-12
    lag = int(np.argmax(dots / norms))
    return float(dots[lag] / norms[lag]), lag


def pitch_of(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(samples.size)))
    return float(np.fft.rfftfreq(samples.size, 1 / rate)[np.argmax(spectrum)])


def test_one_pcm16_conversion_clips_scales_and_rounds():
    x = np.array([-3.0, -1.0, -0.5, 0.0, 0.25, 0.5, 1.0, 7.0, 1.4 / 32767, 1.6 / 32767], dtype=np.float32)
    assert to_pcm16(x).tolist() == [-32767, -32767, -16384, 0, 8192, 16384, 32767, 32767, 1, 2]
    assert to_pcm16(x).dtype == np.dtype("<i2")
    assert pcm16_bytes(x) == to_pcm16(x).tobytes()
    # A torch tensor (any float dtype, a leading channel axis) gives the same bytes as NumPy.
    audio = voice(0.1, RATE)
    assert pcm16_bytes(torch.from_numpy(audio).reshape(1, -1)) == pcm16_bytes(audio)
    assert pcm16_bytes(torch.from_numpy(audio).double()) == pcm16_bytes(audio)


def test_audio_that_is_not_mono_or_not_finite_is_refused():
    with pytest.raises(ValueError, match=r"shape \(2, 10\) is not mono"):
        to_pcm16(np.zeros((2, 10), np.float32))
    bad = np.zeros(10, np.float32)
    bad[3] = np.nan
    bad[4] = np.inf
    with pytest.raises(ValueError, match="2 of 10 samples are NaN or infinite"):
        encode(bad, RATE, "wav")


def test_every_format_has_its_media_type():
    assert MEDIA_TYPES == {
        "mp3": "audio/mpeg",
        "opus": "audio/ogg",
        "aac": "audio/aac",
        "flac": "audio/flac",
        "wav": "audio/wav",
        "pcm": "audio/pcm",
    }
    audio = voice(0.3, RATE)
    for name in RESPONSE_FORMATS:
        out = encode(audio, RATE, name)
        assert (out.media_type, out.response_format) == (MEDIA_TYPES[name], name)
    assert encode(audio, RATE, "WAV").response_format == "wav"


def test_pcm_is_the_raw_samples_and_wav_holds_them_exactly():
    audio = voice(1.0, RATE)
    pcm = encode(audio, RATE, "pcm")
    assert pcm.data == to_pcm16(audio).tobytes() and pcm.sample_rate == RATE
    wav = encode(audio, RATE, "wav").data
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="int16")
    assert rate == RATE and np.array_equal(samples, to_pcm16(audio))
    # The same file the server wrote with the standard library's wave module before.
    assert wav == wav_bytes(torch.from_numpy(audio), RATE)
    assert wav[44:] == pcm.data


def test_flac_is_lossless():
    audio = voice(1.0, RATE)
    flac = encode(audio, RATE, "flac").data
    assert flac[:4] == b"fLaC"
    samples, rate = soundfile.read(io.BytesIO(flac), dtype="int16")
    assert rate == RATE and np.array_equal(samples, to_pcm16(audio))
    decoded, rate, container = decode_av(flac)
    assert (rate, container) == (RATE, "flac")
    assert np.array_equal(np.round(decoded * 32768).astype(np.int16), to_pcm16(audio))


# name -> (container PyAV reads, rate it decodes at for 24 kHz input, samples of codec padding allowed)
LOSSY = {
    "mp3": ("mp3", RATE, 0),  # LAME's delay and padding are in the Xing/LAME header: trimmed
    "opus": ("ogg", 48000, 0),  # Ogg Opus: pre-skip trimmed; Opus always decodes at 48 kHz
    "aac": ("aac", RATE, 2 * 1024),  # ADTS has no priming info: 1024 priming + up to a frame
}


@pytest.mark.parametrize("name", sorted(LOSSY))
def test_lossy_formats_decode_to_the_rate_the_length_and_the_sound(name):
    container, decoded_rate, padding = LOSSY[name]
    seconds = 1.5
    out = encode(voice(seconds, RATE), RATE, name)
    assert out.sample_rate == RATE
    decoded, rate, format_name = decode_av(out.data)
    assert (rate, format_name) == (decoded_rate, container)
    expected = round(seconds * rate)
    assert expected <= decoded.size <= expected + padding
    correlation, lag = best_correlation(
        decoded, voice(seconds, rate).astype(np.float64), max_lag=padding + 64
    )
    assert correlation > 0.98, (name, correlation, lag)


@pytest.mark.parametrize(("rate", "encoded_at"), [(22050, 24000), (44100, 48000), (16000, 16000)])
def test_opus_at_a_rate_it_does_not_take_is_resampled_to_its_next_rate(rate, encoded_at):
    out = encode(voice(1.0, rate), rate, "opus")
    assert out.sample_rate == encoded_at
    decoded, decoded_rate, _ = decode_av(out.data)
    assert decoded_rate == 48000 and abs(decoded.size - 48000) <= 960
    correlation, _ = best_correlation(decoded, voice(1.0, 48000).astype(np.float64), max_lag=200)
    assert correlation > 0.97


def test_mp3_keeps_a_rate_lame_takes():
    out = encode(voice(1.0, 22050), 22050, "mp3")
    decoded, rate, _ = decode_av(out.data)
    assert (out.sample_rate, rate, decoded.size) == (22050, 22050, 22050)


def test_no_samples_make_an_empty_wav_and_flac_and_refuse_the_lossy_formats():
    empty = np.zeros(0, np.float32)
    assert encode(empty, RATE, "pcm").data == b""
    samples, rate = soundfile.read(io.BytesIO(encode(empty, RATE, "wav").data), dtype="int16")
    assert (samples.size, rate) == (0, RATE)
    decoded, rate, container = decode_av(encode(empty, RATE, "flac").data)
    assert (decoded.size, rate, container) == (0, RATE, "flac")
    for name in ("mp3", "opus", "aac"):
        with pytest.raises(ValueError, match=f"an {name} file cannot be empty"):
            encode(empty, RATE, name)


def chunks_of(audio: np.ndarray) -> list[np.ndarray]:
    """``audio`` cut unevenly, with an empty chunk and a torch chunk among them."""
    cuts = [0, 1, 1, 479, 480, 4000, 4001, 9000, audio.size]
    parts = [audio[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    parts[3] = torch.from_numpy(parts[3].copy())
    return parts


def test_a_pcm_stream_is_the_whole_pcm_answer():
    audio = voice(0.6, RATE)
    stream = open_stream("audio", "pcm", RATE)
    assert isinstance(stream, AudioStream) and stream.media_type == "audio/pcm"
    body = [stream.write(chunk) for chunk in chunks_of(audio)] + [stream.finish()]
    assert body[1] == b""  # the empty chunk sends nothing
    assert b"".join(body) == encode(audio, RATE, "pcm").data


def test_a_wav_stream_is_a_streaming_header_then_the_whole_wavs_data():
    audio = voice(0.6, RATE)
    stream = open_stream("audio", "wav", RATE)
    assert stream.media_type == "audio/wav"
    parts = [stream.write(chunk) for chunk in chunks_of(audio)] + [stream.finish()]
    body = b"".join(parts)
    whole = encode(audio, RATE, "wav").data
    header = streaming_wav_header(RATE)
    assert parts[0].startswith(header) and body[:44] == header
    # The whole file's header with both sizes "unknown" (0xFFFFFFFF), then the same samples.
    assert header[:4] + header[8:40] == whole[:4] + whole[8:40]
    assert header[4:8] == header[40:44] == b"\xff\xff\xff\xff"
    assert body[44:] == whole[44:]
    samples, rate = soundfile.read(io.BytesIO(body), dtype="int16")
    assert rate == RATE and np.array_equal(samples, to_pcm16(audio))
    decoded, rate, _ = decode_av(body)
    assert rate == RATE and np.array_equal(np.round(decoded * 32768).astype(np.int16), to_pcm16(audio))


def test_a_wav_stream_without_samples_still_sends_its_header():
    stream = AudioStream("wav", RATE)
    assert stream.finish() == streaming_wav_header(RATE)


def sse_events(body: bytes) -> list[dict]:
    frames = body.split(b"\n\n")
    assert frames[-1] == b""
    events = []
    for frame in frames[:-1]:
        assert frame.startswith(b"data: ") and b"\n" not in frame
        events.append(json.loads(frame[len(b"data: ") :]))
    return events


def test_sse_deltas_carry_base64_pcm16_and_done_carries_usage():
    audio = voice(0.6, RATE)
    stream = open_stream("sse", "pcm", RATE)
    assert isinstance(stream, SseStream) and stream.media_type == "text/event-stream"
    parts = [stream.write(chunk) for chunk in chunks_of(audio)]
    assert parts[1] == b""  # no empty delta
    parts.append(stream.finish(SpeechUsage(input_tokens=12, output_tokens=345)))
    events = sse_events(b"".join(parts))
    deltas, done = events[:-1], events[-1]
    assert len(deltas) == len(chunks_of(audio)) - 1
    assert all(set(event) == {"type", "audio"} and event["type"] == "speech.audio.delta" for event in deltas)
    pcm = b"".join(base64.b64decode(event["audio"], validate=True) for event in deltas)
    assert pcm == encode(audio, RATE, "pcm").data
    assert done == {
        "type": "speech.audio.done",
        "usage": {"input_tokens": 12, "output_tokens": 345, "total_tokens": 357},
    }


def test_sse_deltas_are_pcm16_for_wav_too_never_a_header():
    audio = voice(0.3, RATE)
    stream = open_stream("sse", "wav", RATE)
    parts = [stream.write(chunk) for chunk in chunks_of(audio)]
    events = sse_events(b"".join(parts) + stream.finish(SpeechUsage(1, 2)))
    body = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert body == encode(audio, RATE, "pcm").data
    assert not body.startswith(b"RIFF")


def test_an_sse_stream_needs_usage_to_end():
    stream = SseStream("pcm", RATE)
    with pytest.raises(ValueError, match="speech.audio.done, which carries usage"):
        stream.finish()


def test_a_finished_stream_takes_no_more():
    stream = AudioStream("pcm", RATE)
    stream.finish()
    with pytest.raises(RuntimeError, match="write after finish"):
        stream.write(voice(0.01, RATE))
    with pytest.raises(RuntimeError, match="finish called twice"):
        stream.finish()


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.5, 2.0, 4.0])
def test_speed_changes_the_duration_by_its_factor_and_keeps_the_pitch(speed):
    seconds = 2.0
    audio = voice(seconds, RATE)
    out = encode(audio, RATE, "pcm", speed=speed)
    faster = np.frombuffer(out.data, "<i2").astype(np.float64) / 32767
    assert faster.size / RATE == pytest.approx(seconds / speed, rel=0.03)
    assert pitch_of(faster, RATE) == pytest.approx(pitch_of(audio, RATE), abs=3.0)
    assert encode(audio, RATE, "wav", speed=speed).data[44:] == out.data


def test_speed_one_leaves_the_audio_as_it_is():
    audio = voice(0.5, RATE)
    assert encode(audio, RATE, "pcm", speed=1.0).data == pcm16_bytes(audio)
    assert encode(audio, RATE, "pcm", speed=1).data == pcm16_bytes(audio)


@pytest.mark.parametrize("speed", [0.5, 1.7, 4.0])
def test_a_stream_at_a_speed_is_the_whole_answer_at_that_speed(speed):
    audio = voice(1.0, RATE)
    pcm = open_stream("audio", "pcm", RATE, speed=speed)
    body = b"".join(pcm.write(chunk) for chunk in chunks_of(audio)) + pcm.finish()
    assert body == encode(audio, RATE, "pcm", speed=speed).data
    wav = open_stream("audio", "wav", RATE, speed=speed)
    body = b"".join(wav.write(chunk) for chunk in chunks_of(audio)) + wav.finish()
    assert body == streaming_wav_header(RATE) + encode(audio, RATE, "pcm", speed=speed).data


def test_speed_applies_before_a_lossy_encoder():
    out = encode(voice(2.0, RATE), RATE, "mp3", speed=2.0)
    decoded, rate, _ = decode_av(out.data)
    assert rate == RATE and decoded.size / RATE == pytest.approx(1.0, rel=0.03)


def test_tempo_refuses_use_after_finish():
    tempo = Tempo(RATE, 2.0)
    tempo.push(voice(0.1, RATE))
    tempo.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        tempo.push(voice(0.1, RATE))


@pytest.mark.parametrize("bad", ["ogg", "mp4", "", "wave", None])
def test_an_unknown_response_format_names_the_field_and_the_formats(bad):
    with pytest.raises(RequestError) as info:
        encode(voice(0.1, RATE), RATE, bad)
    assert isinstance(info.value, ValueError) and info.value.field == "response_format"
    assert str(info.value).startswith("response_format: ")
    assert "(allowed: mp3, opus, aac, flac, wav, pcm)" in str(info.value)


@pytest.mark.parametrize("bad", [0.0, 0.2, 4.01, 10, -1.0, float("nan"), float("inf"), "fast", True, None])
def test_a_speed_outside_openais_range_names_the_field_and_the_range(bad):
    for attempt in (
        lambda: encode(voice(0.1, RATE), RATE, "wav", speed=bad),
        lambda: open_stream("audio", "pcm", RATE, speed=bad),
        lambda: Tempo(RATE, bad),
    ):
        with pytest.raises(RequestError) as info:
            attempt()
        assert info.value.field == "speed" and str(info.value).startswith("speed: ")
        assert "0.25 to 4.0" in str(info.value)


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
@pytest.mark.parametrize("name", ["mp3", "opus", "aac", "flac"])
def test_a_stream_of_a_whole_file_format_is_refused_naming_what_streams(stream_format, name):
    with pytest.raises(RequestError) as info:
        open_stream(stream_format, name, RATE)
    assert info.value.field == "response_format" and info.value.allowed == ["pcm", "wav"]
    assert "cannot be streamed" in str(info.value)


def test_an_unknown_stream_format_names_the_field():
    with pytest.raises(RequestError) as info:
        open_stream("chunked", "pcm", RATE)
    assert info.value.field == "stream_format" and info.value.allowed == ["audio", "sse"]


def test_check_request_gives_the_served_values():
    assert audio_out.check_request("FLAC", 2) == ("flac", 2.0)
    assert audio_out.check_request("wav", 1.0, "sse") == ("wav", 1.0)


@pytest.mark.parametrize("speed", [0.5, 4.0])
def test_tempo_fed_sample_by_sample_gives_the_whole_inputs_samples(speed):
    audio = voice(0.2, RATE)
    tempo = Tempo(RATE, speed)
    streamed = np.concatenate([*(tempo.push(audio[i : i + 1]) for i in range(audio.size)), tempo.finish()])
    whole = Tempo(RATE, speed)
    assert np.array_equal(streamed, np.concatenate([whole.push(audio), whole.finish()]))


def test_tempo_of_a_sample_or_two():
    for size, speed in [(1, 4.0), (2, 4.0), (1, 0.25), (3, 2.5)]:
        tempo = Tempo(RATE, speed)
        out = np.concatenate([tempo.push(np.full(size, 0.5, np.float32)), tempo.finish()])
        assert out.size <= round(size / speed) + 1


@pytest.mark.parametrize("samples", [1, 176, 1000, 3000])
@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0, 4.0])
def test_speed_keeps_a_short_take_at_its_length(samples, speed):
    """atempo keeps up to a window of its input at the end: a short take once came out empty."""
    audio = (np.sin(np.arange(samples) * 0.05) * 0.5).astype(np.float32)
    out = encode(audio, 16000, "pcm", speed=speed)
    assert len(out.data) // 2 == round(samples / speed)
    if samples >= 1000:
        assert np.abs(to_pcm16(audio)).mean() * 0.5 < np.abs(np.frombuffer(out.data, "<i2")).mean()
