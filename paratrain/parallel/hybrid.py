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

from paratrain.errors import scalar_loss
from paratrain.metrics.timer import no_phase
from paratrain.precision import autocast
from paratrain.parallel.data import coalesced


def is_layerwise(param: torch.Tensor) -> bool:
    """Whether ``param`` is a per-device slice (MindSpore's ``layerwise_parallel``)."""
    return bool(getattr(param, "layerwise_parallel", False))


class HybridNet:
    """A net under ``hybrid_parallel``: ``forward_backward(batch, loss_scale)`` (``paratrain.engine``'s ``run``)
    runs it (forward in ``precision``) on the whole global batch (or this rank's rows of a dataset sharded per
    rank), then averages the gradients of the parameters that are not ``layerwise_parallel`` over the ranks.
    ``parts`` is ``[net]``."""

    def __init__(self, net: nn.Module, device: torch.device, precision: str = "none"):
        self.net, self.device, self.precision = net.to(device), device, precision
        self.parts = [net]
        self.phase = no_phase  # a StepTimer's phase, set by the engine's face
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1

    def forward_backward(self, batch: tuple, loss_scale: torch.Tensor | float = 1.0,
                         rows_of_this_rank: bool = False) -> dict:
        """Forward and backward of one batch; returns {"loss": the loss averaged over the ranks}."""
        with autocast(self.precision, self.device), self.phase("forward"):
            loss = scalar_loss(self.net(*(t.to(self.device) if isinstance(t, torch.Tensor) else t for t in batch)))
        with self.phase("backward"):
            (loss * loss_scale).backward()
        loss = loss.detach().clone()
        if self.world_size > 1:
            grads = [p.grad for p in self.parameters() if p.grad is not None and not is_layerwise(p)]
            coalesced([*grads, loss], lambda flat: dist.all_reduce(flat, async_op=True))
            torch._foreach_div_([*grads, loss], self.world_size)
        return {"loss": loss}

    def parameters(self):
        return self.net.parameters()

    def named_parameters(self):
        return self.net.named_parameters()
