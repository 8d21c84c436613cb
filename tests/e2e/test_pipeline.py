"""A whole pipeline on vLLM's engine, on CPU: the tiny talker, then the tiny code2wav (issue 8).

Through ``omnigen.serving.Pipeline`` in both modes: ``inproc`` (two ``LLM`` engines in this
process, the payload inline) and ``mp`` (two ``AsyncLLM`` engines, each engine core in a process
of its own, the payload in shared memory, as ``conf/model/omnigen_tiny.yaml`` commits it).
Each run checks what the issue asks: the audio is the tiny vocoder's function of the talker's
codes, with one ``hop_length`` row per code; the code2wav prompt outgrows a step (chunked
prefill across the stage boundary); 16 concurrent requests; a seeded request twice gives the same
audio; the consumer read its payload; and afterwards no stage holds per-request state and no
shared-memory segment is left, aborts included.
"""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.e2e

N_TOKENS = 6
NUM_CODEBOOKS = 4
HOP = 4
ENGINE = dict(
    load_format="dummy",
    skip_tokenizer_init=True,
    enforce_eager=True,
    dtype="float32",
    max_model_len=128,
    max_num_seqs=8,
    enable_chunked_prefill=True,
    max_num_batched_tokens=16,
    enable_prefix_caching=False,
    seed=0,
)


@pytest.fixture(scope="module")
def stage_models(tmp_path_factory):
    from omnigen_testing import tiny_omni

    root = tmp_path_factory.mktemp("tiny")
    return {
        "talker": tiny_omni.write_tiny_config(
            root / "talker", arch=tiny_omni.TALKER_ARCH, variant="mtp_batched"
        ),
        "code2wav": tiny_omni.write_tiny_config(root / "code2wav", arch=tiny_omni.CODE2WAV_ARCH),
    }


def prompts(count: int) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": [(17 * i + j) % 400 + 10 for j in range(3 + i % 5)]} for i in range(count)]


def sampling(seed: int | None = None) -> dict[str, Any]:
    """Greedy talker tokens; with ``seed``, a seeded code predictor too (``tts_local_seed``)."""
    from vllm import SamplingParams

    extra = None if seed is None else {"tts_local_seed": seed}
    talker = SamplingParams(
        max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False, seed=seed, extra_args=extra
    )
    return {"talker": talker, "code2wav": SamplingParams(max_tokens=1, detokenize=False)}


def segments() -> set[str]:
    from omnigen.runtime.transport import SEGMENT_PREFIX

    # This process's segments only (the driver names them by its pid): other runs share the machine.
    return {p.name for p in Path("/dev/shm").glob(f"{SEGMENT_PREFIX}{os.getpid()}-*")}


def check_outputs(outs: list[Any], requests: list[dict[str, Any]]) -> None:
    """Codes in the talker's published payload; audio of one hop per code from code2wav."""
    from omnigen_testing.tiny_omni import talker_to_code2wav

    for out, request in zip(outs, requests, strict=True):
        codes = out.payloads["talker"]["codes.audio"]
        assert codes.shape == (len(request["prompt_token_ids"]) + N_TOKENS - 1, NUM_CODEBOOKS)
        frames = int((codes >= 0).all(dim=-1).sum())
        assert frames == N_TOKENS - 1, "one frame of codes per decode step"
        assert out.token_ids["code2wav"] == [0], "the generation stage's one placeholder token"
        code2wav_prompt = talker_to_code2wav({"codes.audio": codes})
        assert len(code2wav_prompt) == frames * NUM_CODEBOOKS
        assert out.audio is not None and out.audio.shape == (len(code2wav_prompt) * HOP,)
        assert out.payloads["code2wav"].keys() == {"audio"}, "publish: [audio] narrows what the caller gets"
        assert set(out.seconds) == {"talker", "code2wav"}


def check_released_inproc(pipeline: Any) -> None:
    """No request's state outlives the step after it finished: vLLM tells a worker which
    requests finished with the next step's batch, so one more request is sent first."""
    pipeline.generate(prompts(1), sampling())
    for stage in pipeline.stages:
        state = stage.engine.collective_rpc("omni_request_state")[0]
        assert all(len(ids) <= 1 for ids in state.values()), (stage.plan.stage, state)
        scheduler = stage.engine.llm_engine.engine_core.engine_core.scheduler
        assert scheduler.omni_pending == {} and not scheduler.requests


@pytest.fixture(scope="module")
def inproc(tiny_engine_env, stage_models):
    from omnigen import api
    from omnigen.serving.pipeline import Pipeline

    # The committed config sends the payload through shared memory; this run, inline.
    pipeline = Pipeline.from_model(
        api.served_model("omnigen_tiny", ["model.stages.talker.transport=inline"]),
        stage_models,
        mode="inproc",
        engine_kwargs={"talker": ENGINE, "code2wav": ENGINE},
    )
    yield pipeline
    pipeline.close()


class TestInProcess:
    def test_sixteen_requests_reach_audio(self, inproc):
        before = segments()
        requests = prompts(16)
        outs = inproc.generate(requests, sampling())
        check_outputs(outs, requests)
        # Each code2wav prompt (20 codes) outgrows a 16-token step, so it runs chunked: a
        # request's codes cross the stage boundary in more than one step.
        code2wav_steps = inproc.stages[1].engine.collective_rpc(
            lambda w: w.model_runner.model.omni_record.snapshot()
        )[0]["forwards"]
        assert any(f["positions"][0] > 0 for f in code2wav_steps), (
            "a code2wav prompt continued in a later step"
        )
        record = inproc.stages[1].engine.collective_rpc(
            lambda w: w.model_runner.model.omni_record.snapshot()
        )[0]
        assert record["errors"] == []
        assert record["payload_tokens_checked"] == sum(len(o.audio) // HOP for o in outs), (
            "the consumer read every request's payload, inline in its extra_args"
        )
        check_released_inproc(inproc)
        assert segments() == before

    def test_audio_is_the_vocoders_function_of_the_codes(self, inproc):
        """The pipeline's audio equals running code2wav by hand on the talker's codes."""
        from vllm import SamplingParams

        from omnigen.serving.client import stage_payload
        from omnigen_testing.tiny_omni import talker_to_code2wav

        requests = prompts(4)
        outs = inproc.generate(requests, sampling())
        by_hand = inproc.stages[1].engine.generate(
            [
                {"prompt_token_ids": talker_to_code2wav({"codes.audio": o.payloads["talker"]["codes.audio"]})}
                for o in outs
            ],
            SamplingParams(max_tokens=1, detokenize=False),
            use_tqdm=False,
        )
        for out, hand in zip(outs, by_hand, strict=True):
            audio = stage_payload(hand, required=True)["audio"].reshape(-1)
            torch.testing.assert_close(out.audio, audio, rtol=0, atol=1e-5)

    def test_a_seeded_request_twice_gives_the_same_audio(self, inproc):
        from vllm import SamplingParams

        request = prompts(1)
        params = sampling()
        # seed: the talker's tokens; tts_local_seed: its code predictor's generator.
        params["talker"] = SamplingParams(
            max_tokens=N_TOKENS,
            temperature=1.0,
            seed=11,
            ignore_eos=True,
            detokenize=False,
            extra_args={"tts_local_seed": 11},
        )
        first, second = inproc.generate(request, params), inproc.generate(request, params)
        assert torch.equal(
            first[0].payloads["talker"]["codes.audio"], second[0].payloads["talker"]["codes.audio"]
        )
        assert torch.equal(first[0].audio, second[0].audio)

    def test_an_aborted_request_gets_no_payload_and_its_rows_are_dropped(self, inproc):
        """OmniScheduler (8.1): rows of a request aborted mid-decode are dropped, and the
        request that finishes beside it gets its whole payload."""
        from omnigen.serving.client import stage_payload

        talker = inproc.stages[0].engine.llm_engine
        scheduler = talker.engine_core.engine_core.scheduler
        params = sampling()["talker"]
        for name, prompt in zip(("kept", "aborted"), prompts(2), strict=True):
            talker.add_request(name, prompt, params)
        talker.step()
        talker.step()
        assert scheduler.omni_pending, "the decoding requests' rows are held until they finish"
        talker.abort_request(["aborted"], internal=False)
        finished = {}
        while talker.has_unfinished_requests():
            for out in talker.step():
                if out.finished:
                    finished[out.request_id] = out
        assert scheduler.omni_pending == {}
        assert stage_payload(finished["kept"], required=True)["codes.audio"].shape[0] == 3 + N_TOKENS - 1
        assert "aborted" not in finished or not stage_payload(finished["aborted"])


@pytest.fixture(scope="module")
def multiprocess(tiny_engine_env, stage_models):
    from omnigen.serving.pipeline import Pipeline

    pipeline = Pipeline.from_model(
        "omnigen_tiny", stage_models, mode="mp", engine_kwargs={"talker": ENGINE, "code2wav": ENGINE}
    )
    yield pipeline
    pipeline.close()


class TestOneEngineCoreProcessPerStage:
    def test_sixteen_concurrent_requests_through_shared_memory(self, multiprocess):
        before = segments()
        requests = prompts(16)
        outs = multiprocess.generate(requests, sampling())
        check_outputs(outs, requests)
        assert segments() == before, "every consumer released its segment"
        for stage in multiprocess.stages:
            assert stage.plan.stage in multiprocess.stage_seconds

    def test_same_audio_as_in_process(self, multiprocess, inproc):
        requests = prompts(3)
        ours = multiprocess.generate(requests, sampling(seed=5))
        theirs = inproc.generate(requests, sampling(seed=5))
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a.payloads["talker"]["codes.audio"], b.payloads["talker"]["codes.audio"])
            torch.testing.assert_close(a.audio, b.audio, rtol=0, atol=1e-5)

    def test_aborted_requests_leave_no_state_and_no_segment(self, multiprocess):
        """Half of 12 requests cancelled while the others run: each abort reaches the stage it
        is in, and no stage keeps its state or its payload segment."""
        before = segments()
        requests = prompts(12)
        futures = [multiprocess.submit(p, sampling()) for p in requests]
        futures[1].result(timeout=120)  # the pipeline is busy with the rest now
        cancelled = [f.cancel() for f in futures[2::2]]
        assert any(cancelled), "no request was still in flight to abort"
        done, _ = concurrent.futures.wait(futures, timeout=120)
        assert len(done) == len(futures)
        kept = [(f, p) for f, p in zip(futures, requests, strict=True) if not f.cancelled()]
        check_outputs([f.result() for f, _ in kept], [p for _, p in kept])
        # vLLM tells a worker what finished (or was aborted) with the next step's batch.
        multiprocess.generate(prompts(1), sampling())
        for state in multiprocess.run(_stage_states(multiprocess)).result(timeout=60):
            assert all(len(ids) <= 1 for ids in state.values()), state
        assert segments() == before


async def _stage_states(pipeline: Any) -> list[dict[str, list[str]]]:
    return [(await stage.engine.collective_rpc("omni_request_state"))[0] for stage in pipeline.stages]
