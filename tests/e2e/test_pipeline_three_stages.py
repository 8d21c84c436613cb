"""A three-stage pipeline on vLLM's engine, on CPU: the tiny thinker, talker and code2wav (issue 8).

``conf/model/omnigen_tiny_omni.yaml`` through ``omnigen.serving.Pipeline`` in both modes: the
thinker (a real tokenizer: text prompts in, text out) publishes its text and feeds the talker
its output ids and its hidden rows (full-payload mode), the talker feeds code2wav its codes.
``inproc`` runs three ``LLM`` engines in this process with the transports of the committed config
swapped (thinker -> talker in shared memory, talker -> code2wav inline); ``mp`` runs three
``AsyncLLM`` engines, each engine core in a process of its own, with the committed transports
(inline, then shared memory). Each run checks: several requests at once; each one's thinker text
is its tokens detokenized by the thinker's tokenizer; the talker got the thinker's hidden rows
(the tiny talker records them from its buffer) and the code2wav its codes; the audio has one
``hop_length`` row per code; afterwards no stage holds per-request state and no shared-memory
segment is left.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

STAGES = ("thinker", "talker", "code2wav")
N_THINK = 7
N_TOKENS = 5
NUM_CODEBOOKS = 4
HOP = 4
HIDDEN = 128
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
ENGINES = {"thinker": {**ENGINE, "skip_tokenizer_init": False}, "talker": ENGINE, "code2wav": ENGINE}
# mp: each engine core still runs in a process of its own, with its one worker inside it (not
# in a further process): three engine starts fit the module's time budget on two cores.
MP_ENGINES = {stage: {**kwargs, "distributed_executor_backend": "uni"} for stage, kwargs in ENGINES.items()}


# collective_rpc with a function (the talker's record) into an engine-core process.
EXTRA_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


@pytest.fixture(scope="module")
def stage_models(tmp_path_factory):
    from omnigen_testing import tiny_omni

    root = tmp_path_factory.mktemp("tiny_omni")
    return {
        "thinker": tiny_omni.write_tiny_config(root / "thinker", arch=tiny_omni.THINKER_ARCH),
        "talker": tiny_omni.write_tiny_config(
            root / "talker", arch=tiny_omni.TALKER_ARCH, variant="mtp_batched"
        ),
        "code2wav": tiny_omni.write_tiny_config(root / "code2wav", arch=tiny_omni.CODE2WAV_ARCH),
    }


@pytest.fixture(scope="module")
def tokenizer(stage_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stage_models["thinker"])


@pytest.fixture(scope="module")
def inproc_results() -> dict[str, tuple[str, list[int]]]:
    """The in-process run's thinker text and tokens per prompt, for the ``mp`` run to match."""
    return {}


def prompts(count: int) -> list[dict[str, str]]:
    return [{"prompt": f"Hello {i}" + " again" * (i % 3)} for i in range(count)]


def sampling() -> dict[str, Any]:
    from vllm import SamplingParams

    return {
        "thinker": SamplingParams(max_tokens=N_THINK, temperature=0.0, detokenize=True),
        "talker": SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False),
        "code2wav": SamplingParams(max_tokens=1, detokenize=False),
    }


def segments() -> set[str]:
    from omnigen.runtime.transport import SEGMENT_PREFIX

    # This process's segments only (the driver names them by its pid): other runs share the machine.
    return {p.name for p in Path("/dev/shm").glob(f"{SEGMENT_PREFIX}{os.getpid()}-*")}


def described(hidden: Any) -> tuple[list[int], float]:
    return list(hidden.shape), round(float(hidden.abs().sum()), 3)


def check_outputs(outs: list[Any], requests: list[dict[str, str]], tokenizer: Any) -> None:
    """Thinker text, the thinker's hidden rows, the talker's codes, the audio: one request each."""
    from omnigen_testing.tiny_omni import talker_to_code2wav, thinker_to_talker

    for out, request in zip(outs, requests, strict=True):
        assert set(out.seconds) == set(STAGES)
        thinker_ids = out.token_ids["thinker"]
        assert len(thinker_ids) == N_THINK, "no EOS: the thinker writes its whole budget"
        text = out.text["thinker"]
        assert text and text == tokenizer.decode(thinker_ids), (text, thinker_ids)
        prompt_ids = tokenizer(request["prompt"])["input_ids"]
        hidden = out.payloads["thinker"]["hidden"]
        assert hidden.shape == (len(prompt_ids) + N_THINK - 1, HIDDEN), (
            "one hidden row per token the thinker ran"
        )
        assert bool((hidden != 0).any(dim=-1).all()), "every row is a real hidden state"

        talker_prompt = thinker_to_talker(thinker_ids)
        codes = out.payloads["talker"]["codes.audio"]
        assert codes.shape == (len(talker_prompt) + N_TOKENS - 1, NUM_CODEBOOKS)
        frames = int((codes >= 0).all(dim=-1).sum())
        assert frames == N_TOKENS - 1, "one frame of codes per decode step"
        assert "thinker.hidden" not in out.payloads["talker"], "the talker publishes its own rows only"

        assert out.token_ids["code2wav"] == [0], "the generation stage's one placeholder token"
        code2wav_prompt = talker_to_code2wav({"codes.audio": codes})
        assert len(code2wav_prompt) == frames * NUM_CODEBOOKS
        assert out.audio is not None and out.audio.shape == (len(code2wav_prompt) * HOP,)
        assert out.payloads["code2wav"].keys() == {"audio"}


def check_records(records: dict[str, dict[str, Any]], outs: list[Any], talker_ids: list[str] | None) -> None:
    """The talker read each request's thinker rows from its buffer; code2wav each one's codes."""
    assert records["talker"]["errors"] == [] and records["code2wav"]["errors"] == []
    received = records["talker"]["thinker_payloads"]
    got = {rid: (held["shape"], round(held["abs_sum"], 3)) for rid, held in received.items()}
    for index, out in enumerate(outs):
        sent = described(out.payloads["thinker"]["hidden"])
        if talker_ids is None:  # in process, vLLM's LLM numbers the requests itself
            assert sent in got.values(), f"request {index}: the talker never saw its thinker rows {sent}"
        else:
            # vLLM's engine core knows a request as the driver's id plus a suffix of its own.
            seen = [held for rid, held in got.items() if rid.startswith(f"{talker_ids[index]}-")]
            assert seen == [sent], (talker_ids[index], seen, sent)


def check_state(states: list[dict[str, list[str]]]) -> None:
    """At most the one request sent last (vLLM tells a worker what finished with the next step)."""
    for stage, state in zip(STAGES, states, strict=True):
        assert all(len(ids) <= 1 for ids in state.values()), (stage, state)


def _record(worker: Any) -> dict[str, Any]:
    return worker.model_runner.model.omni_record.snapshot()


# --------------------------------------------------------------------------- in process


@pytest.fixture(scope="class")
def inproc(tiny_engine_env, stage_models):
    from omnigen import api
    from omnigen.serving.pipeline import Pipeline

    pipeline = Pipeline.from_model(
        api.served_model(
            "omnigen_tiny_omni",
            ["model.stages.thinker.transport=shm", "model.stages.talker.transport=inline"],
        ),
        stage_models,
        mode="inproc",
        engine_kwargs=ENGINES,
        # The committed config: thinker -> talker inline, talker -> code2wav in shared memory.
        # Swapped here, so each edge runs each transport in one of the two modes.
    )
    yield pipeline
    pipeline.close()


class TestInProcess:
    def test_eight_requests_text_hidden_rows_codes_and_audio(self, inproc, tokenizer, inproc_results):
        assert [s.transport.name for s in inproc.stages[:2]] == ["shm", "inline"]
        before = segments()
        requests = prompts(8)
        outs = inproc.generate(requests, sampling())
        check_outputs(outs, requests, tokenizer)
        records = {s.plan.stage: s.engine.collective_rpc(_record)[0] for s in inproc.stages}
        check_records(records, outs, None)
        assert records["code2wav"]["payload_tokens_checked"] == sum(len(o.audio) // HOP for o in outs)
        for request, out in zip(requests, outs, strict=True):
            inproc_results[request["prompt"]] = (out.text["thinker"], out.token_ids["thinker"])

        inproc.generate(prompts(1), sampling())
        check_state([s.engine.collective_rpc("omni_request_state")[0] for s in inproc.stages])
        for stage in inproc.stages:
            scheduler = stage.engine.llm_engine.engine_core.engine_core.scheduler
            assert scheduler.omni_pending == {} and not scheduler.requests, stage.plan.stage
        assert segments() == before, "the talker released every thinker segment"


# --------------------------------------------------------------------------- one process per stage


@pytest.fixture(scope="class")
def multiprocess(tiny_engine_env, stage_models):
    from omnigen.serving.pipeline import Pipeline

    pipeline = Pipeline.from_model("omnigen_tiny_omni", stage_models, mode="mp", engine_kwargs=MP_ENGINES)
    yield pipeline
    pipeline.close()


async def _records(pipeline: Any) -> dict[str, dict[str, Any]]:
    return {s.plan.stage: (await s.engine.collective_rpc(_record))[0] for s in pipeline.stages}


async def _states(pipeline: Any) -> list[dict[str, list[str]]]:
    return [(await s.engine.collective_rpc("omni_request_state"))[0] for s in pipeline.stages]


class TestOneEngineCoreProcessPerStage:
    def test_eight_concurrent_requests(self, multiprocess, tokenizer, inproc_results):
        assert [s.transport.name for s in multiprocess.stages[:2]] == ["inline", "shm"]
        before = segments()
        requests = prompts(8)
        ids = [f"omni-{i}" for i in range(len(requests))]
        outs = multiprocess.generate(requests, sampling(), request_ids=ids)
        check_outputs(outs, requests, tokenizer)
        records = multiprocess.run(_records(multiprocess)).result(timeout=60)
        check_records(records, outs, [f"{rid}-talker" for rid in ids])
        # Greedy on the same dummy weights: the same text whichever mode ran it.
        for request, out in zip(requests, outs, strict=True):
            if request["prompt"] in inproc_results:
                assert (out.text["thinker"], out.token_ids["thinker"]) == inproc_results[request["prompt"]]

        multiprocess.generate(prompts(1), sampling())
        check_state(multiprocess.run(_states(multiprocess)).result(timeout=60))
        assert segments() == before, "code2wav released every talker segment"
