"""The loss over vocab-sharded logits: cross-entropy without gathering the full vocabulary.

Under ``loss_parallel()`` PyTorch computes the softmax statistics of each vocab shard
locally and all-reduces only (B*T)-sized maxima and sums: for the built-in models' loss and
``paratrain.nn.CrossEntropyLoss`` alike (``paratrain.modules.linear_cross_entropy.token_cross_entropy``).
The context must cover the backward too, so the trainer and a user's placed net enter it around
a whole micro-batch (forward + backward), or around a pipeline's whole step.
"""
from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from paratrain.config import ParallelConfig


def loss_context(config: ParallelConfig):
    """``loss_parallel()`` when the head is vocab-sharded (model_parallel > 1), else a no-op."""
    return loss_parallel() if config.model_parallel > 1 else contextlib.nullcontext()


def whole(loss: torch.Tensor) -> torch.Tensor:
    """A loss value as a plain tensor (under ``loss_parallel`` it is a replicated DTensor)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
