"""Engine-level cost of a decode step: vLLM's engine on CPU with a tiny real Qwen3-TTS talker.

Measures: decode-step wall time and tokens/s through vLLM's ``LLM`` engine on CPU, tiny real
  Qwen3-TTS talker.
Baseline: vllm-omni 0.30's runner on the same engine (``oracle``) and plain vLLM (``vllm``, the floor).
Takes: several minutes: a fresh engine start per side and round (three sides, ``--rounds``).
Writes: a table of ratios to stdout; no data file (each side's process hands its figures back
  through a temporary file).

The same tiny checkpoint (vllm-omni 0.30's ``Qwen3TTSTalkerForConditionalGeneration``, built as
testing/real/cases/qwen3_tts_talker.py builds it: 1 layer, hidden 128, M-RoPE, bf16, dummy
weights) runs through vLLM's ``LLM`` engine in process, once per side, each side in a process of
its own (vllm-omni's runner needs its patch of vLLM; omnigen's must not get it):

* ``omnigen``: the generated worker (``omnigen.generated.qwen3_tts.qwen3_tts.Qwen3TtsWorker``);
* ``oracle``: vllm-omni's ``GPUARModelRunner`` composed onto vLLM's ``CPUModelRunner`` (as the
  real-model differential test composes it: testing/real/harness.py);
* ``vllm``: the floor, plain vLLM with its own CPU runner on a Qwen3 LM of the talker's backbone
  shape (the talker class itself cannot run on plain vLLM's runner: it needs a runner's
  preprocess hook and payloads).

At each concurrency (1, 8, 32 requests, all added at once, ``ignore_eos``) the engine steps until
every request is done; the first step (all prefills) is left out, and the decode-step time is the
median wall time of ``engine.step()`` over the pure-decode steps; tokens/s is the generated tokens
over the wall time of the whole run. Reported as ratios omnigen / vllm-omni (and each against the
floor). Sides run one after another (rounds alternate their order); the machine is shared, so
compare ratios of one run.

    .venv/bin/python benchmarks/engine.py                       # sides omnigen, oracle, vllm; 1 8 32
    .venv/bin/python benchmarks/engine.py --concurrency 1 8 --max-tokens 24 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("omnigen", "oracle", "vllm")


def _requests(count: int, max_tokens: int) -> list:
    from omnigen_testing.real.cases import qwen3_tts_talker as case_module

    text = {"text": "the quick brown fox jumps", "language": "English", "non_streaming_mode": True}
    return [case_module._request(f"r{i}", max_tokens, seed=None, **text) for i in range(count)]


def _floor_checkpoint(folder: Path) -> Path:
    """A Qwen3 LM of the talker's backbone shape (plain vLLM's model class, no M-RoPE)."""
    from omnigen_testing.real.cases import qwen3_tts_talker as case_module

    talker = case_module.qwen3_tts_config(case_module.ARCH)["talker_config"]
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "torch_dtype": "bfloat16",
        **{
            key: talker[key]
            for key in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "hidden_act",
                "max_position_embeddings",
                "rms_norm_eps",
                "rope_theta",
            )
        },
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def run_side(side: str, concurrency: list[int], max_tokens: int, work: Path) -> dict:
    """In this process: build the side's engine once, then time each concurrency."""
    from omnigen_testing.real import harness
    from omnigen_testing.real.cases.qwen3_tts_talker import CASE

    os.environ.update(harness.side_environment("omnigen" if side == "vllm" else side))
    harness.prepare_side("omnigen" if side == "vllm" else side)
    # No per-step trace recording: the benchmark wants the runners as they serve.
    harness.attach_recorder = lambda runner: None
    kwargs = dict(harness.ENGINE_DEFAULTS)
    kwargs.update(
        max_num_seqs=max(concurrency),
        max_num_batched_tokens=2048,  # every prefill in the first step; then pure decode steps
        max_model_len=128,
        load_format="dummy",
        dtype="bfloat16",
    )
    if side == "vllm":
        kwargs["model"] = str(_floor_checkpoint(work / "floor"))
    else:
        model_dir = Path(CASE.write_checkpoint(work / "talker"))
        harness.register_case(CASE, model_dir)
        kwargs["model"] = str(model_dir)
        if side == "omnigen":
            from omnigen import api

            kwargs["worker_cls"] = api.worker_cls_name(CASE.omnigen_model, CASE.omnigen_stage)
        else:
            kwargs["worker_cls"] = harness.oracle_worker_cls(CASE)
            kwargs["scheduler_cls"] = harness.oracle_scheduler_cls(CASE)
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(**kwargs)
    result = {"side": side, "init_s": round(time.perf_counter() - started, 1), "runs": {}}
    engine = llm.llm_engine
    predictor_rows = _count_predictor_rows(engine)
    # A warm-up run of one request first, not reported.
    for label, count in [("warmup", 1), *((str(c), c) for c in concurrency)]:
        for request in _requests(count, max_tokens):
            params = harness.sampling_params("omnigen" if side == "vllm" else side, request)
            if side == "vllm":
                params.extra_args = None  # plain vLLM: no payload, no MTP seed
            prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
            engine.add_request(f"{request.request_id}-{label}", prompt, params)
        steps: list[float] = []
        tokens = 0
        predictor_rows[0] = 0
        begin = time.perf_counter()
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outputs = engine.step()
            steps.append(time.perf_counter() - t0)
            tokens += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished and o.outputs)
        wall = time.perf_counter() - begin
        decode = steps[1:-1] or steps
        result["runs"][label] = {
            "decode_step_ms": statistics.median(decode) * 1e3,
            "tokens_per_s": tokens / wall,
            "steps": len(steps),
            "tokens": tokens,
            # A check that the stage did its work: code-predictor rows run (one per decode token).
            "predictor_rows": predictor_rows[0],
        }
    del result["runs"]["warmup"]
    return result


def _count_predictor_rows(engine) -> list[int]:
    """Wrap the runner's code predictor (if any) to count the rows it runs: ``[count]``."""
    count = [0]
    runner = engine.model_executor.driver_worker.worker.model_runner
    predictor = getattr(runner, "talker_mtp", None)
    if predictor is None:
        return count

    def counted(input_ids, *args, **kwargs):
        count[0] += int(input_ids.shape[0])
        return predictor(input_ids, *args, **kwargs)

    runner.talker_mtp = counted
    return count


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in a child process
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        sys.path.insert(0, str(ROOT))
        with tempfile.TemporaryDirectory(prefix="omnigen-engine-bench-") as work:
            result = run_side(args.side, args.concurrency, args.max_tokens, Path(work))
        args.out.write_text(json.dumps(result))
        return
    results: dict[str, list[dict]] = {side: [] for side in args.sides}
    with tempfile.TemporaryDirectory(prefix="omnigen-engine-bench-") as tmp:
        for round_index in range(args.rounds):
            order = args.sides if round_index % 2 == 0 else list(reversed(args.sides))
            for side in order:
                out = Path(tmp) / f"{side}-{round_index}.json"
                command = [
                    sys.executable, __file__, "--side", side, "--out", str(out),
                    "--max-tokens", str(args.max_tokens), "--concurrency", *map(str, args.concurrency),
                ]  # fmt: skip
                env = {**os.environ, "PYTHONPATH": str(ROOT)}
                print(f"[round {round_index}] {side} ...", file=sys.stderr, flush=True)
                # vLLM logs to stdout: the child's goes to stderr, so stdout is the report.
                subprocess.run(command, check=True, env=env, cwd=ROOT, stdout=sys.stderr)
                results[side].append(json.loads(out.read_text()))
    report(results, args.concurrency)


def _median(results: list[dict], count: int, key: str) -> float:
    return statistics.median(r["runs"][str(count)][key] for r in results)


def report(results: dict[str, list[dict]], concurrency: list[int]) -> None:
    sides = list(results)
    for side in sides:
        runs = results[side][0]["runs"]
        print(
            f"{side}: engine init {results[side][0]['init_s']} s; per concurrency (tokens, steps, "
            "code-predictor rows): "
            + ", ".join(f"{c}: ({r['tokens']}, {r['steps']}, {r['predictor_rows']})" for c, r in runs.items())
        )
    print(f"{'requests':>8} " + " ".join(f"{s + ' ms/step':>16} {s + ' tok/s':>14}" for s in sides))
    for count in concurrency:
        cells = []
        for side in sides:
            cells.append(f"{_median(results[side], count, 'decode_step_ms'):>16.2f}")
            cells.append(f"{_median(results[side], count, 'tokens_per_s'):>14.1f}")
        print(f"{count:>8} " + " ".join(cells))
    if "omnigen" in results and "oracle" in results:
        print("\nratios omnigen / vllm-omni (step time: lower is better; tokens/s: higher is better)")
        for count in concurrency:
            step = _median(results["omnigen"], count, "decode_step_ms") / _median(
                results["oracle"], count, "decode_step_ms"
            )
            rate = _median(results["omnigen"], count, "tokens_per_s") / _median(
                results["oracle"], count, "tokens_per_s"
            )
            line = f"{count:>8} requests: decode step {step:.3f}, tokens/s {rate:.3f}"
            if "vllm" in results:
                floor = _median(results["vllm"], count, "decode_step_ms")
                line += (
                    f"; step / plain-vLLM floor: omnigen "
                    f"{_median(results['omnigen'], count, 'decode_step_ms') / floor:.2f}, vllm-omni "
                    f"{_median(results['oracle'], count, 'decode_step_ms') / floor:.2f}"
                )
            print(line)


if __name__ == "__main__":
    main()
