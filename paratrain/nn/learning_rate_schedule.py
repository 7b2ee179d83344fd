"""MindSpore's ``nn.learning_rate_schedule``: learning rates as modules of the global step (steps taken,
an int or a 0-d tensor) giving a 0-d float32 tensor on its device, to compose with tensor ops and pass to
``paratrain.nn.Momentum`` or ``AdamWeightDecay``. The rates are ``paratrain.optim``'s schedule functions."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from paratrain.errors import UserError
from paratrain.nn.dynamic_lr import check_args, natural_exp_decay_of_steps
from paratrain.optim import cosine_decay, exponential_decay, inverse_decay, polynomial_decay, warmup


class LearningRateSchedule(nn.Module):
    """Base of the schedules: ``forward(global_step) -> lr`` (0-d float32 tensor) from ``rate``, the schedule as a
    plain-Python function of the step (float to float), which optimizers call without making a tensor. A user's
    schedule leaves ``rate`` out and defines ``forward``."""

    def __init__(self, rate=None):
        super().__init__()
        self.rate = rate

    def forward(self, global_step) -> torch.Tensor:
        return torch.tensor(self.rate(float(global_step)), dtype=torch.float32,
                            device=getattr(global_step, "device", "cpu"))


class WarmUpLR(LearningRateSchedule):
    """``learning_rate * min(global_step, warmup_steps) / warmup_steps`` (0 at the first step)."""

    def __init__(self, learning_rate: float, warmup_steps: int):
        check_args("WarmUpLR", "a number > 0", learning_rate=learning_rate, warmup_steps=warmup_steps)
        super().__init__(partial(warmup, steps=warmup_steps, start=0.0, end=learning_rate))


class PolynomialDecayLR(LearningRateSchedule):
    """``(learning_rate - end_learning_rate) * (1 - p) ** power + end_learning_rate`` with
    ``p = min(global_step, decay_steps) / decay_steps``; with ``update_decay_steps`` the decay restarts
    every ``decay_steps`` (``decay_steps * ceil(global_step / decay_steps)`` in place of ``decay_steps``)."""

    def __init__(self, learning_rate: float, end_learning_rate: float, decay_steps: int, power: float,
                 update_decay_steps: bool = False):
        check_args("PolynomialDecayLR", "a number > 0", learning_rate=learning_rate, decay_steps=decay_steps,
                   power=power)
        if not 0 <= end_learning_rate <= learning_rate:
            raise UserError(f"PolynomialDecayLR(end_learning_rate={end_learning_rate!r}): expected a number in "
                            f"[0, learning_rate={learning_rate}]")
        super().__init__(partial(polynomial_decay, start=learning_rate, end=end_learning_rate,
                                 steps=decay_steps, power=power, restart=update_decay_steps))


class CosineDecayLR(LearningRateSchedule):
    """``min_lr + (max_lr - min_lr) * (1 + cos(pi * p)) / 2`` with ``p = min(global_step, decay_steps) /
    decay_steps``."""

    def __init__(self, min_lr: float, max_lr: float, decay_steps: int):
        check_args("CosineDecayLR", "a number > 0", max_lr=max_lr, decay_steps=decay_steps)
        if not 0 <= min_lr < max_lr:
            raise UserError(f"CosineDecayLR(min_lr={min_lr!r}): expected a number in [0, max_lr={max_lr})")
        super().__init__(partial(cosine_decay, start=max_lr, end=min_lr, steps=decay_steps))


class _Decay(LearningRateSchedule):
    """A decay of ``learning_rate`` by ``decay_rate`` with ``p = global_step / decay_steps`` (floored with
    ``is_stair``), by ``paratrain.optim``'s function ``decay``; subclasses name the function."""

    decay = None

    def __init__(self, learning_rate: float, decay_rate: float, decay_steps: int, is_stair: bool = False):
        check_args(type(self).__name__, "a number > 0", learning_rate=learning_rate, decay_rate=decay_rate,
                   decay_steps=decay_steps)
        super().__init__(partial(type(self).decay, start=learning_rate, rate=decay_rate, steps=decay_steps,
                                 stair=is_stair))


class ExponentialDecayLR(_Decay):
    """``learning_rate * decay_rate ** p`` with ``p = global_step / decay_steps`` (floored with ``is_stair``)."""

    decay = staticmethod(exponential_decay)


class NaturalExpDecayLR(_Decay):
    """``learning_rate * e ** (-decay_rate * global_step)``, with ``is_stair`` the step floored to a multiple of
    ``decay_steps``: what MindSpore 2.7.0 computes (its documentation divides the step by ``decay_steps``)."""

    decay = staticmethod(natural_exp_decay_of_steps)


class InverseDecayLR(_Decay):
    """``learning_rate / (1 + decay_rate * p)`` with ``p = global_step / decay_steps`` (floored with ``is_stair``)."""

    decay = staticmethod(inverse_decay)
