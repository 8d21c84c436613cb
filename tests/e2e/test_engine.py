"""End to end: vLLM's real engine loads and drives the generated omni runners.

``vllm.LLM`` (V1 engine, engine core in process) loads omnigen's tiny omni models
(``testing/tiny_omni.py``, random weights; registered by the ``omnigen``
``vllm.general_plugins`` entry point) with ``worker_cls`` set to a GENERATED worker:
``omnigen.generated.omnigen_tiny.talker.OmnigenTinyTalkerWorker`` and
``...code2wav.OmnigenTinyCode2wavWorker`` as committed, or a variant of
``conf/model/omnigen_tiny.yaml`` rendered in memory by ``omnigen.api.worker_cls_name``
(paired with the matching tiny HF config, ``tiny_omni.VARIANT_OVERRIDES``). The worker
builds the generated runner (on vLLM's CPU runner on this machine). The model records
every hook and code-predictor call; the tests read that record and the runner's own
state back through ``llm.collective_rpc``.

One engine at a time: each test class owns a class-scoped engine that is shut down
before the next class starts one. Run with::

    .venv/bin/python -m pytest tests/e2e -m e2e -x -q --durations=0
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]

# Small enough that prompts are chunked: a 9-token prompt is scheduled 8 + 1 (a 1-token
# chunked-prefill tail that must go through the per-row preprocess, never the talker MTP).
MAX_NUM_BATCHED_TOKENS = 8
MAX_NUM_SEQS = 4
N_TOKENS = 6
PROMPT_LENS = (9, 1, 5, 3)  # incl. a 1-token prompt
NUM_CODEBOOKS = 4  # omnigen_num_codebooks default
HOP = 4  # omnigen_hop_length default

# talker run -> payload -> code2wav prompts, handed from the talker class to the code2wav class.
_CHAIN: dict[str, Any] = {}


def _prompt(length: int, start: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": [(start + i) % 400 + 10 for i in range(length)]}


# ------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def engine_env():
    """Environment for an in-process engine core on a small CPU.

    No manual plugin registration: vLLM itself loads omnigen's ``vllm.general_plugins``
    entry point (``omnigen.plugin:register``), which makes the tiny architectures known.
    """
    root = str(REPO_ROOT)
    with pytest.MonkeyPatch.context() as mp:
        # Engine core and worker in this process: collective_rpc takes lambdas, and the
        # in-memory variant modules of omnigen.api resolve as worker_cls.
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes minutes and ~20 GB
        # No VLLM_USE_V2_MODEL_RUNNER: the generated worker and scheduler choose the V1 runner.
        mp.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
        # Only omnigen's plugin: vllm-omni (installed for comparison) ships one too, and it
        # re-registers models and patches vLLM.
        mp.setenv("VLLM_PLUGINS", "omnigen")
        # Any subprocess vLLM starts imports omnigen from this checkout.
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        if root not in sys.path:
            mp.syspath_prepend(root)
        yield


def _runner_state(w: Any) -> dict[str, Any]:
    """In the worker: which classes run, and what per-request state the runner holds."""
    worker, runner = w.worker, w.model_runner
    generated = type(worker).runner_class
    return {
        "worker": f"{type(worker).__module__}.{type(worker).__qualname__}",
        "generated": f"{generated.__module__}.{generated.__qualname__}",
        "generated_file": getattr(sys.modules[generated.__module__], "__file__", None),
        "runner": type(runner).__name__,
        "runner_is_built_class": type(runner) is type(worker).built_runner_class(),
        "mro": [c.__name__ for c in type(runner).__mro__],
        "requests": sorted(runner.requests),
        "buffers": sorted(runner.model_intermediate_buffer),
        "generators": sorted(runner._talker_mtp_generators),
        "pending": sorted(runner._pending_full_payload_send),
    }


def _pending_payloads(w: Any) -> dict[str, dict[str, Any]]:
    """In the worker: each pending full payload, materialized, and the next stage's prompt."""
    from omnigen_testing.tiny_omni import talker_to_code2wav

    runner = w.model_runner
    found = {}
    for req_id, entry in runner._pending_full_payload_send.items():
        payload, request = runner._materialize_full_payload_entry(entry)
        found[req_id] = {
            "keys": sorted(payload),
            "codes": payload["codes.audio"].tolist(),
            "request_is_state": request is runner.requests.get(req_id),
            "code2wav_prompt": talker_to_code2wav(payload, request),
        }
    return found


class Engine:
    """One ``vllm.LLM`` serving a tiny model variant through its generated worker."""

    def __init__(self, tmp_path_factory: Any, variant: str, **overrides: Any) -> None:
        from vllm import LLM

        from omnigen_testing import tiny_omni

        arch = tiny_omni.CODE2WAV_ARCH if variant == "code2wav" else tiny_omni.TALKER_ARCH
        model_dir = tiny_omni.write_tiny_config(tmp_path_factory.mktemp(variant), arch=arch, variant=variant)
        self.variant = variant
        self.worker_cls = tiny_omni.worker_cls(variant)
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
            worker_cls=self.worker_cls,
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

    def rpc(self, fn: Any) -> Any:
        """``fn(worker)`` in the single in-process worker (a callable needs the engine core in
        process; across processes vLLM refuses to pickle one)."""
        (result,) = self.llm.collective_rpc(fn)
        return result

    def record(self) -> dict[str, Any]:
        return self.rpc(lambda w: w.model_runner.model.omni_record.snapshot())

    def reset_record(self) -> None:
        self.rpc(lambda w: w.model_runner.model.omni_record.reset())

    def state(self) -> dict[str, Any]:
        return self.rpc(_runner_state)

    def payloads(self) -> dict[str, dict[str, Any]]:
        return self.rpc(_pending_payloads)

    def flush(self) -> None:
        """One engine step with nothing to run: the scheduler hands the runner the ids of the
        requests that finished in the last step (vLLM tells a runner one step late)."""
        self.llm.llm_engine.step()

    def shutdown(self) -> None:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        cleanup_dist_env_and_memory()  # gc included


def _engine(tmp_path_factory: Any, variant: str, label: str):
    engine = Engine(tmp_path_factory, variant)
    try:
        yield engine
    finally:
        print(f"\n[{label}] engine init {engine.init_s:.1f}s, generate {engine.gen_s:.1f}s")
        engine.shutdown()


def _greedy(n: int = N_TOKENS, **extra: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False, **extra)


# ------------------------------------------------------------------ helpers


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


def _hook_rows(record: dict[str, Any]) -> list[tuple[int, str, str, int, bool, int, int]]:
    """(step, hook, req_id, span, is_prefill, computed, prompt_len) for every row a hook saw."""
    return [
        (c["step"], c["hook"], rid, span, pre, comp, plen)
        for c in record["hook_calls"]
        for rid, span, pre, comp, plen in zip(
            c["req_ids"], c["spans"], c["is_prefill"], c["computed"], c["prompt_len"], strict=True
        )
    ]


def _mtp_rows(record: dict[str, Any]) -> list[tuple[int, str]]:
    """(step, req_id) of every row the code predictor ran, in call order."""
    return [(c["step"], rid) for c in record["mtp_calls"] for rid in c["req_ids"]]


def _check_generated_runner(state: dict[str, Any], variant: str, stage: str) -> None:
    """The runner that ran is the generated one (on vLLM's CPU runner on a CPU-only machine)."""
    from vllm.platforms import current_platform

    from omnigen import api
    from omnigen_testing.tiny_omni import TINY_MODEL, VARIANT_OVERRIDES

    overrides = VARIANT_OVERRIDES[variant]
    plan = api.stage_plan(TINY_MODEL, stage, overrides)
    worker_module, _, worker_name = api.worker_cls_name(TINY_MODEL, stage, overrides).rpartition(".")
    assert state["worker"] == f"{worker_module}.{worker_name}"
    assert state["generated"] == f"{worker_module}.{plan.runner_class}"
    if not overrides:
        # The committed module itself, from generated/ (omnigen build), not a re-render.
        assert worker_module == f"omnigen.generated.{TINY_MODEL}.{stage}"
        assert state["generated_file"] == str(REPO_ROOT / "generated" / TINY_MODEL / f"{stage}.py")
    else:
        assert worker_module.startswith(f"omnigen._variants.{TINY_MODEL}.{stage}_")
    assert state["runner_is_built_class"]
    mro = state["mro"]
    assert "OmniRunnerBase" in mro and "GPUModelRunner" in mro
    if current_platform.is_cpu():
        assert state["runner"] == f"{plan.runner_class}OnCPU"
        assert mro[1] == plan.runner_class
        # Generated methods first, then vLLM's CPU specifics, then the GPU base.
        assert mro.index("OmniRunnerBase") < mro.index("CPUModelRunner") < mro.index("GPUModelRunner")
    else:
        assert state["runner"] == plan.runner_class


def _check_finished(outs: list[Any], n_tokens: int) -> None:
    for out in outs:
        assert out.finished
        assert len(out.outputs[0].token_ids) == n_tokens, out
        assert out.outputs[0].finish_reason == "length"


def _check_prefill_routing(record: dict[str, Any], prompt_lens: dict[str, int]) -> None:
    """Prompt tokens (chunks and tails included) go through the per-row preprocess only."""
    rows = _hook_rows(record)
    mtp = set(_mtp_rows(record))
    prefill = [r for r in rows if r[4]]
    assert prefill
    for step, hook, rid, span, _pre, computed, plen in prefill:
        assert hook == "preprocess", (step, hook, rid, span)
        assert (step, rid) not in mtp, (step, rid)
        assert computed < plen == prompt_lens[rid]
    # Every prompt token was scheduled exactly once, in order, as prefill rows.
    for rid, plen in prompt_lens.items():
        chunks = [(comp, span) for _s, _h, r, span, pre, comp, _p in rows if r == rid and pre]
        assert [c for c, _ in chunks] == [sum(s for _, s in chunks[:i]) for i in range(len(chunks))]
        assert sum(s for _, s in chunks) == plen, (rid, chunks)


def _check_decode_routing(record: dict[str, Any], batch_hook: str | None, mtp: bool) -> None:
    """Single-token decodes go to the decode batch (or the per-row hook) and, with MTP, to the
    code predictor: exactly once per step, in row order."""
    rows = _hook_rows(record)
    decode = [r for r in rows if not r[4]]
    assert decode
    for step, hook, rid, span, _pre, computed, plen in decode:
        assert span == 1 and computed >= plen, (step, rid, span)
        assert hook == (batch_hook or "preprocess"), (step, hook, rid)
    by_step: dict[int, list[str]] = defaultdict(list)
    for step, _h, rid, *_ in decode:
        by_step[step].append(rid)
    if mtp:
        mtp_by_step: dict[int, list[str]] = defaultdict(list)
        for step, rid in _mtp_rows(record):
            mtp_by_step[step].append(rid)
        assert mtp_by_step == by_step
    else:
        assert record["mtp_calls"] == []
    if batch_hook is not None:
        calls = [c for c in record["hook_calls"] if c["hook"] == batch_hook]
        assert max(c["rows"] for c in calls) > 1
        # Adjacent decode rows share one call: two batch calls in a row within a step
        # would mean a run was split with nothing between.
        for prev, nxt in zip(record["hook_calls"], record["hook_calls"][1:], strict=False):
            assert not (prev["step"] == nxt["step"] and prev["hook"] == nxt["hook"] == batch_hook)
    else:
        assert all(c["rows"] == 1 for c in record["hook_calls"])


def _check_rows_and_buffers(record: dict[str, Any]) -> None:
    """One hook call per row per step, runner keys right, each hook's update merged."""
    assert record["errors"] == []
    per_step = Counter((step, rid) for step, _h, rid, *_ in _hook_rows(record))
    assert set(per_step.values()) == {1}
    seen: dict[str, list[int]] = defaultdict(list)
    for c in record["hook_calls"]:
        for rid, n, computed, plen, pre in zip(
            c["req_ids"], c["hook_calls_seen"], c["computed"], c["prompt_len"], c["is_prefill"], strict=True
        ):
            seen[rid].append(n)
            assert pre == (computed < plen)
    assert seen and all(counts == list(range(len(counts))) for counts in seen.values())
    hooked = [f for f in record["forwards"] if f["hook_rows"]]
    assert hooked and all(f["used_embeds"] for f in hooked)
    assert all(
        {"model_intermediate_buffer", "runtime_additional_information"} <= set(f["extra_kwargs"])
        for f in hooked
    )


def _check_released(engine: Engine, finished: set[str]) -> None:
    """After one more step nothing of a finished request is left on the runner."""
    engine.flush()
    state = engine.state()
    for key in ("requests", "buffers", "generators", "pending"):
        assert not finished & set(state[key]), (key, state[key])
    assert state["requests"] == state["buffers"] == state["generators"] == state["pending"] == []


def _talker_run(engine: Engine, lens: tuple[int, ...], start: int, params: Any) -> dict[str, Any]:
    """Generate, then read the record, the runner state and the pending payloads before the
    finished ids reach the runner; then flush and check the release."""
    engine.reset_record()
    prompts = [_prompt(n, start + 13 * i) for i, n in enumerate(lens)]
    outs = engine.generate(prompts, params)
    record = engine.record()
    ids = _engine_ids(record["request_ids"], outs)
    run = {
        "outs": outs,
        "record": record,
        "ids": ids,
        "prompts": {ids[o.request_id]: p["prompt_token_ids"] for o, p in zip(outs, prompts, strict=True)},
        "state": engine.state(),
        "payloads": engine.payloads(),
    }
    _check_released(engine, set(ids.values()))
    return run


SEEDED_PROMPT_LEN = 2


def _seeded_run(engine: Engine) -> tuple[list[list[list[int]]], dict[str, Any]]:
    """The same prompt three times, seeded ``tts_local_seed`` 7 and 8, and a plain ``seed=7``.

    All three finish together, so every payload is still pending when generate returns.
    Returns each request's codes (from its payload) and what the run saw.
    """
    params = [
        _greedy(extra_args={"tts_local_seed": 7}),
        _greedy(extra_args={"tts_local_seed": 8}),
        _greedy(seed=7),
    ]
    engine.reset_record()
    outs = engine.generate([_prompt(SEEDED_PROMPT_LEN, 100)] * len(params), params)
    record = engine.record()
    ids = _engine_ids(record["request_ids"], outs)
    order = [ids[o.request_id] for o in outs]
    _check_finished(outs, N_TOKENS)
    assert record["errors"] == []
    state, payloads = engine.state(), engine.payloads()
    # Only the two tts_local_seed requests own a generator, until they are released.
    assert state["generators"] == sorted(order[:2])
    assert sorted(payloads) == sorted(order)
    codes = [payloads[rid]["codes"][SEEDED_PROMPT_LEN:] for rid in order]
    assert codes == [record["codes"][rid] for rid in order]
    _check_released(engine, set(order))
    return codes, {"record": record, "order": order, "payloads": payloads}


def _chain_from(run: dict[str, Any]) -> dict[str, Any]:
    order = run["order"]
    return {
        "prompts": [run["payloads"][rid]["code2wav_prompt"] for rid in order],
        "codes": [run["record"]["codes"][rid] for rid in order],
    }


# --------------------------------------------------------------------- talkers


@pytest.fixture(scope="class")
def mtp_batched_engine(engine_env, tmp_path_factory):
    yield from _engine(tmp_path_factory, "mtp_batched", "talker mtp_batched (committed)")


@pytest.fixture(scope="class")
def mtp_batched_run(mtp_batched_engine):
    return _talker_run(mtp_batched_engine, PROMPT_LENS, 0, _greedy())


class TestTalkerMtpBatched:
    """(1) The committed talker: per-row preprocess, 5-tuple batched decode, MTP."""

    def test_generated_runner_ran(self, mtp_batched_run):
        _check_generated_runner(mtp_batched_run["state"], "mtp_batched", "talker")

    def test_requests_finished(self, mtp_batched_run):
        _check_finished(mtp_batched_run["outs"], N_TOKENS)
        _check_rows_and_buffers(mtp_batched_run["record"])

    def test_prefill_rows_go_through_preprocess(self, mtp_batched_run):
        run = mtp_batched_run
        record, ids = run["record"], run["ids"]
        lens = {rid: len(p) for rid, p in run["prompts"].items()}
        _check_prefill_routing(record, lens)
        rows = _hook_rows(record)
        # The 1-token prompt: one prefill row of span 1 at computed 0.
        one = ids[run["outs"][PROMPT_LENS.index(1)].request_id]
        assert [(span, comp) for _s, _h, r, span, pre, comp, _p in rows if r == one and pre] == [(1, 0)]
        # The 9-token prompt was chunked 8 + 1; its 1-token tail at computed=8 is still prefill
        # (CONTRACT 3.1) and went through preprocess, not the decode batch or the MTP (3.2).
        nine = ids[run["outs"][PROMPT_LENS.index(9)].request_id]
        assert [(span, comp) for _s, _h, r, span, pre, comp, _p in rows if r == nine and pre] == [
            (8, 0),
            (1, 8),
        ]
        assert {f["phase"] for f in record["forwards"]} >= {"prefill", "decode", "mixed"}

    def test_decode_rows_batched_and_mtp(self, mtp_batched_run):
        record = mtp_batched_run["record"]
        _check_decode_routing(record, "preprocess_decode_batch", mtp=True)
        assert max(c["batch"] for c in record["mtp_calls"]) > 1
        per_req = Counter(rid for _s, rid in _mtp_rows(record))
        assert sorted(per_req.values()) == [N_TOKENS - 1] * len(PROMPT_LENS)
        assert all(len(codes) == NUM_CODEBOOKS for c in record["mtp_calls"] for codes in c["codes"])
        # Unseeded traffic: no generator arguments at all.
        assert all(not c["generator"] and c["generators"] is None for c in record["mtp_calls"])

    def test_full_payload_accumulated(self, mtp_batched_run):
        """The talker accumulates one row per scheduled token: prompt placeholders, then the
        codes its MTP wrote into the request's buffer (what the model emitted)."""
        run = mtp_batched_run
        payloads, record = run["payloads"], run["record"]
        # Requests that finished before the last step were already released; the last ones
        # are still pending when generate returns (finished ids arrive one step late).
        last = run["ids"][run["outs"][PROMPT_LENS.index(3)].request_id]
        assert last in payloads and set(payloads) <= set(run["ids"].values())
        assert set(payloads) == set(run["state"]["pending"])
        for rid, payload in payloads.items():
            plen = len(run["prompts"][rid])
            assert payload["keys"] == ["codes.audio"] and payload["request_is_state"]
            assert payload["codes"][:plen] == [[-1] * NUM_CODEBOOKS] * plen
            assert payload["codes"][plen:] == record["codes"][rid]
            assert len(record["codes"][rid]) == N_TOKENS - 1

    def test_buffers_live_until_finished_ids_arrive(self, mtp_batched_run):
        run = mtp_batched_run
        state = run["state"]
        # Right after generate: the requests that finished in the last step still hold
        # their buffer and pending payload; the flush in _talker_run released them.
        assert state["pending"] and set(state["pending"]) <= set(state["buffers"])
        assert set(state["buffers"]) <= set(state["requests"])

    def test_seeded_codes_reproducible(self, mtp_batched_engine):
        """(2) ``tts_local_seed`` seeds the code predictor per request: same seed, same codes
        across runs; another seed, other codes; a plain ``seed`` does not seed it."""
        _CHAIN["attempted"] = True
        (seed7_a, seed8_a, _plain_a), first = _seeded_run(mtp_batched_engine)
        (seed7_b, seed8_b, _plain_b), _ = _seeded_run(mtp_batched_engine)
        assert len(seed7_a) == N_TOKENS - 1
        assert seed7_a == seed7_b and seed8_a == seed8_b
        assert seed7_a != seed8_a
        # Several seeded rows in one batch: one call with generators=[g, g, None], generator=None.
        record, order = first["record"], first["order"]
        assert record["mtp_calls"]
        for call in record["mtp_calls"]:
            assert not call["generator"] and call["generators"] is not None
            seeded = dict(zip(call["req_ids"], call["generators"], strict=True))
            assert seeded == {order[0]: True, order[1]: True, order[2]: False}
        # Hand the seeded payloads on to the code2wav stage (TestCode2Wav).
        _CHAIN.update(_chain_from(first))

    def test_dummy_run_with_omni_output(self, mtp_batched_engine):
        # vLLM's profile/warm-up/graph-capture path calls the model itself (on GPU at
        # startup); on CPU with eager mode and an explicit KV size vLLM skips it, so call it.
        engine = mtp_batched_engine
        engine.flush()
        engine.reset_record()
        engine.rpc(lambda w: w.model_runner.profile_run())
        record = engine.record()
        assert record["errors"] == [] and record["hook_calls"] == []
        assert [f["phase"] for f in record["forwards"]] == ["unhooked"]
        assert record["forwards"][0]["num_tokens"] == MAX_NUM_BATCHED_TOKENS
        assert engine.state()["pending"] == []


@pytest.fixture(scope="class")
def mtp_per_row_engine(engine_env, tmp_path_factory):
    yield from _engine(tmp_path_factory, "mtp_per_row", "talker mtp_per_row (variant)")


class TestTalkerMtpPerRow:
    """qwen3_omni-talker-like variant: MTP, every row through preprocess, one shared generator."""

    def test_per_row_hooks_and_seeded_fallback(self, mtp_per_row_engine):
        engine = mtp_per_row_engine
        params = [
            _greedy(extra_args={"tts_local_seed": 11 + i}) if i < 2 else _greedy()
            for i in range(len(PROMPT_LENS))
        ]
        run = _talker_run(engine, PROMPT_LENS, 5, params)
        _check_generated_runner(run["state"], "mtp_per_row", "talker")
        _check_finished(run["outs"], N_TOKENS)
        record = run["record"]
        _check_rows_and_buffers(record)
        _check_prefill_routing(record, {rid: len(p) for rid, p in run["prompts"].items()})
        _check_decode_routing(record, None, mtp=True)
        assert {c["hook"] for c in record["hook_calls"]} == {"preprocess"}
        # Seeded rows among several and no per-row generators: one call per row, each seeded
        # row with its own generator; never a `generators` list.
        assert all(c["generators"] is None for c in record["mtp_calls"])
        seeded = {run["ids"][o.request_id] for o in run["outs"][:2]}
        calls_by_step: dict[int, list[dict]] = defaultdict(list)
        for c in record["mtp_calls"]:
            calls_by_step[c["step"]].append(c)
            assert c["generator"] == (c["req_ids"][0] in seeded if c["batch"] == 1 else False)
        for calls in calls_by_step.values():
            if any(rid in seeded for c in calls for rid in c["req_ids"]):
                assert all(c["batch"] == 1 for c in calls)
        assert sum(c["generator"] for c in record["mtp_calls"]) == 2 * (N_TOKENS - 1)


@pytest.fixture(scope="class")
def batched_plain_engine(engine_env, tmp_path_factory):
    yield from _engine(tmp_path_factory, "batched_plain", "talker batched_plain (variant)")


class TestTalkerBatchedPlain:
    """(3) higgs-like variant: 3-tuple batched decode hook, no code predictor."""

    def test_batched_decode_without_mtp(self, batched_plain_engine):
        engine = batched_plain_engine
        run = _talker_run(engine, PROMPT_LENS, 3, _greedy())
        _check_generated_runner(run["state"], "batched_plain", "talker")
        _check_finished(run["outs"], N_TOKENS)
        record = run["record"]
        _check_rows_and_buffers(record)
        _check_prefill_routing(record, {rid: len(p) for rid, p in run["prompts"].items()})
        _check_decode_routing(record, "preprocess_decode_batch", mtp=False)
        assert not engine.rpc(lambda w: hasattr(w.model_runner.model, "talker_mtp"))
        assert not engine.rpc(lambda w: hasattr(w.model_runner, "_talker_mtp_forward"))
        # Still a producer: every scheduled token has a (placeholder) row in its payload.
        for rid, payload in run["payloads"].items():
            assert len(payload["codes"]) == len(run["prompts"][rid]) + N_TOKENS - 1
            assert payload["code2wav_prompt"] == []


# ---------------------------------------------------------------- generation


@pytest.fixture(scope="class")
def chain(engine_env, tmp_path_factory):
    """The talker's seeded payloads as code2wav prompts: from TestTalkerMtpBatched when it ran
    in this session, else from a talker engine of its own (shut down before code2wav starts).
    A failure here is reported by the chain test alone."""
    if "prompts" not in _CHAIN and not _CHAIN.get("attempted"):
        _CHAIN["attempted"] = True
        gen = _engine(tmp_path_factory, "mtp_batched", "talker mtp_batched (for the chain)")
        try:
            _CHAIN.update(_chain_from(_seeded_run(next(gen))[1]))
        except Exception as exc:  # reported by the test that needs it
            _CHAIN["error"] = f"the talker run for the chain failed: {exc!r}"
        finally:
            gen.close()
    return dict(_CHAIN)


@pytest.fixture(scope="class")
def code2wav_engine(engine_env, tmp_path_factory, chain):
    yield from _engine(tmp_path_factory, "code2wav", "code2wav (committed)")


def _check_code2wav_run(engine: Engine, prompts: list[list[int]]) -> dict[str, Any]:
    """Codes in, audio rows out, max_tokens=1; every code ran once at its position."""
    engine.reset_record()
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], _greedy(1))
    state = engine.state()
    _check_generated_runner(state, "code2wav", "code2wav")
    _check_finished(outs, 1)
    record = engine.record()
    assert record["errors"] == [] and record["hook_calls"] == [] and record["mtp_calls"] == []
    assert {f["phase"] for f in record["forwards"]} == {"unhooked"}
    ran = Counter(
        (p, t) for f in record["forwards"] for p, t in zip(f["positions"], f["tokens"], strict=True)
    )
    assert ran == Counter((i, t) for p in prompts for i, t in enumerate(p))
    for f in record["forwards"]:
        audio = f["payload"]["audio"]
        assert audio["shape"] == [f["num_tokens"], HOP] and audio["nonzero_rows"] == f["num_tokens"]
    # A generation stage accumulates nothing for a next stage.
    assert state["pending"] == [] and state["buffers"] == []
    _check_released(engine, set(state["requests"]))
    return record


class TestCode2Wav:
    """(4) The committed generation stage on vLLM's loop: codes in, audio rows out."""

    def test_codes_to_audio(self, code2wav_engine):
        lens = (12, 1, 5, 7)
        prompts = [_prompt(n, 17 * i)["prompt_token_ids"] for i, n in enumerate(lens)]
        record = _check_code2wav_run(code2wav_engine, prompts)
        assert sum(f["num_tokens"] for f in record["forwards"]) == sum(lens)
        # The 12-code prompt cannot fit one 8-token step: it ran chunked.
        assert len(record["forwards"]) >= 2
        assert any(f["positions"][:1] == [8] for f in record["forwards"])

    def test_talker_payload_to_code2wav(self, chain, code2wav_engine):
        """talker run -> accumulated payload -> talker_to_code2wav -> code2wav run."""
        from omnigen_testing.tiny_omni import CODE2WAV_TOKEN_BASE

        if "prompts" not in chain:
            pytest.fail(chain.get("error", "the seeded talker run (TestTalkerMtpBatched) failed"))
        prompts = chain["prompts"]
        for prompt, codes in zip(prompts, chain["codes"], strict=True):
            assert len(prompt) == (N_TOKENS - 1) * NUM_CODEBOOKS
            expected = [CODE2WAV_TOKEN_BASE + k * 32 + c for frame in codes for k, c in enumerate(frame)]
            assert prompt == expected
        record = _check_code2wav_run(code2wav_engine, prompts)
        assert sum(f["num_tokens"] for f in record["forwards"]) == sum(len(p) for p in prompts)
