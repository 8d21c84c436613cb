"""Streaming edges without an engine: how windows are cut, when a producer publishes, what the
window functions make, and how a bad ``stream`` config is refused (issue 35)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from omnigen.glue import higgs_audio_v3, qwen3_omni
from omnigen.glue.qwen3_tts import talker2code2wav
from omnigen.glue.qwen3_tts import talker2code2wav_window as qwen3_window
from omnigen.glue.types import StageResult, Window, frames_counter
from omnigen.runtime.scheduler import STREAM_KEY, next_point, stream_points
from omnigen.serving.streaming import WindowCutter, publish_points
from omnigen.spec import StreamSpec
from omnigen_testing.tiny_glue import talker2code2wav_window

POLICY = StreamSpec(window="w", chunk_frames=8, left_context_frames=3, initial_chunk_frames=2, ramp=(4,))


def test_windows_are_the_first_the_ramp_then_chunks_and_the_rest_at_the_finish():
    cutter = WindowCutter(POLICY)
    assert cutter.ready(1, False) == []
    first = cutter.ready(3, False)
    assert [(w.start, w.end, w.left_context) for w in first] == [(0, 2, 0)]
    assert cutter.ready(5, False) == []  # the ramp's 4 frames are not all there yet
    second = cutter.ready(20, False)
    assert [(w.start, w.end, w.left_context) for w in second] == [(2, 6, 2), (6, 14, 3)]
    last = cutter.ready(23, True)
    assert [(w.index, w.start, w.end, w.left_context, w.last) for w in last] == [
        (3, 14, 22, 3, False),
        (4, 22, 23, 3, True),
    ]
    assert cutter.ready(23, True) == []  # nothing twice


def test_every_frame_lands_in_exactly_one_window_whatever_the_arrivals():
    for arrivals in ([5, 9, 30], [1, 2, 3, 4, 40], [40]):
        cutter = WindowCutter(POLICY)
        windows = [w for n in arrivals[:-1] for w in cutter.ready(n, False)] + cutter.ready(
            arrivals[-1], True
        )
        covered = [f for w in windows for f in range(w.start, w.end)]
        assert covered == list(range(arrivals[-1]))
        assert windows[-1].last


def test_coalescing_merges_every_ready_window_into_one_on_the_same_grid():
    cutter = WindowCutter(POLICY)  # coalesce: the default
    assert [(w.index, w.start, w.end, w.left_context) for w in cutter.take(3, False)] == [(0, 0, 2, 0)]
    # The consumer lagged: the ramp's window and a chunk are both ready, one request takes both.
    merged = cutter.take(20, False)
    assert [(w.index, w.start, w.end, w.left_context, w.last) for w in merged] == [(1, 2, 14, 2, False)]
    assert cutter.take(20, False) == []  # 14..20 is not a whole chunk yet
    assert [(w.index, w.start, w.end, w.last) for w in cutter.take(23, True)] == [(2, 14, 23, True)]
    separate = WindowCutter(StreamSpec(**{**POLICY.__dict__, "coalesce": False}))
    separate.take(3, False)
    assert [(w.index, w.start, w.end) for w in separate.take(20, False)] == [(1, 2, 6), (2, 6, 14)]


def test_paced_windows_wait_until_the_callers_audio_would_run_low():

    from omnigen.serving.streaming import Pacer

    pacer = Pacer(StreamSpec(**{**POLICY.__dict__, "playback_rate_hz": 12.5, "playback_lead_s": 1.0}))
    assert pacer.wait_s(1) == 0.0  # before any audio: the first window goes at once
    pacer.heard()
    pacer.first_audio -= 0.5  # the caller has played 0.5 s
    # 26 frames sent are 2.08 s of audio: 1.58 s left, so the next window in 0.58 s (lead 1 s).
    assert 0.5 < pacer.wait_s(26) <= 0.58
    assert pacer.wait_s(1) == 0.0  # 0.08 s sent: the caller would run dry, send now
    assert Pacer(POLICY).wait_s(100) == 0.0  # no rate: never held


def test_the_producer_publishes_once_each_window_has_its_frames():
    points = publish_points(POLICY)
    assert points == {"publish_at": [3, 7], "every": 8}
    stream = stream_points(type("P", (), {"extra_args": {STREAM_KEY: points}})())
    assert stream == ([3, 7], 8)
    assert [next_point(stream, n) for n in (0, 3, 6, 7, 8, 15, 20)] == [3, 7, 7, 15, 15, 23, 23]
    assert stream_points(type("P", (), {"extra_args": None})()) is None


def _tiny_source(frames: int, tokens: int | None = None) -> StageResult:
    codes = torch.arange(frames * 4).reshape(frames, 4) % 64
    prefill = torch.full((3, 4), -1)
    return StageResult(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        output_token_ids=list(range(tokens if tokens is not None else frames + 1)),
        payload={"codes.audio": torch.cat([prefill, codes])},
    )


def test_a_tiny_window_carries_its_left_context_and_drops_its_samples():
    source = _tiny_source(10)
    assert frames_counter(talker2code2wav_window)(source) == 10
    made = talker2code2wav_window(source, Window(1, 4, 8, 3, last=False))
    assert torch.equal(made.request.payload["codes"]["audio"], source.get("codes.audio")[3:][1:8])
    assert len(made.request.prompt_token_ids) == 7 * 4
    assert made.drop_samples == 3 * 4 * 4  # left frames x codebooks x hop_length
    with pytest.raises(ValueError, match="window 2 needs frames"):
        talker2code2wav_window(source, Window(2, 8, 12, 0, last=False))


def test_qwen3_tts_windows_of_a_whole_take_hold_its_full_payload_codes():
    frames = torch.randint(0, 2048, (30, 16))
    payload = {"codes.audio": torch.cat([torch.full((5, 16), -1), frames])}
    source = StageResult(
        request_id="r", prompt_token_ids=[0] * 5, output_token_ids=list(range(31)), payload=payload
    )
    whole = talker2code2wav(source).payload["codes"]["audio"].reshape(16, -1)
    cutter = WindowCutter(
        StreamSpec(window="w", chunk_frames=25, left_context_frames=72, initial_chunk_frames=1)
    )
    pieces = []
    for window in cutter.ready(frames_counter(qwen3_window)(source), True):
        made = qwen3_window(source, window)
        codes = made.request.payload["codes"]["audio"].reshape(16, -1)
        left = int(made.request.payload["meta"].get("left_context_size", 0))
        assert left == window.left_context
        assert made.drop_samples == 0  # code2wav trims its left context itself
        pieces.append(codes[:, left:])
    assert torch.equal(torch.cat(pieces, dim=1), whole)


def _published(steps: int, every: int) -> list[int]:
    """The steps after which a streaming producer's payload so far arrives: some, then the last."""
    return [*range(every, steps, every), steps]


QWEN3_OMNI_CONFIG = type(
    "HF",
    (),
    {"code2wav_config": type("C", (), {"upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2]})},
)()
"""The released code2wav's upsampling: 1920 samples a frame, 555 lost at a decode's right edge."""


def _qwen3_omni_sources(frames: int, stop: bool) -> list[StageResult]:
    """A Qwen3-Omni talker take as the runner accumulates it: the prefill's zero rows, then a row
    per decode step for the token it fed (the last sampled token has none), output ids ending with
    the codec EOS when ``stop``; the payload so far after every step."""
    codes = torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(frames))
    prefill = torch.zeros((6, 16), dtype=torch.long)
    ids = [*codes[:, 0].tolist(), *([2150] if stop else [])]
    return [
        StageResult(
            request_id="r",
            prompt_token_ids=[0] * 6,
            output_token_ids=ids[:step],
            payload={"codes.audio": torch.cat([prefill, codes[: step - 1]])},
            finish_reason=("stop" if stop else "length") if step == len(ids) else None,
            hf_config=QWEN3_OMNI_CONFIG,
        )
        for step in range(1, len(ids) + 1)
    ]


@pytest.mark.parametrize("stop", [True, False])
def test_qwen3_omni_windows_of_a_whole_take_hold_its_full_payload_codes(stop):
    sources = _qwen3_omni_sources(70, stop)
    whole = torch.tensor(qwen3_omni.talker2code2wav(sources[-1]).payload["codes"]["audio"]).reshape(16, -1)
    cutter = WindowCutter(
        StreamSpec(window="w", chunk_frames=25, left_context_frames=25, initial_chunk_frames=4)
    )
    counter = frames_counter(qwen3_omni.talker2code2wav_window)
    pieces, windows = [], []
    for step in _published(len(sources), 7):
        source = sources[step - 1]
        for window in cutter.take(counter(source), step == len(sources)):
            made = qwen3_omni.talker2code2wav_window(source, window)
            codes = made.request.payload["codes"]["audio"].reshape(16, -1)
            assert made.request.prompt_token_ids == made.request.payload["codes"]["audio"].tolist()
            assert made.request.payload["meta"]["left_context_size"] == window.left_context
            # The left context's samples, less the decoder's right-edge loss its last frames refill.
            assert made.drop_samples == (window.left_context * 1920 - 555 if window.left_context else 0)
            pieces.append(codes[:, window.left_context :])
            windows.append(window)
    assert torch.equal(torch.cat(pieces, dim=1), whole)
    assert windows[-1].last and windows[0].end == 4


def test_qwen3_omni_window_needs_the_code2wav_config():
    source = _qwen3_omni_sources(10, True)[-1]
    bare = StageResult(**{**source.__dict__, "hf_config": None})
    with pytest.raises(ValueError, match="code2wav_config.upsample_rates"):
        qwen3_omni.talker2code2wav_window(bare, Window(0, 0, 4, 0, last=False))
    with pytest.raises(ValueError, match="window 1 needs frames"):
        qwen3_omni.talker2code2wav_window(source, Window(1, 4, 40, 4, last=False))


def _higgs_sources(steps: int) -> list[StageResult]:
    rows = torch.randint(0, 1024, (steps, 8), generator=torch.Generator().manual_seed(steps))
    for step in range(7):  # the delay pattern's ramp-up: codebook i starts i steps late (BOC before)
        rows[step, step + 1 :] = 1024
    return [
        StageResult(
            request_id="h",
            prompt_token_ids=[1],
            output_token_ids=[0] * step,
            payload={"codes.audio": rows[:step]},
            finish_reason="stop" if step == steps else None,
        )
        for step in range(1, steps + 1)
    ]


@pytest.mark.parametrize("steps", [8, 9, 12, 40, 73])
def test_higgs_windows_of_a_whole_take_hold_its_full_payload_codes(steps):
    sources = _higgs_sources(steps)
    whole = torch.tensor(higgs_audio_v3.talker2code2wav(sources[-1]).prompt_token_ids).reshape(8, -1)
    cutter = WindowCutter(
        StreamSpec(window="w", chunk_frames=25, left_context_frames=25, initial_chunk_frames=1)
    )
    counter = frames_counter(higgs_audio_v3.talker2code2wav_window)
    if steps > 12:  # while the talker runs, windows end 4 frames (the right holdback) before its last
        assert counter(sources[11]) == 1  # 12 rows: 5 frames
    pieces = []
    for step in _published(steps, 5):
        source = sources[step - 1]
        for window in cutter.take(counter(source), step == steps):
            made = higgs_audio_v3.talker2code2wav_window(source, window)
            meta = made.request.payload["meta"]
            assert meta["left_context_size"] == window.left_context and made.drop_samples == 0
            assert meta["right_holdback_size"] == (0 if window.last else higgs_audio_v3.RIGHT_HOLDBACK_FRAMES)
            codes = torch.tensor(made.request.prompt_token_ids).reshape(8, -1)
            pieces.append(codes[:, window.left_context : codes.shape[1] - meta["right_holdback_size"]])
    assert torch.equal(torch.cat(pieces, dim=1), whole)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.stages.talker.stream.chunk_frames=0", "stages.talker.stream.chunk_frames"),
        ("model.stages.talker.stream.window=null", "stages.talker.stream.window"),
        ("model.stages.talker.stream.left_context_frames=-1", "stages.talker.stream.left_context_frames"),
        ("model.stages.talker.stream.playback_rate_hz=0", "stages.talker.stream.playback_rate_hz"),
        (
            "model.stages.talker.stream.playback_rate_hz=12.5 model.stages.talker.stream.coalesce=false",
            "needs coalesce",
        ),
        ("model.stages.talker.next_stage_input=null", "the edge has no glue function"),
        (
            "model.stages.code2wav.stream.enabled=true "
            "model.stages.code2wav.stream.window=omnigen_testing.tiny_glue.talker2code2wav_window",
            "stages.code2wav.stream.enabled: streams to the next stage, but the last stage feeds none",
        ),
    ],
)
def test_a_bad_stream_config_names_its_key(tmp_path, override, message):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "omnigen.cli",
            "build",
            "model=omnigen_tiny",
            *override.split(),
            f"out={tmp_path}/t",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert message in result.stderr + result.stdout
    assert not (tmp_path / "t").exists()
