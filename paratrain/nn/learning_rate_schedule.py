"""Learning rates as modules of the global step, written once for both faces: MindSpore's
``nn.learning_rate_schedule`` (checked as MindSpore checks them) over pieces that take any rates, which
``paratrain.optim.lr_schedule`` also composes into the TOML schedules.

Each maps ``global_step`` (an int or a 0-d tensor; steps taken so far, 0 at the first update) to the rate, a
0-d tensor on the step's device: float32, or float64 for a float64 step. Compose them with tensor ops (as the
tutorial's ``LearningRate``) or ``Piecewise``, and pass one to ``paratrain.nn.AdamWeightDecay(learning_rate=)``.
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
    step = torch.as_tensor(global_step, device=getattr(global_step, "device", "cpu"))
    return step if step.dtype == torch.float64 else step.float()


class LearningRateSchedule(nn.Module):
    """Base of the schedules: ``forward(global_step) -> lr`` (0-d tensor)."""


class Warmup(LearningRateSchedule):
    """``start_lr + (end_lr - start_lr) * f`` with ``f = min(step, steps) / steps`` (``warmup_type="linear"``) or
    DeepSpeed's ``log(step + 1) / log(steps)``, at most 1 (``"log"``); steps before 0 count as 0."""

    def __init__(self, start_lr: float, end_lr: float, steps: int, warmup_type: str = "linear"):
        super().__init__()
        self.start_lr, self.end_lr, self.steps, self.warmup_type = float(start_lr), float(end_lr), steps, warmup_type

    def forward(self, global_step) -> torch.Tensor:
        step = _step(global_step).clamp(0, self.steps)
        if self.warmup_type == "log":
            fraction = (torch.log(step + 1) / math.log(self.steps)).clamp(max=1)
        else:
            fraction = step / self.steps
        return self.start_lr + (self.end_lr - self.start_lr) * fraction


class PolynomialDecay(LearningRateSchedule):
    """``end_lr + (start_lr - end_lr) * ((steps - s) / steps) ** power`` with ``s = min(step, steps)``; with
    ``restart`` the decay starts again every ``steps`` (``s = step`` and ``steps * ceil(step / steps)`` in
    place of ``steps``)."""

    def __init__(self, start_lr: float, end_lr: float, steps: int, power: float, restart: bool = False):
        super().__init__()
        self.start_lr, self.end_lr, self.steps = float(start_lr), float(end_lr), steps
        self.power, self.restart = power, restart

    def forward(self, global_step) -> torch.Tensor:
        step = _step(global_step)
        if self.restart:
            steps = self.steps * torch.ceil(step / self.steps).clamp(min=1)
        else:
            step, steps = step.clamp(max=self.steps), self.steps
        return self.end_lr + (self.start_lr - self.end_lr) * ((steps - step) / steps) ** self.power


class CosineDecay(LearningRateSchedule):
    """``end_lr + (start_lr - end_lr) * (1 + cos(pi * s / steps)) / 2`` with ``s = min(step, steps)``, or
    ``s = step`` without ``hold`` (the rate rises again past ``steps``, as DeepSpeed's WarmupCosineLR)."""

    def __init__(self, start_lr: float, end_lr: float, steps: int, hold: bool = True):
        super().__init__()
        self.start_lr, self.end_lr, self.steps, self.hold = float(start_lr), float(end_lr), steps, hold

    def forward(self, global_step) -> torch.Tensor:
        step = _step(global_step)
        p = (step.clamp(max=self.steps) if self.hold else step) / self.steps
        return self.end_lr + (self.start_lr - self.end_lr) * (1 + torch.cos(math.pi * p)) / 2


class Piecewise(LearningRateSchedule):
    """Schedules one after another: each of ``pieces``, ``(start, origin, schedule)``, gives the rate from step
    ``start`` until the next piece starts, as ``schedule`` (a schedule, or a number) at ``step - origin``."""

    def __init__(self, *pieces: tuple):
        super().__init__()
        self.pieces = pieces

    def forward(self, global_step) -> torch.Tensor:
        step = _step(global_step)
        rate = torch.zeros_like(step)
        for start, origin, schedule in self.pieces:
            rate = torch.where(step >= start, schedule(step - origin) if callable(schedule) else schedule, rate)
        return rate


class WarmUpLR(Warmup):
    """MindSpore's ``learning_rate * min(global_step, warmup_steps) / warmup_steps`` (0 at the first step)."""

    def __init__(self, learning_rate: float, warmup_steps: int):
        _positive("WarmUpLR", learning_rate=learning_rate, warmup_steps=warmup_steps)
        super().__init__(0.0, learning_rate, warmup_steps)


class PolynomialDecayLR(PolynomialDecay):
    """MindSpore's ``(learning_rate - end_learning_rate) * (1 - p) ** power + end_learning_rate`` with
    ``p = min(global_step, decay_steps) / decay_steps``; with ``update_decay_steps`` the decay restarts
    every ``decay_steps`` (``decay_steps * ceil(global_step / decay_steps)`` in place of ``decay_steps``)."""

    def __init__(self, learning_rate: float, end_learning_rate: float, decay_steps: int, power: float,
                 update_decay_steps: bool = False):
        _positive("PolynomialDecayLR", learning_rate=learning_rate, decay_steps=decay_steps, power=power)
        if not 0 <= end_learning_rate <= learning_rate:
            raise UserError(f"PolynomialDecayLR(end_learning_rate={end_learning_rate!r}): expected a number in "
                            f"[0, learning_rate={learning_rate}]")
        super().__init__(learning_rate, end_learning_rate, decay_steps, power, update_decay_steps)


class CosineDecayLR(CosineDecay):
    """MindSpore's ``min_lr + (max_lr - min_lr) * (1 + cos(pi * p)) / 2`` with ``p = min(global_step,
    decay_steps) / decay_steps``."""

    def __init__(self, min_lr: float, max_lr: float, decay_steps: int):
        _positive("CosineDecayLR", max_lr=max_lr, decay_steps=decay_steps)
        if not 0 <= min_lr < max_lr:
            raise UserError(f"CosineDecayLR(min_lr={min_lr!r}): expected a number in [0, max_lr={max_lr})")
        super().__init__(max_lr, min_lr, decay_steps)


class ExponentialDecayLR(LearningRateSchedule):
    """MindSpore's ``learning_rate * decay_rate ** p`` with ``p = global_step / decay_steps`` (floored with
    ``is_stair``)."""

    def __init__(self, learning_rate: float, decay_rate: float, decay_steps: int, is_stair: bool = False):
        super().__init__()
        _positive("ExponentialDecayLR", learning_rate=learning_rate, decay_rate=decay_rate, decay_steps=decay_steps)
        self.learning_rate, self.decay_rate = float(learning_rate), float(decay_rate)
        self.decay_steps, self.is_stair = decay_steps, is_stair

    def forward(self, global_step) -> torch.Tensor:
        p = _step(global_step) / self.decay_steps
        return self.learning_rate * self.decay_rate ** (torch.floor(p) if self.is_stair else p)
