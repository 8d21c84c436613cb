"""Sweep the host-overhead benchmark over batch sizes and stage policies (a Hydra app).

Measures: host cost of a decode step's ``_preprocess`` per configuration and batch size (the
  ``wall`` mode of ``benchmarks/host_cost.py``, one cell per job).
Baseline: vllm-omni 0.30's runner on the same steps, interleaved in the same process.
Takes: under a minute a job with the defaults (B = 32, 5 repeats: 46 s here); a full ``-m`` sweep,
  tens of minutes.
Writes: a row a job to ``OUT/sweep.csv`` and the plot ``OUT/sweep.png`` (``out=DIR``, default
  ``$TMPDIR/omnigen-sweep``).

Each job measures one configuration (``policy`` x ``seeded_share`` x ``shape``) at one batch size,
omnigen's generated runner and vllm-omni 0.30's interleaved in this process
(``benchmarks/host_cost.py wall``'s measurement), and appends a row to ``OUT/sweep.csv``; when the sweep
ends, ``OUT/sweep.png`` plots µs per request against B, one line per configuration (solid:
omnigen; dashed, same colour: vllm-omni's runner on the same steps, the reference).

    .venv/bin/python benchmarks/sweep.py -m batch=1,8,32,128,256 \\
        policy=tts_mtp,tts_none,tts_rowgen_never,plain,omni_talker seeded_share=0,1
    .venv/bin/python benchmarks/sweep.py batch=256 policy=omni_talker seeded_share=0.5   # one job

Policies are ``benchmarks/conf/policy/*.yaml`` (a model, a stage and build overrides: decode
batching none/mtp/plain, per-row generators never/eager_only/always). ``out=DIR`` moves the
CSV and PNG (default ``$TMPDIR/omnigen-sweep``); a new sweep into the same folder appends, so
give each sweep its own ``out`` to plot it alone.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIELDS = (
    "config",
    "policy",
    "seeded_share",
    "shape",
    "batch",
    "oracle_us",
    "omnigen_us",
    "ratio",
    "oracle_hook_us",
    "omnigen_hook_us",
)


def config_label(cfg: DictConfig) -> str:
    return f"{cfg.policy.label}, seeded {float(cfg.seeded_share):g}, {cfg.shape}"


def run_job(cfg: DictConfig) -> dict[str, Any]:
    from benchmarks import host_overhead

    cell = host_overhead.Cell(
        label=cfg.policy.label,
        model=cfg.policy.model,
        stage=cfg.policy.stage,
        overrides=tuple(cfg.policy.overrides),
        seeded_share=float(cfg.seeded_share),
    )
    steps = host_overhead.steps_for(int(cfg.batch), int(cfg.steps), int(cfg.min_rows))
    result = host_overhead.measure(cell, int(cfg.batch), steps, int(cfg.repeats), mixed=cfg.shape == "mixed")
    return {
        "config": config_label(cfg),
        "policy": cfg.policy.label,
        "seeded_share": float(cfg.seeded_share),
        "shape": cfg.shape,
        "batch": int(cfg.batch),
        **{key: round(result[key], 4) for key in FIELDS[5:]},
    }


def append_row(out: Path, row: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "sweep.csv"
    new = not path.exists()
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        writer.writerow(row)
    return path


def plot(csv_path: Path, png_path: Path) -> Path:
    """µs per request against B, log-log, one line per configuration and runner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[dict[str, str]]] = {}
    with csv_path.open() as handle:
        for row in csv.DictReader(handle):
            series.setdefault(row["config"], []).append(row)
    fig, ax = plt.subplots(figsize=(10, 6))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (config, rows) in enumerate(sorted(series.items())):
        rows.sort(key=lambda r: int(r["batch"]))
        batches = [int(r["batch"]) for r in rows]
        colour = colours[index % len(colours)]
        ax.plot(
            batches, [float(r["omnigen_us"]) for r in rows], "o-", color=colour, label=f"omnigen: {config}"
        )
        ax.plot(
            batches, [float(r["oracle_us"]) for r in rows], "x--", color=colour, alpha=0.6,
            label=f"vllm-omni 0.30: {config}",
        )  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("B (requests in the step)")
    ax.set_ylabel("host µs per request per step (hooks excluded)")
    ax.set_title("_preprocess host cost: omnigen (solid) vs vllm-omni 0.30 (dashed), same steps")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


class PlotWhenDone(Callback):
    """Hydra callback: redraw ``OUT/sweep.png`` from ``OUT/sweep.csv`` when a run or sweep ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._plot(config)

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._plot(config)

    @staticmethod
    def _plot(config: DictConfig) -> None:
        out = Path(config.out)
        if (out / "sweep.csv").exists():
            print(f"plot: {plot(out / 'sweep.csv', out / 'sweep.png')}", flush=True)


@hydra.main(version_base=None, config_path="conf", config_name="sweep")
def main(cfg: DictConfig) -> None:
    if cfg.shape not in ("decode", "mixed"):
        raise ValueError(f"shape={cfg.shape!r}: expected decode or mixed")
    row = run_job(cfg)
    path = append_row(Path(cfg.out), row)
    print(
        f"{row['config']:60} B={row['batch']:>4}  vllm-omni {row['oracle_us']:8.2f}  "
        f"omnigen {row['omnigen_us']:8.2f} µs/req  ratio {row['ratio']:.3f}  -> {path}",
        flush=True,
    )


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        # Hydra's --help lists the config groups and keys; what the sweep measures, against what,
        # for how long and where it writes is this module's docstring, printed first.
        print(__doc__)
    main()
