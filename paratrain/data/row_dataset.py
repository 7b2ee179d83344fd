"""MindSpore's dataset shape for user scripts: a ``RowDataset`` gives rows by index, in an order (seeded shuffle,
the same on every rank, or as stored); ``batch(batch_size, drop_remainder)`` gives its ``BatchDataset``, the
batches ``paratrain.train.Model`` takes. ``Cifar10Dataset`` and ``paratrain.dataset.GeneratorDataset`` are ones."""
from __future__ import annotations

import numpy as np

from paratrain.errors import UserError


class RowDataset:
    """Rows ``indices`` (of the source's rows) in this epoch's ``order()``; subclasses set ``indices`` and define
    ``rows(indices)``, the columns of those rows stacked (one array or tensor per column, rows first).
    ``num_shards`` / ``shard_id``: the share of the rows this rank reads (``Model.train`` reads them)."""

    indices: np.ndarray
    num_shards, shard_id, shuffle, seed, epoch = 1, 0, False, 0, 0

    def __len__(self) -> int:
        return len(self.indices)

    def order(self) -> np.ndarray:
        """This epoch's row indices (a new shuffle each call when ``shuffle``)."""
        if not self.shuffle:
            return self.indices
        self.epoch += 1
        return np.random.default_rng((self.seed, self.epoch)).permutation(self.indices)

    def rows(self, indices: np.ndarray) -> tuple:
        raise NotImplementedError

    def __iter__(self):
        order = self.order()
        for start in range(0, len(order), 256):  # read a few pages at a time, not the whole share
            yield from zip(*self.rows(order[start:start + 256]))

    def batch(self, batch_size: int, drop_remainder: bool = False) -> "BatchDataset":
        """Batches of ``batch_size`` rows."""
        return BatchDataset(self, batch_size, drop_remainder)

    def get_dataset_size(self) -> int:
        """The number of rows an epoch gives (MindSpore's name)."""
        return len(self)


class BatchDataset:
    """The batches of a ``RowDataset``: one stacked array or tensor per column, ``batch_size`` rows each (the last
    one shorter unless ``drop_remainder``), iterable once per epoch; ``num_shards`` and ``shard_id`` are the
    dataset's (``Model.train`` reads them)."""

    def __init__(self, dataset: RowDataset, batch_size: int, drop_remainder: bool):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UserError(f"batch(batch_size={batch_size!r}): expected a positive int")
        self.dataset, self.batch_size, self.drop_remainder = dataset, batch_size, drop_remainder
        self.num_shards, self.shard_id = dataset.num_shards, dataset.shard_id

    def __len__(self) -> int:
        n, b = len(self.dataset), self.batch_size
        return n // b if self.drop_remainder else -(-n // b)

    def __iter__(self):
        order = self.dataset.order()
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            yield tuple(self.dataset.rows(order[start:start + self.batch_size]))

    def get_dataset_size(self) -> int:
        """The number of batches an epoch gives (MindSpore's name)."""
        return len(self)

    def create_tuple_iterator(self, num_epochs: int = -1, output_numpy: bool = False, do_copy: bool = True):
        """The batches of one epoch, each a list of its columns, as MindSpore's iterator gives them (as NumPy
        arrays with ``output_numpy``)."""
        for batch in self:
            yield [np.asarray(column) for column in batch] if output_numpy else list(batch)
