"""Differential e2e test on vllm-omni 0.30's real model classes (issue 7, item 2).

Each case (``testing/real/cases/<name>.py``) is one real vllm-omni stage class on a tiny
checkpoint written at test time, weights re-drawn from N(0, std) with a fixed generator. vLLM's
``LLM`` on CPU runs it twice, in two processes started once per session and run in parallel
(``run_side.py``; all cases of a side in one process):

* ``omnigen``: omnigen's generated worker, on plain (unpatched) vLLM;
* ``oracle``: vllm-omni's own runner composed onto vLLM's ``CPUModelRunner``.

Both record every engine step (``harness.RecordingRunnerMixin``): per request the sampled tokens,
the codes in its buffer and the step's published payload. ``test_omnigen_matches_oracle`` asserts
they are equal step by step and reports the first mismatch (step, request, field) or how omnigen
failed. ``test_oracle_ran`` asserts the oracle produced what the stage must (the case module's
optional ``EXPECT``: codes every decode step, payload keys, two requests whose outputs differ), so
an equality of two empty traces cannot pass. ``test_negative_control`` shows the comparison fails
on a deliberately damaged oracle run. A case that cannot run on CPU is skipped with its reason.

Nothing here imports vLLM or vllm-omni: the pytest process only reads the two JSON traces.

    .venv/bin/python -m pytest tests/e2e/real -m e2e -x -q       # add -s for timings
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from omnigen_testing.real import harness

pytestmark = pytest.mark.e2e

# Found, not imported (this process never imports vllm-omni; the oracle side's process does).
if importlib.util.find_spec("vllm_omni") is None:
    pytest.skip(
        "vllm-omni (the oracle side of every case) is not installed: it is tied to vLLM 0.30 (requirements/vllm-0.30)",
        allow_module_level=True,
    )

from omnigen_testing.real.run_side import all_case_names  # noqa: E402  (after the skip)

CASES = all_case_names()
# Every case module of omnigen_testing.real.cases; none found means a moved folder, not a pass.
assert CASES, "no case modules found in omnigen_testing.real.cases"
SIDE_TIMEOUT_S = 1200
# The negative control: the oracle again, with the model's postprocess disabled.
NEGATIVE_CASE, NEGATIVE_PERTURBATION = "qwen3_tts_talker", "no_postprocess"
NEGATIVE_KEY = f"{NEGATIVE_CASE}~{NEGATIVE_PERTURBATION}"


def _run_sides(out: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(harness.REPO_ROOT), env.get("PYTHONPATH")) if p)
    procs = {}
    t0 = time.perf_counter()
    for side in harness.SIDES:
        args = [
            sys.executable,
            "-m",
            "omnigen_testing.real.run_side",
            "--side",
            side,
            "--out",
            str(out / f"{side}.json"),
        ]
        args += ["--work-dir", str(out / f"{side}-checkpoints")]
        if side == "oracle" and NEGATIVE_CASE in CASES:
            args += ["--variants", NEGATIVE_KEY]
        log = open(out / f"{side}.log", "w")  # closed below, once the side has exited
        procs[side] = (
            subprocess.Popen(args, cwd=harness.REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT),
            log,
        )
    traces: dict[str, Any] = {"wall_s": {}, "logs": {}}
    for side, (proc, log) in procs.items():
        try:
            proc.wait(timeout=max(1.0, SIDE_TIMEOUT_S - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        traces["wall_s"][side] = round(time.perf_counter() - t0, 1)
        traces["logs"][side] = str(out / f"{side}.log")
        path = out / f"{side}.json"
        if not path.exists():
            tail = (out / f"{side}.log").read_text()[-4000:]
            pytest.fail(f"the {side} side wrote no trace (exit {proc.returncode}); log tail:\n{tail}")
        traces[side] = json.loads(path.read_text())
        if proc.returncode != 0:
            traces[side]["exit_code"] = proc.returncode
    return traces


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    traces = _run_sides(tmp_path_factory.mktemp("real_models"))
    yield traces
    per_case = {
        name: {side: traces[side]["cases"].get(name, {}).get("wall_s") for side in harness.SIDES}
        for name in sorted(set(traces["oracle"]["cases"]) | set(traces["omnigen"]["cases"]))
    }
    own = {side: traces[side].get("wall_s") for side in harness.SIDES}
    print(
        f"\n[real models] sides in parallel, done after {traces['wall_s']} s (own: {own}); per case: {per_case}"
    )


def _case(traces: dict[str, Any], side: str, name: str) -> dict[str, Any]:
    trace = traces[side]
    if trace.get("setup_error"):
        pytest.fail(f"the {side} side failed before any case: {trace['setup_error']}")
    if name not in trace["cases"]:
        pytest.fail(
            f"the {side} side has no trace for {name} (exit code {trace.get('exit_code')}; log {traces['logs'][side]})"
        )
    result = trace["cases"][name]
    if result.get("not_on_cpu"):
        pytest.skip(f"{name} cannot run on CPU: {result['not_on_cpu']}")
    return result


# ----------------------------------------------------------------------------- isolation


def test_sides_isolated(traces):
    """vllm-omni's patch.py ran in the oracle process only; the pytest process never loaded it."""
    assert traces["oracle"]["vllm_patched"] is True
    assert traces["omnigen"]["vllm_patched"] is False, "omnigen's side ran on vLLM patched by vllm-omni"
    assert "vllm_omni.patch" not in sys.modules
    for name, result in traces["omnigen"]["cases"].items():
        if result.get("runner"):
            assert result["runner"]["vllm_patched"] is False, name
            assert "OmniRunnerBase" in result["runner"]["mro"], (name, result["runner"])
    for name, result in traces["oracle"]["cases"].items():
        if result.get("runner"):
            mro = result["runner"]["mro"]
            assert mro[0].endswith("OnCPU") and "CPUModelRunner" in mro and "OmniGPUModelRunner" in mro, (
                name,
                mro,
            )


# ---------------------------------------------------------------------- negative control


def test_negative_control(traces):
    """The comparison fails where it must: the oracle against itself with the model's postprocess
    disabled (no ``hidden_states.last`` for the code predictor) differs in codes; the oracle
    against itself is equal; swapping two differently seeded requests is caught."""
    if NEGATIVE_CASE not in CASES:
        pytest.skip(f"{NEGATIVE_CASE} is not a case")
    oracle = _case(traces, "oracle", NEGATIVE_CASE)
    damaged = traces["oracle"]["cases"].get(NEGATIVE_KEY)
    assert damaged is not None, f"the oracle side did not run {NEGATIVE_KEY}"
    assert harness.describe_error(damaged) is None, harness.describe_error(damaged)
    assert harness.first_mismatch(oracle, copy.deepcopy(oracle)) is None

    mismatch = harness.first_mismatch(oracle, damaged)
    assert mismatch is not None, "disabling postprocess changed nothing the comparison sees"
    assert mismatch["field"] == "codes", harness.format_mismatch(NEGATIVE_KEY, mismatch)
    # Prefill steps are untouched: the first difference is a decode step's code predictor.
    assert mismatch["request"] is not None and mismatch["step"] > 0

    a, b = oracle["expect"]["differ"]
    swapped = copy.deepcopy(oracle)
    for step in swapped["steps"]:
        rows = step["requests"]
        if a in rows and b in rows:
            rows[a]["codes"], rows[b]["codes"] = rows[b]["codes"], rows[a]["codes"]
    mismatch = harness.first_mismatch(oracle, swapped)
    assert mismatch is not None and mismatch["field"] == "codes" and mismatch["request"] in (a, b), mismatch


def test_cases_not_on_cpu(traces):
    """The cases that cannot run on this CPU machine, each with its reason (skipped, listed)."""
    listed = {
        name: result["not_on_cpu"]
        for name, result in sorted(traces["oracle"]["cases"].items())
        if result.get("not_on_cpu")
    }
    if listed:
        pytest.skip("not on CPU: " + "; ".join(f"{name}: {why}" for name, why in listed.items()))


# ------------------------------------------------------------------------------ the oracle


def _decode_codes(result: dict[str, Any], rid: str) -> list[Any]:
    """The codes in a request's buffer after each of its decode steps (one scheduled token after
    it had sampled at least one)."""
    seen_token = False
    codes = []
    for step in result["steps"]:
        row = step["requests"].get(rid)
        if row is None:
            continue
        if seen_token and row["scheduled"] == 1:
            codes.append(row["codes"])
        seen_token = seen_token or bool(row["tokens"])
    return codes


def _payloads(result: dict[str, Any], rid: str) -> list[dict[str, Any]]:
    return [
        s["requests"][rid]["payload"] for s in result["steps"] if s["requests"].get(rid, {}).get("payload")
    ]


def expectation_problems(result: dict[str, Any]) -> list[str]:
    """What the stage should have produced and did not (the case module's EXPECT)."""
    problems = []
    request_ids = sorted(set(result.get("finished") or {}) | set(result.get("unfinished") or []))
    expect = result.get("expect") or {}
    if not expect:
        if not any(_payloads(result, rid) for rid in request_ids):
            problems.append("no request published any payload (and the case states no EXPECT)")
        return problems
    width = expect.get("decode_codes")
    for rid in request_ids:
        if width:
            codes = _decode_codes(result, rid)
            if not codes:
                problems.append(f"{rid}: no decode step")
            for k, c in enumerate(codes):
                if not (isinstance(c, list) and len(c) == 1 and len(c[0]) == width):
                    problems.append(
                        f"{rid}: decode step {k}: buffer codes {c!r}, expected one row of {width}"
                    )
                    break
        published = (
            set().union(*(p.keys() for p in _payloads(result, rid))) if _payloads(result, rid) else set()
        )
        missing = set(expect.get("payload_keys", ())) - published
        if missing:
            problems.append(f"{rid}: never published {sorted(missing)} (published {sorted(published)})")
    pair = expect.get("differ")
    if pair:
        a, b = pair
        if width:
            codes_a, codes_b = _decode_codes(result, a), _decode_codes(result, b)
            n = min(len(codes_a), len(codes_b))
            same = n == 0 or harness.same(codes_a[:n], codes_b[:n])
        else:
            outputs_a, outputs_b = _payloads(result, a), _payloads(result, b)
            same = not outputs_a or harness.same(outputs_a[-1], (outputs_b or [None])[-1])
        if same:
            problems.append(f"{a} and {b} produced the same outputs; they must differ")
    return problems


@pytest.mark.parametrize("case", CASES)
def test_oracle_ran(traces, case):
    """vllm-omni's runner ran the case cleanly and produced what the stage must."""
    result = _case(traces, "oracle", case)
    error = harness.describe_error(result)
    assert error is None, f"the oracle side failed on {case}:\n{error}"
    assert result["steps"], f"{case}: the oracle recorded no step"
    problems = expectation_problems(result)
    assert not problems, f"{case}: " + "; ".join(problems)


# ------------------------------------------------------------------------ the comparison


@pytest.mark.parametrize("case", CASES)
def test_omnigen_matches_oracle(traces, case):
    """omnigen's generated runner does what vllm-omni's runner does, step by step."""
    oracle = _case(traces, "oracle", case)
    omnigen = _case(traces, "omnigen", case)
    oracle_error = harness.describe_error(oracle)
    if oracle_error:
        pytest.fail(f"{case}: no reference, the oracle side failed (see test_oracle_ran):\n{oracle_error}")
    mismatch = harness.first_mismatch(oracle, omnigen)
    omnigen_error = harness.describe_error(omnigen)
    report = []
    if mismatch is not None:
        report.append(harness.format_mismatch(case, mismatch))
    if omnigen_error:
        report.append(f"omnigen side: {omnigen_error}")
    assert not report, "\n".join(report)
