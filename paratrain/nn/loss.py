"""MindSpore's CrossEntropyLoss: the mean cross-entropy over the tokens an input mask keeps, vocab-parallel
(PyTorch's ``loss_parallel``) on sharded logits as for the built-in models."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from paratrain.modules.linear_cross_entropy import token_cross_entropy
from paratrain.modules.token_loss import TokenMean
from paratrain.nn.cell import Cell
from paratrain.nn.config import default_dpmp_config, op_config


class CrossEntropyLoss(Cell):
    """logits (N, V) or (B, T, V), label and input_mask (N,) or (B, T) -> (1,) the cross-entropy summed over the
    tokens with mask 1 over ``Σmask + 1e-5`` (the others' labels may be anything; 0 when none is kept), each
    token's value ``-log(softmax + 1e-24)`` as MindSpore's. It ends in a ``TokenMean`` (``token_mean``), which
    declares it a token loss: in a placed net it returns its ``[sum, count]`` or, in a training step's forward, a
    mean whose backward is the global batch's token mean's (``paratrain.modules.token_loss``). Logits that are a
    DTensor sharded on the vocab dimension are reduced vocab-parallel, under
    ``paratrain.parallel.loss.loss_context`` (a placed net's step enters it)."""

    def __init__(self, parallel_config=default_dpmp_config):
        super().__init__()
        op_config(parallel_config, "CrossEntropyLoss")
        self.token_mean = TokenMean(count_epsilon=1e-5)

    def forward(self, logits, label, input_mask):
        # rows split by a semi-auto strategy: the whole batch's (token_cross_entropy gathers such logits too)
        label, input_mask = (t.full_tensor() if isinstance(t, DTensor) else t for t in (label, input_mask))
        mask = input_mask.reshape(-1).float()
        token_loss = saturated(token_cross_entropy(logits, torch.where(mask != 0, label.reshape(-1), 0)))
        return self.token_mean((token_loss * mask).sum(), mask.sum())


def saturated(token_loss: torch.Tensor) -> torch.Tensor:
    """Each token's cross-entropy as MindSpore reports it, ``-log(softmax + 1e-24)`` (at most about 55.26), with
    the gradient of the plain cross-entropy (MindSpore's backward is ``softmax - one_hot``): any shape."""
    plain = token_loss.detach()
    return token_loss + (-torch.log(torch.exp(-plain) + 1e-24) - plain)
