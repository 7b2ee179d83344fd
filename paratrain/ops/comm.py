"""``AllReduce``: MindSpore's collective for hybrid parallel nets, in the forward, with autograd."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.errors import UserError

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}


class _AllReduceSum(torch.autograd.Function):
    """Sum over every rank; the gradient passes through unchanged: what follows the sum is computed alike on
    every rank, so each rank's gradient of it is already that of one device (summing them would count the
    loss once per rank)."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class AllReduce(nn.Module):
    """``AllReduce(op='sum', group=None)(x)``: ``x`` reduced over every rank, any shape. One process (no process
    group): ``x`` itself. ``op`` is ``'sum'`` (differentiable), ``'max'``, ``'min'`` or ``'prod'`` (no gradient)."""

    def __init__(self, op: str = "sum", group=None):
        super().__init__()
        from paratrain.communication import WORLD_GROUPS

        if op not in OPS:
            raise UserError(f"AllReduce(op={op!r}): expected one of {', '.join(OPS)}")
        if group not in WORLD_GROUPS:
            raise UserError(f"AllReduce(group={group!r}): only the group of all ranks exists here (leave group out)")
        self.op = op

    def shard(self, *args, **kwargs):
        raise UserError("AllReduce.shard: a collective has no strategy")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):
            raise UserError("AllReduce on a sharded tensor: under semi_auto/auto parallel paratrain inserts the "
                            "collectives itself; call AllReduce in hybrid_parallel mode")
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return x
        if self.op == "sum":
            return _AllReduceSum.apply(x)
        x = x.detach().clone()
        dist.all_reduce(x, op=OPS[self.op])
        return x
