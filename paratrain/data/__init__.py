"""Datasets: each yields the rows of a global batch that one data-parallel rank reads."""
from __future__ import annotations

import torch

from paratrain.config import Config
from paratrain.data.synthetic import SyntheticLM, SyntheticTranslation


class ShardedBatches:
    """Step -> this data-parallel rank's rows of the global batch (B / dp rows, in rank order)."""

    def __init__(self, source, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1):
        self.source, self.global_batch_size = source, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        rows = self.global_batch_size // self.dp_size
        full = self.source.global_batch(step, self.global_batch_size)
        return {k: v[self.dp_rank * rows : (self.dp_rank + 1) * rows] for k, v in full.items()}


def build_dataset(cfg: Config):
    """The global-batch source named by ``cfg.data.kind`` for ``cfg.model.kind``."""
    if cfg.data.kind != "synthetic":
        raise ValueError(f"data.kind={cfg.data.kind!r} is not supported; use synthetic")
    if cfg.model.kind == "gpt":
        return SyntheticLM(cfg.model, cfg.run.seed)
    return SyntheticTranslation(cfg.model, cfg.run.seed, cfg.data.task, cfg.data.min_length)
