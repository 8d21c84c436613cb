"""Streaming edges on vLLM's engine, on CPU: the tiny talker streams windows of its frames to the
tiny code2wav while it runs (issue 35), in both modes: ``mp`` (each engine core in a process of
its own, windows through shared memory) and ``inproc`` (the talker's engine core stepped here).

What is checked: streamed audio equals the full-payload audio of the same seeded request sample
for sample (the tiny vocoder's left context covers its receptive field), nothing is dropped at the
tail, the first chunk comes before the talker finishes, many concurrent seeded streams never mix,
a stream closed mid-request is aborted in every stage and leaves no state or segment, and a reader
that stops reading holds at most ``ahead`` windows of audio.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.test_pipeline import ENGINE, prompts, segments, stage_models  # noqa: F401 (fixture)

pytestmark = pytest.mark.e2e

TOKENS = 24  # 23 frames: windows of 2, 4, 8, 8 and the last 1


def sampling(seed: int) -> dict[str, Any]:
    from vllm import SamplingParams

    talker = SamplingParams(
        max_tokens=TOKENS,
        temperature=1.0,
        ignore_eos=True,
        detokenize=False,
        seed=seed,
        extra_args={"tts_local_seed": seed},
    )
    return {"talker": talker, "code2wav": SamplingParams(max_tokens=1, detokenize=False)}


@pytest.fixture(scope="module")
def mp_pipeline(tiny_engine_env, stage_models):  # noqa: F811
    from omnigen.serving.pipeline import Pipeline

    engine = {**ENGINE, "max_model_len": 128, "max_num_batched_tokens": 128}
    with Pipeline.from_model(
        "omnigen_tiny", stage_models, mode="mp", engine_kwargs={"talker": engine, "code2wav": engine}
    ) as pipeline:
        yield pipeline


def _collect(pipeline: Any, prompt: dict[str, Any], seed: int, request_id: str) -> tuple[list[Any], Any]:
    from omnigen.serving.streaming import stream

    items = list(stream(pipeline, prompt, sampling(seed), request_id))
    return items[:-1], items[-1]


def test_streamed_audio_equals_the_full_payload_audio_and_comes_early(mp_pipeline):
    (prompt,) = prompts(1)
    full = mp_pipeline.generate([prompt], sampling(5), ["full-0"])[0]
    chunks, result = _collect(mp_pipeline, prompt, 5, "streamed-0")
    assert [c.index for c in chunks] == list(range(len(chunks)))
    # Windows of 2, 4, 8, 8 and 1 frames (16 samples each); coalescing may merge neighbours when
    # code2wav lags, but every seam stays on that grid and the first window is never merged.
    ends = [int(e) for e in torch.tensor([c.samples.numel() for c in chunks]).cumsum(0)]
    assert set(ends) <= {2 * 16, 6 * 16, 14 * 16, 22 * 16, 23 * 16} and ends[0] == 2 * 16
    assert len(chunks) >= 2
    streamed = torch.cat([c.samples for c in chunks])
    assert streamed.numel() == (TOKENS - 1) * 4 * 4 == full.audio.numel()  # no sample dropped at the tail
    torch.testing.assert_close(streamed, full.audio.float(), rtol=0, atol=1e-5)
    assert torch.equal(result.audio, streamed)
    assert result.token_ids["talker"] == full.token_ids["talker"]
    # The first window's audio came while the talker still ran.
    assert chunks[0].seconds < result.seconds["talker"]


def test_concurrent_seeded_streams_never_mix(mp_pipeline):
    from omnigen.serving.streaming import stream_async

    requests = prompts(12)
    # One seed each: the tiny talker's codes follow its seed (its dummy weights barely see the prompt).
    full = [mp_pipeline.generate([requests[i]], sampling(100 + i), [f"f{i}"])[0] for i in range(12)]

    async def one(i: int) -> torch.Tensor:
        got = []
        async for item in stream_async(mp_pipeline, requests[i], sampling(100 + i), f"s{i}"):
            if hasattr(item, "samples"):
                got.append(item.samples)
        return torch.cat(got)

    async def every() -> list[torch.Tensor]:
        return list(await asyncio.gather(*(one(i) for i in range(12))))

    streamed = mp_pipeline.run(every()).result(timeout=600)
    for i, audio in enumerate(streamed):
        torch.testing.assert_close(audio, full[i].audio.float(), rtol=0, atol=1e-5, msg=f"request {i}")
    assert len({a.sum().item() for a in streamed}) == len(streamed)  # different prompts, different audio


def test_a_stream_closed_mid_request_is_aborted_everywhere(mp_pipeline):
    from omnigen.serving.streaming import stream

    before = segments()
    (prompt,) = prompts(1)
    items = stream(mp_pipeline, prompt, sampling(3), "closed-early")
    first = next(items)
    assert first.index == 0
    items.close()  # the reader goes away after the first window

    async def states() -> dict[str, Any]:
        return {
            s.plan.stage: (await s.engine.collective_rpc("omni_request_state"))[0] for s in mp_pipeline.stages
        }

    # vLLM tells a worker what was aborted with the next step's batch: one more request first.
    mp_pipeline.generate(prompts(1), sampling(4), ["after-close"])
    for stage, held in mp_pipeline.run(states()).result(timeout=60).items():
        assert all(len(ids) <= 1 for ids in held.values()), (stage, held)
    assert segments() == before


def test_a_reader_that_stops_holds_at_most_ahead_windows(mp_pipeline):
    from omnigen.serving.streaming import stream_async

    (prompt,) = prompts(1)

    async def stalled() -> tuple[int, int, int]:
        before = mp_pipeline.stream_windows
        iterator = stream_async(mp_pipeline, prompt, sampling(9), "stalled", ahead=2)
        first = await iterator.__anext__()
        await asyncio.sleep(3.0)  # the talker finishes meanwhile (its 5 windows are ready)
        during = mp_pipeline.stream_windows - before
        await iterator.aclose()
        await asyncio.sleep(0.5)
        return first.index, during, mp_pipeline.stream_windows - before

    first, during, after = mp_pipeline.run(stalled()).result(timeout=120)
    assert first == 0
    # The one read, and at most two decoded or held for the reader (one, if coalescing merged the
    # rest into it): never all 5.
    assert 2 <= during <= 1 + 2
    assert after == during  # closing stopped the stream


def test_inproc_streams_the_same_audio(tiny_engine_env, stage_models):  # noqa: F811
    from omnigen.serving.pipeline import Pipeline
    from omnigen.serving.streaming import stream

    engine = {**ENGINE, "max_model_len": 128, "max_num_batched_tokens": 128}
    (prompt,) = prompts(1)
    with Pipeline.from_model(
        "omnigen_tiny", stage_models, mode="inproc", engine_kwargs={"talker": engine, "code2wav": engine}
    ) as pipeline:
        full = pipeline.generate([prompt], sampling(5), ["full-inproc"])[0]
        items = list(stream(pipeline, prompt, sampling(5), "streamed-inproc"))
    chunks, result = items[:-1], items[-1]
    assert len(chunks) == 5
    streamed = torch.cat([c.samples for c in chunks])
    torch.testing.assert_close(streamed, full.audio.float(), rtol=0, atol=1e-5)
    assert chunks[0].seconds < result.seconds["talker"]
    assert not list(Path("/dev/shm").glob(f"omnigen-{os.getpid()}-*"))
