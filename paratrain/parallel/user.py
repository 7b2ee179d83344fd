"""A user's own net on any layout: ``place_net(net, config, layout, example_batch)``.

The net is a plain ``nn.Module`` whose ``forward(*batch)`` returns its loss, built from
``paratrain.nn`` blocks and plain torch layers. What is split comes from the net itself:

- **Tensor parallel**: every module with a ``parallel_plan()`` method (the ``paratrain.nn``
  blocks) names its own Linear/Embedding submodules and their split over ``model_parallel``,
  in the kinds of ``paratrain.parallel.tensor``: ``colwise`` (output features), ``rowwise``
  (input features, outputs summed), ``vocab_rows`` (embedding rows, lookups summed)...
  Everything else is replicated and data-parallel, as MindSpore does with ops that have no strategy.
- **Layers**: modules marked ``is_transformer_layer`` are the units of recompute and of FSDP
  (their own ``recompute_mode``, set by ``recompute()`` or MindSpore's ``lambda_func``, or the
  config's ``recompute`` for all of them).
- **Pipeline** (``pipeline_stage > 1``): the forward is traced and cut where the ``pipeline_stage``
  attributes set on its submodules say (``paratrain.parallel.traced_pipeline``). Each rank keeps its
  stage's module, then tensor parallel, recompute and FSDP are applied to it. Parameter names stay the net's.
- **Loss**: token losses that declare ``supports_sum_and_count`` (``paratrain.nn.CrossEntropyLoss``)
  get ``reduction = "sum_and_count"`` and return (sum, count), so the loss of a step is the mean
  over every masked token of the global batch whatever the layout; a net returning any other
  scalar has it averaged over micro-batches and replicas.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from paratrain.config import ParallelConfig
from paratrain.errors import UserError
from paratrain.mesh import Layout
from paratrain.metrics.timer import no_phase
from paratrain.modules.moe import MoE, moe_totals
from paratrain.modules.token_loss import token_means_to
from paratrain.parallel.data import apply_data_parallel, fusion_groups
from paratrain.parallel.expert import apply_expert_parallel
from paratrain.parallel.micro_batches import StepLoss, forward_backward, forward_only, has_rows
from paratrain.parallel.pipeline import build_schedule, chunk_rank
from paratrain.parallel.recompute import apply_recompute
from paratrain.parallel.tensor import declared_plan, gradient_like_parameter, has_submodule, parallel_style
from paratrain.parallel.traced_pipeline import TracedStage, by_name, split_traced


def _layer_stacks(net: nn.Module) -> dict[str, int]:
    """The containers of the net's layers with the layers before each (MindSpore's offset)."""
    stacks, count = {}, 0
    for name, module in net.named_modules():
        if getattr(module, "is_transformer_layer", False):
            parent = name.rpartition(".")[0]
            if parent not in stacks:
                stacks[parent] = count
            count += 1
    return stacks


class Placed:
    """What every placement of a user's net gives ``paratrain.engine``: this rank's modules (``parts``), their
    parameters, ``phase`` and the forward and backward of a global batch (``forward_backward(batch, loss_scale,
    rows_of_this_rank) -> dict``) in ``config.micro_batch_num`` micro-batches, run by
    ``paratrain.parallel.micro_batches.forward_backward`` and normalised by its ``StepLoss`` on ``layout``.
    A net whose token losses can return (sum, count) (``supports_sum_and_count``) is switched to them."""

    def __init__(self, net: nn.Module, config: ParallelConfig, layout: Layout, precision: str = "none"):
        self.config, self.layout, self.device, self.precision = config, layout, layout.device, precision
        self.summed = _sum_and_count(net)
        # a mixture of experts' aux loss, which the net adds to its token losses' means: with several
        # micro-batches the step counts their tokens first (StepLoss.count_first)
        self.counts_first = self.summed and config.micro_batch_num > 1 and any(
            isinstance(m, MoE) for m in net.modules())
        self.parts = [net]
        self._norm: StepLoss | None = None  # this step's
        self.phase = no_phase  # a StepTimer's phase, set by the engine's face

    def _rows(self, batch: tuple, rows_of_this_rank: bool, replicas: int = 1) -> tuple:
        """This rank's rows of a global batch on its device: the ``dp_rank``-th of ``replicas`` equal parts
        (unless ``rows_of_this_rank``: a dataset sharded per rank gave them already), each a whole number of
        micro-batches; UserError when they do not split so."""
        micro_batch_num = self.config.micro_batch_num
        replicas = 1 if rows_of_this_rank else replicas
        size = next((t.shape[0] for t in batch if has_rows(t)), 0)
        parts = replicas * micro_batch_num
        if size % parts:
            split = ("this rank's share of a dataset sharded per rank" if rows_of_this_rank
                     else f"data_parallel={replicas}")
            raise UserError(f"a batch of {size} rows does not split into {parts} equal parts ({split} x "
                            f"micro_batch_num={micro_batch_num}): give a batch size divisible by {parts}")
        rows = size // replicas
        start = self.layout.dp_rank * rows  # (one replica, or rows of this rank: the batch as it is)
        mine = (t[start:start + rows] if replicas > 1 and has_rows(t) else t for t in batch)
        return tuple(t.to(self.device, non_blocking=True) if isinstance(t, torch.Tensor) else t for t in mine)

    def _micro_loss(self, output: torch.Tensor, target=None, pairs: bool = True) -> torch.Tensor:
        """What backward runs on for one micro-batch (``StepLoss``): its loss sum and token count (``pairs``: a
        pipeline stage's output; else its token losses' means plus any other terms), or its plain loss
        (``target``: a pipeline schedule's, unused). A loss of another shape (per row, per token) is refused."""
        # a token loss of the user's own (``supports_sum_and_count``) returns its pair itself, making no token means
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

    def _run(self, batch: tuple, loss_scale: torch.Tensor | float, forward=None, pipeline=None) -> dict:
        """Forward and backward of this rank's ``batch`` (``_rows``) in micro-batches through ``forward(*micro)``
        (the net's output; its token losses give their means: ``paratrain.modules.token_loss``), or a pipeline
        schedule's ``pipeline(batch)``; returns ``StepLoss.result()``."""
        self._norm = StepLoss(self.layout, self.config.micro_batch_num, loss_scale, counted=self.summed)
        with token_means_to(self._norm if self.summed and pipeline is None else None):
            if self.counts_first and pipeline is None:
                self._norm.count_first(lambda: forward_only(batch, self.config, self.precision, self.device, forward,
                                                            self.phase))
                moe_totals(self.parts[0])  # the statistics of the step's forwards with gradients only
            forward_backward(batch, self.config, self.precision, self.device, self.phase, module=self.parts[0],
                             loss_of=lambda micro: self._micro_loss(forward(*micro), pairs=False),
                             pipeline=pipeline)
        return self._norm.result()

    def parameters(self):
        return itertools.chain.from_iterable(part.parameters() for part in self.parts)

    def named_parameters(self):
        """(name in the whole net, this rank's parameter)."""
        for part in self.parts:
            yield from part.named_parameters()


class PlacedNet(Placed):
    """A user's net placed on a layout (``Placed``): tensor, pipeline, expert and data parallel as the net and
    ``config`` say. ``forward_backward(batch, loss_scale)`` runs a global batch (a tuple of tensors, the net's
    forward arguments, batch first): this rank keeps its data-parallel rows and splits them into
    ``micro_batch_num`` micro-batches, run forward in ``precision`` ("none", "bf16", "fp16"). Gradients end up as
    those of the global-batch loss times ``loss_scale`` on one device once the engine applies the ``grad_scale``
    returned with the loss. With ``compile_layers`` (no pipeline stages: a traced stage runs its layers inlined)
    each layer, or the whole net when it has none, is compiled once placed.
    """

    def __init__(self, net: nn.Module, config: ParallelConfig, layout: Layout, example: tuple,
                 precision: str = "none", compile_layers: bool = False):
        super().__init__(net, config, layout, precision)
        self.compile_layers = compile_layers
        if config.sequence_parallel:
            raise UserError("sequence_parallel on a user's net is not offered: its own modules between the blocks "
                            "(residuals, norms) would need sequence-sharded activations; leave it off (the built-in "
                            "models of `paratrain train` have it)")
        self.on_meta = any(p.is_meta for p in net.parameters())  # placed as it is, materialised after
        if not self.on_meta:
            net.to(self.device)
        self.pipeline = None
        if config.pipeline_stage > 1:
            if config.expert_parallel > 1:
                raise UserError(f"expert_parallel={config.expert_parallel} with pipeline_stage="
                                f"{config.pipeline_stage} on a user's net is not supported: its traced stages hold "
                                f"no MoE blocks to split; use pipeline_stage=1, or expert_parallel=1 (the built-in "
                                f"models of `paratrain train` have both)")
            self.parts = self._pipeline_stages(net, example)
        else:
            self.parts = [self._parallelize(net, net)]

    # --- placing ----------------------------------------------------------------------------

    def _parallelize(self, module: nn.Module, originals: nn.Module, root: nn.Module | None = None) -> nn.Module:
        """Tensor parallel, recompute and data parallel on ``module`` (the net or a traced stage of it)."""
        config = self.config
        if config.model_parallel > 1:
            for name, kind in declared_plan(originals).items():
                style = parallel_style(kind)  # a user's net: no sequence parallel, declared embedding splits
                if style is None or not has_submodule(module, name):
                    continue
                original = originals.get_submodule(name)
                parent, _, child = name.rpartition(".")
                module.get_submodule(parent).register_module(child, original)  # a traced leaf: the real layer again
                parallelize_module(original, self.layout.tp_mesh, style)
                if kind == "vocab_rows":
                    original.weight.register_post_accumulate_grad_hook(gradient_like_parameter)
        apply_expert_parallel(module, config, self.layout)
        module.layer_stacks = {s: o for s, o in _layer_stacks(originals).items() if has_submodule(module, s)}
        layers = [originals.get_submodule(n) for n, m in originals.named_modules()
                  if getattr(m, "is_transformer_layer", 0)]
        if any(getattr(layer, "recompute_mode", "none") != "none" for layer in layers):
            config = _with_layer_recompute(config, layers)
        apply_recompute(module, config)
        if self.compile_layers:  # as train.compile: after tensor parallel and recompute
            for layer in [layer for layer in layers if layer in set(module.modules())] or [module]:
                layer.compile()
        if config.data_parallel > 1:
            groups = [[m for m in group if m in set(module.modules())] for group in fusion_groups(originals)]
            apply_data_parallel(module, config, self.layout, root=root, every_batch_norm=False,
                                groups=[group for group in groups if group] or None)
        return module

    def _pipeline_stages(self, net: nn.Module, example: tuple) -> list[nn.Module]:
        """The traced stage modules of this rank: one per virtual stage (``chunk_rank``), and the schedule."""
        config, layout = self.config, self.layout
        micro = tuple(t[: t.shape[0] // (config.data_parallel * config.micro_batch_num)].to(
            "meta" if self.on_meta else self.device) for t in example)
        if self.summed and not _returns_its_token_loss(net, micro):
            raise UserError(f"pipeline_stage={config.pipeline_stage}: the net's loss adds other terms (a mixture of "
                            f"experts' aux loss...) to its CrossEntropyLoss, whose (sum, count) the last stage sends "
                            f"on to be added up over the micro-batches; use pipeline_stage=1, or return the loss alone")
        pipe = split_traced(net, micro, config)
        chunks = config.pipeline_stage * config.virtual_pipeline_stage
        ids = [chunk for chunk in range(chunks) if chunk_rank(chunk, config) == layout.pp_rank]
        modules = [pipe.get_stage_module(chunk) for chunk in ids]
        for module in modules:
            self._parallelize(module, net, root=module)
        # what pipe.build_stage builds, less its rewrite of the device of factory calls: the trace ran on this device
        stages = [TracedStage(module, chunk, pipe.info(), self.device, group=layout.pp_group)
                  for chunk, module in zip(ids, modules)]
        self.is_last = chunks - 1 in ids
        self.pipeline = build_schedule(stages, config, self._micro_loss)
        return modules

    # --- a step -----------------------------------------------------------------------------

    def forward_backward(self, batch: tuple, loss_scale: torch.Tensor | float = 1.0,
                         rows_of_this_rank: bool = False) -> dict:
        """Forward and backward of one global batch, or with ``rows_of_this_rank`` of this data-parallel rank's
        rows of it (a dataset sharded per rank); returns ``StepLoss.result()``: the global batch's loss (a device
        tensor) and, for a loss with sum and count, the ``grad_scale`` the engine's optimizer step applies."""
        mine = self._rows(batch, rows_of_this_rank, self.config.data_parallel)
        if self.pipeline is None:
            return self._run(mine, loss_scale, self.parts[0])
        target = torch.zeros(len(mine[0]), device=self.device) if self.is_last else None
        return self._run(mine, loss_scale, pipeline=lambda inputs: self.pipeline.step(
            **by_name(inputs), target=target, return_outputs=False))


def place_net(net: nn.Module, config: ParallelConfig, layout: Layout, example_batch: tuple,
              precision: str = "none", compile_layers: bool = False) -> PlacedNet:
    """Place ``net`` (built identically on every rank) on ``layout``; ``example_batch`` is one global batch."""
    return PlacedNet(net, config, layout, example_batch, precision, compile_layers)


def _sum_and_count(net: nn.Module) -> bool:
    """Switch the net's token losses that can (``supports_sum_and_count``: paratrain.nn's CrossEntropyLoss) to
    return (sum, count); whether it has any."""
    losses = [m for m in net.modules() if getattr(m, "supports_sum_and_count", False)]
    for loss in losses:
        loss.reduction = "sum_and_count"
    return bool(losses)


class _TokenLossCalls:
    """A stand-in for a step's ``StepLoss`` that keeps the token means a forward's token losses return."""

    def __init__(self):
        self.means = []

    def token_mean(self, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        self.means.append(total / count.clamp(min=1e-5))
        return self.means[-1]


def _returns_its_token_loss(net: nn.Module, example: tuple) -> bool:
    """Whether ``net(*example)`` returns its one token loss's value itself, nothing added (or a loss of the user's
    own that makes no token means)."""
    calls = _TokenLossCalls()
    with torch.no_grad(), token_means_to(calls):
        output = net(*example)
    return not calls.means or (len(calls.means) == 1 and output is calls.means[0])


def _with_layer_recompute(config: ParallelConfig, layers: list[nn.Module]) -> ParallelConfig:
    """``config`` with one recompute mode per layer: the layer's own where set, else the config's."""
    modes = [getattr(layer, "recompute_mode", "none") for layer in layers]
    modes = [m if m != "none" else config.recompute_mode(i) for i, m in enumerate(modes)]
    return dataclasses.replace(config, recompute=modes)
