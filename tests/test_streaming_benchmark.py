"""benchmarks/streaming.py without engines: its command line and the figures it reports.

The benchmark itself (both pipelines, both modes, concurrency 1, 8, 32) runs by hand or in CI
with ``--short``; here, in milliseconds: every switch is documented and checked, ``--short``
says what it changes, and the figures, ratios and goal verdicts follow from given records.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch

from benchmarks import streaming

# --------------------------------------------------------------------------- command line


def test_help_documents_every_switch():
    parser = streaming.build_parser()
    text = parser.format_help()
    switches = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert {a.dest for a in switches} >= {"models", "concurrency", "short", "out", "checkpoint"}
    for action in switches:
        assert action.help and len(action.help) > 15, action.dest
        assert action.option_strings[0] in text


def test_defaults_measure_both_models_at_1_8_32_into_the_results_file():
    args = streaming.parse([])
    assert args.models == ["omnigen_tiny", "qwen3_tts"]
    assert args.concurrency == [1, 8, 32]
    assert args.out == Path(streaming.ROOT, "benchmarks", "results", "streaming.json")
    # An utterance the goal applies to: at least 5 s of released-model speech.
    assert (args.qwen3_max_tokens - 1) / streaming.RELEASED_FRAME_RATE_HZ >= streaming.GOAL_UTTERANCE_S


def test_short_cuts_repeats_requests_and_warm_up_only():
    full, short = streaming.parse([]), streaming.parse(["--short"])
    assert (short.repeats, short.requests_per_client, short.min_requests, short.warmup) == (1, 1, 2, 2)
    for kept in ("models", "concurrency", "tiny_max_tokens", "qwen3_max_tokens"):
        assert getattr(short, kept) == getattr(full, kept)


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--tiny-max-tokens", "200"], "--tiny-max-tokens"),
        (["--qwen3-max-tokens", "1"], "--qwen3-max-tokens"),
        (["--repeats", "0"], "--repeats"),
        (["--models", "fish_speech"], "--models"),
        (["--checkpoint", "/nonexistent/folder"], "--checkpoint"),
    ],
)
def test_bad_switches_are_refused_by_name(argv, names, capsys):
    with pytest.raises(SystemExit) as exited:
        streaming.parse(argv)
    assert exited.value.code == 2
    assert names in capsys.readouterr().err


# --------------------------------------------------------------------------- figures


def records(first: float, latency: float, samples: int, frames: int, count: int = 10) -> list:
    return [
        streaming.Record(i, first, latency, samples, frames, 1, torch.zeros(samples)) for i in range(count)
    ]


def test_ratios_and_the_goal_from_records():
    # Ten requests of 79 frames (6.32 s of released-model speech), 1920 samples at 24 kHz.
    full = streaming.figures([10.0], records(1.0, 1.0, 1920, 79), 24000, 12.5)
    stream = streaming.figures([10.5], records(0.1, 1.2, 1920, 79), 24000, 12.5)
    assert full["first_audio_p50_s"] == full["latency_p50_s"] == 1.0
    assert math.isclose(full["audio_s_per_s"], 10 * 0.08 / 10.0)
    assert math.isclose(full["nominal"]["audio_s_per_s"], 10 * 6.32 / 10.0)
    assert math.isclose(full["nominal"]["rtf_p50"], 1.0 / 6.32)
    ratio = streaming.ratios(full, stream)
    assert math.isclose(ratio["first_audio_over_full_latency_p50"], 0.1)
    assert math.isclose(ratio["audio_s_per_s"], 10.0 / 10.5)
    verdict = streaming.goal(full, ratio)
    assert verdict["goal_applies"] and verdict["first_audio_met"] and verdict["throughput_met"]
    assert verdict["met"]
    slow = streaming.ratios(full, streaming.figures([12.0], records(0.3, 1.2, 1920, 79), 24000, 12.5))
    missed = streaming.goal(full, slow)
    assert not missed["first_audio_met"] and not missed["throughput_met"] and not missed["met"]


def test_a_short_take_is_reported_but_the_goal_does_not_apply():
    full = streaming.figures([1.0], records(0.5, 0.5, 1904, 119), 16000, None)
    assert "nominal" not in full
    verdict = streaming.goal(full, streaming.ratios(full, full))
    assert math.isclose(verdict["utterance_s"], 1904 / 16000)
    assert not verdict["goal_applies"]


def test_percentiles_interpolate():
    assert streaming.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert math.isclose(streaming.percentile([float(i) for i in range(101)], 99), 99.0)
    assert math.isnan(streaming.percentile([], 50))


def test_same_audio_counts_lengths_and_the_largest_deviation():
    full = records(1.0, 1.0, 4, 1, count=3)
    stream = records(0.1, 1.0, 4, 1, count=3)
    stream[1].audio = torch.tensor([0.0, 0.25, 0.0, 0.0])
    stream[2].audio, stream[2].samples = torch.zeros(3), 3  # a dropped tail
    found = streaming.same_audio(full, stream)
    assert found == {"requests": 3, "same_length": 2, "max_abs_deviation": 0.25}
