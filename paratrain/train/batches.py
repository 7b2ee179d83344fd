"""The batches of ``Model.train`` and ``Model.eval``: a dataset's batch as a tuple of tensors, the checks of each
batch on the host as it is drawn (``BatchCheck``), and the streams of batches a training epoch or sink draws."""
from __future__ import annotations

import itertools
from typing import Iterable

import numpy as np
import torch
from torch import nn

from paratrain.config import ParallelConfig
from paratrain.errors import UserError
from paratrain.train.callbacks import CallbackParams


def dataset_shards(owner: str, config: ParallelConfig, world_size: int, dataset: Iterable) -> int:
    """The shards ``dataset`` is split into (its ``num_shards``; 1: every rank gives the global batch); a split other
    than one per rank, all of them data-parallel, refused naming ``owner``."""
    shards = getattr(dataset, "num_shards", None) or 1
    if shards > 1 and not shards == config.data_parallel == world_size:
        raise UserError(f"{owner}: the dataset is split into num_shards={shards} for {world_size} ranks, "
                        f"{config.data_parallel} of them data-parallel: a dataset split per rank needs "
                        f"num_shards=get_group_size() and no model or pipeline parallelism")
    return shards


def as_batch(batch) -> tuple:
    """A dataset's batch as a tuple, its NumPy arrays (what MindSpore's datasets give) as tensors."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        batch = (batch,)
    if isinstance(batch, (tuple, list)):
        return tuple(torch.from_numpy(t) if isinstance(t, np.ndarray) else t for t in batch)
    raise UserError(f"Model.train: a batch must be a tuple of tensors (the net's forward arguments), got "
                    f"{type(batch).__name__}")


def ids_per_row(first) -> int:
    """The tokens of a row of a batch whose first tensor is ``first``: its ids per row when it holds integer
    ids, else 1 (a row is one sample)."""
    if isinstance(first, torch.Tensor) and first.ndim > 1 and not first.is_floating_point():
        return first.shape[1:].numel()
    return 1


def _kind(value) -> tuple[str, tuple[int, ...] | None]:
    """(dtype, shape) of a tensor of a batch; (type name, None) of anything else."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch."), tuple(value.shape)
    return type(value).__name__, None


def _kinds_text(kinds: list) -> str:
    return "(" + ", ".join(name if shape is None else f"{list(shape)} {name}" for name, shape in kinds) + ")"


def _alike(kinds: list, first: list, rows_may_differ: bool) -> bool:
    """Whether a batch of ``kinds`` is like the first batch: the same tensors, dtypes and shapes, but for the
    rows (the first dimension) when ``rows_may_differ``."""

    def compared(kind):
        name, shape = kind
        return name, shape if shape is None or not rows_may_differ else (len(shape), shape[1:])

    return [compared(k) for k in kinds] == [compared(k) for k in first]


def _declared_shape_problem(net: nn.Module, first: torch.Tensor) -> str | None:
    """What is wrong with a first batch whose first tensor is ``first`` (the net's input: ids (B, T) or hidden
    states (B, T, H)) for the ``batch_size`` and sequence lengths the net's attention blocks were built with; None
    when they declare none or it fits. Under a ``PipelineCell(network, micro_size)`` the blocks may be built with
    the batch's rows or with the rows of one micro-batch (MindSpore's tutorial builds them with
    ``batch_size // micro_size``). A length one longer than declared is an input the net shifts itself."""
    from paratrain.nn.cell import PipelineCell
    from paratrain.nn.layers import MultiHeadAttention

    blocks = [m for m in net.modules() if isinstance(m, MultiHeadAttention)]
    batch_sizes = {m.batch_size for m in blocks}
    lengths = sorted({n for m in blocks for n in (m.src_seq_length, m.tgt_seq_length)})
    if not blocks or first.ndim < 2 or len(batch_sizes) != 1:
        return None
    (batch_size,) = batch_sizes
    rows, micro_size = first.shape[0], net.micro_size if isinstance(net, PipelineCell) else 1
    fitting = {rows} | ({rows // micro_size} if rows % micro_size == 0 else set())
    if batch_size not in fitting:
        micro = (f" or with the rows of one of its micro_size={micro_size} micro-batches ({rows // micro_size})"
                 if len(fitting) > 1 else "")
        return (f"its first tensor has {rows} rows, but the net's blocks were built with batch_size={batch_size}: "
                f"build the blocks with batch_size={rows}{micro} or give batches that fit")
    if first.shape[1] not in lengths and first.shape[1] - 1 not in lengths:
        return (f"its first tensor has length {first.shape[1]}, but the net's blocks were built with sequence "
                f"lengths {lengths}: give sequences of that length or build the blocks with it")
    return None


def batch_position(params: CallbackParams) -> str:
    """The batch of the step under way, in words."""
    return f"batch index {params.cur_step_in_epoch} of epoch {params.cur_epoch_num}"


def _token_problem(vocab: int | None, batch: tuple) -> str | None:
    """An id of the batch's integer (B, T) tensors on the host that no row of the net's largest embedding table
    (``vocab`` rows; None: the net has none) holds (it would end the step in an IndexError); None when there is
    none (the tensors on a device are not read: that would wait for the device every step)."""
    if vocab is None:
        return None
    for index, tensor in enumerate(batch):
        if (isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and tensor.ndim >= 2
                and not tensor.is_floating_point() and tensor.dtype != torch.bool and tensor.numel()):
            largest = int(tensor.max())
            if largest >= vocab:
                return (f"tensor {index} holds id {largest}, but the net's largest embedding table has vocab_size="
                        f"{vocab} rows (ids 0..{vocab - 1}): build the embedding with a larger vocab_size or "
                        f"fix the data")
    return None


class BatchCheck:
    """The checks of ``Model.train``'s batches on the host as they are drawn, against the first batch (the
    (dtype, shape) of each of its tensors, kept for every later batch and ``train`` call)."""

    def __init__(self, network: nn.Module):
        self.network = network
        self.first_batch: list | None = None
        # the net's largest embedding table, as built (before placement shards any)
        self.vocab = max((m.num_embeddings for m in network.modules() if isinstance(m, nn.Embedding)), default=None)

    def __call__(self, batch: tuple, config: ParallelConfig, where: str, rows_of_this_rank: bool) -> None:
        """Refuse, before it runs, a batch unlike the first (its tensors' count, dtypes and shapes; the rows may differ,
        as in a last, smaller batch, except under a pipeline, traced with the first batch's shapes), a first batch
        unlike the blocks' declared shapes (unless each rank reads its own rows: ``rows_of_this_rank``), and ids
        beyond the net's embedding tables."""
        kinds = [_kind(t) for t in batch]
        problem = _token_problem(self.vocab, batch)
        if self.first_batch is None and problem is None and not rows_of_this_rank:
            problem = isinstance(batch[0], torch.Tensor) and _declared_shape_problem(self.network, batch[0])
        if problem:
            raise UserError(f"Model.train: {where}: {problem}")
        if self.first_batch is None:
            self.first_batch = kinds
        elif not _alike(kinds, self.first_batch, rows_may_differ=config.pipeline_stage == 1):
            rows = "" if config.pipeline_stage == 1 else " (a pipeline's rows too)"
            raise UserError(f"Model.train: {where} is {_kinds_text(kinds)}, unlike the first batch "
                            f"{_kinds_text(self.first_batch)}: give every batch the first one's tensors, dtypes "
                            f"and shapes{rows}")


def first_batch(owner: str, name: str, dataset: Iterable) -> tuple:
    """(the first batch of ``dataset``, the dataset to iterate from its start): a one-shot iterator's first batch
    is put back in front of the rest. UserError naming the argument when it gives no batch."""
    batches = iter(dataset)
    first = next(batches, None)
    if first is None:
        raise UserError(f"{owner}: {name} gave no batch")
    return first, (itertools.chain([first], batches) if batches is dataset else dataset)


def endless_batches(dataset: Iterable):
    """The batches of ``dataset`` without end, iterating it again whenever it runs out."""
    while True:
        empty = True
        for batch in dataset:
            empty = False
            yield batch
        if empty:
            raise UserError("Model.train: train_dataset gave no batch")


_END = object()


def with_last(items: Iterable):
    """(item, whether it is the last) of each of ``items``, drawing each one a step ahead."""
    items = iter(items)
    current = next(items, _END)
    while current is not _END:
        following = next(items, _END)
        yield current, following is _END
        current = following
