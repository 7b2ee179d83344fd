"""CIFAR-10 in its binary format (``cifar-10-batches-bin``), read memory-mapped.

Each file is a sequence of 3073-byte records: one label byte (0-9), then 3072 pixel bytes, the 1024 red, 1024 green
and 1024 blue values of a 32x32 image in row-major order. ``data_batch_1.bin`` .. ``data_batch_5.bin`` are the
training set, ``test_batch.bin`` the test set.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

RECORD = 1 + 3 * 32 * 32
MEAN = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)
STD = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32)


def write_cifar_bin(path: str | Path, images: np.ndarray, labels: np.ndarray) -> Path:
    """Write uint8 images (N, 3, 32, 32) and labels (N,) as one file of CIFAR-10 binary records."""
    images, labels = np.asarray(images, dtype=np.uint8), np.asarray(labels, dtype=np.uint8)
    records = np.concatenate([labels.reshape(-1, 1), images.reshape(len(images), -1)], axis=1)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    records.tofile(path)
    return path


class CifarDataset:
    """CIFAR-10 images and labels from the binary batches in ``path``.

    ``rows(indices)`` returns images (b, 3, 32, 32) float32 normalised with
    the CIFAR-10 channel mean and std, and labels (b,) int64.
    """

    num_classes = 10

    def __init__(self, path: str | Path, train: bool = True):
        path = Path(path)
        names = [f"data_batch_{i}.bin" for i in range(1, 6)] if train else ["test_batch.bin"]
        files = [path / n for n in names if (path / n).is_file()]
        if not files:
            raise FileNotFoundError(f"{path} has none of {', '.join(names)}: point data.path at the "
                                    f"cifar-10-batches-bin directory")
        self.records = []
        for file in files:
            size = file.stat().st_size
            if size % RECORD:
                raise ValueError(f"{file} is {size} bytes, not a whole number of {RECORD}-byte CIFAR-10 records")
            self.records.append(np.memmap(file, dtype=np.uint8, mode="r", shape=(size // RECORD, RECORD)))
        self.starts = np.cumsum([0] + [len(r) for r in self.records])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def rows(self, indices: np.ndarray, batch_indices: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        files = np.searchsorted(self.starts, indices, side="right") - 1
        records = np.stack([self.records[f][i - self.starts[f]] for f, i in zip(files, indices)])
        bad = records[:, 0] >= self.num_classes
        if bad.any():
            raise ValueError(f"example {int(np.asarray(indices)[bad][0])} has label {records[bad][0, 0]}, not 0-9")
        images = records[:, 1:].reshape(-1, 3, 32, 32).astype(np.float32) / 255
        images = (images - MEAN[:, None, None]) / STD[:, None, None]
        return {"images": torch.from_numpy(images), "labels": torch.from_numpy(records[:, 0].astype(np.int64))}
