"""A rank's share of a global batch in micro-batches, and the normalisation of a step's loss.

:func:`forward_backward` runs forward and backward of each micro-batch (or a pipeline schedule's step), with the
gradients accumulated and, below ZeRO 3, reduced once; :class:`StepLoss` (losses that come whole from each
micro-batch) or :class:`TokenMeanStep` (token means given to the step in the forward) makes the loss and gradients
those of one device whatever the split. Every placed model uses them (``paratrain.parallel.placed``);
``paratrain.engine`` does the rest of the step.
"""
from __future__ import annotations

from typing import Callable

import torch

from paratrain.config import ParallelConfig
from paratrain.errors import UserError
from paratrain.mesh import Layout
from paratrain.modules.token_loss import token_denominator
from paratrain.parallel.loss import loss_context, whole
from paratrain.precision import autocast


class StepLoss:
    """The normalisation of a step's loss when each micro-batch's loss comes whole: the global batch's summed token
    loss over its token count, or the mean of a plain scalar loss over the micro-batches and the data-parallel
    replicas. Whatever the split, the loss and the gradients are one device's.

    ``token_sum`` and ``mean`` give what backward runs on for one micro-batch (times the loss scale) and keep its
    value; ``result`` adds them up over the ranks. A token count known before the forward (``tokens``: a built-in
    model's, from the labels) divides each micro-batch's loss; counts that come with the sums (``counted``: the
    (sum, count) pairs of a user's net's pipeline stages) are added up after, and divide the gradients in the
    optimizer's step (``grad_scale``, ``LossScaler.divisor``): no pass of its own over them. ``count_epsilon``:
    what the net's token loss adds to the count it divides by (``paratrain.modules.token_loss.token_denominator``).
    A forward whose token losses give their means to the step is ``TokenMeanStep``'s."""

    def __init__(self, layout: Layout, micro_batch_num: int, loss_scale: torch.Tensor | float,
                 tokens: torch.Tensor | None = None, counted: bool = False, count_epsilon: float | None = None):
        self.layout, self.micro_batch_num, self.loss_scale = layout, micro_batch_num, loss_scale
        self.counted, self.tokens, self.count_epsilon = counted, tokens, count_epsilon
        # what a micro-batch's summed loss is divided by: the global batch's token count over the data x context
        # parallel size (gradient reduction averages where a sum is wanted) and the loss scale; one division a step
        self.divisor = None if tokens is None else tokens / (layout.dp_cp_size * loss_scale)
        # (value, token count or None) of each micro-batch's loss; a pipeline schedule may call its loss function
        # before the micro-batches too (torch 2.13 infers the backward's shapes so): only the last ones count
        self.kept: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def token_sum(self, loss_sum: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
        """A micro-batch's summed token loss (and its token count when ``counted``), times the data x context
        parallel size (gradient reduction averages where a sum is wanted) and the loss scale, over ``tokens`` when
        given."""
        if self.divisor is not None:
            return self._kept(loss_sum / self.divisor, count)
        return self._kept(loss_sum * (self.layout.dp_cp_size * self.loss_scale), count)

    @property
    def mean_factor(self) -> torch.Tensor | float:
        """What ``mean`` multiplies a micro-batch's loss by: the loss scale over the micro-batches (the
        data-parallel average of the gradients does the rest); a per-micro-batch mean such as a mixture of
        experts' load-balancing loss takes it too."""
        return self.loss_scale / self.micro_batch_num

    def mean(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's plain scalar loss: its share of the mean over the micro-batches."""
        return self._kept(loss * self.mean_factor)

    def _kept(self, loss: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
        self.kept.append((whole(loss.detach()), None if count is None else whole(count.detach())))
        return loss

    def result(self) -> dict:
        """{"loss": the global batch's loss, the same on every rank} and, when ``counted``, ``grad_scale``; with
        ``tokens``, those too."""
        layout, kept = self.layout, self.kept[-self.micro_batch_num:]  # only the last pipeline stage has any
        values = [value for value, _ in kept]
        total = values[0] if len(values) == 1 else _sum(values, layout)  # divided next: reduced in a tensor of its own
        loss = layout.all_reduce_dp_cp(total / (layout.dp_cp_size * self.loss_scale))
        out = {}
        if self.counted:
            count = layout.all_reduce_pp(layout.all_reduce_dp_cp(_sum([c for _, c in kept], layout)))
            count = token_denominator(count, self.count_epsilon)
            loss, out["grad_scale"] = loss / count, count.reciprocal()
        out["loss"] = layout.all_reduce_pp(loss)  # only the last stage has it
        return out | ({"tokens": self.tokens} if self.tokens is not None else {})


class TokenMeanStep:
    """The normalisation of a step whose forwards' token losses give it their sums and counts
    (``paratrain.modules.token_loss.TokenMeansTo``): each returns, to the net, its micro-batch's token mean
    (``token_mean``, the value one process computes), and the net's output may add other terms to the means, such
    as a mixture of experts' load-balancing loss, which are one process's when averaged over the micro-batches and
    replicas (``with_token_means``: what backward runs on; ``result``: the loss over the ranks). Whatever the split,
    the loss and the gradients are one device's.

    Such a term's gradient must not be divided by the token count, so the count divides the token means'
    gradients in their backward: with one micro-batch it is added up over the ranks before the backward; with
    several it comes from forwards without gradients first (``count_first``: a net with a mixture of experts),
    else the output must be a token mean alone, whose gradients the optimizer's step divides (``grad_scale``).
    ``count_epsilon``: what the token losses add to the count they divide by
    (``paratrain.modules.token_loss.token_denominator``)."""

    def __init__(self, layout: Layout, micro_batch_num: int, loss_scale: torch.Tensor | float,
                 count_epsilon: float | None = None):
        self.layout, self.micro_batch_num, self.loss_scale = layout, micro_batch_num, loss_scale
        self.count_epsilon = count_epsilon
        # the token means of the forward under way (mean, sum, count, weight), then per micro-batch (output value,
        # [(mean, sum, count, weight)]); factor: what their backward multiplies the gradient by; count: the global
        # batch's token count once added up over the ranks
        self.pending: list[tuple] = []
        self.means: list[tuple[torch.Tensor, list]] = []
        self.factor: torch.Tensor | float = layout.dp_cp_size * micro_batch_num
        self.count: torch.Tensor | None = None

    @property
    def mean_factor(self) -> torch.Tensor | float:
        """What a micro-batch's output is multiplied by: the loss scale over the micro-batches."""
        return self.loss_scale / self.micro_batch_num

    def token_mean(self, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """A token loss of the micro-batch under way: its mean over its ``count`` tokens (the value one process
        computes), whose backward gives ``total`` the gradient of the global batch's token mean."""
        total, count = whole(total).float(), whole(count.detach()).float()
        weight = torch.zeros((), device=total.device)
        mean = _TokenMean.apply(total, count, self, weight)
        self.pending.append((mean, total.detach(), count, weight))
        return mean

    def with_token_means(self, output: torch.Tensor) -> torch.Tensor:
        """A micro-batch's net output (a scalar) holding the token means made in its forward, plus any other terms:
        what backward runs on, the output times ``mean_factor``, the token means' gradients divided by the global
        batch's token count (the class docstring says when). UserError for other terms with several micro-batches."""
        terms, self.pending = self.pending, []
        if self.micro_batch_num == 1:
            self._count(terms)
        elif self.count is None and not (len(terms) == 1 and output is terms[0][0]):
            raise UserError(f"the net's loss adds other terms to its CrossEntropyLoss's token mean, with "
                            f"micro_batch_num={self.micro_batch_num}: the token count of the global batch is known "
                            f"only after every micro-batch's forward; use micro_batch_num=1, or return the loss alone")
        self.means.append((whole(output.detach()).float().reshape(()), [(m.detach(), *rest) for m, *rest in terms]))
        return output.float().reshape(()) * self.mean_factor

    def count_first(self, forwards: Callable[[], None]) -> None:
        """Run ``forwards()``, the forwards of this rank's micro-batches without gradients, for their token
        counts: the global batch's count then divides the token means' gradients from the first backward on, and
        the outputs may hold other terms (``with_token_means``)."""
        forwards()
        terms, self.pending = self.pending, []
        self._count(terms)

    def _count(self, terms: list[tuple]) -> None:
        """The global batch's token count from this rank's ``terms``, added up over the data- and context-parallel
        ranks."""
        self.count = self.denominator(self.layout.all_reduce_dp_cp(_sum([count for _, _, count, _ in terms],
                                                                        self.layout)))
        self.factor = self.layout.dp_cp_size * self.micro_batch_num / self.count

    def denominator(self, count: torch.Tensor) -> torch.Tensor:
        """What a token loss's sum over ``count`` tokens is divided by (``count_epsilon`` says)."""
        return token_denominator(count, self.count_epsilon)

    def result(self) -> dict:
        """{"loss": the global batch's loss, the same on every rank}: each token mean's share of the output
        (``weight``: its gradient in backward, over ``mean_factor``) as the global batch's token mean, the rest
        averaged; and ``grad_scale`` when the count was not known before the backward."""
        token_sum, rest = [], []
        for output, terms in self.means:
            shares = [weight / self.mean_factor for *_, weight in terms]
            token_sum += [share * total for share, (_, total, _, _) in zip(shares, terms)]
            rest.append(output - _sum([share * mean for share, (mean, *_) in zip(shares, terms)], self.layout))
        local = [_sum(token_sum, self.layout), _sum(rest, self.layout)]
        if self.count is None:
            local.append(_sum([count for _, terms in self.means for _, _, count, _ in terms], self.layout))
        summed = self.layout.all_reduce_dp_cp(torch.stack(local))
        count = self.count if self.count is not None else self.denominator(summed[2])
        out = {"loss": summed[0] / count + summed[1] / (self.layout.dp_cp_size * self.micro_batch_num)}
        if self.count is None:  # the token means' gradients are divided by the count in the optimizer's step
            out["grad_scale"] = count.reciprocal()
        return out


def _sum(values: list[torch.Tensor], layout: Layout) -> torch.Tensor:
    """The sum of 0-dim ``values``, 0 on the layout's device when there are none."""
    return torch.stack(values).sum() if values else torch.zeros((), device=layout.device)


class _TokenMean(torch.autograd.Function):
    """``total / count``, whose backward gives ``total`` the incoming gradient times ``step.factor`` (the step's
    normalisation) and notes that gradient in ``weight``: how much of the net's output this mean is."""

    @staticmethod
    def forward(ctx, total: torch.Tensor, count: torch.Tensor, step: TokenMeanStep,
                weight: torch.Tensor) -> torch.Tensor:
        ctx.step, ctx.weight = step, weight
        return total / step.denominator(count)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.weight.copy_(grad)
        return grad * ctx.step.factor, None, None, None


def has_rows(value) -> bool:
    """Whether ``value`` is a batch tensor with rows (dimension 0) to split; others go whole to every split."""
    return isinstance(value, torch.Tensor) and value.ndim > 0


def split(batch: dict | tuple, parts: int) -> list:
    """``batch`` (a dict or tuple, rows first) in ``parts`` micro-batches of the same kind: tensors with rows are
    chunked, other values (numbers, 0-dim tensors) go whole to each; an empty batch gives empty micro-batches."""
    if parts == 1:
        return [batch]
    values = list(batch.values() if isinstance(batch, dict) else batch)
    chunks = [v.chunk(parts) if has_rows(v) else [v] * parts for v in values]
    micro_batches = [tuple(chunk[i] for chunk in chunks) for i in range(parts)]
    return [dict(zip(batch, micro)) for micro in micro_batches] if isinstance(batch, dict) else micro_batches


def forward_only(batch: tuple, config: ParallelConfig, precision: str, device: torch.device, forward: Callable,
                 phase) -> None:
    """``forward(*micro_batch)`` of this rank's rows of a global batch in ``config.micro_batch_num`` micro-batches
    as ``forward_backward`` runs them, without gradients."""
    with torch.no_grad(), loss_context(config), autocast(precision, device), phase("forward"):
        for micro in split(batch, config.micro_batch_num):
            forward(*micro)


def forward_backward(batch: dict | tuple, config: ParallelConfig, precision: str, device: torch.device, phase, *,
                     module: torch.nn.Module | None = None, loss_of: Callable | None = None,
                     pipeline: Callable | None = None) -> None:
    """Forward and backward of this rank's rows of a global batch (a dict or tuple of tensors, rows first) in
    ``config.micro_batch_num`` micro-batches, gradients accumulated, forward in ``precision``: ``pipeline(batch)``
    (a pipeline schedule's step, its loss function a :class:`StepLoss`'s), else ``module``'s, where
    ``loss_of(micro_batch)`` runs the forward and returns what backward runs on (a :class:`StepLoss`'s); with
    ZeRO < 3 gradients are then reduced once, during the last backward. ``phase``: a StepTimer's."""
    if pipeline is not None:
        with loss_context(config), autocast(precision, device), phase("pipeline"):
            pipeline(batch)
        return
    micro_batches = split(batch, config.micro_batch_num)
    sync = hasattr(module, "set_requires_gradient_sync") and config.effective_zero_stage < 3
    for i, micro in enumerate(micro_batches):
        if sync:
            module.set_requires_gradient_sync(i == len(micro_batches) - 1)
        with loss_context(config):  # vocab-sharded logits: the loss and its backward are loss_parallel's
            with phase("forward"), autocast(precision, device):
                loss = loss_of(micro)
            with phase("backward"):
                loss.backward()
