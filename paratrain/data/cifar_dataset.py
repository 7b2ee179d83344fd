"""MindSpore's ``Cifar10Dataset(dataset_dir, num_shards=..., shard_id=...).batch(...)`` for user scripts.

Each rank reads only its share of the memory-mapped records: record ``i`` belongs to shard
``i % num_shards``, as MindSpore's distributed sampler deals them, every shard padded with the first
records to ``ceil(records / num_shards)`` rows so that every rank takes as many steps. Images are
normalised only (no random crop, flip or resize). ``write_cifar10_sample`` writes a small sample in
the real binary format for examples and tests that have no CIFAR-10 download.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from paratrain.data.cifar import CifarDataset, write_cifar_bin
from paratrain.data.row_dataset import RowDataset
from paratrain.errors import UserError

USAGES = {"train": True, "test": False}


class Cifar10Dataset(RowDataset):
    """CIFAR-10 from ``dataset_dir`` (a ``cifar-10-batches-bin`` directory): ``usage`` ``"train"`` or ``"test"``,
    this rank's share ``shard_id`` of ``num_shards`` (None: all), the first ``num_samples`` of the share,
    in a fresh order each epoch with ``shuffle`` (seeded; the same on every rank).

    Iterating gives (image (3, 32, 32) float32 normalised with the CIFAR-10 mean and std, label int64);
    ``batch(batch_size, drop_remainder)`` gives the batches ``Model.train`` takes.
    """

    def __init__(self, dataset_dir: str | Path, usage: str = "train", num_samples: int | None = None,
                 shuffle: bool = False, num_shards: int | None = None, shard_id: int | None = None, seed: int = 0):
        if usage not in USAGES:
            raise UserError(f"Cifar10Dataset(usage={usage!r}): expected 'train' or 'test'")
        if (num_shards is None) != (shard_id is None):
            raise UserError("Cifar10Dataset: give num_shards and shard_id together")
        num_shards, shard_id = (1, 0) if num_shards is None else (num_shards, shard_id)
        if num_shards < 1 or not 0 <= shard_id < num_shards:
            raise UserError(f"Cifar10Dataset(num_shards={num_shards}, shard_id={shard_id}): expected num_shards >= 1 "
                            f"and shard_id in 0..num_shards - 1 (get_group_size(), get_rank())")
        if num_samples is not None and num_samples < 1:
            raise UserError(f"Cifar10Dataset(num_samples={num_samples}): expected a positive count, or None for all")
        try:
            self.source = CifarDataset(dataset_dir, train=USAGES[usage])
        except FileNotFoundError:
            raise UserError(f"Cifar10Dataset({str(dataset_dir)!r}) has no {usage} batches (data_batch_1.bin.., "
                            f"test_batch.bin): give the cifar-10-batches-bin directory, or write a sample there "
                            f"with write_cifar10_sample") from None
        self.num_shards, self.shard_id, self.shuffle, self.seed = num_shards, shard_id, shuffle, seed
        per_shard = -(-len(self.source) // num_shards)
        self.indices = (np.arange(per_shard) * num_shards + shard_id)[:num_samples] % len(self.source)

    def rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The (images, labels) of records ``indices``."""
        rows = self.source.rows(indices)
        return rows["images"], rows["labels"]


def write_cifar10_sample(directory: str | Path, num_images: int = 256, seed: int = 0) -> Path:
    """Write ``num_images`` 32x32 images as ``data_batch_1.bin`` (and a quarter as many as ``test_batch.bin``)
    in CIFAR-10's binary format under ``directory``: each class has its own mean colour, plus noise, so
    that a network can learn them. Returns ``directory``."""
    rng = np.random.default_rng(seed)
    colours = rng.integers(40, 216, (10, 3))
    directory = Path(directory)
    for name, count in (("data_batch_1.bin", num_images), ("test_batch.bin", max(1, num_images // 4))):
        labels = rng.integers(0, 10, count)
        noise = rng.normal(0, 30, (count, 3, 32, 32))
        images = np.clip(colours[labels][:, :, None, None] + noise, 0, 255).astype(np.uint8)
        write_cifar_bin(directory / name, images, labels)
    return directory

