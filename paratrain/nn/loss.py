"""MindSpore's CrossEntropyLoss: the mean cross-entropy over the tokens an input mask keeps, vocab-parallel
(PyTorch's ``loss_parallel``) on sharded logits as for the built-in models."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from paratrain.errors import UserError
from paratrain.modules.linear_cross_entropy import token_cross_entropy
from paratrain.modules.token_loss import sum_and_count
from paratrain.nn.cell import Cell
from paratrain.nn.config import default_dpmp_config, op_config

REDUCTIONS = ("mean", "sum_and_count")


class CrossEntropyLoss(Cell):
    """logits (N, V) or (B, T, V), label and input_mask (N,) or (B, T) -> (1,) the cross-entropy summed over the
    tokens with mask 1 over ``Σmask + 1e-5`` (the others' labels may be anything; 0 when none is kept), each
    token's value ``-log(softmax + 1e-24)`` as MindSpore's. ``reduction="sum_and_count"``, a placed net's:
    float32 (2,) ``[sum of the kept tokens' losses, their number]``, summed over data-parallel ranks and
    micro-batches; in a training step's forward the mean as a scalar, whose backward is the global batch's token
    mean's, over its ``Σmask + 1e-5`` too (``paratrain.modules.token_loss``). Logits that are a DTensor sharded on
    the vocab dimension are reduced
    vocab-parallel, under ``paratrain.parallel.loss.loss_context`` (a placed net's step enters it)."""

    supports_sum_and_count = True  # paratrain.parallel.user switches it to the global-batch token mean
    count_epsilon = 1e-5  # added to the count of kept tokens, here and by a placed net's step (StepLoss)

    def __init__(self, parallel_config=default_dpmp_config):
        super().__init__()
        op_config(parallel_config, "CrossEntropyLoss")
        self.reduction = "mean"

    def forward(self, logits, label, input_mask):
        if self.reduction not in REDUCTIONS:
            raise UserError(f"CrossEntropyLoss: reduction={self.reduction!r} is not one of {', '.join(REDUCTIONS)}")
        # rows split by a semi-auto strategy: the whole batch's (token_cross_entropy gathers such logits too)
        label, input_mask = (t.full_tensor() if isinstance(t, DTensor) else t for t in (label, input_mask))
        mask = input_mask.reshape(-1).float()
        token_loss = saturated(token_cross_entropy(logits, torch.where(mask != 0, label.reshape(-1), 0)))
        total, count = (token_loss * mask).sum(), mask.sum()
        if self.reduction == "sum_and_count":
            return sum_and_count(total, count)
        return (total / (count + self.count_epsilon)).reshape(1)


def saturated(token_loss: torch.Tensor) -> torch.Tensor:
    """Each token's cross-entropy as MindSpore reports it, ``-log(softmax + 1e-24)`` (at most about 55.26), with
    the gradient of the plain cross-entropy (MindSpore's backward is ``softmax - one_hot``): any shape."""
    plain = token_loss.detach()
    return token_loss + (-torch.log(torch.exp(-plain) + 1e-24) - plain)
