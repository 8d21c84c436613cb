"""``benchmarks/host_cost.py wall``: thread CPU time of a decode step's ``_preprocess``, omnigen's
generated runner against vllm-omni 0.30's (the baseline), interleaved in one process.

Both runners are driven side by side in one process, interleaved (oracle, omnigen, oracle, ...),
through the same steady-state steps with the same dummy model (tests/oracle: both runners call
the same hooks with the same arguments). The steps run with the model's hooks and code predictor
unwrapped; their time is measured apart, by replaying the calls a run of the same steps recorded
(``HookRecorder``), and reported in its own columns; the runner's figure is the rest of
``_preprocess`` (vLLM's base ``_preprocess`` included, for both), per request per step.
Medians over repeats; the ratios are the result (the machine is shared).

Measures: this thread's CPU time in ``_preprocess`` per request per step, hooks timed apart.
Baseline: vllm-omni 0.30's runner on the same steps, interleaved in the same run (the ratio).
Takes: about 3 minutes with ``--short`` (B 1, 32, 256, 4 steps, 3 repeats: the figure
  scripts/test prints, never a gate), far longer for the full table (B in 1..256, both shapes,
  5 repeats, at least 4096 request-steps a figure: tens of minutes or more, not timed here).
Writes: the table to stdout; with ``--json PATH`` its rows to a data file.

    .venv/bin/python benchmarks/host_cost.py wall                 # the full table, B in 1..256
    .venv/bin/python benchmarks/host_cost.py wall --short         # the CI figure (scripts/test)
    .venv/bin/python benchmarks/host_cost.py wall --profile tts_mtp --batch 256   # cProfile, by function
    .venv/bin/python benchmarks/host_cost.py wall --clauses --batch 256 --repeats 5   # each contract mechanism's cost
    .venv/bin/python benchmarks/host_cost.py wall --ablate host_layout --batch 256    # omnigen without one mechanism
    .venv/bin/python benchmarks/host_cost.py wall --hook-timing-check --batch 256 --repeats 7   # replayed vs per-call hook timing
    .venv/bin/python benchmarks/host_cost.py wall --collections --batch 256   # garbage collections per runner

Cells (``CELLS``): batched decode + MTP (qwen3_tts, unseeded and every row seeded), plain
batched decode (the 3-tuple hook, on the Higgs talker as the differential tests run it),
per-row hooks + MTP (qwen3_omni talker) and the same with seeded rows (one predictor call per
seeded row). Each runs as all-decode steps and as a mixed step (every eighth row a prefill chunk
of ``PREFILL_CHUNK`` tokens, so decode runs are split and per-row hooks run among them).
Every repeat runs every batch size and runner (``measure_batches``: a block each, in a drawn
order; ``--cold-caches``: a step at a time). The marginal cost is the slope between the two
largest batches, in µs per added request: the median of each repeat's own slope.

``--ablate NAME`` runs omnigen without one contract mechanism (``_ablations()``), each switched
off by name: a runtime function replaced by a no-op, or for ``host_layout`` the merge's own switch
``omnigen.runtime.buffers.HOST_LAYOUT`` set to False (no source of the product is rewritten).
The steps and cells are also the other modes' (``floors``, ``instructions``): this module is
where they are built (``scenario``, ``_classes``, ``_prepare``, ``_drive``).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import gc
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from vllm.utils.gc_utils import freeze_gc_heap  # noqa: E402

from omnigen import api  # noqa: E402
from omnigen.runtime import buffers, vllm_api  # noqa: E402
from omnigen_testing.oracle import harness  # noqa: E402
from omnigen_testing.oracle.dummy_model import HIDDEN, NUM_CODES, DummyTalkerModel, make_model  # noqa: E402
from omnigen_testing.oracle.policy_map import policy_from_plan  # noqa: E402

HOOKS = ("preprocess", "preprocess_decode_batch", "preprocess_batch")
# This thread's CPU time: on a shared machine the wall clock also counts the time the process
# waits for a core; the work it does is what is compared (``--clock wall`` for the wall clock).
_clock = time.thread_time
INFERENCE_MODE = True
"""vLLM runs a step's ``_preprocess`` under ``torch.inference_mode()`` (``execute_model`` is
decorated with it), where a tensor skips its version counter and autograd bookkeeping: the
benchmarks run every step, floor and hook replay the same way (``step_mode``).
``--outside-inference-mode`` runs them outside it, as they ran before 2026-12-03."""


COLD_CACHES = False
"""``--cold-caches``: the runners take turns a step at a time, so a step finds the caches another
runner's step left (in vLLM the forward pass and the scheduler run between two steps of a
runner); by default each runner's steps of a repeat run in one block, each step in the caches
its own previous step left, as the issue's harness measured."""


def step_mode() -> torch.inference_mode:
    """The autograd mode of a measured step: vLLM's (``INFERENCE_MODE``)."""
    return torch.inference_mode(INFERENCE_MODE)


def set_step_mode(args: argparse.Namespace) -> None:
    """``--outside-inference-mode`` (every mode's, ``host_cost.common_arguments``)."""
    global INFERENCE_MODE
    INFERENCE_MODE = not args.outside_inference_mode


BATCHES = (1, 8, 32, 128, 256)
PREFILL_CHUNK = 8
"""Tokens of a prefill row per mixed step (a chunked prefill of a long prompt)."""
PREFILL_EVERY = 8
"""In a mixed step, rows ``PREFILL_EVERY - 1, 2 * PREFILL_EVERY - 1, ...`` are prefill chunks."""


@dataclass(frozen=True)
class Cell:
    label: str
    model: str
    stage: str
    overrides: tuple[str, ...] = ()
    seeded_share: float = 0.0
    """The share of rows whose request carries ``tts_local_seed`` (spread evenly over the batch)."""
    cudagraph: str = "none"


# No shipped stage of vllm-omni 0.30 batches plain decode rows: the 3-tuple path runs on the
# Higgs talker with the hook on, as tests/oracle/test_differential.py's "plain batch" cell does.
PLAIN_BATCH = (
    "model.stages.talker.preprocess.hook=true",
    "model.stages.talker.preprocess.decode_batch=plain",
    "model.stages.talker.buffers.refresh_every_step=true",
)
CELLS = {
    "tts_mtp": Cell("batched decode + MTP (qwen3_tts)", "qwen3_tts", "qwen3_tts"),
    "tts_mtp_seeded": Cell("same, every row seeded", "qwen3_tts", "qwen3_tts", seeded_share=1.0),
    "plain": Cell("plain batched decode (3-tuple)", "higgs_audio_v3", "talker", PLAIN_BATCH),
    "omni_talker": Cell("per-row hooks + MTP (qwen3_omni talker)", "qwen3_omni", "talker"),
    "omni_talker_seeded": Cell(
        "same, seeded: one predictor call per row", "qwen3_omni", "talker", seeded_share=1.0
    ),
}


class TrivialHooksModel(DummyTalkerModel):
    """The dummy model's flags (what the oracle probes) with hooks that cost next to nothing, so
    the runners' own work is what the benchmark sees: each hook hands back constant rows and one
    small update per row (``hidden_states.last``, as the Qwen3 talkers write), a decode row its
    MTP inputs; the predictor returns its input embeddings and constant codes.
    (``--hooks dummy`` uses the differential tests' model instead: the same figures for the
    runners, hooks about 50-150 µs a row.)"""

    def __init__(self, flags, *, seed: int = 0) -> None:
        super().__init__(flags, seed=seed)
        rows = 4096
        # Made in the step's autograd mode, as a forward's outputs are: inside vLLM's inference
        # mode the rows handed back are views of inference tensors, which carry no autograd view
        # record for a runner to free with the rows it stored the step before.
        with step_mode():
            self._embeds = torch.linspace(0, 1, rows * HIDDEN).reshape(rows, HIDDEN)
            self._hidden = torch.ones(rows, HIDDEN)
            self._codes = torch.zeros(rows, NUM_CODES, dtype=torch.int64)
        if self.flags.mtp:
            self.talker_mtp = self._predict

    def preprocess(self, input_ids, input_embeds=None, **req_infos):
        span = int(input_ids.shape[0])
        embeds = self._embeds[:span]
        update = {"hidden_states": {"last": embeds[-1:]}}
        if self.flags.mtp and span == 1 and not req_infos["_omni_is_prefill"]:
            update["mtp_inputs"] = (self._hidden[0], self._hidden[1])
        return input_ids, embeds, update

    def _updates(self, count: int) -> list:
        embeds = self._embeds
        return [{"hidden_states": {"last": embeds[row : row + 1]}} for row in range(count)]

    def _preprocess_decode_batch_mtp(self, input_ids, req_infos):
        n = len(req_infos)
        return input_ids.reshape(-1), self._embeds[:n], self._hidden[:n], self._hidden[:n], self._updates(n)

    def _preprocess_decode_batch_plain(self, input_ids, req_infos):
        n = len(req_infos)
        return input_ids.reshape(-1), self._embeds[:n], self._updates(n)

    def _preprocess_batch(self, req_ids, model_intermediate_buffer, device=None) -> None:
        return None

    def _predict(self, input_ids, inputs_embeds, last_talker_hidden, text_step, **kwargs):
        return inputs_embeds, self._codes[: int(input_ids.shape[0])]


class HookRecorder:
    """Keeps every call of a model's hooks and of its code predictor while ``recording``, so that
    their time is measured apart, by replaying them (``replay_seconds``), and the measured run
    calls them unwrapped.

    A clock read around each call inside the measured run charges the runner around it for the
    instrument: with ``time.thread_time`` (a system call) the per-row cells at B = 256 cost each
    runner 1-8 µs a request more than unwrapped, by amounts that differ between the runners and
    between runs (``--hook-timing-check``). A replay times the same calls, with the same
    arguments, in one clock reading."""

    def __init__(self, model, runner=None) -> None:
        self.model = model
        self.runner = runner
        self.calls: list[tuple[object, tuple, dict]] = []
        self.step_ends: list[int] = []
        """How many calls were recorded by the end of each measured step (``_drive`` marks them)."""

    def _wrap(self, fn):
        """``fn``, its calls recorded."""
        keep = self.calls.append

        def recorded(*args, **kwargs):
            keep((fn, args, kwargs))
            return fn(*args, **kwargs)

        return recorded

    def install(self) -> list[tuple[object, str, object]]:
        """Wrap the hooks (and the predictor, on the model and on a runner that took it when it
        was built, 2.1) to record their calls; returns what ``uninstall`` puts back."""
        saved = []
        for name in HOOKS:
            hook = getattr(self.model, name, None)
            if callable(hook):
                saved.append((self.model, name, self.model.__dict__.get(name, _ABSENT)))
                setattr(self.model, name, self._wrap(hook))
        predictor = getattr(self.model, "talker_mtp", None)
        if predictor is not None:
            wrapped = _WrappedPredictor(predictor, self._wrap(predictor))
            for owner in (self.model, self.runner):
                if owner is not None and hasattr(owner, "talker_mtp"):
                    saved.append((owner, "talker_mtp", owner.__dict__.get("talker_mtp", _ABSENT)))
                    owner.talker_mtp = wrapped
        return saved

    @staticmethod
    def uninstall(saved: list[tuple[object, str, object]]) -> None:
        for owner, name, value in reversed(saved):
            if value is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)

    @contextlib.contextmanager
    def recording(self):
        saved = self.install()
        try:
            yield self
        finally:
            self.uninstall(saved)

    def step_calls(self, step: int) -> list[tuple[object, tuple, dict]]:
        """The calls the ``step``-th measured step made."""
        return self.calls[self.step_ends[step - 1] if step else 0 : self.step_ends[step]]

    def replay_seconds(self, times: int = 1) -> float:
        """This thread's seconds to make every recorded call ``times`` over (the GC heap frozen,
        as in the measured run)."""
        calls = self.calls
        freeze_gc_heap()
        try:
            with step_mode():
                start = _clock()
                for _ in range(times):
                    for fn, args, kwargs in calls:
                        fn(*args, **kwargs)
                return _clock() - start
        finally:
            gc.unfreeze()


_ABSENT = object()


class _WrappedPredictor:
    """The code predictor called through ``call`` (its recording or timing wrapper); its
    attributes (the runner asks whether it is graph-wrapped) read through."""

    def __init__(self, inner, call) -> None:
        self._inner = inner
        self._call = call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class PerCallClock(HookRecorder):
    """Diagnostics (``--hook-timing-check``): the hooks timed as this benchmark timed them before
    it replayed them, a clock read around each call inside the measured run (``seconds``)."""

    def __init__(self, model, runner=None) -> None:
        super().__init__(model, runner)
        self.seconds = 0.0

    def _wrap(self, fn):
        """``fn``, its calls timed."""

        def timed(*args, **kwargs):
            start = _clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += _clock() - start

        return timed


def _seeded(row: int, share: float) -> bool:
    """Rows seeded evenly: row ``i`` is seeded when ``floor((i + 1) * share)`` steps up."""
    return int((row + 1) * share) > int(row * share)


def _is_prefill_row(row: int, mixed: bool) -> bool:
    return mixed and row % PREFILL_EVERY == PREFILL_EVERY - 1


def scenario(batch: int, steps: int, *, mixed: bool, seeded_share: float):
    """One prefill step for ``batch`` requests, then ``steps`` steps of single-token decodes
    (``mixed``: every ``PREFILL_EVERY``-th row a prefill chunk of a long prompt instead)."""
    short_prompt = (3, 1, 4, 1)
    long_prompt = tuple((5 * k) % 89 + 1 for k in range(PREFILL_CHUNK * (steps + 2)))
    requests = {}
    for i in range(batch):
        prompt = long_prompt if _is_prefill_row(i, mixed) else short_prompt
        seed = 1000 + i if _seeded(i, seeded_share) else None
        requests[f"r{i}"] = harness.RequestSpec(
            req_id=f"r{i}",
            prompt=prompt,
            outputs=tuple((7 * i + k) % 97 + 1 for k in range(steps + 2)),
            max_tokens=steps + 2,
            seed_kind="tts_local_seed" if seed is not None else "none",
            tts_seed=seed,
            plain_seed=None,
        )
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

    def first_row(i: int, rid: str) -> harness.Row:
        plen = len(requests[rid].prompt)
        span = PREFILL_CHUNK if _is_prefill_row(i, mixed) else plen
        return harness.Row(rid, 0, span, plen, 0, "prefill", True)

    plan = [step(0, [first_row(i, r) for i, r in enumerate(ids)], ids)]
    for k in range(steps):
        rows = []
        for i, rid in enumerate(ids):
            plen = len(requests[rid].prompt)
            if _is_prefill_row(i, mixed):
                rows.append(
                    harness.Row(rid, PREFILL_CHUNK * (k + 1), PREFILL_CHUNK, plen, 0, "prefill", False)
                )
            else:
                rows.append(harness.Row(rid, plen + k, 1, plen, k + 1, "decode1", False))
        plan.append(step(k + 1, rows, []))
    config = harness.ScenarioConfig(seed=0, payloads=False, local_payloads=False)
    return harness.Scenario(config, requests, plan), plan


@dataclass
class _Prepared:
    runner: object
    recorder: HookRecorder | None
    """Set (``wrap``): the model's hooks are wrapped by it (recorded, to be replayed)."""
    outputs: list
    state: object


def _prepare(
    cls, policy, extra, scen, plan, hooks: str = "trivial", *, wrap: type[HookRecorder] | None = None
) -> _Prepared:
    """A fresh runner after its prefill step, and the scheduler outputs of the measured steps.
    With ``wrap`` (``HookRecorder``), its hook calls in the measured steps are recorded."""
    model = make_model(policy.flags, seed=0) if hooks == "dummy" else TrivialHooksModel(policy.flags, seed=0)
    runner = harness.build_runner(cls, model, policy, extra_patch_modules=extra)
    state = harness.RunState(scen, policy)
    with step_mode():
        sched = harness._apply_step(runner, state, plan[0])
        runner._preprocess(sched, plan[0].num_input_tokens)
    outputs = [(s, scen.scheduler_output(s, state.sampling_params)) for s in plan[1:]]
    recorder = None
    if wrap is not None:
        recorder = wrap(model, runner)
        recorder.install()
    return _Prepared(runner, recorder, outputs, state)


def _drive(prep: _Prepared, profiler: cProfile.Profile | None = None) -> float:
    """Seconds in ``_preprocess`` over the prepared steps, hooks included (``profiler``: enabled
    around each ``_preprocess`` only)."""
    runner = prep.runner
    total = 0.0
    # vLLM's engine core and worker freeze the heap after warm-up (vllm.utils.gc_utils), so a
    # step's collections do not scan the static objects; serving is measured the same way.
    freeze_gc_heap()
    try:
        with step_mode():
            for s, sched in prep.outputs:
                harness._apply_step(runner, prep.state, s)
                if profiler is not None:
                    profiler.enable()
                start = _clock()
                runner._preprocess(sched, s.num_input_tokens)
                total += _clock() - start
                if profiler is not None:
                    profiler.disable()
                if prep.recorder is not None:
                    prep.recorder.step_ends.append(len(prep.recorder.calls))
    finally:
        gc.unfreeze()
    return total


@dataclass
class _Lane:
    """One runner's measured steps in an interleaved run: its steps, the recorded hook calls of
    the same steps (replayed right after each step, to time them), and the mechanisms it runs
    without (``ablate``)."""

    prep: _Prepared
    recorded: HookRecorder
    ablation: tuple[str, ...] = ()

    @property
    def steps(self) -> int:
        return len(self.prep.outputs)

    def run_step(self, k: int) -> tuple[float, float]:
        """Step ``k``: seconds in ``_preprocess`` less its hooks' replay, seconds in the replay."""
        s, sched = self.prep.outputs[k]
        runner = self.prep.runner
        harness._apply_step(runner, self.prep.state, s)
        saved = ablate(list(self.ablation))
        try:
            start = _clock()
            runner._preprocess(sched, s.num_input_tokens)
            spent = _clock() - start
        finally:
            restore(saved)
        calls = self.recorded.step_calls(k)
        start = _clock()
        for fn, args, kwargs in calls:
            fn(*args, **kwargs)
        inside = _clock() - start
        return spent - inside, inside


def _drive_interleaved(lanes: Sequence[_Lane]) -> list[tuple[float, float]]:
    """Each lane's seconds in ``_preprocess`` (hooks excluded) and in the model's hooks over its
    steps, every lane in every call, in an order drawn anew each time (seeded: a rerun takes the
    same turns): each lane's steps in one block, or with ``COLD_CACHES`` a step at a time, step k
    of every lane before step k + 1. A shared machine's speed changes within seconds (seen here:
    1.1 against 2.2 µs a request for the same loop a few seconds apart), so figures that are
    compared, two runners' or two batch sizes', are measured within a repeat, seconds (blocks) or
    milliseconds (steps) apart, not minutes.

    A step runs in the caches the step before it left. In blocks that is its own previous step
    (warm, as the issue's harness measured); a step at a time, another lane's, so that in vLLM's
    terms the forward pass and the scheduler ran between two steps of a runner (cold). The order
    is drawn so that no lane always follows the same one: one that did would pay for that lane's
    footprint every time (0.5 µs a request at B = 256 measured for omnigen after vllm-omni's
    step, against after its own)."""
    totals = [0.0] * len(lanes)
    hooks = [0.0] * len(lanes)
    turns = random.Random(0)
    if COLD_CACHES:
        order = [
            (i, k)
            for k in range(max(lane.steps for lane in lanes))
            for i in turns.sample(range(len(lanes)), len(lanes))
            if k < lanes[i].steps
        ]
    else:
        order = [(i, k) for i in turns.sample(range(len(lanes)), len(lanes)) for k in range(lanes[i].steps)]
    freeze_gc_heap()
    try:
        with step_mode():
            for i, k in order:
                own, inside = lanes[i].run_step(k)
                totals[i] += own
                hooks[i] += inside
    finally:
        gc.unfreeze()
    return list(zip(totals, hooks, strict=True))


def _recorded_hooks(cls, policy, extra, scen, plan, hooks: str) -> HookRecorder:
    """The hook calls a runner makes in the measured steps, recorded on a run of its own."""
    prep = _prepare(cls, policy, extra, scen, plan, hooks, wrap=HookRecorder)
    _drive(prep)
    assert prep.recorder is not None
    return prep.recorder


class _NoJournal:
    """``--ablate journal``: a step journal that keeps nothing (what the all-or-nothing clause
    costs), only each row's request and buffer, which the step takes from it."""

    def __init__(self, runner, req_ids, *inputs) -> None:
        self.buffers = list(map(runner.model_intermediate_buffer.get, req_ids))
        self.all_found = None not in self.buffers
        self.requests = list(map(runner.requests.get, req_ids))

    def undo(self) -> None:
        pass


def _unchecked(_ids: object, out: object, *args: object, **kwargs: object) -> object:
    return out


NOT_CLAUSES = ("collector_hold",)
"""Entries of ``_ablations()`` that switch off an optimization, not a clause: ``all`` keeps them."""


def _ablations() -> dict[str, tuple[str, list[tuple[object, str, object]]]]:
    """Each contract mechanism the hot path pays for: ``name -> (the clause, the replacements that
    switch it off)``. Diagnostics only: without one the runner is no longer the contract's."""
    from omnigen.runtime import base, mtp, phases

    return {
        "journal": ("issue 9: a failed step is undone (StepJournal)", [(phases, "StepJournal", _NoJournal)]),
        "checks": (
            # A talker-MTP decode row's result is checked in the generated row loop itself: that
            # check stays (nothing to replace).
            "3.5: every hook result checked before a write (but a talker-MTP decode row's)",
            [(phases, "row_output", _unchecked), (phases, "batch_output", _unchecked)],
        ),
        # buffers.HOST_LAYOUT, the merge's own switch for this measurement (read once a merge call).
        "host_layout": (
            "4.1 as vllm-omni keeps it: a stored host tensor detached and contiguous (two reads of each)",
            [(buffers, "HOST_LAYOUT", False)],
        ),
        "merges": (
            "4.1: each row's update merged into its buffer (and its owned copies)",
            [(buffers, "merge_updates", lambda *a: None), (base.OmniRunnerBase, "_update_intermediate_buffer", lambda self, req_id, update: None)],
        ),
        "owned_copies": (
            "4.1 / buffers.gpu_resident: an owned device copy of each GPU-resident update",
            [(buffers, "owned_copies", list), (buffers, "keep_on_device", lambda value: value)],
        ),
        "code_rows": (
            "2.3: each MTP row's codes stored in its buffer (a row view each)",
            [(mtp, "store_code_rows", lambda *a: None), (mtp, "row_views", lambda tensor: ())],
        ),
        "generators": ("2.3: each MTP row's seeded generator looked up (seeded rows: and the one-call-per-row fallback)", [(mtp, "row_generators", lambda cache, requests, req_ids, device: [None] * len(req_ids))]),
        # Not a clause: what holding the collector off for the step saves (a negative cost).
        "collector_hold": ("not a clause: the garbage collector held off for the step (gc.disable a no-op)", [(gc, "disable", lambda: None)]),
    }  # fmt: skip


def ablate(names: list[str]) -> list[tuple[object, str, object]]:
    """Switch off each named mechanism of ``_ablations()``; returns what to ``restore``."""
    if not names:
        # Nothing to switch off: a measured runner's every step asks (``_Lane.run_step``).
        return []
    table = _ablations()
    saved = []
    for name in names:
        if name not in table:
            raise ValueError(f"--ablate {name}: expected one of {', '.join(table)}")
        for owner, attr, replacement in table[name][1]:
            saved.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, replacement)
    return saved


def restore(saved: list[tuple[object, str, object]]) -> None:
    for owner, attr, original in reversed(saved):
        setattr(owner, attr, original)


def clause_costs(cells: list[str], batch: int, steps: int, repeats: int, min_rows: int) -> None:
    """What each mechanism of ``_ablations()`` costs omnigen per request at ``batch`` (decode): in
    every repeat the oracle, omnigen as generated and omnigen without each mechanism in turn run
    interleaved; costs = as generated - without (medians), also as a share of vllm-omni's time."""
    names = [*_ablations(), "all"]
    print(
        f"{'cell':42} {'without':15} {'omnigen':>8} {'ratio':>6} {'costs':>7} {'of oracle':>9}   "
        f"µs/request/step at B={batch}, decode",
        flush=True,
    )
    for key in cells:
        cell = CELLS[key]
        r = measure(cell, batch, steps_for(batch, steps, min_rows), repeats, without=tuple(names))
        oracle = r["oracle_us"]
        print(
            f"{cell.label:42} {'(nothing)':15} {r['omnigen_us']:>8.2f} {r['ratio']:>6.3f}   (vllm-omni {oracle:.2f})"
        )
        for name in names:
            us = r[f"without_{name}_us"]
            cost = r["omnigen_us"] - us
            print(
                f"{cell.label:42} {name:15} {us:>8.2f} {us / oracle:>6.3f} {cost:>7.2f} {cost / oracle:>9.3f}",
                flush=True,
            )
    for name, (clause, _) in _ablations().items():
        print(f"  {name:15} {clause}")
    print(
        f"  {'all':15} every clause's mechanism above at once (not {', '.join(NOT_CLAUSES)}): "
        "what omnigen costs without the contract's bookkeeping"
    )


@functools.cache
def _classes(cell: Cell):
    plan = api.stage_plan(cell.model, cell.stage, list(cell.overrides))
    policy = policy_from_plan(plan, cudagraph=cell.cudagraph)
    ours = api.runner_class(cell.model, cell.stage, list(cell.overrides))
    return policy, ours, harness.oracle_runner_class(), (sys.modules[ours.__module__], vllm_api)


def _room(batch: int, mixed: bool) -> None:
    """Make the fake input batch and the persistent token buffers big enough for the step."""
    harness.MAX_NUM_REQS = max(harness.MAX_NUM_REQS, batch)
    tokens = batch * (PREFILL_CHUNK if mixed else 1) + 8 * batch
    harness.MAX_NUM_TOKENS = max(harness.MAX_NUM_TOKENS, tokens)


def measure(
    cell: Cell,
    batch: int,
    steps: int,
    repeats: int,
    *,
    mixed: bool = False,
    hooks: str = "trivial",
    without: tuple[str, ...] = (),
) -> dict[str, float]:
    """µs per request per step for both runners at one ``batch``: ``measure_batches`` of one."""
    return measure_batches(
        cell, [batch], lambda _: steps, repeats, mixed=mixed, hooks=hooks, without=without
    )[batch]


def measure_batches(
    cell: Cell,
    batches: list[int],
    steps_of: Callable[[int], int],
    repeats: int,
    *,
    mixed: bool = False,
    hooks: str = "trivial",
    without: tuple[str, ...] = (),
) -> dict[int, dict[str, float]]:
    """µs per request per step for both runners at each of ``batches`` (``steps_of(batch)`` steps
    each): runner-only (hooks excluded) and hooks, medians over ``repeats``.

    Every repeat runs every batch size with every runner (``_drive_interleaved``: a block each, or
    a step at a time with ``COLD_CACHES``), so a change in the shared machine's speed moves all of
    a repeat's figures together. With two batch sizes or more, the largest's figures also hold the
    marginal cost (``NAME_marginal_us``): the median of each repeat's own slope between the two
    largest batches, not the slope between two medians.

    ``without``: mechanisms of ``_ablations()`` (or ``"all"``: every one of them at once); omnigen
    also runs without each of them in turn, interleaved with the two runners in every repeat
    (``without_NAME_us``)."""
    for batch in batches:
        _room(batch, mixed)
    policy, ours, oracle, extra = _classes(cell)
    sides = [("oracle", oracle, ()), ("omnigen", ours, ())]
    every = tuple(name for name in _ablations() if name not in NOT_CLAUSES)
    sides += [(f"without_{name}", ours, every if name == "all" else (name,)) for name in without]
    scenarios = {
        batch: scenario(batch, steps_of(batch), mixed=mixed, seeded_share=cell.seeded_share)
        for batch in batches
    }
    names = [name for name, _, _ in sides]
    samples: dict[tuple[int, str], list[tuple[float, float]]] = {
        (batch, name): [] for batch in batches for name in names
    }
    with harness.harness_patches(extra):
        # Each runner's hook calls, recorded once; in every repeat the steps run unwrapped and the
        # recorded calls are replayed (an ablated omnigen makes omnigen's calls).
        recorded = {
            (batch, name): _recorded_hooks(cls, policy, extra, *scenarios[batch], hooks)
            for batch in batches
            for name, cls, _ in sides[:2]
        }
        for _ in range(repeats):
            lanes: dict[tuple[int, str], _Lane] = {}
            for batch in batches:
                for name, cls, ablation in sides:
                    prep = _prepare(cls, policy, extra, *scenarios[batch], hooks)
                    runner = "oracle" if name == "oracle" else "omnigen"
                    lanes[batch, name] = _Lane(prep, recorded[batch, runner], ablation)
            figures = _drive_interleaved(list(lanes.values()))
            for (batch, name), (runner_s, hooks_s) in zip(lanes, figures, strict=True):
                per = 1e6 / (steps_of(batch) * batch)
                samples[batch, name].append((runner_s * per, hooks_s * per))
    results: dict[int, dict[str, float]] = {}
    for batch in batches:
        result = results[batch] = {}
        for name in names:
            values = samples[batch, name]
            result[f"{name}_us"] = statistics.median(v[0] for v in values)
            result[f"{name}_hook_us"] = statistics.median(v[1] for v in values)
        result["ratio"] = result["omnigen_us"] / result["oracle_us"]
    if len(batches) >= 2:
        lo, hi = sorted(batches)[-2:]
        for name in names:
            slopes = [
                (high[0] * hi - low[0] * lo) / (hi - lo)
                for low, high in zip(samples[lo, name], samples[hi, name], strict=True)
            ]
            results[hi][f"{name}_marginal_us"] = statistics.median(slopes)
    return results


def hook_timing_check(cells: list[str], batch: int, steps: int, repeats: int, min_rows: int) -> None:
    """Diagnostics: each runner's figure with its hooks timed as ``measure`` times them (the steps
    unwrapped, the recorded calls replayed) and with a clock read around each call inside the
    measured steps (``PerCallClock``, as before), and unwrapped steps' totals, hooks included;
    all interleaved in every repeat, medians. Shows what the per-call clock adds to each runner."""
    print(
        f"{'cell':42} {'runner':9} {'unwrapped':>9} {'replay':>7} {'figure':>7} "
        f"{'per-call':>8} {'inside':>7} {'figure':>7}   µs/request/step at B={batch}, decode",
        flush=True,
    )
    for key in cells:
        cell = CELLS[key]
        cell_steps = steps_for(batch, steps, min_rows)
        _room(batch, False)
        policy, ours, oracle, extra = _classes(cell)
        scen, plan = scenario(batch, cell_steps, mixed=False, seeded_share=cell.seeded_share)
        per = 1e6 / (cell_steps * batch)
        found: dict[str, list[tuple[float, float, float, float]]] = {"vllm-omni": [], "omnigen": []}
        with harness.harness_patches(extra):
            runners = {"vllm-omni": oracle, "omnigen": ours}
            recorded = {
                name: _recorded_hooks(cls, policy, extra, scen, plan, "trivial")
                for name, cls in runners.items()
            }
            for _ in range(repeats):
                for name, cls in runners.items():
                    total = _drive(_prepare(cls, policy, extra, scen, plan))
                    replay = recorded[name].replay_seconds()
                    prep = _prepare(cls, policy, extra, scen, plan, wrap=PerCallClock)
                    wrapped = _drive(prep)
                    found[name].append(
                        (total * per, replay * per, wrapped * per, prep.recorder.seconds * per)
                    )
        figures = {}
        for name, samples in found.items():
            total, replay, wrapped, inside = (statistics.median(s[i] for s in samples) for i in range(4))
            figures[name] = (total - replay, wrapped - inside)
            print(
                f"{cell.label:42} {name:9} {total:>9.2f} {replay:>7.2f} {total - replay:>7.2f} "
                f"{wrapped:>8.2f} {inside:>7.2f} {wrapped - inside:>7.2f}",
                flush=True,
            )
        (ours_replay, ours_per_call), (theirs_replay, theirs_per_call) = (
            figures["omnigen"],
            figures["vllm-omni"],
        )
        print(
            f"{'':42} ratio: {ours_replay / theirs_replay:.3f} hooks replayed, "
            f"{ours_per_call / theirs_per_call:.3f} hooks timed per call",
            flush=True,
        )


def collections(cells: list[str], batch: int, steps: int) -> None:
    """Diagnostics: the garbage collections (young, middle, old generation) each runner's steps
    set off, counted over the steps and the harness's work between them (so a collection a step
    only put off is counted too), the GC heap frozen first as measured."""
    print(f"{'cell':42} {'runner':9} collections over {steps} steps of B={batch} (gen 0, 1, 2)", flush=True)
    for key in cells:
        cell = CELLS[key]
        _room(batch, False)
        policy, ours, oracle, extra = _classes(cell)
        scen, plan = scenario(batch, steps, mixed=False, seeded_share=cell.seeded_share)
        with harness.harness_patches(extra):
            for name, cls in (("vllm-omni", oracle), ("omnigen", ours)):
                prep = _prepare(cls, policy, extra, scen, plan)
                counts = [0, 0, 0]

                def count(phase: str, info: dict, counts: list[int] = counts) -> None:
                    if phase == "start":
                        counts[info["generation"]] += 1

                gc.callbacks.append(count)
                try:
                    _drive(prep)
                finally:
                    gc.callbacks.remove(count)
                # _drive's freeze_gc_heap collects each generation once before the steps.
                print(f"{cell.label:42} {name:9} {tuple(n - 1 for n in counts)}", flush=True)


def profile(
    cell: Cell,
    batch: int,
    steps: int,
    *,
    runner: str,
    mixed: bool = False,
    top: int = 25,
    hooks: str = "trivial",
) -> str:
    """cProfile of ``steps`` steps of one runner, by function (tottime), as text."""
    _room(batch, mixed)
    policy, ours, oracle, extra = _classes(cell)
    scen, plan = scenario(batch, steps, mixed=mixed, seeded_share=cell.seeded_share)
    cls = ours if runner == "omnigen" else oracle
    with harness.harness_patches(extra):
        prep = _prepare(cls, policy, extra, scen, plan, hooks)
        profiler = cProfile.Profile()
        _drive(prep, profiler)
    import io

    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs().sort_stats("tottime")
    stats.print_stats(top)
    return text.getvalue()


def steps_for(batch: int, steps: int, min_rows: int) -> int:
    """At least ``steps`` steps and ``min_rows`` request-steps: a small batch gets more steps, so
    every figure is a total over enough work to stand above the clock and warm-up effects."""
    return max(steps, -(-min_rows // batch))


def table(
    cells: list[str],
    batches: list[int],
    steps: int,
    repeats: int,
    shapes: list[str],
    hooks: str = "trivial",
    min_rows: int = 0,
) -> list[dict]:
    rows = []
    header = (
        f"{'cell':42} {'shape':6} {'B':>4} {'oracle':>8} {'omnigen':>8} {'ratio':>6}"
        f" {'hooks(o)':>9} {'hooks(g)':>9}   µs/request/step; hooks timed apart"
    )
    print(header, flush=True)
    for key in cells:
        cell = CELLS[key]
        for shape in shapes:
            found = measure_batches(
                cell,
                batches,
                lambda batch: steps_for(batch, steps, min_rows),
                repeats,
                mixed=shape == "mixed",
                hooks=hooks,
            )
            for batch, r in found.items():
                rows.append({"cell": key, "shape": shape, "batch": batch, **r})
                print(
                    f"{cell.label:42} {shape:6} {batch:>4} {r['oracle_us']:>8.2f} {r['omnigen_us']:>8.2f}"
                    f" {r['ratio']:>6.3f} {r['oracle_hook_us']:>9.2f} {r['omnigen_hook_us']:>9.2f}",
                    flush=True,
                )
            if len(found) >= 2:
                lo, hi = sorted(found)[-2:]
                print(
                    f"{'':42} {'':6} marginal µs/request B {lo}->{hi} (median of paired slopes): oracle "
                    f"{found[hi]['oracle_marginal_us']:.2f}, omnigen {found[hi]['omnigen_marginal_us']:.2f}",
                    flush=True,
                )
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``host_cost.py wall``'s own switches (``--cells``, ``--batch``, ``--steps``, ``--json`` and
    ``--outside-inference-mode`` are every mode's: ``host_cost.common_arguments``)."""
    parser.set_defaults(cells=list(CELLS), batch=list(BATCHES), steps=40)
    parser.add_argument("--min-rows", type=int, default=4096, help="request-steps per figure, at least")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", default=["decode", "mixed"], choices=["decode", "mixed"])
    parser.add_argument(
        "--short", action="store_true", help="the CI figure: B 1, 32, 256, few steps; reports, never gates"
    )
    parser.add_argument("--profile", choices=list(CELLS), help="profile one cell at the first --batch")
    parser.add_argument("--runner", choices=["omnigen", "oracle"], default="omnigen")
    parser.add_argument("--hooks", choices=["trivial", "dummy"], default="trivial")
    parser.add_argument("--clock", choices=["thread", "wall"], default="thread")
    parser.add_argument(
        "--cold-caches", action="store_true",
        help="the runners take turns a step at a time (each step in another runner's caches), not a block each",
    )  # fmt: skip
    parser.add_argument(
        "--ablate", nargs="+", default=[], choices=list(_ablations()),
        help="diagnostics: omnigen without one contract mechanism, to measure what it costs",
    )  # fmt: skip
    parser.add_argument(
        "--clauses", action="store_true",
        help="what each contract mechanism costs: the cells at the first --batch without each in turn",
    )  # fmt: skip
    parser.add_argument(
        "--hook-timing-check", action="store_true",
        help="diagnostics: the cells at the first --batch with hooks replayed (as measured) and timed per call (as before)",
    )  # fmt: skip
    parser.add_argument(
        "--collections", action="store_true",
        help="diagnostics: the garbage collections each runner's steps set off, at the first --batch",
    )  # fmt: skip


def run(args: argparse.Namespace) -> list[dict] | None:
    """``host_cost.py wall``: the table's rows (None for the diagnostics, which only print)."""
    global COLD_CACHES, _clock
    COLD_CACHES = args.cold_caches
    ablate(args.ablate)
    if args.collections:
        collections(args.cells, args.batch[0], args.steps)
        return None
    if args.hook_timing_check:
        hook_timing_check(args.cells, args.batch[0], args.steps, args.repeats, args.min_rows)
        return None
    if args.clauses:
        clause_costs(args.cells, args.batch[0], args.steps, args.repeats, args.min_rows)
        return None
    _clock = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.profile:
        print(profile(CELLS[args.profile], args.batch[0], args.steps, runner=args.runner, hooks=args.hooks))
        return None
    if args.short:
        args.batch = [b for b in args.batch if b in (1, 32, 256)] or args.batch
        args.steps, args.repeats, args.min_rows = 4, 3, 256
    return table(args.cells, args.batch, args.steps, args.repeats, args.shapes, args.hooks, args.min_rows)
