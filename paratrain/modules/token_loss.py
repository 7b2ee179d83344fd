"""The declared end of a token loss, ``TokenMean``: a loss module that ends in one says that its value is a mean over
tokens whose sum and count a placement may take instead, and ``TokenMeansTo``, the hook by which a placement does.

A token loss (paratrain.nn's ``CrossEntropyLoss``, or a user's own) computes its summed loss and its token count
and returns ``self.token_mean(total, count)``: on one unplaced process the mean, as MindSpore returns it. In a
placed net ``TokenMeansTo`` replaces that output: outside a training step with ``[sum, count]`` (float32, (2,):
what a traced pipeline stage sends on and ``Model.eval`` adds up over the ranks), within one (``TokenMeansTo.to``)
with ``step.token_mean(sum, count)``, a scalar, the micro-batch's token mean, so the net may add other terms to it
(a mixture of experts' load-balancing loss) and return what it returns on one process; the step's normalisation
(``paratrain.parallel.micro_batches.StepLoss``) makes its backward that of the global batch's token mean.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn


def token_denominator(count: torch.Tensor, count_epsilon: float | None) -> torch.Tensor:
    """What a token loss's sum over ``count`` tokens is divided by: the count plus ``count_epsilon``, or with None
    the count, at least 1e-5 (a batch of no counted token has a loss of 0)."""
    return count.clamp(min=1e-5) if count_epsilon is None else count + count_epsilon


class TokenMean(nn.Module):
    """The last step of a token loss: ``(total (), count ()) -> total / (count + count_epsilon)`` of shape (1,)
    (``token_denominator``; MindSpore's ``Σmask + 1e-5`` is ``count_epsilon=1e-5``). A placement reads it (the module
    docstring)."""

    def __init__(self, count_epsilon: float | None = None):
        super().__init__()
        self.count_epsilon = count_epsilon

    def forward(self, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return (total / token_denominator(count, self.count_epsilon)).reshape(1)


class TokenMeansTo:
    """The forward hook a placement puts on every ``TokenMean`` of ``net``: each returns its ``[sum, count]``, or
    within ``to(step)`` ``step.token_mean(sum, count)``. ``found``: whether the net has any; ``count_epsilon``: the
    largest they add to their counts (None: none adds any)."""

    def __init__(self, net: nn.Module):
        self.step = None  # the StepLoss (or what keeps token means like it) of the forward under way
        means = [m for m in net.modules() if isinstance(m, TokenMean)]
        for mean in means:
            mean.register_forward_hook(self)
        self.found = bool(means)
        self.count_epsilon = max((m.count_epsilon for m in means if m.count_epsilon is not None), default=None)

    @torch.compiler.disable  # a compiled net (GRAPH_MODE) runs it eagerly: the step's normalisation is not traceable
    def __call__(self, module: TokenMean, args: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor):
        total, count = args
        return torch.stack([total, count]) if self.step is None else self.step.token_mean(total, count)

    @contextlib.contextmanager
    def to(self, step):
        """Within it the token losses of a forward return ``step.token_mean(sum, count)``; ``None``: their pair."""
        self.step = step
        try:
            yield
        finally:
            self.step = None
