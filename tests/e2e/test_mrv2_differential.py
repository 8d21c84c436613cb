"""Model Runner V2 against V1, end to end: the same scheduled steps, the same results.

Each side runs vLLM's real engine (``tests/e2e/mrv2_side.py``, one process per side) on omnigen's
tiny models: the talker of ``omnigen_tiny`` in three hook flavours (batched decode feeding the
code predictor, per-row hooks with per-row generators, plain batched decode without MTP), its
code2wav (a generation stage) on the talker's own codes, and the thinker of
``omnigen_tiny_omni``. The ``v1`` side builds the generated V1 runner (``<stage>.py``), the ``v2``
side the generated V2 target (``<stage>_v2.py``) on vLLM's Model Runner V2, through the same
generated worker (``vllm_api.runner_target`` picks; the sides differ in
``VLLM_USE_V2_MODEL_RUNNER`` only). On this CPU the V2 side runs vLLM's V2 runner with its Triton
kernels simulated (``omnigen_testing.mrv2_cpu``: exactly the kernels listed in its
``SIMULATED``; any other one a step reached would fail the side, naming it).

For every step both sides ran, and for every request in it: the payload it published (8.1), the
codes and keys in its buffer, the runner keys (3.1) and the hook calls its buffer counts are
equal; then each request's tokens and the payload its scheduler handed over
(``kv_transfer_params["omnigen"]``). Requests are compared by id (V2 orders a step's rows
decodes first), never by position in a step.

Needs a vLLM whose V2 runner has every seam the target uses (``vllm_api.V2_SEAMS``): vLLM 0.32
here. On 0.30 the test skips, naming the seams that vLLM lacks (its V2 runner predates
``ModelState.capture_inner_cudagraphs``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import mrv2_side

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]


def _missing_seams() -> tuple[str, ...]:
    from omnigen.runtime import vllm_api

    return vllm_api.v2_missing_seams()


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    missing = _missing_seams()
    if missing:
        pytest.skip(f"this vLLM's Model Runner V2 lacks seams the V2 target uses: {', '.join(missing)}")
    work = tmp_path_factory.mktemp("mrv2")
    found = {}
    for side in mrv2_side.SIDES:
        out = work / f"{side}.json"
        env = {**os.environ, **mrv2_side.environment(side)}
        proc = subprocess.run(
            [sys.executable, "-c", "import tests.e2e.mrv2_side as side; side.main()", side, str(out)],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=1500,
            check=False,
        )
        assert out.exists(), f"{side} side wrote no trace:\n{proc.stderr[-4000:]}"
        trace = json.loads(out.read_text())
        assert proc.returncode == 0 and "error" not in trace, f"{side} side failed:\n{trace.get('error')}"
        found[side] = trace
    return found


CASES = [case for case, *_ in mrv2_side.CASES]


def _equal(a: Any, b: Any, where: str) -> None:
    """Exact for integers, tokens and keys; floats within 1e-5 (the same kernels on both sides)."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert sorted(a) == sorted(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            _equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{where}: {len(a)} entries != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_each_side_ran_its_target(traces):
    """The v1 side built the V1 runner, the v2 side the V2 target with its model state, and V2's
    simulated kernels ran (the steps went through vLLM's V2 runner, not around it)."""
    for case in CASES:
        v1, v2 = traces["v1"]["cases"][case]["engine"], traces["v2"]["cases"][case]["engine"]
        assert v1["target"] == "v1" and v2["target"] == "v2", (case, v1["reason"], v2["reason"])
        assert "RunnerV2" not in v1["runner"], v1
        assert "RunnerV2" in v2["runner"] and v2["state"].endswith("ModelState"), v2
        assert v1["record_errors"] == [] and v2["record_errors"] == [], case
    launches = traces["v2"]["kernel_launches"]
    for kernel in (
        "_prepare_pos_seq_lens_kernel",
        "_post_update_kernel",
        "_gumbel_sample_kernel",
        "_apply_write_kernel",
    ):
        assert launches[kernel] > 0, (kernel, launches)
    assert traces["v1"].get("kernel_launches") == {}


@pytest.mark.parametrize("case", CASES)
def test_every_step_publishes_and_buffers_the_same(traces, case):
    steps_v1 = traces["v1"]["cases"][case]["steps"]
    steps_v2 = traces["v2"]["cases"][case]["steps"]
    assert len(steps_v1) == len(steps_v2) > 1, case
    published = 0
    for index, (a, b) in enumerate(zip(steps_v1, steps_v2, strict=True)):
        _equal(a["buffers"], b["buffers"], f"{case} step {index} buffers")
        _equal(a["published"], b["published"], f"{case} step {index} published")
        assert a["pending"] == b["pending"], (case, index)
        published += sum(1 for rows in a["published"].values() if rows)
    assert published > 0, f"{case}: no step published anything (the comparison would prove nothing)"


@pytest.mark.parametrize("case", CASES)
def test_every_request_gets_the_same_tokens_and_payload(traces, case):
    a = traces["v1"]["cases"][case]["requests"]
    b = traces["v2"]["cases"][case]["requests"]
    _equal(a, b, f"{case} requests")
    assert all(r["tokens"] for r in a.values()), case
    if case != "thinker":
        assert all(r["payload"] for r in a.values()), f"{case}: a request finished without a payload"


def test_state_is_released_on_both_sides(traces):
    """CONTRACT 6: once every request finished, neither target holds anything of one."""
    for side in mrv2_side.SIDES:
        for case in CASES:
            left = traces[side]["cases"][case]["engine"]["left"]
            assert all(not ids for ids in left.values()), (side, case, left)


def test_the_compared_values_differ_between_requests(traces):
    """A negative control: what is compared is not trivially equal (each request's codes, and the
    thinker's tokens against the talker's, differ)."""
    cases = traces["v1"]["cases"]
    for case in ("talker.mtp_batched", "talker.mtp_per_row", "code2wav"):
        payloads = {json.dumps(r["payload"], sort_keys=True) for r in cases[case]["requests"].values()}
        assert len(payloads) == len(cases[case]["requests"]), case
    assert (
        cases["thinker"]["requests"]["0"]["tokens"] != cases["talker.mtp_batched"]["requests"]["0"]["tokens"]
    )
