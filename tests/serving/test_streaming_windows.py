"""Streaming edges without an engine: how windows are cut, when a producer publishes, what the
window functions make, and how a bad ``stream`` config is refused (issue 35)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from omnigen.glue.omnigen_tiny import talker2code2wav_window
from omnigen.glue.qwen3_tts import talker2code2wav
from omnigen.glue.qwen3_tts import talker2code2wav_window as qwen3_window
from omnigen.glue.types import StageResult, Window, frames_counter
from omnigen.runtime.scheduler import STREAM_KEY, next_point, stream_points
from omnigen.serving.streaming import WindowCutter, publish_points
from omnigen.spec import StreamSpec

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


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.stages.talker.stream.chunk_frames=0", "stages.talker.stream.chunk_frames"),
        ("model.stages.talker.stream.window=null", "stages.talker.stream.window"),
        ("model.stages.talker.stream.left_context_frames=-1", "stages.talker.stream.left_context_frames"),
    ],
)
def test_a_bad_stream_config_names_its_key(tmp_path, override, message):
    result = subprocess.run(
        [sys.executable, "-m", "omnigen.cli", "build", "model=omnigen_tiny", override, f"out={tmp_path}/t"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert message in result.stderr + result.stdout
    assert not (tmp_path / "t").exists()
