"""MindSpore's CrossEntropyLoss: the mean cross-entropy over the tokens an input mask keeps.

With vocab-sharded logits (a DTensor from a tensor-parallel head) the loss is computed on each
rank's slice of the vocabulary: only per-token maxima, sums of exponentials and target logits are
all-reduced over the model-parallel ranks, never the logits themselves.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from paratrain.errors import UserError
from paratrain.nn.cell import Cell
from paratrain.nn.config import default_dpmp_config, op_config

REDUCTIONS = ("mean", "sum_and_count")


class CrossEntropyLoss(Cell):
    """logits (N, V), labels (N,), input_mask (N,) -> the mean cross-entropy over tokens with mask 1.

    The mask weighs each token's loss (0 drops it; labels of dropped tokens may be anything), and a
    batch with nothing kept has loss 0 (MindSpore adds 1e-5 to the count for this; here the count is
    exact). Leading dimensions (B, T, V) are flattened. ``reduction``: ``"mean"``, or
    ``"sum_and_count"`` for the trainer, which sums both over data-parallel ranks and micro-batches:
    float32 (2,) ``[sum of the kept tokens' losses, number of kept tokens]``.

    Logits that are a DTensor sharded on the vocab dimension (and replicated on any other mesh
    dimension) are reduced vocab-parallel; the result is the same plain tensor on every rank.
    """

    def __init__(self, parallel_config=default_dpmp_config):
        super().__init__()
        op_config(parallel_config, "CrossEntropyLoss")
        self.reduction = "mean"

    def forward(self, logits, labels, input_mask):
        if self.reduction not in REDUCTIONS:
            raise UserError(f"CrossEntropyLoss: reduction={self.reduction!r} is not one of {', '.join(REDUCTIONS)}")
        mask = input_mask.reshape(-1).float()
        labels = torch.where(mask != 0, labels.reshape(-1), 0).long()
        if isinstance(logits, DTensor):
            token_loss = vocab_parallel_cross_entropy(logits, labels)
        else:
            token_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels, reduction="none")
        total, count = (token_loss * mask).sum(), mask.sum()
        if self.reduction == "sum_and_count":
            return torch.stack([total, count])
        return total / count.clamp(min=1e-5)


def vocab_parallel_cross_entropy(logits: DTensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy (N,) of (..., V) logits sharded on V over one mesh dimension, as a plain tensor."""
    vocab_dim = logits.ndim - 1
    mesh = logits.device_mesh
    shard_dims = [i for i, p in enumerate(logits.placements) if p.is_shard(vocab_dim)]
    others = [p for i, p in enumerate(logits.placements) if i not in shard_dims and not p.is_replicate()]
    if len(shard_dims) != 1 or others:
        raise UserError(f"CrossEntropyLoss: logits with placements {logits.placements} are not sharded on the vocab "
                        f"dimension over exactly one mesh dimension and replicated on the others")
    mesh_dim = shard_dims[0]
    vocab_size = logits.shape[-1]
    shard_size = -(-vocab_size // mesh.size(mesh_dim))  # DTensor's Shard puts ceil(V / n) rows on each rank
    start = mesh.get_local_rank(mesh_dim) * shard_size
    local = logits.to_local()
    return _VocabParallelCrossEntropy.apply(local.reshape(-1, local.shape[-1]).float(), labels, start,
                                            mesh.get_group(mesh_dim))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of (N, V/n) logit slices holding vocab ids [start, start + V/n); the backward needs no
    communication: each rank's gradient is softmax - one_hot on its own slice."""

    @staticmethod
    def forward(ctx, logits, labels, start, group):
        shifted = logits - funcol.all_reduce(logits.amax(dim=-1), "max", group)[:, None]
        exp = shifted.exp()
        sum_exp = funcol.all_reduce(exp.sum(dim=-1), "sum", group)
        local_labels = labels - start
        here = (local_labels >= 0) & (local_labels < logits.shape[-1])
        local_labels = local_labels.clamp(0, logits.shape[-1] - 1)
        target = shifted.gather(-1, local_labels[:, None]).squeeze(-1) * here
        target = funcol.all_reduce(target, "sum", group)
        ctx.save_for_backward(exp / sum_exp[:, None], local_labels, here)
        return sum_exp.log() - target

    @staticmethod
    def backward(ctx, grad):
        softmax, local_labels, here = ctx.saved_tensors
        one_hot = F.one_hot(local_labels, softmax.shape[-1]) * here[:, None]
        return (softmax - one_hot) * grad[:, None], None, None, None
