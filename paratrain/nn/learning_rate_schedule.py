"""MindSpore's ``nn.learning_rate_schedule``: learning rates as modules of the global step.

Each schedule maps ``global_step`` (an int or a 0-d tensor; steps taken so far, 0 at the first
update) to the learning rate, as a 0-d float32 tensor on the step's device (the host, when an
optimizer asks). Users compose them with tensor ops, as the tutorial's ``LearningRate`` does, and
pass the result to ``paratrain.nn.AdamWeightDecay(learning_rate=...)``.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from paratrain.errors import UserError


def _positive(owner: str, **values) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise UserError(f"{owner}({name}={value!r}): expected a number > 0")


def _step(global_step) -> torch.Tensor:
    return torch.as_tensor(global_step, dtype=torch.float32, device=getattr(global_step, "device", "cpu"))


class LearningRateSchedule(nn.Module):
    """Base of the schedules: ``forward(global_step) -> lr`` (0-d float32 tensor)."""


class WarmUpLR(LearningRateSchedule):
    """``learning_rate * min(global_step, warmup_steps) / warmup_steps`` (0 at the first step)."""

    def __init__(self, learning_rate: float, warmup_steps: int):
        super().__init__()
        _positive("WarmUpLR", learning_rate=learning_rate, warmup_steps=warmup_steps)
        self.learning_rate, self.warmup_steps = float(learning_rate), warmup_steps

    def forward(self, global_step) -> torch.Tensor:
        return self.learning_rate * _step(global_step).clamp(max=self.warmup_steps) / self.warmup_steps


class PolynomialDecayLR(LearningRateSchedule):
    """``(learning_rate - end_learning_rate) * (1 - p) ** power + end_learning_rate`` with
    ``p = min(global_step, decay_steps) / decay_steps``; with ``update_decay_steps`` the decay restarts
    every ``decay_steps`` (``decay_steps * ceil(global_step / decay_steps)`` in place of ``decay_steps``)."""

    def __init__(self, learning_rate: float, end_learning_rate: float, decay_steps: int, power: float,
                 update_decay_steps: bool = False):
        super().__init__()
        _positive("PolynomialDecayLR", learning_rate=learning_rate, decay_steps=decay_steps, power=power)
        if not 0 <= end_learning_rate <= learning_rate:
            raise UserError(f"PolynomialDecayLR(end_learning_rate={end_learning_rate!r}): expected a number in "
                            f"[0, learning_rate={learning_rate}]")
        self.learning_rate, self.end_learning_rate = float(learning_rate), float(end_learning_rate)
        self.decay_steps, self.power, self.update_decay_steps = decay_steps, power, update_decay_steps

    def forward(self, global_step) -> torch.Tensor:
        step = _step(global_step)
        if self.update_decay_steps:
            decay_steps = self.decay_steps * torch.ceil(step / self.decay_steps).clamp(min=1)
        else:
            step, decay_steps = step.clamp(max=self.decay_steps), self.decay_steps
        span = self.learning_rate - self.end_learning_rate
        return span * (1 - step / decay_steps) ** self.power + self.end_learning_rate


class CosineDecayLR(LearningRateSchedule):
    """``min_lr + (max_lr - min_lr) * (1 + cos(pi * p)) / 2`` with ``p = min(global_step, decay_steps) /
    decay_steps``."""

    def __init__(self, min_lr: float, max_lr: float, decay_steps: int):
        super().__init__()
        _positive("CosineDecayLR", max_lr=max_lr, decay_steps=decay_steps)
        if not 0 <= min_lr < max_lr:
            raise UserError(f"CosineDecayLR(min_lr={min_lr!r}): expected a number in [0, max_lr={max_lr})")
        self.min_lr, self.max_lr, self.decay_steps = float(min_lr), float(max_lr), decay_steps

    def forward(self, global_step) -> torch.Tensor:
        p = _step(global_step).clamp(max=self.decay_steps) / self.decay_steps
        return self.min_lr + (self.max_lr - self.min_lr) * (1 + torch.cos(math.pi * p)) / 2


class ExponentialDecayLR(LearningRateSchedule):
    """``learning_rate * decay_rate ** p`` with ``p = global_step / decay_steps`` (floored with ``is_stair``)."""

    def __init__(self, learning_rate: float, decay_rate: float, decay_steps: int, is_stair: bool = False):
        super().__init__()
        _positive("ExponentialDecayLR", learning_rate=learning_rate, decay_rate=decay_rate, decay_steps=decay_steps)
        self.learning_rate, self.decay_rate = float(learning_rate), float(decay_rate)
        self.decay_steps, self.is_stair = decay_steps, is_stair

    def forward(self, global_step) -> torch.Tensor:
        p = _step(global_step) / self.decay_steps
        return self.learning_rate * self.decay_rate ** (torch.floor(p) if self.is_stair else p)
