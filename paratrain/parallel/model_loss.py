"""The declared loss of a placed model: what its forward takes and returns, and how a step makes of it the loss of one
device (``paratrain.parallel.micro_batches``: ``StepLoss``, ``TokenMeanStep``). ``PlacedModel`` reads one of two:

- ``TokenSumLoss``, a built-in model's: a batch of (B, T) tensors with ``labels``; the model returns the summed
  token cross-entropy from its head (``loss_in_head``: no whole logits) or its logits, over the global batch's
  counted tokens, known from the labels before the forward. A mixture of experts' load-balancing loss joins
  backward in each block (``AuxLossInBackward``), on any pipeline stage, and the step reports it beside the loss.
- ``NetLoss``, a user's net's: the batch is the net's forward arguments; the net returns its loss. A token loss
  ending in a ``TokenMean`` (paratrain.nn's ``CrossEntropyLoss``) gives the step its sum and count
  (``TokenMeansTo``), so the loss is the mean over every counted token of the global batch; any other scalar is
  averaged over the micro-batches and replicas; other terms (a mixture of experts' aux loss) are the net's to add.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.config import ParallelConfig
from paratrain.device import to_device
from paratrain.errors import UserError
from paratrain.modules.linear_cross_entropy import token_loss_sum
from paratrain.modules.moe import AuxLossInBackward, moe_totals
from paratrain.modules.token_loss import TokenMeansTo
from paratrain.parallel.context import split_sequence
from paratrain.parallel.loss import loss_context, whole
from paratrain.parallel.micro_batches import StepLoss, TokenMeanStep, forward_only, has_rows, split
from paratrain.parallel.traced_pipeline import by_name
from paratrain.precision import autocast

# every method takes the placed model reading it (``paratrain.parallel.placed.PlacedModel``, which imports this module)


class TokenSumLoss:
    """A built-in model's loss (the module docstring): its summed token cross-entropy but ``ignore_index``, from the
    head when ``loss_in_head`` (the model's forward takes ``labels``) or from its logits, plus a mixture of experts'
    load-balancing loss joined to backward in every MoE block of the placed parts (``experts``)."""

    aux_loss_in_backward = True  # the step reports the MoE blocks' aux loss beside the loss

    def __init__(self, ignore_index: int = -100, loss_in_head: bool = False, experts: bool = False):
        self.ignore_index, self.loss_in_head, self.experts = ignore_index, loss_in_head, experts
        self.aux_losses: AuxLossInBackward | None = None

    def attach(self, placed: PlacedModel) -> None:
        """Hook the placed parts' MoE blocks, whose aux losses join backward in a step."""
        self.aux_losses = AuxLossInBackward(placed.parts) if self.experts else None

    def rows(self, placed: PlacedModel, batch: dict) -> dict:
        """This rank's share of ``batch`` on its device: the data loader gives its rows, of which context
        parallelism keeps this rank's tokens (``split_sequence``)."""
        return split_sequence(batch, placed.layout)

    def step_loss(self, placed: PlacedModel, batch: dict, loss_scale: torch.Tensor | float) -> StepLoss:
        """The step's normalisation: the loss over the global batch's tokens other than ``ignore_index``."""
        tokens = placed.layout.all_reduce_dp_cp((batch["labels"] != self.ignore_index).sum())
        return StepLoss(placed.layout, placed.config.micro_batch_num, loss_scale, tokens=tokens)

    def losses_to(self, placed: PlacedModel, norm: StepLoss, batch: dict) -> contextlib.AbstractContextManager:
        """Where the forwards' other losses go: a mixture of experts' load-balancing loss joins backward in each
        block (any pipeline stage's), a micro-batch's share of its mean."""
        placed.model.train()
        return self.aux_losses.during(norm.mean_factor) if self.aux_losses else contextlib.nullcontext()

    def micro_loss(self, placed: PlacedModel, micro: dict, norm: StepLoss) -> torch.Tensor:
        """What backward runs on for one micro-batch (without a pipeline)."""
        return norm.token_sum(self.micro_loss_sum(placed.model, micro))

    def micro_loss_sum(self, model: nn.Module, micro: dict) -> torch.Tensor:
        """A micro-batch's summed token loss (without a pipeline), from the head or the logits."""
        inputs = {k: v for k, v in micro.items() if k != "labels"}
        if self.loss_in_head:
            return model(**inputs, labels=micro["labels"])
        return self.loss_sum(model(**inputs), micro["labels"])

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Logits (b, T, V) and labels (b, T) -> the summed token cross-entropy but ``ignore_index`` (fp32)."""
        return token_loss_sum(logits.float(), labels, self.ignore_index)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, norm: StepLoss) -> torch.Tensor:
        """A micro-batch's summed token loss, normalised by ``norm`` (a pipeline's last stage's loss)."""
        return norm.token_sum(self.loss_sum(logits, labels))

    def pipeline_step(self, placed: PlacedModel, norm: StepLoss, batch: dict) -> Callable:
        """The pipeline schedule's step over a batch, its last stage's loss normalised by ``norm``."""
        return functools.partial(placed.pipeline.step, loss_fn=functools.partial(self.loss, norm=norm))

    def held_out_loss_sum(self, placed: PlacedModel, batch: dict) -> torch.Tensor:
        """The summed token loss (but ``ignore_index``) of this rank's rows of a held-out global batch, an fp32
        device scalar, the same on every pipeline, tensor- and context-parallel rank of a data-parallel rank: forward
        only, without gradients, in eval mode (no dropout), in ``config.micro_batch_num`` micro-batches and
        ``precision`` as training runs them (a pipeline: its schedule's ``eval``); train mode is restored after."""
        layout, model = placed.layout, placed.model
        batch = split_sequence(batch, layout)
        model.eval()
        try:
            with torch.no_grad(), loss_context(placed.config), autocast(placed.precision, placed.device):
                if placed.pipeline is not None:
                    total = placed.pipeline.evaluate(batch, lambda logits, labels: whole(self.loss_sum(logits, labels)))
                    total = layout.all_reduce_pp(total)
                else:
                    total = torch.stack([whole(self.micro_loss_sum(model, micro)).float()
                                         for micro in split(batch, placed.config.micro_batch_num)]).sum()
                return layout.all_reduce_cp(total)  # each context-parallel rank's tokens
        finally:
            model.train()
            moe_totals(model)  # the held-out forwards' mixture-of-experts statistics are no step's


class NetLoss:
    """A user's net's loss (the module docstring): whatever ``net``'s forward returns. Its batch is a tuple of
    tensors, the net's forward arguments, batch first: this rank keeps its rows (the ``dp_rank``-th of ``replicas``
    equal parts, unless ``rows_of_this_rank``: a dataset sharded per rank gave them already), each a whole number
    of micro-batches. ``as_input(tensor, rows_of_this_rank)``, when given, makes each batch tensor what the net
    takes (op strategies: a DTensor; the net's outputs are then made whole). ``is_last``: this rank holds the last
    traced pipeline stage."""

    aux_loss_in_backward = False  # a net adds any aux loss to what it returns

    def __init__(self, net: nn.Module, config: ParallelConfig, *, replicas: int = 1, experts: bool = False,
                 as_input: Callable | None = None):
        self.token_means = TokenMeansTo(net)
        self.summed = self.token_means.found
        # what the token losses add to the count they divide by (paratrain.nn's CrossEntropyLoss: 1e-5)
        self.count_epsilon = self.token_means.count_epsilon
        # a mixture of experts' aux loss, which the net adds to its token losses' means: with several
        # micro-batches the step counts their tokens first (TokenMeanStep.count_first)
        self.counts_first = self.summed and config.micro_batch_num > 1 and experts
        self.replicas, self.as_input = replicas, as_input
        self.rows_of_this_rank = False  # set by the face for each dataset
        self.is_last = True
        self._norm: StepLoss | TokenMeanStep | None = None  # this step's

    def attach(self, placed: PlacedModel) -> None:
        """Nothing to hook on the placed parts: the token losses were hooked on the whole net."""

    def rows(self, placed: PlacedModel, batch: tuple) -> tuple:
        """This rank's rows of a global batch on its device; UserError when they do not split so."""
        micro_batch_num = placed.config.micro_batch_num
        replicas = 1 if self.rows_of_this_rank else self.replicas
        size = next((t.shape[0] for t in batch if has_rows(t)), 0)
        parts = replicas * micro_batch_num
        if size % parts:
            split_by = ("this rank's share of a dataset sharded per rank" if self.rows_of_this_rank
                        else f"data_parallel={replicas}")
            raise UserError(f"a batch of {size} rows does not split into {parts} equal parts ({split_by} x "
                            f"micro_batch_num={micro_batch_num}): give a batch size divisible by {parts}")
        rows = size // replicas
        start = placed.layout.dp_rank * rows  # (one replica, or rows of this rank: the batch as it is)
        mine = (t[start:start + rows] if replicas > 1 and has_rows(t) else t for t in batch)
        return tuple(to_device(t, placed.device) if isinstance(t, torch.Tensor) else t for t in mine)

    def eval_rows(self, placed: PlacedModel, batch: tuple, sharded: bool) -> tuple[tuple, object]:
        """The inputs this rank runs the net on for ``batch`` in ``Model.eval``, on its device, and the group of
        ranks whose rows add up to the global batch (None: this rank saw all of it). ``sharded``: the batch is this
        rank's rows already (a dataset split per rank)."""
        if self.as_input is not None:  # DTensor inputs: the outputs are the global batch's
            return tuple(self.as_input(t, sharded) for t in batch), None
        layout = placed.layout
        batch = tuple(t.to(placed.device) if isinstance(t, torch.Tensor) else t for t in batch)
        if not sharded and self.replicas > 1:
            batch = tuple(t.tensor_split(layout.dp_size)[layout.dp_rank] if isinstance(t, torch.Tensor) else t
                          for t in batch)
        return batch, layout.dp_group if sharded or self.replicas > 1 else None

    def step_loss(self, placed: PlacedModel, batch: tuple,
                  loss_scale: torch.Tensor | float) -> StepLoss | TokenMeanStep:
        """The step's normalisation: the token losses' means given to it in an eager forward (``TokenMeanStep``), or
        the (sum, count) pairs of the pipeline stages, or a plain scalar loss (``StepLoss``)."""
        layout, micro_batch_num = placed.layout, placed.config.micro_batch_num
        if self.summed and placed.pipeline is None:
            self._norm = TokenMeanStep(layout, micro_batch_num, loss_scale, self.count_epsilon)
        else:
            self._norm = StepLoss(layout, micro_batch_num, loss_scale, counted=self.summed,
                                  count_epsilon=self.count_epsilon)
        return self._norm

    @contextlib.contextmanager
    def losses_to(self, placed: PlacedModel, norm: StepLoss | TokenMeanStep, batch: tuple):
        """The token losses' means go to ``norm`` (``paratrain.modules.token_loss``; a pipeline's stages send on
        their (sum, count) instead), counted first when the net adds other terms to them."""
        with self.token_means.to(norm if isinstance(norm, TokenMeanStep) else None):
            if self.counts_first and placed.pipeline is None:
                norm.count_first(lambda: forward_only(batch, placed.config, placed.precision, placed.device,
                                                      functools.partial(self.run, placed), placed.phase))
                moe_totals(placed.model)  # the statistics of the step's forwards with gradients only
            yield

    def run(self, placed: PlacedModel, *inputs):
        """The net's output of a micro-batch."""
        if self.as_input is None:
            return placed.model(*inputs)
        output = placed.model(*(self.as_input(t, self.rows_of_this_rank) for t in inputs))
        return output.full_tensor() if isinstance(output, DTensor) else output

    def micro_loss(self, placed: PlacedModel, micro: tuple, norm: StepLoss | TokenMeanStep) -> torch.Tensor:
        return self.output_loss(self.run(placed, *micro), pairs=False)

    def output_loss(self, output: torch.Tensor, target=None, pairs: bool = True) -> torch.Tensor:
        """What backward runs on for one micro-batch: its loss sum and token count (``pairs``: a pipeline stage's
        output), its token losses' means plus any other terms (``TokenMeanStep``), or its plain loss (``target``: a
        pipeline schedule's, unused). A loss of another shape (per row, per token) is refused."""
        pair = self.summed and pairs
        if not isinstance(output, torch.Tensor) or output.numel() != (2 if pair else 1):
            what = (f"a tensor of shape {list(output.shape)}" if isinstance(output, torch.Tensor)
                    else f"a {type(output).__name__}")
            raise UserError(f"the net returned {what}, not a loss: reduce it to "
                            f"{'a (sum, count) pair' if pair else 'a scalar'}, or give Model a loss_fn")
        if isinstance(self._norm, TokenMeanStep):
            if not self._norm.pending:
                raise UserError("the net's token loss (a TokenMean, as paratrain.nn's CrossEntropyLoss ends in) made "
                                "no token mean in this forward: return a loss computed through it")
            loss = self._norm.with_token_means(output)
        else:
            output = output.reshape(-1).float()
            loss = self._norm.token_sum(output[0], output[1]) if pair else self._norm.mean(output[0])
        # a net of no trainable parameter has nothing to learn: its backward is a no-op
        return loss if loss.requires_grad else loss.requires_grad_()

    def pipeline_step(self, placed: PlacedModel, norm: StepLoss, batch: tuple) -> Callable:
        """The traced stages' schedule over a batch (its loss function: ``output_loss``)."""
        target = torch.zeros(len(batch[0]), device=placed.device) if self.is_last else None
        return lambda inputs: placed.pipeline.step(**by_name(inputs), target=target, return_outputs=False)
