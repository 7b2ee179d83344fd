"""Make the documentation's figures from real runs (``make figures``):

- ``docs/images/demo-loss.png``: the loss curve ``paratrain plot`` draws of a run of the demo (``make demo``;
  ``--run`` names the run directory, default ``runs/demo-latest``, the link ``make demo`` leaves),
- ``docs/images/gpu-throughput.png``: the GPU throughput measured on lent GPUs, as bars, from
  ``docs/data/gpu-throughput.json`` (each run's date, GPU and torch recorded there).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images"
GPU_DATA = ROOT / "docs" / "data" / "gpu-throughput.json"
MAX_BYTES = 200_000


def demo_loss(run_dir: Path, out: Path) -> Path:
    """``paratrain plot RUN_DIR``'s loss.png of the demo run ``run_dir``, copied to ``out``."""
    if not (run_dir / "metrics.jsonl").is_file():
        raise SystemExit(f"make_figures: {run_dir} holds no metrics.jsonl: run `make demo` first, or give the run "
                         f"directory of a demo run with --run")
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-m", "paratrain", "plot", str(run_dir), "--out", folder], check=True,
                       stdout=subprocess.DEVNULL)
        shutil.copyfile(Path(folder) / "loss.png", out)
    return out


def gpu_throughput(data: dict, out: Path) -> Path:
    """One panel of horizontal bars per run of ``data``: tokens/s of each side (a range as an error bar),
    labelled with its tokens/s and peak memory."""
    runs = data["runs"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.2 + 0.55 * sum(len(r["rows"]) for r in runs)),
                             gridspec_kw={"height_ratios": [len(r["rows"]) for r in runs]}, squeeze=False)
    top = max(max(row["tokens_per_s"]) if isinstance(row["tokens_per_s"], list) else row["tokens_per_s"]
              for run in runs for row in run["rows"])
    for ax, run in zip(axes[:, 0], runs):
        rows = run["rows"][::-1]  # the first row on top
        lows = [min(r["tokens_per_s"]) if isinstance(r["tokens_per_s"], list) else r["tokens_per_s"] for r in rows]
        highs = [max(r["tokens_per_s"]) if isinstance(r["tokens_per_s"], list) else r["tokens_per_s"] for r in rows]
        mids = [(lo + hi) / 2 for lo, hi in zip(lows, highs)]
        colors = ["#4c72b0" if r["side"].startswith("paratrain") else "#999999" for r in rows]
        ax.barh(range(len(rows)), mids, color=colors)
        ranges = [i for i, (lo, hi) in enumerate(zip(lows, highs)) if lo != hi]
        ax.errorbar([mids[i] for i in ranges], ranges, xerr=[[mids[i] - lows[i] for i in ranges],
                                                            [highs[i] - mids[i] for i in ranges]],
                    fmt="none", ecolor="black", capsize=3)
        for i, (row, lo, hi) in enumerate(zip(rows, lows, highs)):
            value = f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"
            ax.text(hi + top * 0.01, i, f"{value} tok/s, {row['peak_gib']:g} GiB", va="center", fontsize=8)
        ax.set_yticks(range(len(rows)), [r["side"] for r in rows], fontsize=8)
        ax.set_xlim(0, top * 1.45)
        ax.set_title(f"{run['date']}, {run['gpu']}, torch {run['torch']}\n{run['command']}", fontsize=8)
        ax.xaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("tokens / s (peak memory after each bar)")
    fig.suptitle(f"Training throughput on one GPU\n{data['model']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=ROOT / "runs" / "demo-latest",
                        help="run directory of the demo (default runs/demo-latest, left by make demo)")
    args = parser.parse_args()
    IMAGES.mkdir(parents=True, exist_ok=True)
    written = [demo_loss(args.run, IMAGES / "demo-loss.png"),
               gpu_throughput(json.loads(GPU_DATA.read_text(encoding="utf-8")), IMAGES / "gpu-throughput.png")]
    for path in written:
        size = path.stat().st_size
        print(f"wrote {path.relative_to(ROOT)} ({size / 1000:.0f} KB)")
        if size > MAX_BYTES:
            raise SystemExit(f"make_figures: {path.relative_to(ROOT)} is {size:,} bytes, over {MAX_BYTES:,}: make "
                             f"it smaller")
    return 0


if __name__ == "__main__":
    sys.exit(main())
