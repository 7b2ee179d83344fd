"""Batches for the trainer: each data-parallel rank reads its rows of every global batch."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from paratrain.config import Config, ConfigError
from paratrain.data import DataError, not_utf8
from paratrain.data.cifar import CifarDataset
from paratrain.data.datasets import ChatDataset, DocumentsDataset, TextDataset, TranslationDataset
from paratrain.data.sampler import DistributedSampler
from paratrain.data.synthetic import CPU, SyntheticLM, SyntheticTranslation
from paratrain.data.tokenizer import Tokenizer, lines_of
from paratrain.device import pinned, to_device


class ShardedBatches:
    """Step -> this data-parallel rank's rows of the global batch (B / dp rows, in rank order), on ``device``.

    A synthetic source makes any rows of any global batch from (seed, step, row). A dataset (one with ``rows``) is
    ordered by a ``DistributedSampler`` seeded with ``seed``; this rank reads only its own rows. While a step runs,
    the next step's rows are made on the host by a background thread (pinned for a fast copy when the device is a GPU)
    and copied with ``non_blocking``. ``state_dict``/``load_state_dict`` hold the next step, so a resumed run reads
    exactly the batches that come next.

    Causal inputs (``input_ids``, ``tgt_in_ids``) must be padded at the end of each row
    with ``pad_token_id``: the models' causal attention does not mask padding.
    """

    CAUSAL_INPUTS = ("input_ids", "tgt_in_ids")

    def __init__(self, source, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 device: torch.device = CPU, pad_token_id: int | None = None):
        self.source, self.global_batch_size = source, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.device, self.pad_token_id = device, pad_token_id
        self.sampler = None
        if hasattr(source, "rows"):
            self.sampler = DistributedSampler(len(source), global_batch_size, dp_rank, dp_size,
                                              seed=getattr(source, "seed", 0), shuffle=getattr(source, "shuffle", True),
                                              lengths=getattr(source, "lengths", None),
                                              bucket_size=getattr(source, "bucket_size", 0))
        self.next_step = 0
        self._workers = ThreadPoolExecutor(1, thread_name_prefix="paratrain-data")
        self._ahead: tuple[int, Future] | None = None  # (step, its rows being made)

    def host_rows(self, step: int) -> dict[str, torch.Tensor]:
        """This rank's rows of global batch ``step``, on the host."""
        if self.sampler is not None:
            rows = self.source.rows(self.sampler.indices(step), self.sampler.global_indices(step))
        else:
            per_rank = self.global_batch_size // self.dp_size
            rows = self.source.batch_rows(step, self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
        for key in self.CAUSAL_INPUTS:
            ids = rows.get(key)
            if ids is not None and self.pad_token_id is not None and \
                    bool(((ids[:, :-1] == self.pad_token_id) & (ids[:, 1:] != self.pad_token_id)).any()):
                raise DataError(f"{key} of step {step} has padding ({self.pad_token_id}) before a token: pad "
                                f"each sequence at its end (causal attention does not mask padding)")
        # one block each (a source's input_ids may be a view of its windows): made here, off the step, the device
        # copy is one transfer and the step's lookups and gathers read them as they are
        return {k: pinned(v.contiguous(), self.device) for k, v in rows.items()}

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """Rows of step ``step`` on the device; starts making those of ``step + 1``."""
        ahead, self._ahead = self._ahead, None
        rows = ahead[1].result() if ahead is not None and ahead[0] == step else self.host_rows(step)
        self._ahead = (step + 1, self._workers.submit(self.host_rows, step + 1))
        self.next_step = step + 1
        return {k: to_device(v, self.device) for k, v in rows.items()}

    def state_dict(self) -> dict:
        return self.sampler.state_dict() | {"step": self.next_step} if self.sampler else {"step": self.next_step}

    def load_state_dict(self, state: dict) -> None:
        if self.sampler is not None:
            self.sampler.load_state_dict(state)
        self.next_step = int(state["step"])
        self._ahead = None


class HeldOutBatches:
    """A decoder's held-out data, the same every time it is read: this data-parallel rank's rows (B / dp, in rank
    order) of up to ``batches`` global batches of ``source``, kept on the host and iterated on ``device``.

    A dataset (one with ``rows``) gives its windows in order, as many whole global batches as it holds up to
    ``batches`` (DataError: not one); a synthetic source the global batches of steps -1, -2, ..., which training
    never reads."""

    def __init__(self, source, global_batch_size: int, batches: int, dp_rank: int = 0, dp_size: int = 1,
                 device: torch.device = CPU):
        per_rank = global_batch_size // dp_size
        start, stop = dp_rank * per_rank, (dp_rank + 1) * per_rank
        if hasattr(source, "rows"):
            whole = len(source) // global_batch_size
            if not whole:
                raise DataError(f"data.eval_path={source.path} holds {len(source)} windows of model.seq_length "
                                f"tokens, fewer than train.global_batch_size={global_batch_size}: give more "
                                f"held-out data")
            first = [i * global_batch_size for i in range(min(batches, whole))]
            host = [source.rows(np.arange(f + start, f + stop), np.arange(f, f + global_batch_size)) for f in first]
        else:
            host = [source.batch_rows(-1 - i, start, stop) for i in range(batches)]
        self.host = [{k: pinned(v.contiguous(), device) for k, v in rows.items()} for rows in host]
        self.device = device

    def __len__(self) -> int:
        return len(self.host)

    def __iter__(self):
        for rows in self.host:
            yield {k: to_device(v, self.device) for k, v in rows.items()}


def load_tokenizer(cfg: Config) -> Tokenizer:
    """``data.tokenizer``, trained on ``data.path`` (the lines of its file, or the texts of its documents) with
    ``model.vocab_size`` tokens and saved there if absent; without ``data.tokenizer`` a ``model.from_hf`` directory's
    own."""
    if cfg.model.from_hf and not cfg.data.tokenizer:
        path = Path(cfg.model.from_hf) / "tokenizer.json"
        tokenizer = Tokenizer.of_hf_model(cfg.model.from_hf)
    else:
        path = Path(cfg.data.tokenizer or Path(cfg.data.path).with_name("tokenizer.json"))
        if not path.is_file() and cfg.data.kind == "chat":
            raise DataError(f"data.tokenizer={str(path)!r} does not exist: chat data needs the tokenizer its chat "
                            f"template was written for (or model.from_hf, whose tokenizer it takes)")
        if not path.is_file():
            try:
                if cfg.data.kind == "documents":
                    from paratrain.data.documents import read_documents
                    texts = read_documents(Path(cfg.data.path), cfg.data.text_field)
                else:
                    texts = lines_of([cfg.data.path])
                Tokenizer.train(texts, cfg.model.vocab_size).save(path)
            except UnicodeDecodeError as exc:
                raise not_utf8(cfg.data.path, exc) from None
            except OSError as exc:
                raise DataError(f"cannot train tokenizer {path} on data.path={cfg.data.path}: {exc.strerror} "
                                f"({exc.filename})") from None
        tokenizer = Tokenizer.load(path)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError([f"tokenizer {path} has {tokenizer.vocab_size} tokens, more than model.vocab_size="
                           f"{cfg.model.vocab_size}: set model.vocab_size={tokenizer.vocab_size} or retrain it smaller"])
    return tokenizer


def build_dataset(cfg: Config, key: str = "path"):
    """The batch source named by ``cfg.data.kind`` for ``cfg.model.kind``, of the files of ``data.<key>``
    (``eval_path``: the held-out ones, read with the training data's tokenizer).

    Datasets carry their order settings (``seed``, ``shuffle``, ``bucket_size``)
    for the ``ShardedBatches`` that reads them.
    """
    d, m = cfg.data, cfg.model
    if d.problems():
        raise ConfigError(d.problems())
    if d.kind == "synthetic":
        if m.spec.encoder_decoder:
            return SyntheticTranslation(m, cfg.run.seed, d.synthetic_task(m.kind), d.min_length)
        return SyntheticLM(m, cfg.run.seed)
    path = getattr(d, key)
    try:
        if d.kind == "translation":
            dataset = TranslationDataset(path, load_tokenizer(cfg), m.src_seq_length, m.tgt_seq_length,
                                         d.too_long, d.dynamic_padding)
        elif d.kind == "text":
            dataset = TextDataset(path, None if path.endswith(".npy") else load_tokenizer(cfg), m.seq_length)
        elif d.kind == "documents":
            dataset = DocumentsDataset(path, load_tokenizer(cfg), m.seq_length, d.text_field, d.document_mask)
        elif d.kind == "chat":
            from paratrain.data.chat import ChatTemplate

            template = ChatTemplate.load(m.from_hf or None, d.chat_template or None)
            dataset = ChatDataset(path, load_tokenizer(cfg), template, m.seq_length, d.train_on, d.packing,
                                  d.document_mask, d.too_long)
        else:
            dataset = CifarDataset(path, train=True)
    except (DataError, ConfigError):
        raise
    except UnicodeDecodeError as exc:
        raise not_utf8(path, exc) from None
    except (ValueError, OSError) as exc:  # numpy's, or a file that changed since the checks at start
        raise DataError(f"data.{key}={path} cannot be used: {exc}") from None
    dataset.seed, dataset.shuffle, dataset.bucket_size = cfg.run.seed, d.shuffle, d.bucket_size
    return dataset
