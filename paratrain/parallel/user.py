"""A user's own net on any layout: ``place_net(net, config, layout, example_batch)``.

The net is a plain ``nn.Module`` whose ``forward(*batch)`` returns its loss
(``paratrain.parallel.model_loss.NetLoss``), built from ``paratrain.nn`` blocks and plain torch layers. What is split comes from the net itself
(``paratrain.parallel.parallelize.parallelize_chunk``): each module with a ``parallel_plan()`` (the
``paratrain.nn`` blocks) names its Linear/Embedding submodules' split over ``model_parallel``
(``paratrain.parallel.tensor``), the rest is replicated and data-parallel, as MindSpore does with ops that have
no strategy; modules marked ``is_transformer_layer`` are the units of recompute and of FSDP. With
``pipeline_stage > 1`` the forward is traced and cut where its submodules' ``pipeline_stage`` attributes say
(``paratrain.parallel.traced_pipeline``), and each rank's stages are placed so. Parameter names stay the net's.
"""
from __future__ import annotations

import torch
from torch import nn

from paratrain.config import ParallelConfig
from paratrain.errors import UserError
from paratrain.mesh import Layout
from paratrain.modules.moe import MoE
from paratrain.modules.token_loss import TokenMeansTo
from paratrain.parallel.model_loss import NetLoss
from paratrain.parallel.parallelize import parallelize_chunk
from paratrain.parallel.pipeline import build_schedule, chunk_rank
from paratrain.parallel.placed import PlacedModel
from paratrain.parallel.traced_pipeline import TracedStage, split_traced


def place_net(net: nn.Module, config: ParallelConfig, layout: Layout, example_batch: tuple,
              precision: str = "none", compile_layers: bool = False, grad_factor: float = 1.0) -> PlacedModel:
    """Place ``net`` (built identically on every rank) on ``layout``: tensor, pipeline, expert and data parallel as
    the net and ``config`` say (``parallelize_chunk``); ``example_batch`` is one global batch. Its loss is what it
    returns (``paratrain.parallel.model_loss.NetLoss``). A net on the meta device is placed as it is and
    materialised after. ``compile_layers`` (no pipeline stages: a traced stage runs its layers inlined): as
    ``parallelize_chunk``'s; ``grad_factor``: as ``PlacedModel``'s."""
    if config.sequence_parallel:
        raise UserError("sequence_parallel on a user's net is not offered: its own modules between the blocks "
                        "(residuals, norms) would need sequence-sharded activations; leave it off (the built-in "
                        "models of `paratrain train` have it)")
    if config.context_parallel > 1:
        raise UserError(f"context_parallel={config.context_parallel} on a user's net is not offered: its attention is "
                        f"not paratrain's built-in decoder attention, whose sequence split over ranks needs the "
                        f"load-balanced positions and masks of a decoder's batch; use context_parallel=1, or the "
                        f"built-in models 'gpt' and 'llama' of `paratrain train`")
    experts = any(isinstance(m, MoE) for m in net.modules())
    loss = NetLoss(net, config, replicas=config.data_parallel, experts=experts)
    on_meta = any(p.is_meta for p in net.parameters())
    if not on_meta:
        net.to(layout.device)
    if config.pipeline_stage == 1:
        parallelize_chunk(net, config, layout, net=net, precision=precision, compile_layers=compile_layers)
        return PlacedModel([net], config, layout, precision, loss=loss, experts=experts, grad_factor=grad_factor)
    if config.expert_parallel > 1:
        raise UserError(f"expert_parallel={config.expert_parallel} with pipeline_stage={config.pipeline_stage} on a "
                        f"user's net is not supported: its traced stages hold no MoE blocks to split; use "
                        f"pipeline_stage=1, or expert_parallel=1 (the built-in models of `paratrain train` have both)")
    micro = tuple(t[: t.shape[0] // (config.data_parallel * config.micro_batch_num)].to(
        "meta" if on_meta else layout.device) for t in example_batch)
    if loss.summed and not _returns_its_token_loss(net, micro, loss.token_means):
        raise UserError(f"pipeline_stage={config.pipeline_stage}: the net's loss adds other terms (a mixture of "
                        f"experts' aux loss...) to its CrossEntropyLoss, whose (sum, count) the last stage sends "
                        f"on to be added up over the micro-batches; use pipeline_stage=1, or return the loss alone")
    pipe = split_traced(net, micro, config)
    chunks = config.pipeline_stage * config.virtual_pipeline_stage
    ids = [chunk for chunk in range(chunks) if chunk_rank(chunk, config) == layout.pp_rank]
    parts = [parallelize_chunk(module, config, layout, root=module, net=net, precision=precision)
             for module in map(pipe.get_stage_module, ids)]
    # what pipe.build_stage builds, less its rewrite of the device of factory calls: the trace ran on this device
    stages = [TracedStage(module, chunk, pipe.info(), layout.device, group=layout.pp_group)
              for chunk, module in zip(ids, parts)]
    loss.is_last = chunks - 1 in ids
    return PlacedModel(parts, config, layout, precision, loss=loss, pipeline=build_schedule(stages, config,
                       loss.output_loss), experts=experts, grad_factor=grad_factor)


class _TokenLossCalls:
    """A stand-in for a step's ``StepLoss`` that keeps the token means a forward's token losses return."""

    def __init__(self):
        self.means = []

    def token_mean(self, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        self.means.append(total / count.clamp(min=1e-5))
        return self.means[-1]


def _returns_its_token_loss(net: nn.Module, example: tuple, token_means: TokenMeansTo) -> bool:
    """Whether ``net(*example)`` returns its one token loss's value itself, nothing added."""
    calls = _TokenLossCalls()
    with torch.no_grad(), token_means.to(calls):
        output = net(*example)
    return len(calls.means) == 1 and output is calls.means[0]
