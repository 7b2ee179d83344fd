"""Which examples form global batch ``step`` and which rows of it each data-parallel rank reads.

The example stream is the concatenation of epoch orders, each a pure function of (seed, epoch), and
global batch ``step`` is its slice ``[step * B, (step + 1) * B)``: every rank computes any step on its
own, nothing is dropped at epoch ends, and a resume on any number of data-parallel ranks is exact.
"""
from __future__ import annotations

import numpy as np


class DistributedSampler:
    """Step -> example indices; rank ``dp_rank`` of ``dp_size`` reads rows ``[r*B/dp, (r+1)*B/dp)`` of each batch.

    ``shuffle``: each epoch is a permutation seeded by (seed, epoch), else file order. ``lengths`` (N,) with
    ``bucket_size`` > 0: each window of ``bucket_size`` global batches is sorted by length, cut into batches
    and those shuffled, so a batch holds examples of similar length. ``next(sampler)`` gives this rank's
    indices of ``sampler.step`` and advances; ``state_dict``/``load_state_dict`` save and restore it.
    """

    def __init__(self, num_examples: int, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, shuffle: bool = True, lengths: np.ndarray | None = None, bucket_size: int = 0):
        if num_examples <= 0:
            raise ValueError("the dataset has no examples")
        if global_batch_size % dp_size or not 0 <= dp_rank < dp_size:
            raise ValueError(f"global batch {global_batch_size} cannot be split over data-parallel rank "
                             f"{dp_rank} of {dp_size}: the batch must be a multiple of {dp_size}")
        if bucket_size and lengths is None:
            raise ValueError("length bucketing needs the example lengths")
        self.num_examples, self.global_batch_size = num_examples, global_batch_size
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.lengths = None if lengths is None else np.asarray(lengths)
        self.bucket_size = bucket_size
        self.step = 0
        self._cache: dict[int, np.ndarray] = {}

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All N example indices in the order epoch ``epoch`` visits them."""
        if epoch not in self._cache:
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(self.num_examples) if self.shuffle else np.arange(self.num_examples)
            if self.bucket_size:
                order = self._bucketed(order, rng)
            self._cache[epoch] = order
            if len(self._cache) > 2:  # a batch spans at most two epochs
                self._cache.pop(next(iter(self._cache)))
        return self._cache[epoch]

    def _bucketed(self, order: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        window, batch = self.bucket_size * self.global_batch_size, self.global_batch_size
        out = []
        for start in range(0, len(order), window):
            chunk = order[start : start + window]
            chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
            batches = [chunk[i : i + batch] for i in range(0, len(chunk), batch)]
            out += [batches[i] for i in rng.permutation(len(batches))]
        return np.concatenate(out)

    def global_indices(self, step: int) -> np.ndarray:
        """The B example indices of global batch ``step``, in row order."""
        start, end = step * self.global_batch_size, (step + 1) * self.global_batch_size
        parts = []
        for epoch in range(start // self.num_examples, (end - 1) // self.num_examples + 1):
            base = epoch * self.num_examples
            parts.append(self.epoch_order(epoch)[max(start, base) - base : min(end, base + self.num_examples) - base])
        return np.concatenate(parts)

    def indices(self, step: int) -> np.ndarray:
        """This rank's rows of global batch ``step`` (B / dp_size example indices)."""
        rows = self.global_batch_size // self.dp_size
        return self.global_indices(step)[self.dp_rank * rows : (self.dp_rank + 1) * rows]

    def padding_fraction(self, steps: int, start: int = 0) -> float:
        """Share of padding when each global batch of ``steps`` steps is padded to its longest example (needs
        ``lengths``; with ``dynamic_padding`` the padding the model sees)."""
        real = padded = 0
        for step in range(start, start + steps):
            lengths = self.lengths[self.global_indices(step)]
            real += int(lengths.sum())
            padded += int(lengths.max()) * len(lengths)
        return 1 - real / padded

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        indices = self.indices(self.step)
        self.step += 1
        return indices

    def state_dict(self) -> dict:
        """The position (next step) and what the order depends on, to check a restore against."""
        return {"step": self.step, "seed": self.seed, "num_examples": self.num_examples,
                "global_batch_size": self.global_batch_size, "shuffle": self.shuffle, "bucket_size": self.bucket_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state["step"]``; ValueError if the data or the order settings changed."""
        changed = [f"{k}: saved {state[k]!r}, now {v!r}" for k, v in self.state_dict().items()
                   if k != "step" and k in state and state[k] != v]
        if changed:
            raise ValueError("cannot resume the data order exactly, the sampler changed: " + "; ".join(changed))
        self.step = int(state["step"])
