"""A model placed on this rank, as ``paratrain.engine`` steps it: ``PlacedModel``, the one class every placement
returns (``paratrain.parallel.parallelize`` for a built-in model, ``paratrain.parallel.user.place_net`` for a
user's net, and the MindSpore face's hybrid and op-strategy placements)."""
from __future__ import annotations

import functools
import itertools
from typing import Callable

import torch
from torch import nn

from paratrain.config import ParallelConfig
from paratrain.mesh import Layout
from paratrain.metrics.timer import no_phase
from paratrain.parallel.expert import moe_step_metrics
from paratrain.parallel.micro_batches import forward_backward
from paratrain.parallel.model_loss import NetLoss, TokenSumLoss
from paratrain.parallel.pipeline import Pipeline


class PlacedModel:
    """This rank's share of a model placed on ``layout``: ``parts`` (the model itself, or this rank's pipeline
    chunks or traced stages, each holding its parameters under their names in the whole model), the ``pipeline``
    (``paratrain.parallel.pipeline.Pipeline``, a traced pipeline's schedule, or None) and ``model``, every part as
    one module.

    ``forward_backward(batch, loss_scale) -> dict`` runs this rank's batch in ``config.micro_batch_num``
    micro-batches, forward in ``precision``, leaving on every parameter the gradient of the global batch's loss
    times ``loss_scale`` that one device would compute (over ``grad_scale`` when returned: the engine applies it);
    it returns ``{"loss": a device scalar, the same on every rank}``, optionally ``grad_scale``, a mixture of
    experts' ``aux_loss`` and ``dropped`` (``experts``: the whole model has MoE blocks) and a built-in's ``tokens``.

    What the model takes and returns, and so how a step makes its loss, is its declared loss (``loss``,
    ``paratrain.parallel.model_loss``): a built-in model's summed token loss (``TokenSumLoss``: its batch a dict of
    (B, T) tensors with labels) or what a user's net returns (``NetLoss``: its batch the net's forward arguments).
    ``finish_gradients(placed)``, when given, is what the gradients need after the backward besides the
    data-parallel reduction (a hybrid net's own average, op strategies' placements). ``grad_factor`` multiplies
    the gradients (MindSpore's data parallel without ``gradients_mean`` sums the replicas' gradients:
    ``data_parallel``). ``phase`` is the engine's timer's.
    """

    def __init__(self, parts: list[nn.Module], config: ParallelConfig, layout: Layout, precision: str = "none", *,
                 loss: TokenSumLoss | NetLoss, pipeline=None, experts: bool = False, grad_factor: float = 1.0,
                 finish_gradients: Callable[[PlacedModel], None] | None = None):
        self.parts, self.config, self.layout, self.device = parts, config, layout, layout.device
        self.model = parts[0] if len(parts) == 1 else nn.ModuleList(parts)
        self.precision, self.pipeline, self.experts, self.grad_factor = precision, pipeline, experts, grad_factor
        self.loss, self.finish_gradients = loss, finish_gradients
        loss.attach(self)
        self.phase = no_phase

    @property
    def counted_in_norm(self) -> set[int] | None:
        """Ids of the parameters the gradient norm counts (None: all): one held by several pipeline chunks once
        (a traced stage holds each parameter once)."""
        return self.pipeline.counted_in_norm() if isinstance(self.pipeline, Pipeline) else None

    def parameters(self):
        return itertools.chain.from_iterable(part.parameters() for part in self.parts)

    def named_parameters(self):  # (name in the whole model, this rank's parameter)
        return itertools.chain.from_iterable(part.named_parameters() for part in self.parts)

    def forward_backward(self, batch, loss_scale: torch.Tensor | float = 1.0) -> dict:
        """Forward and backward of this rank's share of a global batch; see the class docstring."""
        loss = self.loss
        batch = loss.rows(self, batch)
        norm = loss.step_loss(self, batch, loss_scale)
        with loss.losses_to(self, norm, batch):
            forward_backward(batch, self.config, self.precision, self.device, self.phase, module=self.model,
                             loss_of=functools.partial(loss.micro_loss, self, norm=norm),
                             pipeline=self.pipeline and loss.pipeline_step(self, norm, batch))
        out = norm.result()
        if self.finish_gradients is not None:
            self.finish_gradients(self)
        moe = moe_step_metrics(self.model, self.layout, self.experts)
        if moe and loss.aux_loss_in_backward:  # not in the loss, which the step reports with it
            out["loss"] = out["loss"] + moe["aux_loss"]
        if self.grad_factor != 1:
            out["grad_scale"] = out.get("grad_scale", 1.0) * self.grad_factor
        return {**out, **moe}
