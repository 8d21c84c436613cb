"""Host overhead of a decode step's ``_preprocess``: omnigen's generated runner vs vllm-omni 0.30's.

Both runners are driven side by side in one process, interleaved, through the same
steady-state decode steps (every row a single-token decode, the shape of a serving step),
with the same dummy model (tests/oracle: its hooks are cheap and identical for both). The
time spent inside the model's hooks is measured and subtracted, so the figure is the
runner's own bookkeeping per request per step. Reported as ratios: the machines are shared.

    .venv/bin/python benchmarks/host_overhead.py [--batch 8 32 64] [--steps 200] [--repeats 5]

Cells: qwen3_tts (batched decode hook feeding the MTP, the 5-tuple) and qwen3_omni talker
(per-row hooks, MTP), each with unseeded rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from omnigen import api  # noqa: E402
from omnigen.runtime import vllm_api  # noqa: E402
from tests.oracle import harness  # noqa: E402
from tests.oracle.dummy_model import make_model  # noqa: E402
from tests.oracle.policy_map import policy_from_plan  # noqa: E402

CELLS = {
    "qwen3_tts (batched decode + MTP)": ("qwen3_tts", "qwen3_tts"),
    "qwen3_omni talker (per-row hooks + MTP)": ("qwen3_omni", "talker"),
}
HOOKS = ("preprocess", "preprocess_decode_batch", "preprocess_batch")


class _HookClock:
    """Wraps the model's hooks and the predictor call to total the time spent inside them."""

    def __init__(self, model) -> None:
        self.seconds = 0.0
        for name in HOOKS:
            hook = getattr(model, name, None)
            if callable(hook):
                setattr(model, name, self._timed(hook))
        if getattr(model, "talker_mtp", None) is not None:
            model.talker_mtp = _TimedCallable(model.talker_mtp, self)

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return wrapper


class _TimedCallable:
    def __init__(self, inner, clock: _HookClock) -> None:
        self._inner = inner
        self._clock = clock

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self._clock.seconds += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _decode_steps(batch: int, steps: int) -> tuple[harness.Scenario, list[harness.Step]]:
    """One prefill step for ``batch`` requests, then ``steps`` single-token decode steps."""
    prompt = (3, 1, 4, 1)
    requests = {
        f"r{i}": harness.RequestSpec(
            req_id=f"r{i}",
            prompt=prompt,
            outputs=tuple((7 * i + k) % 97 + 1 for k in range(steps + 2)),
            max_tokens=steps + 2,
            seed_kind="none",
            tts_seed=None,
            plain_seed=None,
        )
        for i in range(batch)
    }
    ids = list(requests)

    def step(index: int, rows: list[harness.Row], new: list[str]) -> harness.Step:
        return harness.Step(
            index=index,
            rows=rows,
            new_req_ids=new,
            resumed_req_ids=set(),
            finished_req_ids=set(),
            num_input_tokens=sum(r.span for r in rows),
            order_mode="adjacent",
            new_payloads={},
            cached_payloads=None,
            local_payloads={},
            pending_broadcast=set(),
            forward_kind="tensor",
        )

    plan = [step(0, [harness.Row(r, 0, len(prompt), len(prompt), 0, "prefill", True) for r in ids], ids)]
    for k in range(steps):
        computed = len(prompt) + k
        plan.append(
            step(k + 1, [harness.Row(r, computed, 1, len(prompt), k + 1, "decode1", False) for r in ids], [])
        )
    config = harness.ScenarioConfig(seed=0, payloads=False, local_payloads=False)
    return harness.Scenario(config, requests, plan), plan


def _runner(cls, policy, extra_modules):
    model = make_model(policy.flags, seed=0)
    clock = _HookClock(model)
    runner = harness.build_runner(cls, model, policy, extra_patch_modules=extra_modules)
    return runner, clock


def measure(model_name: str, stage: str, batch: int, steps: int, repeats: int) -> dict[str, float]:
    harness.MAX_NUM_REQS = max(harness.MAX_NUM_REQS, batch)  # room for the batch in the fake input batch
    plan = api.stage_plan(model_name, stage)
    policy = policy_from_plan(plan)
    ours = api.runner_class(model_name, stage)
    oracle = harness.oracle_runner_class()
    extra = (sys.modules[ours.__module__], vllm_api)
    scenario, steps_plan = _decode_steps(batch, steps)
    per_request = {"omnigen": [], "oracle": []}
    with harness.harness_patches(extra):
        for _ in range(repeats):
            for name, cls in (("oracle", oracle), ("omnigen", ours)):
                runner, clock = _runner(cls, policy, extra)
                state = harness.RunState(scenario, policy)
                harness._apply_step(runner, state, steps_plan[0])
                first = steps_plan[0]
                runner._preprocess(
                    scenario.scheduler_output(first, state.sampling_params), first.num_input_tokens
                )
                outputs = [(s, scenario.scheduler_output(s, state.sampling_params)) for s in steps_plan[1:]]
                clock.seconds = 0.0
                total = 0.0
                for s, sched in outputs:
                    harness._apply_step(runner, state, s)
                    start = time.perf_counter()
                    runner._preprocess(sched, s.num_input_tokens)
                    total += time.perf_counter() - start
                per_request[name].append((total - clock.seconds) / (steps * batch) * 1e6)
    oracle_us = statistics.median(per_request["oracle"])
    ours_us = statistics.median(per_request["omnigen"])
    return {"oracle_us": oracle_us, "omnigen_us": ours_us, "ratio": ours_us / oracle_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'cell':44} {'B':>3} {'oracle µs/req':>14} {'omnigen µs/req':>15} {'omnigen/oracle':>15}")
    for label, (model_name, stage) in CELLS.items():
        for batch in args.batch:
            r = measure(model_name, stage, batch, args.steps, args.repeats)
            print(
                f"{label:44} {batch:>3} {r['oracle_us']:>14.1f} {r['omnigen_us']:>15.1f} {r['ratio']:>15.2f}"
            )


if __name__ == "__main__":
    main()
