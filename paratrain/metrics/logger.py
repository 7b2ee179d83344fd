"""Sinks for the step records (main rank only): console line, ``metrics.jsonl``, TensorBoard, progress bar."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from paratrain.config import MetricsConfig
from paratrain.config import dotted

BREAKDOWN_LABELS = {"forward": "fwd", "backward": "bwd", "optimizer": "opt", "comm": "comm",
                    "pipeline_idle": "idle", "other": "other"}


def format_record(r: dict, total_steps: int, log_format: str = "default") -> str:
    """The console line of a record: paratrain's, or MindSpore's LossMonitor ``epoch: 1 step: 1, loss is 9.9034``."""
    if log_format == "mindspore":
        return f"epoch: 1 step: {r['step']}, loss is {r['loss']:.4f}"
    line = (f"step {r['step']:>6}/{total_steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
            f"grad_norm {r['grad_norm']:.3f} | {r['step_time_s']:.3f} s/step | {r['tokens_per_s']:,.0f} tok/s")
    if "mfu" in r:
        line += f" | mfu {100 * r['mfu']:.2f}% | mem {r['memory_mb']:,.0f} MB"
    if "eval_loss" in r:
        line += f" | eval_loss {r['eval_loss']:.4f} | eval_ppl {r['eval_ppl']:.2f}"
    if "bleu" in r:
        line += f" | bleu {r['bleu']:.2f}"
    if r.get("skipped_steps"):
        line += f" | skipped {r['skipped_steps']}"
    if "breakdown" in r:
        b = r["breakdown"]
        line += " | " + " ".join(f"{label} {b[f'{part}_pct']:.0f}%" for part, label in BREAKDOWN_LABELS.items())
    return line


class MetricsLogger:
    """Writes one JSON object per logged step to ``metrics.jsonl``, prints a line for it, and, when
    configured, adds it to TensorBoard (``metrics.tensorboard``: event files in the run directory) and
    shows a progress bar with ETA (``metrics.progress``, when stdout is a terminal). Main rank only."""

    def __init__(self, run_dir: Path, cfg: MetricsConfig, total_steps: int, enabled: bool = True):
        self.cfg, self.total_steps, self.enabled = cfg, total_steps, enabled
        self.file = open(run_dir / "metrics.jsonl", "a") if enabled else None
        self.writer = None
        if enabled and cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=str(run_dir))
        self.progress = None
        if enabled and cfg.progress and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
                TimeRemainingColumn
            self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                     TimeRemainingColumn(), transient=True)
        self._task = None
        self._info = ""  # the progress bar's text: the last logged loss and throughput

    def should_log(self, step: int) -> bool:
        return (step + 1) % self.cfg.log_steps == 0 or step + 1 == self.total_steps

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"time": time.time(), **record}) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in dotted(record, "/"):  # loss, breakdown/forward_pct, ...
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key.rpartition("/")[2] != "step":
                    self.writer.add_scalar(key, float(value), record["step"])
            self.writer.flush()
        line = format_record(record, self.total_steps, self.cfg.log_format)
        self._info = f"loss {record['loss']:.4f} {record['tokens_per_s']:,.0f} tok/s"
        if self.progress is not None:
            self.progress.console.print(line, highlight=False, markup=False, soft_wrap=True)
        else:
            print(line, file=sys.stdout, flush=True)

    def advance(self, step: int) -> None:
        """Move the progress bar to ``step`` (every step, not only logged ones)."""
        if self.progress is None:
            return
        if self._task is None:
            self.progress.start()
            self._task = self.progress.add_task("train", total=self.total_steps, completed=step - 1, info="")
        self.progress.update(self._task, completed=step, info=self._info)

    def close(self) -> None:
        if self.progress is not None and self._task is not None:
            self.progress.stop()
        if self.writer is not None:
            self.writer.close()
        if self.file:
            self.file.close()
