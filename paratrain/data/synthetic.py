"""Learnable data made in-process from a seed, so training needs no download.

Every global batch is a pure function of (seed, step): any rank can produce its
share of any step, which makes data order exact across restarts and layouts.
"""
from __future__ import annotations

import torch

from paratrain.config import ModelConfig

PAD, BOS, EOS, UNK = 0, 1, 2, 3
NUM_SPECIAL = 4


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


class SyntheticTranslation:
    """Seq2seq task on random token strings of random length, padded with PAD.

    ``reverse``: target is the source reversed; ``copy``: target equals source.
    A global batch: src_ids (B, S); tgt_in_ids (B, T) = BOS + target; labels (B, T) = target + EOS.
    """

    def __init__(self, model: ModelConfig, seed: int, task: str = "reverse", min_length: int = 4):
        if task not in ("reverse", "copy"):
            raise ValueError(f"data.task={task!r} for a synthetic translation is not one of reverse, copy")
        self.vocab_size, self.seed, self.task = model.vocab_size, seed, task
        self.src_len, self.tgt_len = model.src_seq_length, model.tgt_seq_length
        self.max_length = min(self.src_len, self.tgt_len - 1)
        self.min_length = min(min_length, self.max_length)

    def global_batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        g = _generator(self.seed, step)
        lengths = torch.randint(self.min_length, self.max_length + 1, (batch_size,), generator=g)
        tokens = torch.randint(NUM_SPECIAL, self.vocab_size, (batch_size, self.max_length), generator=g)
        positions = torch.arange(self.max_length)
        valid = positions[None, :] < lengths[:, None]
        src = torch.full((batch_size, self.src_len), PAD)
        src[:, : self.max_length] = tokens.masked_fill(~valid, PAD)
        if self.task == "reverse":  # reverse the valid prefix of each row
            index = (lengths[:, None] - 1 - positions[None, :]).clamp(min=0)
            target = tokens.gather(1, index).masked_fill(~valid, PAD)
        else:
            target = src[:, : self.max_length]
        tgt_in = torch.full((batch_size, self.tgt_len), PAD)
        labels = torch.full((batch_size, self.tgt_len), PAD)
        tgt_in[:, 0] = BOS
        tgt_in[:, 1 : self.max_length + 1] = target
        labels[:, : self.max_length] = target
        labels[torch.arange(batch_size), lengths] = EOS
        return {"src_ids": src, "tgt_in_ids": tgt_in, "labels": labels}


class SyntheticLM:
    """Token streams from a fixed random Markov chain (each token has ``branching`` successors).

    A global batch: input_ids (B, S), labels (B, S) = input_ids shifted by one.
    A model that learns the chain reaches loss ln(branching), far below ln(V).
    """

    def __init__(self, model: ModelConfig, seed: int, branching: int = 2):
        self.seed, self.seq_length, self.vocab_size = seed, model.seq_length, model.vocab_size
        g = _generator(seed, -1)
        span = self.vocab_size - NUM_SPECIAL
        self.successors = NUM_SPECIAL + torch.randint(0, span, (self.vocab_size, branching), generator=g)

    def global_batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        g = _generator(self.seed, step)
        choices = torch.randint(0, self.successors.shape[1], (batch_size, self.seq_length), generator=g)
        tokens = torch.empty(batch_size, self.seq_length + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(NUM_SPECIAL, self.vocab_size, (batch_size,), generator=g)
        for t in range(self.seq_length):
            tokens[:, t + 1] = self.successors[tokens[:, t], choices[:, t]]
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].clone()}
