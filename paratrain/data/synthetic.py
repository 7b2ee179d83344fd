"""Learnable data made in-process from a seed, so training needs no download.

Every row of every global batch is a pure function of (seed, step, row): a rank makes only its own
rows, and the order is exact across restarts and layouts. Tensors are made on the host.
"""
from __future__ import annotations

import torch

from paratrain.config import SPECIAL_TOKENS, ModelConfig

PAD, BOS, EOS, UNK = 0, 1, 2, 3
NUM_SPECIAL = SPECIAL_TOKENS
CPU = torch.device("cpu")


def _generator(*key: int) -> torch.Generator:
    seed = 0
    for k in key:
        seed = (seed * 1_000_003 + k) % 2**63
    return torch.Generator(device=CPU).manual_seed(seed)


class SyntheticTranslation:
    """Seq2seq task on random token strings of random length, padded with PAD: the target is the source
    reversed (``reverse``) or itself (``copy``). Rows: src_ids (b, S); tgt_in_ids (b, T) = BOS + target;
    labels (b, T) = target + EOS."""

    def __init__(self, model: ModelConfig, seed: int, task: str = "reverse", min_length: int = 4):
        if task not in ("reverse", "copy"):
            raise ValueError(f"data.task={task!r} for a synthetic translation is not one of reverse, copy")
        self.vocab_size, self.seed, self.task = model.vocab_size, seed, task
        self.src_len, self.tgt_len = model.src_seq_length, model.tgt_seq_length
        self.max_length = min(self.src_len, self.tgt_len - 1)
        self.min_length = min(min_length, self.max_length)

    def batch_rows(self, step: int, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Rows ``start``..``stop - 1`` of global batch ``step``."""
        n = stop - start
        lengths = torch.empty(n, dtype=torch.long, device=CPU)
        tokens = torch.empty(n, self.max_length, dtype=torch.long, device=CPU)
        for i, row in enumerate(range(start, stop)):
            g = _generator(self.seed, step, row)
            lengths[i] = torch.randint(self.min_length, self.max_length + 1, (), generator=g, device=CPU)
            tokens[i] = torch.randint(NUM_SPECIAL, self.vocab_size, (self.max_length,), generator=g, device=CPU)
        positions = torch.arange(self.max_length, device=CPU)
        valid = positions[None, :] < lengths[:, None]
        src = torch.full((n, self.src_len), PAD, device=CPU)
        src[:, : self.max_length] = tokens.masked_fill(~valid, PAD)
        if self.task == "reverse":  # reverse the valid prefix of each row
            index = (lengths[:, None] - 1 - positions[None, :]).clamp(min=0)
            target = tokens.gather(1, index).masked_fill(~valid, PAD)
        else:
            target = src[:, : self.max_length]
        tgt_in = torch.full((n, self.tgt_len), PAD, device=CPU)
        labels = torch.full((n, self.tgt_len), PAD, device=CPU)
        tgt_in[:, 0] = BOS
        tgt_in[:, 1 : self.max_length + 1] = target
        labels[:, : self.max_length] = target
        labels[torch.arange(n, device=CPU), lengths] = EOS
        return {"src_ids": src, "tgt_in_ids": tgt_in, "labels": labels}


class SyntheticLM:
    """Token streams from a fixed random Markov chain (each token has ``branching`` successors): a model that
    learns it reaches loss ln(branching). Rows: input_ids (b, S), labels (b, S) = input_ids shifted by one."""

    def __init__(self, model: ModelConfig, seed: int, branching: int = 2):
        self.seed, self.seq_length, self.vocab_size = seed, model.seq_length, model.vocab_size
        span = self.vocab_size - NUM_SPECIAL
        self.successors = NUM_SPECIAL + torch.randint(0, span, (self.vocab_size, branching),
                                                      generator=_generator(seed, -1), device=CPU)

    def batch_rows(self, step: int, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Rows ``start``..``stop - 1`` of global batch ``step``."""
        n, branching = stop - start, self.successors.shape[1]
        choices = torch.empty(n, self.seq_length, dtype=torch.long, device=CPU)
        tokens = torch.empty(n, self.seq_length + 1, dtype=torch.long, device=CPU)
        for i, row in enumerate(range(start, stop)):
            g = _generator(self.seed, step, row)
            tokens[i, 0] = torch.randint(NUM_SPECIAL, self.vocab_size, (), generator=g, device=CPU)
            choices[i] = torch.randint(0, branching, (self.seq_length,), generator=g, device=CPU)
        for t in range(self.seq_length):
            tokens[:, t + 1] = self.successors[tokens[:, t], choices[:, t]]
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].clone()}
