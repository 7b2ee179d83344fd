"""MindSpore's hybrid parallel: the net runs whole on every rank and calls its own collectives.

A parameter marked ``layerwise_parallel`` (``paratrain.nn.Parameter(..., layerwise_parallel=True)``)
is this rank's own slice and keeps its gradient; every other gradient is averaged over the ranks
(the data-parallel reduction, in a few flat buckets: ``paratrain.parallel.data.coalesced``), which leaves
it unchanged when every rank ran the same global batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from paratrain.errors import UserError
from paratrain.parallel.data import coalesced


def is_layerwise(param: torch.Tensor) -> bool:
    """Whether ``param`` is a per-device slice (MindSpore's ``layerwise_parallel``)."""
    return bool(getattr(param, "layerwise_parallel", False))


class HybridNet:
    """A net under ``hybrid_parallel``: ``train_step(batch)`` runs it on the whole global batch (or this rank's
    rows of a dataset sharded per rank), then averages the gradients of the parameters that are not
    ``layerwise_parallel`` over the ranks. ``parts`` is ``[net]``."""

    def __init__(self, net: nn.Module, device: torch.device):
        self.net, self.device = net.to(device), device
        self.parts = [net]
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1

    def train_step(self, batch: tuple, rows_of_this_rank: bool = False) -> torch.Tensor:
        """Forward and backward of one batch; returns the loss averaged over the ranks (a scalar tensor)."""
        loss = self.net(*(t.to(self.device) if isinstance(t, torch.Tensor) else t for t in batch))
        if loss.numel() != 1:
            raise UserError(f"the net returned a tensor of shape {list(loss.shape)}, not a loss: reduce it to a "
                            f"scalar, or give Model a loss_fn")
        loss = loss.reshape(())
        loss.backward()
        loss = loss.detach().clone()
        if self.world_size > 1:
            grads = [p.grad for p in self.parameters() if p.grad is not None and not is_layerwise(p)]
            coalesced([*grads, loss], lambda flat: dist.all_reduce(flat, async_op=True))
            torch._foreach_div_([*grads, loss], self.world_size)
        return loss

    def parameters(self):
        return self.net.parameters()

    def named_parameters(self):
        return self.net.named_parameters()
