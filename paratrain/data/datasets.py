"""Datasets over real text: sentence pairs for translation, a token stream for language modelling.

Text is tokenized once, cached as ``.npy`` arrays next to the data (named by the tokenizer's
fingerprint) and read memory-mapped. ``rows(indices, batch_indices)`` gives the padded tensors of
those examples (``batch_indices``, the whole global batch, sets the width when padding to the longest).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import torch

from paratrain.data import DataError
from paratrain.data.synthetic import BOS, EOS, PAD
from paratrain.data.tokenizer import Tokenizer
from paratrain.data.wmt14 import read_pairs


def _ragged(side: str, rows: list[list[int]]) -> dict[str, np.ndarray]:
    """Rows of token ids as a flat int32 array ``{side}_tokens`` and (N+1,) int64 ``{side}_offsets``."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    tokens = np.fromiter((t for r in rows for t in r), dtype=np.int32, count=int(offsets[-1]))
    return {f"{side}_tokens": tokens, f"{side}_offsets": offsets}


def cached_arrays(source: Path, tokenizer: Tokenizer, build) -> dict[str, np.ndarray]:
    """Arrays ``build()`` makes from ``source``, saved once in ``<source>.<fingerprint>.cache/`` (appearing
    atomically: ranks building it together never read a half-written one) and memory-mapped."""
    stat = source.stat()
    cache = source.with_name(f"{source.name}.{tokenizer.fingerprint()}-{stat.st_size}-{int(stat.st_mtime)}.cache")
    if not cache.is_dir():
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        for name, array in build().items():
            np.save(tmp / f"{name}.npy", array)
        try:
            os.rename(tmp, cache)
        except OSError:  # another rank finished first
            shutil.rmtree(tmp)
    return {p.stem: np.load(p, mmap_mode="r") for p in cache.glob("*.npy")}


def _pad(rows: list[np.ndarray], width: int) -> torch.Tensor:
    out = np.full((len(rows), width), PAD, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return torch.from_numpy(out)


class TranslationDataset:
    """Tokenized (source, target) pairs from a ``source<TAB>target`` file.

    ``rows`` returns src_ids (b, S); tgt_in_ids (b, T) = BOS + target; labels (b, T) = target + EOS; PAD=0
    after. S, T are the model's sequence lengths, or with ``dynamic_padding`` the global batch's longest.
    Longer pairs are dropped (``too_long="filter"``, counted in ``num_filtered``) or cut (``"truncate"``).
    """

    def __init__(self, path: str | Path, tokenizer: Tokenizer, src_seq_length: int, tgt_seq_length: int,
                 too_long: str = "filter", dynamic_padding: bool = False):
        if too_long not in ("filter", "truncate"):
            raise ValueError(f"data.too_long={too_long!r} is not one of filter, truncate")
        self.path, self.tokenizer = Path(path), tokenizer
        self.src_seq_length, self.tgt_seq_length, self.dynamic_padding = src_seq_length, tgt_seq_length, dynamic_padding

        def build():
            pairs = read_pairs(self.path)
            return (_ragged("src", tokenizer.encode_batch([p[0] for p in pairs]))
                    | _ragged("tgt", tokenizer.encode_batch([p[1] for p in pairs])))

        self.arrays = cached_arrays(self.path, tokenizer, build)
        src_len, tgt_len = np.diff(self.arrays["src_offsets"]), np.diff(self.arrays["tgt_offsets"]) + 1
        fits = (src_len <= src_seq_length) & (tgt_len <= tgt_seq_length)
        self.examples = np.flatnonzero(fits) if too_long == "filter" else np.arange(len(fits))
        self.num_filtered = len(fits) - len(self.examples)
        if not len(self.examples):
            raise DataError(f"{path}: none of the {len(fits)} pairs fits src_seq_length={src_seq_length} and "
                             f"tgt_seq_length={tgt_seq_length}: raise them or set data.too_long='truncate'")
        self.src_lengths = np.minimum(src_len[self.examples], src_seq_length)
        self.tgt_lengths = np.minimum(tgt_len[self.examples], tgt_seq_length)  # BOS/EOS included

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def lengths(self) -> np.ndarray:
        """Per example, the longer of its padded source and target rows (for length bucketing)."""
        return np.maximum(self.src_lengths, self.tgt_lengths)

    def _tokens(self, side: str, example: int) -> np.ndarray:
        offsets = self.arrays[f"{side}_offsets"]
        return np.asarray(self.arrays[f"{side}_tokens"][offsets[example] : offsets[example + 1]])

    def rows(self, indices: np.ndarray, batch_indices: np.ndarray) -> dict[str, torch.Tensor]:
        S, T = self.src_seq_length, self.tgt_seq_length
        if self.dynamic_padding:
            S, T = int(self.src_lengths[batch_indices].max()), int(self.tgt_lengths[batch_indices].max())
        src, tgt_in, labels = [], [], []
        for example in self.examples[indices]:
            target = self._tokens("tgt", example)
            src.append(self._tokens("src", example)[: self.src_seq_length])
            tgt_in.append(np.concatenate([[BOS], target])[: self.tgt_seq_length])
            labels.append(np.concatenate([target, [EOS]])[: self.tgt_seq_length])
        return {"src_ids": _pad(src, S), "tgt_in_ids": _pad(tgt_in, T), "labels": _pad(labels, T)}


class TextDataset:
    """A token stream (a ``.npy`` array, or a text file tokenized once, the tokenizer's EOS after each line) cut
    into windows
    of ``seq_length + 1`` tokens: ``rows`` returns input_ids (b, L) and labels (b, L), shifted left by one."""

    def __init__(self, path: str | Path, tokenizer: Tokenizer | None, seq_length: int):
        self.path, self.seq_length = Path(path), seq_length
        if self.path.suffix == ".npy":
            self.stream = np.load(self.path, mmap_mode="r")
        else:
            if tokenizer is None:
                raise DataError(f"{path} is text: set data.tokenizer to tokenize it")

            def build():
                with open(self.path, encoding="utf-8") as f:
                    return {"stream": np.fromiter((t for ids in tokenizer.encode_batch(f.read().splitlines())
                                                   for t in (*ids, tokenizer.eos_id)), dtype=np.int32)}

            self.stream = cached_arrays(self.path, tokenizer, build)["stream"]
        if len(self) == 0:
            raise DataError(f"{path} holds {len(self.stream)} tokens, fewer than model.seq_length + 1 = "
                            f"{seq_length + 1}: give more text or a shorter model.seq_length")

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // self.seq_length)

    def rows(self, indices: np.ndarray, batch_indices: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        L = self.seq_length
        windows = np.stack([np.asarray(self.stream[i * L : i * L + L + 1]) for i in indices])
        windows = torch.from_numpy(windows.astype(np.int64))
        return {"input_ids": windows[:, :-1], "labels": windows[:, 1:]}
