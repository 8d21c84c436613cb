"""End-to-end throughput of a whole pipeline: omnigen's driver against the same stages by hand.

Measures: requests/s and audio seconds/s of the tiny talker -> code2wav pipeline through
  omnigen's driver (mp and inproc) at 1, 8 and 32 concurrent requests.
Baseline: the same two stages driven by hand with two ``vllm.LLM`` engines, in the same run.
Takes: several minutes (engine starts per mode and repeat; ``--repeats 3``).
Writes: a table to stdout; no data file.

The tiny talker -> code2wav (testing/tiny_omni.py) on vLLM's CPU engine, at 1, 8 and
32 concurrent requests:

- ``driver (mp)``: ``omnigen.serving.Pipeline`` with one engine-core process per stage; every
  request submitted at once, each a task that awaits the talker, then the code2wav.
- ``driver (inproc)``: the same driver with both engines in this process, stage by stage.
- ``by hand``: two ``vllm.LLM`` engines in this process, ``generate`` on the talker, the glue,
  ``generate`` on the code2wav, written out as a user would (the baseline).

Reports requests/s and audio seconds/s (16 kHz) per cell, medians of ``--repeats`` runs
interleaved, and the ratio to the baseline in the same run.

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_PLUGINS=omnigen .venv/bin/python benchmarks/pipeline.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_PLUGINS", "omnigen")
# omnigen's plugin registers the tiny test models these runs build (omnigen.models).
os.environ.setdefault("OMNIGEN_MODELS", "omnigen_tiny,omnigen_tiny_omni")

SAMPLE_RATE = 16000
MAX_TOKENS = 12
ENGINE = dict(
    load_format="dummy",
    skip_tokenizer_init=True,
    enforce_eager=True,
    dtype="float32",
    max_model_len=128,
    max_num_seqs=32,
    max_num_batched_tokens=256,
    enable_prefix_caching=False,
    seed=0,
)


def prompts(count: int) -> list[dict]:
    return [{"prompt_token_ids": [(17 * i + j) % 400 + 10 for j in range(8)]} for i in range(count)]


def sampling() -> dict:
    from vllm import SamplingParams

    return {
        "talker": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False),
        "code2wav": SamplingParams(max_tokens=1, detokenize=False),
    }


def by_hand(talker, code2wav, batch: list[dict]) -> float:
    """The baseline: both engines' generate, the glue between them; audio seconds made."""
    from omnigen.glue.types import StageResult
    from omnigen.serving.client import stage_payload
    from omnigen_testing.tiny_glue import talker2code2wav

    params = sampling()
    outs = talker.generate(batch, params["talker"], use_tqdm=False)
    nexts = [
        talker2code2wav(
            StageResult(
                request_id=o.request_id, prompt_token_ids=[], output_token_ids=[], payload=stage_payload(o)
            )
        )
        for o in outs
    ]
    audio = code2wav.generate(
        [{"prompt_token_ids": n.prompt_token_ids} for n in nexts], params["code2wav"], use_tqdm=False
    )
    return sum(stage_payload(a)["audio"].numel() for a in audio) / SAMPLE_RATE


def through(pipeline, batch: list[dict]) -> float:
    outs = pipeline.generate(batch, sampling())
    return sum(o.audio.numel() for o in outs) / SAMPLE_RATE


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from vllm import LLM

    from omnigen.runtime.scheduler import scheduler_cls_name
    from omnigen.serving.pipeline import Pipeline
    from omnigen_testing import tiny_omni

    root = tempfile.mkdtemp(prefix="omnigen-bench-")
    models = {
        "talker": tiny_omni.write_tiny_config(
            f"{root}/talker", arch=tiny_omni.TALKER_ARCH, variant="mtp_batched"
        ),
        "code2wav": tiny_omni.write_tiny_config(f"{root}/code2wav", arch=tiny_omni.CODE2WAV_ARCH),
    }
    kwargs = {"talker": ENGINE, "code2wav": ENGINE}
    mp = Pipeline.from_model("omnigen_tiny", models, mode="mp", engine_kwargs=kwargs)
    inproc = Pipeline.from_model("omnigen_tiny", models, mode="inproc", engine_kwargs=kwargs)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    hand = [
        LLM(
            model=models[s],
            worker_cls=f"omnigen.generated.omnigen_tiny.{s}.{w}",
            scheduler_cls=scheduler_cls_name(),
            **ENGINE,
        )
        for s, w in (("talker", "OmnigenTinyTalkerWorker"), ("code2wav", "OmnigenTinyCode2wavWorker"))
    ]
    cells = {
        "by hand (2 LLMs)": lambda b: by_hand(*hand, b),
        "driver (inproc)": lambda b: through(inproc, b),
        "driver (mp)": lambda b: through(mp, b),
    }
    print(f"{'requests':>8}  {'cell':<18} {'req/s':>8} {'audio s/s':>10} {'ratio':>6}")
    for count in args.concurrency:
        batch = prompts(count)
        for run in cells.values():
            run(batch)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in cells}
        audio: dict[str, float] = {}
        for _ in range(args.repeats):
            for name, run in cells.items():
                started = time.perf_counter()
                audio[name] = run(batch)
                times[name].append(time.perf_counter() - started)
        base = statistics.median(times["by hand (2 LLMs)"])
        for name in cells:
            spent = statistics.median(times[name])
            print(
                f"{count:>8}  {name:<18} {count / spent:>8.1f} {audio[name] / spent:>10.3f} {base / spent:>6.2f}"
            )
    mp.close()
    inproc.close()


if __name__ == "__main__":
    main()
