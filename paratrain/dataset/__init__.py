"""MindSpore's ``mindspore.dataset`` for user scripts: ``GeneratorDataset`` with ``map`` and ``batch``,
``Cifar10Dataset``, and ``transforms.TypeCast``; batches are tuples of torch tensors (or NumPy arrays), one per
column, which ``paratrain.train.Model`` takes."""
from __future__ import annotations

import numpy as np
import torch

from paratrain.data.cifar_dataset import Cifar10Dataset
from paratrain.data.row_dataset import BatchDataset, RowDataset
from paratrain.errors import UserError

__all__ = ["BatchDataset", "Cifar10Dataset", "GeneratorDataset"]


class GeneratorDataset(RowDataset):
    """``GeneratorDataset(source, column_names, shuffle=None, num_samples=None)``: the rows ``source`` gives, each a
    tuple of one array per column of ``column_names``. ``source``: a function returning an iterator of rows (called
    again each time the dataset is read), an iterable of rows, or a random-access one (``__getitem__`` and
    ``__len__``), which is shuffled by default, as MindSpore does (seeded, the same on every rank). The rows are read
    once, on first use, and kept. ``map(operations, input_columns)`` and ``batch(batch_size, drop_remainder)``
    return new datasets; every rank reads every row (full batch). The worker options are accepted and unused."""

    def __init__(self, source, column_names: str | list[str] | None = None, column_types=None, schema=None,
                 num_samples: int | None = None, num_parallel_workers: int = 1, shuffle: bool | None = None,
                 sampler=None, num_shards: int | None = None, shard_id: int | None = None,
                 python_multiprocessing: bool = True, max_rowsize=None):
        if column_types is not None or schema is not None:
            raise UserError("GeneratorDataset(column_types=/schema=): the columns keep the types the source gives; "
                            "cast them with map(operations=TypeCast(...), input_columns=...)")
        if sampler is not None or num_shards is not None or shard_id is not None:
            raise UserError("GeneratorDataset(sampler=/num_shards=/shard_id=): every rank reads the whole global "
                            "batch here (full_batch) and keeps its rows; leave them out")
        if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, int)
                                        or num_samples < 1):
            raise UserError(f"GeneratorDataset(num_samples={num_samples!r}): expected a positive int, or None for all")
        random_access = hasattr(source, "__getitem__") and hasattr(source, "__len__")
        if not (callable(source) or random_access or hasattr(source, "__iter__")):
            raise UserError(f"GeneratorDataset(source={source!r:.60}): expected a function returning an iterator "
                            f"of rows, an iterable of rows or a random-access dataset")
        self.source, self.num_samples = source, num_samples
        self.column_names = [column_names] if isinstance(column_names, str) else list(column_names or [])
        self.shuffle = random_access if shuffle is None else bool(shuffle)
        self.maps: list[tuple[list[int], list]] = []
        self._rows: list[tuple] | None = None

    def _all_rows(self) -> list[tuple]:
        if self._rows is None:
            if callable(self.source) and not hasattr(self.source, "__getitem__"):
                rows = self.source()
            elif hasattr(self.source, "__getitem__") and hasattr(self.source, "__len__"):
                rows = (self.source[i] for i in range(len(self.source)))
            else:
                rows = iter(self.source)
            self._rows = [self._row(row) for _, row in zip(range(self.num_samples or np.iinfo(np.int64).max), rows)]
            self.indices = np.arange(len(self._rows))
        return self._rows

    def _row(self, row) -> tuple:
        row = tuple(row) if isinstance(row, (tuple, list)) else (row,)
        if self.column_names and len(row) != len(self.column_names):
            raise UserError(f"GeneratorDataset: a row has {len(row)} columns, column_names names "
                            f"{len(self.column_names)} ({', '.join(self.column_names)})")
        return tuple(np.asarray(value) for value in row)

    def __len__(self) -> int:
        return len(self._all_rows())

    def order(self) -> np.ndarray:
        self._all_rows()
        return super().order()

    def rows(self, indices: np.ndarray) -> tuple[torch.Tensor, ...]:
        """The columns of rows ``indices`` after the ``map`` operations, each stacked to (rows, ...)."""
        rows = [list(self._all_rows()[i]) for i in indices]
        for columns, operations in self.maps:
            for row in rows:
                for c in columns:
                    for operation in operations:
                        row[c] = operation(row[c])
        return tuple(torch.stack([torch.as_tensor(row[c]) for row in rows]) for c in range(len(rows[0])))

    def map(self, operations=None, input_columns: str | list[str] | None = None, output_columns=None,
            num_parallel_workers: int | None = None, python_multiprocessing: bool = False,
            max_rowsize=None) -> "GeneratorDataset":
        """A dataset whose rows have ``operations`` (a callable or a list of them, applied in turn to each value)
        applied to the columns ``input_columns`` (default: the first). The worker options are accepted; the
        operations run in this process, when a batch is read."""
        operations = operations if isinstance(operations, (list, tuple)) else [operations]
        if not operations or not all(callable(op) for op in operations):
            raise UserError(f"map(operations={operations!r:.60}): expected a callable, or a list of them")
        if output_columns is not None and output_columns != input_columns:
            raise UserError("map(output_columns=...): the operations replace their input columns here; leave "
                            "output_columns out")
        names = [input_columns] if isinstance(input_columns, str) else list(input_columns or self.column_names[:1])
        unknown = [n for n in names if n not in self.column_names]
        if unknown:
            raise UserError(f"map(input_columns={input_columns!r}): no column {unknown[0]!r}; the columns are "
                            f"{', '.join(self.column_names)}")
        mapped = object.__new__(GeneratorDataset)
        mapped.__dict__.update(self.__dict__)
        mapped.maps = self.maps + [([self.column_names.index(n) for n in names], list(operations))]
        return mapped

    def get_col_names(self) -> list[str]:
        """The column names."""
        return list(self.column_names)
