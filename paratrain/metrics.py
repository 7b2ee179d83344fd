"""Step metrics: a console line every ``log_steps`` and ``metrics.jsonl`` in the run directory."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from paratrain.config import MetricsConfig


class MetricsLogger:
    """Writes one JSON object per logged step and prints a line for it (on the main rank only)."""

    def __init__(self, run_dir: Path, cfg: MetricsConfig, total_steps: int, enabled: bool = True):
        self.cfg, self.total_steps, self.enabled = cfg, total_steps, enabled
        self.file = open(run_dir / "metrics.jsonl", "a") if enabled else None

    def should_log(self, step: int) -> bool:
        return (step + 1) % self.cfg.log_steps == 0 or step + 1 == self.total_steps

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        print(self.format(record), file=sys.stdout, flush=True)

    def format(self, r: dict) -> str:
        if self.cfg.log_format == "mindspore":
            return f"epoch: 1 step: {r['step']}, loss is {r['loss']:.4f}"
        return (f"step {r['step']:>6}/{self.total_steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
                f"grad_norm {r['grad_norm']:.3f} | {r['step_time_s']:.3f} s/step | {r['tokens_per_s']:,.0f} tok/s")

    def close(self) -> None:
        if self.file:
            self.file.close()
