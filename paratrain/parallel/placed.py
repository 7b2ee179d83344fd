"""A model placed on this rank, as ``paratrain.engine`` steps it: ``PlacedModel``, which ``parallelize`` returns for
a built-in model and ``paratrain.parallel.user.place_net`` (``PlacedNet``) for a user's net."""
from __future__ import annotations

import contextlib
import functools
import itertools

import torch
from torch import nn

from paratrain.config import ParallelConfig
from paratrain.mesh import Layout
from paratrain.metrics.timer import no_phase
from paratrain.modules.linear_cross_entropy import token_loss_sum
from paratrain.modules.moe import AuxLossInBackward, moe_totals
from paratrain.parallel.context import split_sequence
from paratrain.parallel.expert import moe_step_metrics
from paratrain.parallel.loss import loss_context, whole
from paratrain.parallel.micro_batches import StepLoss, forward_backward, split
from paratrain.precision import autocast


class PlacedModel:
    """This rank's share of a model placed on ``layout``: ``parts`` (the model itself, or this rank's pipeline
    chunks, each holding its parameters under their names in the whole model), the ``pipeline``
    (``paratrain.parallel.pipeline.Pipeline``, or None) and ``model``, every part as one module.

    ``forward_backward(batch, loss_scale) -> dict`` runs this rank's batch in ``config.micro_batch_num``
    micro-batches, forward in ``precision``, leaving on every parameter the gradient of the global batch's loss
    times ``loss_scale`` that one device would compute (over ``grad_scale`` when returned: the engine applies it);
    it returns ``{"loss": a device scalar, the same on every rank}``, optionally ``grad_scale``, a mixture of
    experts' ``aux_loss`` and ``dropped`` (``experts``: the whole model has MoE blocks) and a built-in's ``tokens``.
    ``grad_factor`` multiplies the gradients (MindSpore's data parallel without ``gradients_mean`` sums the
    replicas' gradients: ``data_parallel``). ``phase`` is the engine's timer's.

    This class places a built-in model: its batch is a dict of (B, T) tensors with ``labels``; its loss the summed
    token cross-entropy (but ``ignore_index``) of every micro-batch over the global batch's counted tokens, from the
    head (``loss_in_head``: no whole logits) or the logits, plus a mixture of experts' load-balancing loss.
    """

    def __init__(self, parts: list[nn.Module], config: ParallelConfig, layout: Layout, precision: str = "none", *,
                 pipeline=None, experts: bool = False, grad_factor: float = 1.0, ignore_index: int = -100,
                 loss_in_head: bool = False):
        self.parts, self.config, self.layout, self.device = parts, config, layout, layout.device
        self.model = parts[0] if len(parts) == 1 else nn.ModuleList(parts)
        self.precision, self.pipeline, self.experts, self.grad_factor = precision, pipeline, experts, grad_factor
        self.ignore_index, self.loss_in_head = ignore_index, loss_in_head
        self.aux_losses = AuxLossInBackward(parts) if experts and self.adds_aux_loss else None
        self.phase = no_phase

    @property
    def counted_in_norm(self) -> set[int] | None:
        """Ids of the parameters the gradient norm counts (None: all): one held by several pipeline chunks once."""
        return self.pipeline.counted_in_norm() if self.pipeline is not None else None

    def parameters(self):
        return itertools.chain.from_iterable(part.parameters() for part in self.parts)

    def named_parameters(self):  # (name in the whole model, this rank's parameter)
        return itertools.chain.from_iterable(part.named_parameters() for part in self.parts)

    def forward_backward(self, batch, loss_scale: torch.Tensor | float = 1.0) -> dict:
        """Forward and backward of this rank's share of a global batch; see the class docstring."""
        batch = self.rows(batch)
        norm = self.step_loss(batch, loss_scale)
        with self.losses_to(norm, batch):
            forward_backward(batch, self.config, self.precision, self.device, self.phase, module=self.model,
                             loss_of=functools.partial(self.micro_loss, norm=norm),
                             pipeline=self.pipeline and self.pipeline_step(norm, batch))
        out = norm.result()
        self.reduce_gradients()
        moe = moe_step_metrics(self.model, self.layout, self.experts)
        if moe and self.adds_aux_loss:
            out["loss"] = out["loss"] + moe["aux_loss"]
        if self.grad_factor != 1:
            out["grad_scale"] = out.get("grad_scale", 1.0) * self.grad_factor
        return {**out, **({"tokens": norm.tokens} if norm.tokens is not None else {}), **moe}

    # --- what a placement of another kind of model changes ---------------------------------------------------
    adds_aux_loss = True  # a built-in model's MoE blocks put their aux loss in backward, not in the loss

    def rows(self, batch):
        """This rank's share of ``batch`` on its device: the data loader gives its rows, of which context
        parallelism keeps this rank's tokens (``split_sequence``)."""
        return split_sequence(batch, self.layout)

    def step_loss(self, batch: dict, loss_scale: torch.Tensor | float) -> StepLoss:
        """The step's normalisation: the loss over the global batch's tokens other than ``ignore_index``."""
        tokens = self.layout.all_reduce_dp_cp((batch["labels"] != self.ignore_index).sum())
        return StepLoss(self.layout, self.config.micro_batch_num, loss_scale, tokens=tokens)

    def losses_to(self, norm: StepLoss, batch) -> contextlib.AbstractContextManager:
        """Where the forwards' other losses go: a mixture of experts' load-balancing loss joins backward in each
        block (any pipeline stage's), a micro-batch's share of its mean."""
        self.model.train()
        return self.aux_losses.during(norm.mean_factor) if self.aux_losses else contextlib.nullcontext()

    def micro_loss(self, micro: dict, norm: StepLoss) -> torch.Tensor:
        """What backward runs on for one micro-batch (without a pipeline)."""
        return norm.token_sum(self.micro_loss_sum(micro))

    def micro_loss_sum(self, micro: dict) -> torch.Tensor:
        """A micro-batch's summed token loss (without a pipeline), from the head or the logits."""
        inputs = {k: v for k, v in micro.items() if k != "labels"}
        if self.loss_in_head:
            return self.model(**inputs, labels=micro["labels"])
        return self.loss_sum(self.model(**inputs), micro["labels"])

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Logits (b, T, V) and labels (b, T) -> the summed token cross-entropy but ``ignore_index`` (fp32)."""
        return token_loss_sum(logits.float(), labels, self.ignore_index)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, norm: StepLoss) -> torch.Tensor:
        """A micro-batch's summed token loss, normalised by ``norm`` (also a pipeline's last stage's loss)."""
        return norm.token_sum(self.loss_sum(logits, labels))

    def held_out_loss_sum(self, batch: dict) -> torch.Tensor:
        """The summed token loss (but ``ignore_index``) of this rank's rows of a held-out global batch, an fp32
        device scalar, the same on every pipeline, tensor- and context-parallel rank of a data-parallel rank: forward
        only, without gradients, in eval mode (no dropout), in ``config.micro_batch_num`` micro-batches and
        ``precision`` as training runs them (a pipeline: its schedule's ``eval``); train mode is restored after."""
        batch = split_sequence(batch, self.layout)
        self.model.eval()
        try:
            with torch.no_grad(), loss_context(self.config), autocast(self.precision, self.device):
                if self.pipeline is not None:
                    total = self.pipeline.evaluate(batch, lambda logits, labels: whole(self.loss_sum(logits, labels)))
                    total = self.layout.all_reduce_pp(total)
                else:
                    total = torch.stack([whole(self.micro_loss_sum(micro)).float()
                                         for micro in split(batch, self.config.micro_batch_num)]).sum()
                return self.layout.all_reduce_cp(total)  # each context-parallel rank's tokens
        finally:
            self.model.train()
            moe_totals(self.model)  # the held-out forwards' mixture-of-experts statistics are no step's

    def pipeline_step(self, norm: StepLoss, batch):
        """The pipeline schedule's step over a batch, its last stage's loss normalised by ``norm``."""
        return functools.partial(self.pipeline.step, loss_fn=functools.partial(self.loss, norm=norm))

    def reduce_gradients(self) -> None:
        """What the gradients need after the backward besides the data-parallel reduction (none here)."""
