"""``paratrain plot RUN_DIR [RUN_DIR ...] [--out DIR]`` and ``paratrain summary RUN_DIR``: read ``metrics.jsonl`` back.

plot writes ``loss.png``, ``throughput.png`` (tokens/s and MFU) and, with ``metrics.breakdown = true``,
``breakdown.png`` (a stacked bar per run of where the mean step went); runs are overlaid, labelled by
their directory names.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from paratrain.errors import UserError

PARTS = ("forward", "backward", "optimizer", "comm", "pipeline_idle", "other")
COLORS = {"forward": "#4c72b0", "backward": "#55a868", "optimizer": "#c44e52", "comm": "#8172b2",
          "pipeline_idle": "#ccb974", "other": "#bbbbbb"}


class MetricsNotFound(UserError, FileNotFoundError):
    """A run directory without ``metrics.jsonl``."""


def read_records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise MetricsNotFound(f"{path} not found: is {run_dir} a paratrain run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mean_breakdown(records: list[dict]) -> dict[str, float] | None:
    """Mean seconds per part over the logged steps, leaving out the first (warm-up) when there are others."""
    rows = [r["breakdown"] for r in records if "breakdown" in r]
    if len(rows) > 1:
        rows = rows[1:]
    if not rows:
        return None
    return {part: sum(b[f"{part}_s"] for b in rows) / len(rows) for part in PARTS}


def plot(run_dirs: list[Path], out: Path | None = None) -> list[Path]:
    """Write the figures of one or more runs; returns the PNG paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {Path(d).resolve().name or str(d): read_records(Path(d)) for d in run_dirs}
    out = Path(out) if out is not None else Path(run_dirs[0])
    out.mkdir(parents=True, exist_ok=True)
    written = []

    figures = {"loss.png": [("loss", 1, "loss", "Training loss")],
               "throughput.png": [("tokens_per_s", 1, "tokens / s", "Throughput"),
                                  ("mfu", 100, "MFU (%)", "Model FLOPs utilization")]}
    for file, panels in figures.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(11 if len(panels) > 1 else 7, 4), squeeze=False)
        for ax, (key, scale, ylabel, title) in zip(axes[0], panels):
            for name, records in runs.items():
                values = [scale * r.get(key, 0.0) for r in records]
                ax.plot([r["step"] for r in records], values, marker=".", label=name)
            ax.set(xlabel="step", ylabel=ylabel, title=title)
            ax.grid(alpha=0.3)
            ax.legend()
        written.append(_save(fig, out / file))

    breakdowns = {name: b for name, records in runs.items() if (b := mean_breakdown(records))}
    if breakdowns:
        fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(breakdowns) + 3), 4.5))
        names = list(breakdowns)
        bottom = [0.0] * len(names)
        for part in PARTS:
            values = [breakdowns[n][part] for n in names]
            bars = ax.bar(names, values, bottom=bottom, color=COLORS[part], label=part.replace("_", " "))
            for bar, value, base, name in zip(bars, values, bottom, names):
                share = 100 * value / sum(breakdowns[name].values())
                if share >= 4:
                    ax.text(bar.get_x() + bar.get_width() / 2, base + value / 2, f"{share:.0f}%",
                            ha="center", va="center", fontsize=8, color="white")
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set(ylabel="seconds per step (mean)", title="Step time breakdown")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
        written.append(_save(fig, out / "breakdown.png"))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_rows(run_dir: Path) -> list[tuple[str, str]]:
    """(name, value) rows describing a run: layout, steps, loss, speed, MFU, memory, breakdown."""
    records = read_records(run_dir)
    rows = [("run", str(run_dir))]
    config = Path(run_dir) / "config.toml"
    if config.exists():
        from paratrain.config_file import tomllib  # tomli before Python 3.11
        cfg = tomllib.loads(config.read_text())
        m, p = cfg.get("model", {}), cfg.get("parallel", {})
        rows.append(("model", f"{m.get('kind')} hidden {m.get('hidden_size')} heads {m.get('num_heads')} "
                              f"layers {m.get('encoder_layers', 0) if m.get('kind') == 'transformer' else 0}"
                              f"+{m.get('decoder_layers')}"))
        rows.append(("layout", f"dp {p.get('data_parallel', 1)} x mp {p.get('model_parallel', 1)} x "
                               f"pp {p.get('pipeline_stage', 1)}, micro-batches {p.get('micro_batch_num', 1)}"))
    if not records:
        return rows + [("records", "none")]
    timed = records[1:] if len(records) > 1 else records  # the first logged step includes warm-up
    mean = lambda key: sum(r.get(key, 0.0) for r in timed) / len(timed)  # noqa: E731
    last = records[-1]
    rows += [("steps logged", f"{len(records)} (last step {last['step']})"),
             ("loss first / last / min", f"{records[0]['loss']:.4f} / {last['loss']:.4f} / "
                                         f"{min(r['loss'] for r in records):.4f}"),
             ("step time (mean)", f"{mean('step_time_s'):.4f} s"),
             ("tokens/s (mean)", f"{mean('tokens_per_s'):,.0f}"),
             ("samples/s (mean)", f"{mean('samples_per_s'):,.1f}")]
    if "mfu" in last:
        rows += [("MFU (mean)", f"{100 * mean('mfu'):.2f} %  ({mean('tflops'):.4f} TFLOP/s)"),
                 ("peak memory", f"{max(r.get('memory_mb', 0.0) for r in records):,.0f} MB"),
                 ("skipped steps", str(last.get("skipped_steps", 0)))]
    breakdown = mean_breakdown(records)
    if breakdown:
        total = sum(breakdown.values()) or 1.0
        rows += [(f"  {part.replace('_', ' ')}", f"{breakdown[part]:.4f} s  {100 * breakdown[part] / total:5.1f} %")
                 for part in PARTS]
    return rows


def summary(run_dir: Path, file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"paratrain run {Path(run_dir).resolve().name}", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    for name, value in summary_rows(Path(run_dir)):
        table.add_row(name, value)
    Console(file=file or sys.stdout).print(table)


def cmd_plot(args) -> int:
    for path in plot(args.run_dirs, args.out):
        print(path)
    return 0


def cmd_summary(args) -> int:
    summary(args.run_dir)
    return 0


def register(sub) -> None:
    """Add ``plot`` and ``summary`` to the ``paratrain`` subcommands."""
    plot_parser = sub.add_parser("plot", help="PNG figures (loss, throughput, time breakdown) of one or more runs")
    plot_parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    plot_parser.add_argument("--out", help="folder for the PNGs (default: the first RUN_DIR)")
    plot_parser.set_defaults(func=cmd_plot)
    summary_parser = sub.add_parser("summary", help="a table of one run's metrics")
    summary_parser.add_argument("run_dir", metavar="RUN_DIR")
    summary_parser.set_defaults(func=cmd_summary)
