"""What a token loss that reports its sum and count (``reduction="sum_and_count"``: paratrain.nn's
CrossEntropyLoss in a placed net) returns, inside and outside a training step.

Outside a step's forward it returns ``[sum, count]`` (float32, (2,)): what a traced pipeline stage sends on and
``Model.eval`` adds up over the ranks. Inside one (``token_means_to(step)``, entered by the placement of a net
whose forward runs eagerly) it returns ``step.token_mean(sum, count)``: a scalar, the micro-batch's token mean, so
the net may add other terms to it (a mixture of experts' load-balancing loss) and return what it returns on one
process; the step's normalisation (``paratrain.parallel.micro_batches.StepLoss``) makes its backward that of the
global batch's token mean.
"""
from __future__ import annotations

import contextlib

import torch

_step: list = [None]  # the StepLoss of the step whose forward is under way


@contextlib.contextmanager
def token_means_to(step):
    """Within it the token losses of a forward return ``step.token_mean(sum, count)``; ``None``: their pair."""
    _step[0] = step
    try:
        yield
    finally:
        _step[0] = None


@torch.compiler.disable  # a compiled net (GRAPH_MODE) runs it eagerly: the step's normalisation is not traceable
def sum_and_count(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A token loss's sum and count, as the module docstring says: ``[sum, count]``, or in a step its token mean."""
    step = _step[0]
    return torch.stack([total, count]) if step is None else step.token_mean(total, count)
