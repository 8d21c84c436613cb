"""Model Runner V2 against V1: host cost per step of the hooks' path, and the generated code's size.

Measures: host cost per step of the hooks' path on Model Runner V2 against V1, and the
  generated code's size (vLLM 0.32: ``.venv-0.32/bin/python``).
Baseline: the V1 runner of the same stage, interleaved in the same process.
Takes: a few minutes with the defaults, about a minute with ``--short``, seconds with ``--sizes-only``.
Writes: ``benchmarks/results/mrv2.json`` (``--out``), and prints the tables.

    .venv/bin/python benchmarks/mrv2.py                  # both, written to benchmarks/results/mrv2.json
    .venv/bin/python benchmarks/mrv2.py --short          # fewer batches and repeats (a check it runs)
    .venv/bin/python benchmarks/mrv2.py --sizes-only     # the size table only (no vLLM step)

Host cost. The same steps of the same requests run through each target's own seam, in one
process, interleaved (V1, V2, V1, ...), under ``torch.inference_mode()`` as vLLM runs a step, with
the garbage collector's heap frozen as vLLM's worker freezes it, timing this thread's CPU time
(the machine is shared): on V1 the generated runner's ``_preprocess_rows`` (what its
``_preprocess`` runs after vLLM's), on V2 the generated model state's ``preprocess_state`` and
``prepare_inputs_embeds`` (what V2's ``execute_model`` calls on a real step: the rows are read
from V2's ``InputBatch`` and ``RequestState``, and V2 embeds the step's ids before the hooks run),
then ``prepare_inputs`` (the forward's kwargs; V1 builds them inside ``_model_forward``, which
cannot run without a model, so that column is V2's only). The hooks are trivial (constant rows,
one small update per row; the predictor returns its inputs): what is measured is the targets'
own work around them, with the steps' scenario of ``benchmarks/host_overhead.py`` (``scenario``:
a prefill step, then decode steps; ``--mixed``: every eighth row a prefill chunk). The V1 runner
asks a stand-in for vLLM's ``_determine_batch_execution_and_padding`` (the contract tests' fake);
V2 asks the predictor's wrapper, its own code. Medians over repeats, per request per step.

Size. Lines of each stage's generated V2 target (``<stage>_v2.py``) against its V1 runner
(``<stage>.py``, the worker class included), and of the hand-written bases each builds on.

Figures go to ``benchmarks/results/mrv2.json`` (and are printed); the ratios are the result.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results" / "mrv2.json"
CELLS = {
    "tts_mtp": ("qwen3_tts", "qwen3_tts", "batched decode + MTP (qwen3_tts)"),
    "omni_talker": ("qwen3_omni", "talker", "per-row hooks + MTP (qwen3_omni talker)"),
    "tiny_talker": ("omnigen_tiny", "talker", "batched decode + MTP (omnigen_tiny talker)"),
}
_clock = time.thread_time


# -- size ------------------------------------------------------------------------------------------


def _lines(path: Path) -> dict[str, int]:
    text = path.read_text().splitlines()
    code = [line for line in text if line.strip() and not line.strip().startswith("#")]
    return {"lines": len(text), "code_lines": len(code)}


def sizes() -> dict[str, Any]:
    from omnigen import paths, pipeline

    generated = paths.generated_dir()
    stages = {}
    for model in paths.model_names():
        for stage in pipeline.model_plan(model).stages:
            v1 = _lines(generated / model / f"{stage.stage}.py")
            v2 = _lines(generated / model / f"{stage.stage}_v2.py")
            stages[f"{model}.{stage.stage}"] = {
                "v1": v1,
                "v2": v2,
                "ratio": round(v2["lines"] / v1["lines"], 3),
            }
    total_v1 = sum(s["v1"]["lines"] for s in stages.values())
    total_v2 = sum(s["v2"]["lines"] for s in stages.values())
    runtime = ROOT / "omnigen" / "runtime"
    bases = {
        "v1": {"omnigen/runtime/base.py": _lines(runtime / "base.py")["lines"]},
        "v2": {
            str(p.relative_to(ROOT)): _lines(p)["lines"]
            for p in [runtime / "v2" / "state.py", runtime / "v2" / "runner.py", runtime / "vllm_api_v2.py"]
        },
    }
    return {
        "stages": stages,
        "total": {"v1": total_v1, "v2": total_v2, "ratio": round(total_v2 / total_v1, 3)},
        "hand_written_bases": bases,
        "note": "base.py is shared: OmniStateBase (the omni state both targets hold) and OmniRunnerBase (V1)",
    }


# -- host cost -------------------------------------------------------------------------------------


class LeanModel:
    """Hooks that cost next to nothing (``benchmarks/host_overhead.py``'s trivial hooks, for the
    contract tests' fakes' call shapes): constant rows, one small update per row, MTP inputs for
    a decode row; the predictor returns its inputs and constant codes."""

    def __init__(self, hidden: int, mtp: bool) -> None:
        import torch

        rows = 4096
        self.hidden = hidden
        self.mtp = mtp
        self._embeds = torch.linspace(0, 1, rows * hidden).reshape(rows, hidden)
        self._ones = torch.ones(rows, hidden)
        self._codes = torch.zeros(rows, 4, dtype=torch.int64)

    def embed_input_ids(self, input_ids):
        return self._embeds[: int(input_ids.shape[0])]

    def preprocess(self, input_ids, input_embeds, **infos):
        span = int(input_ids.shape[0])
        update = {"hidden_states": {"last": self._embeds[span - 1 : span]}}
        if self.mtp and span == 1 and not infos["_omni_is_prefill"]:
            update["mtp_inputs"] = (self._ones[0], self._ones[1])
        return input_ids, self._embeds[:span], update

    def preprocess_decode_batch(self, input_ids, req_infos):
        n = len(req_infos)
        updates = [{"hidden_states": {"last": self._embeds[i : i + 1]}} for i in range(n)]
        if self.mtp:
            return input_ids.reshape(-1), self._embeds[:n], self._ones[:n], self._ones[:n], updates
        return input_ids.reshape(-1), self._embeds[:n], updates

    def preprocess_batch(self, req_ids, model_intermediate_buffer, device=None):
        return None

    def talker_mtp(self, input_ids, inputs_embeds, last_talker_hidden, text_step, **kwargs):
        return inputs_embeds, self._codes[: int(input_ids.shape[0])]


def _steps(batch: int, steps: int, mixed: bool) -> list[list[Any]]:
    """Each measured step's rows (``RowSpec``), after one prefill step: decode rows of short
    prompts, and with ``mixed`` every eighth row a 4-token chunk of a long prompt."""
    from omnigen_testing.contract_support import RowSpec

    plan = []
    for k in range(steps + 1):
        rows = []
        for i in range(batch):
            tag = i + 1
            if mixed and i % 8 == 7:
                rows.append(RowSpec(f"r{i}", 4 * (steps + 2), 4 * k, 4, tag=tag))
            elif k == 0:
                rows.append(RowSpec(f"r{i}", 4, 0, 4, tag=tag))
            else:
                rows.append(RowSpec(f"r{i}", 4, 4 + k - 1, 1, tag=tag, seed=None))
        plan.append(rows)
    return plan


class Lane:
    """One target over the steps of a cell: its omni state persists from step to step."""

    def __init__(self, target: str, model: str, stage: str, plan: list[list[Any]]) -> None:
        from omnigen_testing import contract_support as _support

        # The contract tests' builders size their persistent buffers for 16 requests.
        _support.MAX_REQS = max(_support.MAX_REQS, len(plan[0]) + 1)
        self.target = target
        variant = _support.Variant(model, stage)
        self.variant = variant
        caps = variant.caps
        recorder = _support.Recorder()
        self.steps = [_support.Step(rows, pad=0) for rows in plan]
        first = self.steps[0]
        self.rig = _support.rig(variant, first, recorder, None, target=target)
        lean = LeanModel(first.hidden, caps["talker_mtp"])
        self.rig.runner.model = lean
        self.rig.model = lean
        if caps["talker_mtp"]:
            for name, buffer in _support.mtp_buffers(rows=_support.MAX_REQS, hidden=first.hidden).items():
                setattr(self.rig.runner, name, buffer)
            self.rig.runner._talker_mtp_views = {}
            self.rig.runner.talker_mtp = lean.talker_mtp
            if target == "v1":
                self.rig.runner._determine_batch_execution_and_padding = _Determiner()
        self.kwargs = 0.0

    def run(self, k: int) -> float:
        """Seconds of step ``k``'s hooks' path on this target (the rig is moved to the step first)."""
        import torch

        step = self.steps[k]
        self.rig.use_step(step)
        runner = self.rig.runner
        with torch.inference_mode():
            if self.target == "v1":
                start = _clock()
                runner._preprocess_rows(step.sched, step.ids(), step.embeds())
                return _clock() - start
            v2 = self.rig.v2
            start = _clock()
            runner.preprocess_state(v2.input_batch, (), None, None)
            runner.prepare_inputs_embeds({}, v2.input_batch, v2.req_states)
            spent = _clock() - start
            start = _clock()
            runner.prepare_inputs(v2.input_batch, v2.req_states)
            self.kwargs += _clock() - start
            runner._omni_forward_pending = False
            return spent


class _Determiner:
    """vLLM's ``_determine_batch_execution_and_padding`` answer for an eager predictor."""

    def __call__(self, **kwargs: Any) -> tuple[Any, ...]:
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import BatchDescriptor

        n = kwargs["num_tokens"]
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens=n, num_reqs=n, uniform=True), False, None, None


def host_cost(cells: list[str], batches: list[int], steps: int, repeats: int, mixed: bool) -> dict[str, Any]:
    from unittest import mock

    from vllm.utils.gc_utils import freeze_gc_heap

    from omnigen.runtime import vllm_api
    from omnigen_testing.contract_support import FakeForwardContext, Recorder

    found: dict[str, Any] = {}
    turns = random.Random(0)
    with mock.patch.object(vllm_api, "set_forward_context", FakeForwardContext(Recorder())):
        for cell in cells:
            model, stage, label = CELLS[cell]
            per_batch = {}
            for batch in batches:
                samples: dict[str, list[float]] = {"v1": [], "v2": [], "v2_kwargs": []}
                for _ in range(repeats):
                    plan = _steps(batch, steps, mixed)
                    lanes = {target: Lane(target, model, stage, plan) for target in ("v1", "v2")}
                    for lane in lanes.values():
                        lane.run(0)  # the prefill step: not measured
                    totals = dict.fromkeys(lanes, 0.0)
                    freeze_gc_heap()
                    try:
                        for k in range(1, steps + 1):
                            for target in turns.sample(list(lanes), len(lanes)):
                                totals[target] += lanes[target].run(k)
                    finally:
                        gc.unfreeze()
                    scale = 1e6 / (steps * batch)
                    samples["v1"].append(totals["v1"] * scale)
                    samples["v2"].append(totals["v2"] * scale)
                    samples["v2_kwargs"].append(lanes["v2"].kwargs * scale)
                median = {key: round(statistics.median(values), 3) for key, values in samples.items()}
                median["ratio_v2_over_v1"] = round(median["v2"] / median["v1"], 3) if median["v1"] else None
                per_batch[str(batch)] = median
                print(
                    f"{cell:12s} B={batch:4d}  V1 {median['v1']:8.2f}  V2 {median['v2']:8.2f}  "
                    f"(x{median['ratio_v2_over_v1']})  V2 kwargs {median['v2_kwargs']:6.2f}  us/request/step",
                    flush=True,
                )
            found[cell] = {"label": label, "us_per_request_per_step": per_batch}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--short", action="store_true", help="B in (1, 16, 64), 3 repeats, 4 steps")
    parser.add_argument("--sizes-only", action="store_true")
    parser.add_argument("--mixed", action="store_true", help="every eighth row a prefill chunk")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per repeat (at most 14)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result: dict[str, Any] = {"sizes": sizes()}
    total = result["sizes"]["total"]
    print(f"generated lines: V1 {total['v1']}, V2 {total['v2']} (x{total['ratio']})")
    if not args.sizes_only:
        import vllm

        batches = [1, 16, 64] if args.short else [1, 8, 64, 256]
        repeats = 3 if args.short else args.repeats
        steps = 4 if args.short else args.steps
        result["host_cost"] = {
            "vllm": vllm.__version__,
            "python": platform.python_version(),
            "clock": "thread CPU time",
            "batches": batches,
            "repeats": repeats,
            "steps": steps,
            "mixed": args.mixed,
            "cells": host_cost(list(CELLS), batches, steps, repeats, args.mixed),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
