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

from paratrain.config import ParallelConfig
from paratrain.mesh import Layout
from paratrain.modules.moe import MoE
from paratrain.parallel.data import coalesced
from paratrain.parallel.model_loss import NetLoss
from paratrain.parallel.placed import PlacedModel
from paratrain.train.parallel_modes import refuse_options


def place_hybrid(net: nn.Module, config: ParallelConfig, layout: Layout, precision: str = "none") -> PlacedModel:
    """``net`` under ``hybrid_parallel``: every rank runs it whole on the global batch (or its rows of a dataset
    sharded per rank) in micro-batches, its loss what it returns (``NetLoss``), then averages over the ranks
    (``layout``'s data-parallel ones, every rank) the gradients of the parameters that are not
    ``layerwise_parallel`` (``average_shared_gradients``). ``parts`` is ``[net]``."""
    problems = []
    if config.model_parallel > 1 or config.pipeline_stage > 1:
        problems.append(f"model_parallel={config.model_parallel} x pipeline_stage={config.pipeline_stage}: the "
                        f"net runs whole on every rank and splits itself (its collectives, layerwise_parallel "
                        f"parameters)")
    if config.effective_zero_stage > 0:
        problems.append(f"the parallel optimizer (zero_stage={config.effective_zero_stage}, "
                        f"enable_parallel_optimizer): each rank's layerwise_parallel parameters are its own")
    refuse_options(config, net, "hybrid_parallel", problems)
    experts = any(isinstance(m, MoE) for m in net.modules())
    return PlacedModel([net.to(layout.device)], config, layout, precision, loss=NetLoss(net, config, experts=experts),
                       experts=experts, finish_gradients=average_shared_gradients)


def average_shared_gradients(placed: PlacedModel) -> None:
    """The gradients that are not ``layerwise_parallel`` averaged over the data-parallel ranks."""
    grads = [p.grad for p in placed.parameters() if p.grad is not None and not getattr(p, "layerwise_parallel", 0)]
    group = placed.layout.dp_group
    if group is not None and grads:
        coalesced(grads, lambda flat: dist.all_reduce(flat, group=group, async_op=True))
        torch._foreach_div_(grads, placed.layout.dp_size)
