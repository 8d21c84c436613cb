"""End to end: vLLM's real engine runs omni stage runners built by a custom worker.

``vllm.LLM`` (V1 engine, engine core in process) loads a tiny omni model
(``omnigen.testing.tiny_omni``, random weights) with
``worker_cls="tests.e2e.prototype_worker.<Worker>"``; the worker builds the
prototype runner on vLLM's CPU runner (or GPU runner on a GPU machine). The
model records every hook call; the test reads the records and the runner's trace
back through ``llm.collective_rpc``.

One engine at a time: each test class owns a class-scoped engine that is shut
down before the next class starts one. Run with::

    .venv/bin/python -m pytest tests/e2e -m e2e -x -q
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKERS = "tests.e2e.prototype_worker"

# Small enough that the prompts below are chunked: a 9-token prompt is scheduled
# 8 + 1 (a 1-token chunked-prefill tail that must not go to the talker MTP).
MAX_NUM_BATCHED_TOKENS = 8
MAX_NUM_SEQS = 4
N_TOKENS = 6
PROMPT_LENS = (9, 1, 5, 3)  # incl. a 1-token prompt


def _prompt(length: int, start: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": [(start + i) % 400 + 10 for i in range(length)]}


# ------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def engine_env():
    """Environment for an in-process engine core on a small CPU, and the plugin."""
    root = str(REPO_ROOT)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes minutes and ~20 GB
        mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # the runners subclass the V1 GPUModelRunner
        # vLLM inspects an out-of-tree model class in a fresh `python -m` subprocess:
        # it must be able to import omnigen.testing.tiny_omni.
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        if root not in sys.path:
            mp.syspath_prepend(root)
        from omnigen.plugin import register

        register()  # what the vllm.general_plugins entry point does when installed
        yield


class Engine:
    """One ``vllm.LLM`` plus what the test reads back from its worker."""

    def __init__(self, model_dir: str, worker: str, **overrides: Any) -> None:
        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=model_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            max_model_len=128,
            max_num_seqs=MAX_NUM_SEQS,
            enable_chunked_prefill=True,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            enable_prefix_caching=False,
            worker_cls=f"{WORKERS}.{worker}",
            seed=0,
        )
        kwargs.update(overrides)
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.init_s = time.perf_counter() - t0
        self.gen_s = 0.0

    def generate(self, prompts: list[dict], params: Any) -> list[Any]:
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        self.gen_s += time.perf_counter() - t0
        return outs

    def rpc(self, fn):
        (result,) = self.llm.collective_rpc(fn)
        return result

    def record(self) -> dict[str, Any]:
        return self.rpc(lambda w: w.model_runner.model.omni_record.snapshot())

    def trace(self) -> dict[str, Any]:
        import copy

        return self.rpc(lambda w: copy.deepcopy(w.model_runner.prototype_trace))

    def shutdown(self) -> None:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        cleanup_dist_env_and_memory()


def _start(tmp_path_factory, worker: str, variant: str, arch: str | None = None, **overrides: Any) -> Engine:
    from omnigen.testing.tiny_omni import TALKER_ARCH, write_tiny_config

    model_dir = write_tiny_config(tmp_path_factory.mktemp(variant), arch=arch or TALKER_ARCH, variant=variant)
    return Engine(model_dir, worker, **overrides)


def _greedy(n: int = N_TOKENS, **extra: Any):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False, **extra)


def _timing(engine: Engine, label: str) -> None:
    print(f"\n[{label}] engine init {engine.init_s:.1f}s, generate {engine.gen_s:.1f}s")


def _rows_by_step(trace: dict[str, Any]) -> dict[int, list[tuple]]:
    by_step: dict[int, list[tuple]] = defaultdict(list)
    for row in trace["rows"]:
        by_step[row[0]].append(tuple(row))
    return by_step


def _hook_rows(record: dict[str, Any]) -> list[tuple[int, str, str, int, bool]]:
    """(step, hook, req_id, span, is_prefill) for every row a hook saw."""
    return [
        (c["step"], c["hook"], rid, span, pre)
        for c in record["hook_calls"]
        for rid, span, pre in zip(c["req_ids"], c["spans"], c["is_prefill"])
    ]


def _engine_ids(seen: list[str], outs: list[Any]) -> dict[str, str]:
    """User request id -> the id the runner and model saw.

    vLLM 0.30 makes engine-side ids unique by appending ``-<8 hex>`` to the id a
    ``RequestOutput`` carries, so a runner never sees ``out.request_id`` itself.
    """
    mapping = {}
    for out in outs:
        matches = [rid for rid in seen if rid == out.request_id or rid.startswith(f"{out.request_id}-")]
        assert len(matches) == 1, (out.request_id, seen)
        mapping[out.request_id] = matches[0]
    return mapping


def _decode_runs(trace_rows: list[tuple], route: str = "mtp") -> list[tuple[int, list[str]]]:
    """Maximal runs of adjacent rows with ``route`` per step: (step, req_ids)."""
    runs: list[tuple[int, list[str]]] = []
    for step, rows in sorted(_rows_by_step({"rows": trace_rows}).items()):
        current: list[str] = []
        for row in sorted(rows, key=lambda r: r[2]):  # by offset = batch order
            if row[6] == route:
                current.append(row[1])
            elif current:
                runs.append((step, current))
                current = []
        if current:
            runs.append((step, current))
    return runs


def _check_common(engine: Engine, outs: list[Any], runner: str) -> tuple[dict, dict]:
    """Runner identity, N tokens per request, one hook call per row per step."""
    info = engine.rpc(
        lambda w: {
            "worker": type(w.worker).__name__,
            "runner": type(w.model_runner).__name__,
            "mro": [c.__name__ for c in type(w.model_runner).__mro__],
        }
    )
    assert info["runner"] == runner
    assert "GPUModelRunner" in info["mro"]
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        assert info["runner"].startswith("CPU") and "CPUModelRunner" in info["mro"]
        assert info["mro"].index(runner[3:]) < info["mro"].index("CPUModelRunner")

    for out in outs:
        assert len(out.outputs[0].token_ids) == N_TOKENS, out
        assert out.outputs[0].finish_reason == "length"

    record, trace = engine.record(), engine.trace()
    assert record["errors"] == []
    ids = _engine_ids(record["request_ids"], outs)
    assert len(set(ids.values())) == len(outs)
    # Each row of each step got exactly one hook call.
    rows_seen = Counter((s, rid) for s, _h, rid, _sp, _p in _hook_rows(record))
    rows_sched = Counter((s, rid) for s, rid, *_ in trace["rows"])
    assert rows_seen == rows_sched
    # Every step's forward ran on the embeddings the hooks produced.
    hooked = [f for f in record["forwards"] if f["hook_rows"]]
    assert hooked and all(f["used_embeds"] for f in hooked)
    return record, trace


# --------------------------------------------------------------------- talkers
# Engines are class-scoped fixtures (module-level functions): each is shut down
# when its class is done, so only one engine exists at a time.


@pytest.fixture(scope="class")
def mtp_batched_engine(engine_env, tmp_path_factory):
    engine = _start(tmp_path_factory, "PrototypeTalkerWorker", "mtp_batched")
    yield engine
    _timing(engine, "talker mtp_batched")
    engine.shutdown()


@pytest.fixture(scope="class")
def mtp_batched_run(mtp_batched_engine):
    prompts = [_prompt(n, 13 * i) for i, n in enumerate(PROMPT_LENS)]
    outs = mtp_batched_engine.generate(prompts, _greedy())
    return outs, mtp_batched_engine.record(), mtp_batched_engine.trace()


class TestTalkerMtpBatched:
    """qwen3_tts-like talker: per-row preprocess, 5-tuple batched decode, MTP."""

    def test_runner_and_outputs(self, mtp_batched_engine, mtp_batched_run):
        outs, _, _ = mtp_batched_run
        worker = mtp_batched_engine.rpc(lambda w: type(w.worker).__name__)
        assert worker == "PrototypeTalkerWorker"
        _check_common(mtp_batched_engine, outs, "CPUPrototypeTalkerRunner")

    def test_prefill_rows_go_through_preprocess(self, mtp_batched_run):
        outs, record, trace = mtp_batched_run
        ids = _engine_ids(record["request_ids"], outs)
        hook_rows = _hook_rows(record)
        prefill = [r for r in hook_rows if r[4]]
        assert prefill and all(h == "preprocess" for _s, h, *_ in prefill)
        # The 1-token prompt: one prefill row of span 1 at computed 0, via preprocess.
        one = ids[outs[PROMPT_LENS.index(1)].request_id]
        assert [r[3] for r in trace["rows"] if r[1] == one and r[6] == "prefill"] == [1]
        # The 9-token prompt was chunked (8 + 1); its 1-token tail at computed=8 is
        # still prefill (CONTRACT 3.1) and did not go to the talker MTP (3.2).
        nine = ids[outs[PROMPT_LENS.index(9)].request_id]
        chunks = [(r[3], r[4]) for r in trace["rows"] if r[1] == nine and r[6] == "prefill"]
        assert chunks == [(8, 0), (1, 8)], chunks
        tail = [c for c in record["hook_calls"] if nine in c["req_ids"] and c["computed"] == [8]]
        assert len(tail) == 1 and tail[0]["hook"] == "preprocess" and tail[0]["is_prefill"] == [True]
        assert {f["phase"] for f in record["forwards"]} >= {"prefill", "decode", "mixed"}

    def test_decode_rows_batched_and_mtp(self, mtp_batched_run):
        outs, record, trace = mtp_batched_run
        decode = [r for r in _hook_rows(record) if not r[4]]
        assert decode and all(h == "preprocess_decode_batch" and span == 1 for _s, h, _r, span, _p in decode)
        # Adjacent single-token decode rows: one batch-hook call per run, row order kept.
        calls = [(c["step"], c["req_ids"]) for c in record["hook_calls"] if c["hook"] == "preprocess_decode_batch"]
        assert calls == _decode_runs(trace["rows"], "mtp")
        # MTP: exactly the decode rows, batched, N-1 per request.
        assert [c["batch"] for c in record["mtp_calls"]] == [len(r) for _s, r in calls]
        assert max(c["batch"] for c in record["mtp_calls"]) > 1
        per_req = Counter(r[2] for r in decode)
        assert sorted(per_req.values()) == [N_TOKENS - 1] * len(outs)
        assert all(len(c["codes"][0]) == 4 for c in record["mtp_calls"])
        # Unseeded traffic: no generator arguments at all.
        assert all(not c["generator"] and c["generators"] is None for c in record["mtp_calls"])

    def test_runner_owned_keys_and_buffer_merge(self, mtp_batched_run):
        _, record, _ = mtp_batched_run
        seen: dict[str, list[int]] = defaultdict(list)
        for c in record["hook_calls"]:
            for rid, n, computed, plen, pre in zip(
                c["req_ids"], c["hook_calls_seen"], c["computed"], c["prompt_len"], c["is_prefill"]
            ):
                seen[rid].append(n)
                assert pre == (computed < plen)
        # Each hook's update dict was merged into the request's buffer.
        assert seen and all(counts == list(range(len(counts))) for counts in seen.values())

    def test_seeded_mtp_reproducible(self, mtp_batched_engine):
        engine = mtp_batched_engine

        def codes_for(params) -> tuple[list, list]:
            before = len(engine.record()["mtp_calls"])
            (out,) = engine.generate([_prompt(4, 100)], params)
            rid = _engine_ids(engine.record()["request_ids"], [out])[out.request_id]
            codes = engine.rpc(lambda w: w.model_runner.prototype_trace["mtp_codes"][rid])
            return codes, engine.record()["mtp_calls"][before:]

        a, calls_a = codes_for(_greedy(extra_args={"tts_local_seed": 7}))
        b, _ = codes_for(_greedy(extra_args={"tts_local_seed": 7}))
        c, _ = codes_for(_greedy(extra_args={"tts_local_seed": 8}))
        d, calls_d = codes_for(_greedy(seed=7))
        assert len(a) == N_TOKENS - 1
        assert a == b and a != c
        assert all(call["generator"] and call["batch"] == 1 for call in calls_a)
        # A plain sampling seed does not seed the code predictor.
        assert all(not call["generator"] and call["generators"] is None for call in calls_d)

    def test_finished_requests_release_buffers(self, mtp_batched_engine, mtp_batched_run):
        engine = mtp_batched_engine
        outs, record, _ = mtp_batched_run
        first_ids = set(_engine_ids(record["request_ids"], outs).values())
        engine.generate([_prompt(2, 7)], _greedy(2))  # finished ids arrive with a later step
        buffers, gens = engine.rpc(
            lambda w: (list(w.model_runner.model_intermediate_buffer), list(w.model_runner._talker_mtp_generators))
        )
        released = set(engine.trace()["released"])
        assert first_ids <= released
        assert not released & (set(buffers) | set(gens))


@pytest.fixture(scope="class")
def mtp_per_row_engine(engine_env, tmp_path_factory):
    engine = _start(tmp_path_factory, "PrototypeTalkerPerRowWorker", "mtp_per_row")
    yield engine
    _timing(engine, "talker mtp_per_row")
    engine.shutdown()


class TestTalkerMtpPerRow:
    """qwen3_omni-talker-like: MTP, every row through preprocess, shared generator."""

    def test_per_row_hooks_and_seeded_fallback(self, mtp_per_row_engine):
        engine = mtp_per_row_engine
        prompts = [_prompt(n, 5 * i) for i, n in enumerate(PROMPT_LENS)]
        params = [_greedy(extra_args={"tts_local_seed": 11 + i}) if i < 2 else _greedy() for i in range(len(prompts))]
        outs = engine.generate(prompts, params)
        record, trace = _check_common(engine, outs, "CPUPrototypeTalkerPerRowRunner")
        assert {c["hook"] for c in record["hook_calls"]} == {"preprocess"}
        assert all(c["rows"] == 1 for c in record["hook_calls"])
        decode = [r for r in _hook_rows(record) if not r[4]]
        assert decode and all(span == 1 for *_x, span, _p in decode)
        assert sum(c["batch"] for c in record["mtp_calls"]) == len(decode)
        # Seeded rows among several and no per-row generators: one call per row,
        # each seeded row with its own generator; never a `generators` list.
        assert all(c["generators"] is None for c in record["mtp_calls"])
        assert all(c["batch"] == 1 for c in record["mtp_calls"])
        assert sum(c["generator"] for c in record["mtp_calls"]) == 2 * (N_TOKENS - 1)


@pytest.fixture(scope="class")
def no_mtp_engine(engine_env, tmp_path_factory):
    engine = _start(tmp_path_factory, "PrototypeTalkerNoMtpWorker", "batched_no_mtp")
    yield engine
    _timing(engine, "talker batched_no_mtp")
    engine.shutdown()


class TestTalkerBatchedNoMtp:
    """higgs-like: 3-tuple batched decode hook, no code predictor."""

    def test_batched_decode_without_mtp(self, no_mtp_engine):
        engine = no_mtp_engine
        prompts = [_prompt(n, 3 * i) for i, n in enumerate(PROMPT_LENS)]
        outs = engine.generate(prompts, _greedy())
        record, trace = _check_common(engine, outs, "CPUPrototypeTalkerNoMtpRunner")
        assert record["mtp_calls"] == []
        assert not engine.rpc(lambda w: hasattr(w.model_runner.model, "talker_mtp"))
        calls = [(c["step"], c["req_ids"]) for c in record["hook_calls"] if c["hook"] == "preprocess_decode_batch"]
        assert calls and calls == _decode_runs(trace["rows"], "decode")
        assert max(len(r) for _s, r in calls) > 1


# ---------------------------------------------------------------- generation


@pytest.fixture(scope="class")
def code2wav_engine(engine_env, tmp_path_factory):
    from omnigen.testing.tiny_omni import CODE2WAV_ARCH

    engine = _start(tmp_path_factory, "PrototypeCode2WavWorker", "code2wav", arch=CODE2WAV_ARCH)
    yield engine
    _timing(engine, "code2wav")
    engine.shutdown()


class TestCode2Wav:
    """A generation stage on vLLM's loop: codes in, audio rows out, max_tokens=1."""

    HOP = 4  # omnigen_hop_length default

    def test_codes_to_audio(self, code2wav_engine):
        engine = code2wav_engine
        lens = (12, 1, 5, 7)
        prompts = [_prompt(n, 17 * i) for i, n in enumerate(lens)]
        outs = engine.generate(prompts, _greedy(1))
        assert engine.rpc(lambda w: type(w.model_runner).__name__) == "CPUPrototypeCode2WavRunner"
        assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
        trace, record = engine.trace(), engine.record()
        assert record["hook_calls"] == [] and record["errors"] == []
        ids = _engine_ids(list(trace["audio_samples"]), outs)
        # Every code became HOP samples, whether its prompt was chunked or not.
        for out, n in zip(outs, lens):
            assert trace["audio_samples"][ids[out.request_id]] == n * self.HOP
        assert sum(f["num_tokens"] for f in record["forwards"]) == sum(lens)
        assert len(record["forwards"]) >= 2  # 25 codes at 8 tokens per step
        audio = engine.rpc(lambda w: {k: w.model_runner.finished_audio(k).abs().sum().item() for k in ids.values()})
        assert all(a > 0 for a in audio.values())
