"""Datasets over real text: sentence pairs for translation, a token stream for language modelling.

Text is tokenized once, cached as ``.npy`` arrays next to the data (named by the tokenizer's
fingerprint) and read memory-mapped. ``rows(indices, batch_indices)`` gives the padded tensors of
those examples (``batch_indices``, the whole global batch, sets the width when padding to the longest).
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from paratrain.data import DataError
from paratrain.data.documents import document_files
from paratrain.data.synthetic import BOS, EOS, PAD
from paratrain.data.tokenizer import Tokenizer
from paratrain.data.wmt14 import read_pairs


def _ragged(side: str, rows: list[list[int]]) -> dict[str, np.ndarray]:
    """Rows of token ids as a flat int32 array ``{side}_tokens`` and (N+1,) int64 ``{side}_offsets``."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    tokens = np.fromiter((t for r in rows for t in r), dtype=np.int32, count=int(offsets[-1]))
    return {f"{side}_tokens": tokens, f"{side}_offsets": offsets}


def cached_arrays(source: Path, tokenizer: Tokenizer, build, files: list[Path] | None = None,
                  tag: str = "") -> dict[str, np.ndarray]:
    """Arrays ``build()`` makes from ``source``, saved once in ``<source>.<fingerprint>.cache/`` (appearing
    atomically: ranks building it together never read a half-written one) and memory-mapped.

    The cache is named by the tokenizer's fingerprint and the size and mtime of ``source`` (or of each of ``files``,
    a folder's, hashed with their names and ``tag``, what else the arrays depend on): a changed input is rebuilt."""
    if files is None and not tag:
        stat = source.stat()
        key = f"{stat.st_size}-{int(stat.st_mtime)}"
    else:
        stats = [(str(f), f.stat().st_size, int(f.stat().st_mtime)) for f in files or [source]]
        key = hashlib.sha1(repr((stats, tag)).encode()).hexdigest()[:12]
    cache = source.with_name(f"{source.name}.{tokenizer.fingerprint()}-{key}.cache")
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


def packed(documents: list[list[int]], eos_id: int) -> dict[str, np.ndarray]:
    """Token ids of documents as one int32 ``stream``, ``eos_id`` after each, and (N+1,) int64 ``starts``: document
    i is ``stream[starts[i]:starts[i + 1]]``, its EOS included."""
    arrays = _ragged("documents", [[*ids, eos_id] for ids in documents])
    return {"stream": arrays["documents_tokens"], "starts": arrays["documents_offsets"]}


def _pad(rows: list[np.ndarray], width: int) -> torch.Tensor:
    out = np.full((len(rows), width), PAD, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return torch.from_numpy(out)


class TranslationDataset:
    """Tokenized (source, target) pairs from a ``source<TAB>target`` file.

    ``rows`` returns src_ids (b, S); tgt_in_ids (b, T) = BOS + target; labels (b, T) = target + EOS; PAD=0
    after. S, T are the model's sequence lengths, or with ``dynamic_padding`` the global batch's longest.
    Longer pairs are dropped (``too_long="filter"`` or ``"drop"``, counted in ``num_filtered``) or cut
    (``"truncate"``).
    """

    def __init__(self, path: str | Path, tokenizer: Tokenizer, src_seq_length: int, tgt_seq_length: int,
                 too_long: str = "filter", dynamic_padding: bool = False):
        if too_long not in ("filter", "drop", "truncate"):
            raise ValueError(f"data.too_long={too_long!r} is not one of filter, drop, truncate")
        self.path, self.tokenizer = Path(path), tokenizer
        self.src_seq_length, self.tgt_seq_length, self.dynamic_padding = src_seq_length, tgt_seq_length, dynamic_padding

        def build():
            pairs = read_pairs(self.path)
            return (_ragged("src", tokenizer.encode_batch([p[0] for p in pairs]))
                    | _ragged("tgt", tokenizer.encode_batch([p[1] for p in pairs])))

        self.arrays = cached_arrays(self.path, tokenizer, build)
        src_len, tgt_len = np.diff(self.arrays["src_offsets"]), np.diff(self.arrays["tgt_offsets"]) + 1
        fits = (src_len <= src_seq_length) & (tgt_len <= tgt_seq_length)
        self.examples = np.arange(len(fits)) if too_long == "truncate" else np.flatnonzero(fits)
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
    into windows of ``seq_length + 1`` tokens: ``rows`` returns input_ids (b, L) and labels (b, L), shifted left by
    one.

    Subclasses give the stream as documents (``load``: the stream and its document ``starts``); with
    ``document_mask`` ``rows`` also returns, per input token, ``document_ids`` (b, L) (0 for the document the window
    starts in, counting up at each start of another) and ``position_ids`` (b, L), its position in its document's
    part of the window (0 at the window's start or the document's, whichever is later)."""

    def __init__(self, path: str | Path, tokenizer: Tokenizer | None, seq_length: int, document_mask: bool = False):
        self.path, self.seq_length, self.document_mask = Path(path), seq_length, document_mask
        arrays = self.load(tokenizer)
        self.stream, self.starts = arrays["stream"], arrays.get("starts")
        if document_mask and self.starts is None:
            raise DataError(f"{path}: data.document_mask needs document boundaries: use data.kind='documents'")
        if len(self) == 0:
            raise DataError(f"{path} holds {len(self.stream)} tokens, fewer than model.seq_length + 1 = "
                             f"{seq_length + 1}: give more text or a shorter model.seq_length")

    def load(self, tokenizer: Tokenizer | None) -> dict[str, np.ndarray]:
        """``{"stream": (N,) token ids}``, and ``"starts"`` where the stream is made of documents (see ``packed``)."""
        if self.path.suffix == ".npy":
            return {"stream": np.load(self.path, mmap_mode="r")}
        if tokenizer is None:
            raise DataError(f"{self.path} is text: set data.tokenizer to tokenize it")

        def build():
            with open(self.path, encoding="utf-8") as f:
                return {"stream": packed(tokenizer.encode_batch(f.read().splitlines()), tokenizer.eos_id)["stream"]}

        return cached_arrays(self.path, tokenizer, build)

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // self.seq_length)

    def rows(self, indices: np.ndarray, batch_indices: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        L = self.seq_length
        first = np.asarray(indices, dtype=np.int64) * L  # each window's first token in the stream
        windows = np.stack([np.asarray(self.stream[i : i + L + 1]) for i in first])
        windows = torch.from_numpy(windows.astype(np.int64))
        out = {"input_ids": windows[:, :-1], "labels": windows[:, 1:]}
        if self.document_mask:
            token = first[:, None] + np.arange(L)  # (b, L) stream index of each input token
            document = np.searchsorted(self.starts, token, side="right") - 1
            out["document_ids"] = torch.from_numpy(document - document[:, :1])
            out["position_ids"] = torch.from_numpy(token - np.maximum(self.starts[document], first[:, None]))
        return out


class DocumentsDataset(TextDataset):
    """Documents of a folder or file of ``.jsonl`` / ``.parquet`` (the text in field ``text_field``) and ``.txt``
    (one document a file) files, read through ``datasets``, tokenized once (the tokenizers library encodes a batch in
    parallel) and cached beside ``path`` as a memory-mapped stream with the tokenizer's EOS after each document and
    the documents' starts; packed into the windows of ``TextDataset`` (with its ``document_mask``)."""

    def __init__(self, path: str | Path, tokenizer: Tokenizer, seq_length: int, text_field: str = "text",
                 document_mask: bool = False):
        self.text_field = text_field
        super().__init__(path, tokenizer, seq_length, document_mask)

    def load(self, tokenizer: Tokenizer | None) -> dict[str, np.ndarray]:
        from paratrain.data.documents import document_problems, read_documents

        if tokenizer is None:
            raise DataError(f"{self.path} holds documents: set data.tokenizer to tokenize them")

        def build():
            if problems := document_problems(self.path, self.text_field):
                raise DataError("; ".join(problems))
            return packed(tokenizer.encode_batch(read_documents(self.path, self.text_field)), tokenizer.eos_id)

        return cached_arrays(self.path, tokenizer, build, files=document_files(self.path), tag=self.text_field)


class ChatDataset:
    """Conversations of a folder or file of ``.jsonl`` / ``.parquet`` records (``paratrain.data.chat``), rendered
    with ``template``, tokenized once and cached beside ``path``, in rows of ``seq_length`` positions: each
    conversation of n tokens fills n - 1 of them (its tokens but the last as inputs, each predicting the next).

    ``rows`` returns input_ids (b, L) and labels (b, L): the next token, or -100 (not counted in the loss) where it
    is not the assistant's (``train_on="assistant"``) and on the padding after a row's last conversation (whose
    inputs are ``tokenizer.eos_id``). One conversation a row, or with ``packing`` as many consecutive ones as fit;
    with ``document_mask`` also each position's conversation in its row, ``document_ids`` (b, L) (from 0; the
    padding one more), and its ``position_ids`` (b, L) in it. A conversation of more than L + 1 tokens is dropped
    (``too_long`` "filter" or "drop") or cut to its first L + 1 (``"truncate"``): ``num_too_long`` counts them;
    ``num_unlearned`` counts the conversations left out with no token to learn in their first L + 1."""

    def __init__(self, path: str | Path, tokenizer: Tokenizer, template, seq_length: int, train_on: str = "assistant",
                 packing: bool = False, document_mask: bool = False, too_long: str = "filter"):
        from paratrain.data.chat import FORMATS, chat_problems, read_conversations

        self.path, self.seq_length, self.document_mask = Path(path), seq_length, document_mask
        self.train_on, self.pad_id = train_on, tokenizer.eos_id
        assistant = train_on == "assistant"

        def build():
            if problems := chat_problems(self.path):
                raise DataError("; ".join(problems))
            return template.tokenized(read_conversations(self.path), tokenizer, assistant)

        self.arrays = cached_arrays(self.path, tokenizer, build, files=document_files(self.path, FORMATS),
                                    tag=f"{template.fingerprint()}-{train_on}")
        starts, tokens = self.arrays["offsets"][:-1], np.diff(self.arrays["offsets"])
        longer = tokens > seq_length + 1
        kept = np.minimum(tokens, seq_length + 1)
        useful = kept >= 2
        if assistant:  # an assistant token among the targets of the kept tokens (all but the first)
            counted = np.concatenate([[0], np.cumsum(self.arrays["assistant"], dtype=np.int64)])
            useful &= counted[starts + kept] > counted[starts + np.minimum(kept, 1)]
        dropped = longer & (too_long != "truncate")
        self.too_long, self.num_too_long = too_long, int(longer.sum())
        self.num_unlearned = int((~useful & ~dropped).sum())
        useful &= ~dropped
        self.examples, self.kept = np.flatnonzero(useful), kept[useful]
        if not len(self.examples):
            raise DataError(f"{path}: none of the {len(tokens)} conversations has a token to learn within "
                            f"model.seq_length + 1 = {seq_length + 1} tokens: raise model.seq_length, or set "
                            f"data.too_long='truncate'")
        self.row_starts = self._rows(self.kept - 1, packing)

    def _rows(self, positions: np.ndarray, packing: bool) -> np.ndarray:
        """(rows + 1,) the first example (of ``self.examples``) of each row, and their number last: one a row, or
        with ``packing`` each row as many consecutive ones as fit in its ``seq_length`` positions."""
        if not packing:
            return np.arange(len(positions) + 1)
        starts, used = [0], 0
        for number, filled in enumerate(positions.tolist()):
            if used + filled > self.seq_length:
                starts.append(number)
                used = 0
            used += filled
        return np.array(starts + [len(positions)])

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def summary(self) -> str:
        """The log line of what the conversations became: how many train in how many rows, how many were too long
        and what became of them, how many are left out with no token to learn."""
        fate = "truncated" if self.too_long == "truncate" else "dropped"
        return (f"data: {len(self.examples)} conversations in {len(self)} rows of model.seq_length="
                f"{self.seq_length}; {self.num_too_long} longer than {self.seq_length + 1} tokens {fate} "
                f"(data.too_long={self.too_long!r}); {self.num_unlearned} left out with no "
                f"{'assistant ' if self.train_on == 'assistant' else ''}token to learn")

    def rows(self, indices: np.ndarray, batch_indices: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        L, offsets = self.seq_length, self.arrays["offsets"]
        inputs = np.full((len(indices), L), self.pad_id, dtype=np.int64)
        labels = np.full((len(indices), L), -100, dtype=np.int64)
        documents, positions = np.zeros((len(indices), L), dtype=np.int64), np.zeros((len(indices), L), dtype=np.int64)
        for row, index in enumerate(np.asarray(indices)):
            at, first, last = 0, self.row_starts[index], self.row_starts[index + 1]
            for document, (example, kept) in enumerate(zip(self.examples[first:last], self.kept[first:last])):
                start = offsets[example]
                ids = np.asarray(self.arrays["tokens"][start : start + kept], dtype=np.int64)
                n = kept - 1
                inputs[row, at : at + n] = ids[:-1]
                learned = np.asarray(self.arrays["assistant"][start + 1 : start + kept], dtype=bool) \
                    if self.train_on == "assistant" else np.ones(n, dtype=bool)
                labels[row, at : at + n] = np.where(learned, ids[1:], -100)
                documents[row, at : at + n], positions[row, at : at + n] = document, np.arange(n)
                at += n
            documents[row, at:], positions[row, at:] = last - first, np.arange(L - at)
        out = {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels)}
        if self.document_mask:
            out |= {"document_ids": torch.from_numpy(documents), "position_ids": torch.from_numpy(positions)}
        return out
