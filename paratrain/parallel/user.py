"""A user's own net on any layout: ``place_net(net, config, layout, example_batch)``.

The net is a plain ``nn.Module`` whose ``forward(*batch)`` returns its loss (``PlacedNet``), built from
``paratrain.nn`` blocks and plain torch layers. What is split comes from the net itself
(``paratrain.parallel.parallelize.parallelize_chunk``): each module with a ``parallel_plan()`` (the
``paratrain.nn`` blocks) names its Linear/Embedding submodules' split over ``model_parallel``
(``paratrain.parallel.tensor``), the rest is replicated and data-parallel, as MindSpore does with ops that have
no strategy; modules marked ``is_transformer_layer`` are the units of recompute and of FSDP. With
``pipeline_stage > 1`` the forward is traced and cut where its submodules' ``pipeline_stage`` attributes say
(``paratrain.parallel.traced_pipeline``), and each rank's stages are placed so. Parameter names stay the net's.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from paratrain.config import ParallelConfig
from paratrain.device import to_device
from paratrain.errors import UserError
from paratrain.mesh import Layout
from paratrain.modules.moe import MoE, moe_totals
from paratrain.modules.token_loss import TokenMeansTo
from paratrain.parallel.micro_batches import StepLoss, forward_only, has_rows
from paratrain.parallel.parallelize import parallelize_chunk
from paratrain.parallel.pipeline import build_schedule, chunk_rank
from paratrain.parallel.placed import PlacedModel
from paratrain.parallel.traced_pipeline import TracedStage, by_name, split_traced


class PlacedNet(PlacedModel):
    """A user's net placed on a layout (``PlacedModel``: by ``place_net``, or MindSpore's hybrid and op-strategy
    placements). Its batch is a tuple of tensors, the net's forward arguments, batch first: this rank keeps its
    rows (the ``dp_rank``-th of ``replicas`` equal parts, unless ``rows_of_this_rank``: a dataset sharded per rank
    gave them already), each a whole number of micro-batches. Its loss is what the net returns (any MoE aux loss
    in it): a token loss ending in a ``TokenMean`` (``paratrain.nn.CrossEntropyLoss``) gives the step its (sum,
    count) (``paratrain.modules.token_loss.TokenMeansTo``), so the step's loss is the mean over every counted token
    of the global batch whatever the layout; any other scalar is averaged over the micro-batches and replicas."""

    adds_aux_loss = False
    counted_in_norm = None  # a traced stage holds each parameter once

    def __init__(self, net: nn.Module, config: ParallelConfig, layout: Layout, precision: str = "none", *,
                 replicas: int = 1, grad_factor: float = 1.0):
        super().__init__([net], config, layout, precision, grad_factor=grad_factor,
                         experts=any(isinstance(m, MoE) for m in net.modules()))
        self.token_means = TokenMeansTo(net)
        self.summed = self.token_means.found
        # what the token losses add to the count they divide by (paratrain.nn's CrossEntropyLoss: 1e-5)
        self.count_epsilon = self.token_means.count_epsilon
        # a mixture of experts' aux loss, which the net adds to its token losses' means: with several
        # micro-batches the step counts their tokens first (StepLoss.count_first)
        self.counts_first = self.summed and config.micro_batch_num > 1 and self.experts
        self.replicas, self.rows_of_this_rank = replicas, False  # the latter: set by the face for each dataset
        self._norm: StepLoss | None = None  # this step's

    def rows(self, batch: tuple) -> tuple:
        """This rank's rows of a global batch on its device; UserError when they do not split so."""
        micro_batch_num = self.config.micro_batch_num
        replicas = 1 if self.rows_of_this_rank else self.replicas
        size = next((t.shape[0] for t in batch if has_rows(t)), 0)
        parts = replicas * micro_batch_num
        if size % parts:
            split = ("this rank's share of a dataset sharded per rank" if self.rows_of_this_rank
                     else f"data_parallel={replicas}")
            raise UserError(f"a batch of {size} rows does not split into {parts} equal parts ({split} x "
                            f"micro_batch_num={micro_batch_num}): give a batch size divisible by {parts}")
        rows = size // replicas
        start = self.layout.dp_rank * rows  # (one replica, or rows of this rank: the batch as it is)
        mine = (t[start:start + rows] if replicas > 1 and has_rows(t) else t for t in batch)
        return tuple(to_device(t, self.device) if isinstance(t, torch.Tensor) else t for t in mine)

    def step_loss(self, batch: tuple, loss_scale: torch.Tensor | float) -> StepLoss:
        self._norm = StepLoss(self.layout, self.config.micro_batch_num, loss_scale, counted=self.summed,
                              count_epsilon=self.count_epsilon)
        return self._norm

    @contextlib.contextmanager
    def losses_to(self, norm: StepLoss, batch: tuple):
        """The token losses' means go to ``norm`` (``paratrain.modules.token_loss``; a pipeline's stages send on
        their (sum, count) instead), counted first when the net adds other terms to them."""
        with self.token_means.to(norm if self.summed and self.pipeline is None else None):
            if self.counts_first and self.pipeline is None:
                norm.count_first(lambda: forward_only(batch, self.config, self.precision, self.device, self.run_net,
                                                      self.phase))
                moe_totals(self.model)  # the statistics of the step's forwards with gradients only
            yield

    def run_net(self, *inputs):
        """The net's output of a micro-batch."""
        return self.model(*inputs)

    def micro_loss(self, micro: tuple, norm: StepLoss) -> torch.Tensor:
        return self.output_loss(self.run_net(*micro), pairs=False)

    def output_loss(self, output: torch.Tensor, target=None, pairs: bool = True) -> torch.Tensor:
        """What backward runs on for one micro-batch (``StepLoss``): its loss sum and token count (``pairs``: a
        pipeline stage's output; else its token losses' means plus any other terms), or its plain loss
        (``target``: a pipeline schedule's, unused). A loss of another shape (per row, per token) is refused."""
        pair = self.summed and (pairs or not self._norm.pending)
        if not isinstance(output, torch.Tensor) or output.numel() != (2 if pair else 1):
            what = (f"a tensor of shape {list(output.shape)}" if isinstance(output, torch.Tensor)
                    else f"a {type(output).__name__}")
            raise UserError(f"the net returned {what}, not a loss: reduce it to "
                            f"{'a (sum, count) pair' if pair else 'a scalar'}, or give Model a loss_fn")
        if self.summed and not pair:
            loss = self._norm.with_token_means(output)
        else:
            output = output.reshape(-1).float()
            loss = self._norm.token_sum(output[0], output[1]) if pair else self._norm.mean(output[0])
        # a net of no trainable parameter has nothing to learn: its backward is a no-op
        return loss if loss.requires_grad else loss.requires_grad_()

    def pipeline_step(self, norm: StepLoss, batch: tuple):
        """The traced stages' schedule over a batch (its loss function: ``output_loss``)."""
        target = torch.zeros(len(batch[0]), device=self.device) if self.is_last else None
        return lambda inputs: self.pipeline.step(**by_name(inputs), target=target, return_outputs=False)


def place_net(net: nn.Module, config: ParallelConfig, layout: Layout, example_batch: tuple,
              precision: str = "none", compile_layers: bool = False, grad_factor: float = 1.0) -> PlacedNet:
    """Place ``net`` (built identically on every rank) on ``layout``: tensor, pipeline, expert and data parallel as
    the net and ``config`` say (``parallelize_chunk``); ``example_batch`` is one global batch. A net on the meta
    device is placed as it is and materialised after. ``compile_layers`` (no pipeline stages: a traced stage runs
    its layers inlined): as ``parallelize_chunk``'s; ``grad_factor``: as ``PlacedModel``'s."""
    if config.sequence_parallel:
        raise UserError("sequence_parallel on a user's net is not offered: its own modules between the blocks "
                        "(residuals, norms) would need sequence-sharded activations; leave it off (the built-in "
                        "models of `paratrain train` have it)")
    if config.context_parallel > 1:
        raise UserError(f"context_parallel={config.context_parallel} on a user's net is not offered: its attention is "
                        f"not paratrain's built-in decoder attention, whose sequence split over ranks needs the "
                        f"load-balanced positions and masks of a decoder's batch; use context_parallel=1, or the "
                        f"built-in models 'gpt' and 'llama' of `paratrain train`")
    placed = PlacedNet(net, config, layout, precision, replicas=config.data_parallel, grad_factor=grad_factor)
    on_meta = any(p.is_meta for p in net.parameters())
    if not on_meta:
        net.to(layout.device)
    if config.pipeline_stage == 1:
        parallelize_chunk(net, config, layout, net=net, precision=precision, compile_layers=compile_layers)
        return placed
    if config.expert_parallel > 1:
        raise UserError(f"expert_parallel={config.expert_parallel} with pipeline_stage={config.pipeline_stage} on a "
                        f"user's net is not supported: its traced stages hold no MoE blocks to split; use "
                        f"pipeline_stage=1, or expert_parallel=1 (the built-in models of `paratrain train` have both)")
    micro = tuple(t[: t.shape[0] // (config.data_parallel * config.micro_batch_num)].to(
        "meta" if on_meta else layout.device) for t in example_batch)
    if placed.summed and not _returns_its_token_loss(net, micro, placed.token_means):
        raise UserError(f"pipeline_stage={config.pipeline_stage}: the net's loss adds other terms (a mixture of "
                        f"experts' aux loss...) to its CrossEntropyLoss, whose (sum, count) the last stage sends "
                        f"on to be added up over the micro-batches; use pipeline_stage=1, or return the loss alone")
    pipe = split_traced(net, micro, config)
    chunks = config.pipeline_stage * config.virtual_pipeline_stage
    ids = [chunk for chunk in range(chunks) if chunk_rank(chunk, config) == layout.pp_rank]
    placed.parts = [parallelize_chunk(module, config, layout, root=module, net=net, precision=precision)
                    for module in map(pipe.get_stage_module, ids)]
    placed.model = placed.parts[0] if len(placed.parts) == 1 else nn.ModuleList(placed.parts)
    # what pipe.build_stage builds, less its rewrite of the device of factory calls: the trace ran on this device
    stages = [TracedStage(module, chunk, pipe.info(), layout.device, group=layout.pp_group)
              for chunk, module in zip(ids, placed.parts)]
    placed.is_last = chunks - 1 in ids
    placed.pipeline = build_schedule(stages, config, placed.output_loss)
    return placed


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
