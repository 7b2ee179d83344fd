"""Mixed precision: fp32 master weights, bf16/fp16 compute, dynamic loss scaling for fp16."""
from __future__ import annotations

import contextlib
import math

import torch

from paratrain.device import DTYPES


def autocast(mixed_precision: str, device: torch.device):
    """Forward in bf16/fp16 where safe (matmuls), fp32 elsewhere; parameters stay fp32."""
    if mixed_precision == "none":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[mixed_precision])


class LossScaleFloor(RuntimeError):
    """fp16 training cannot go on: its gradients overflowed at the minimum loss scale, or in too many steps
    in a row. ``paratrain train`` exits with :data:`EXIT_CODE`."""

    EXIT_CODE = 5


class LossScaler:
    """Dynamic loss scale for fp16: the loss is multiplied by ``scale`` before backward so
    small gradients do not underflow; a step whose gradients overflow is skipped and the
    scale halved, down to ``min_scale``; after ``growth_interval`` good steps in a row it doubles.

    An overflow when the scale is already ``min_scale`` (DeepSpeed's ``min_loss_scale``), or
    ``max_skipped`` overflowed steps in a row (0: no limit), raise :class:`LossScaleFloor`:
    such a run only skips steps. With ``enabled=False`` (bf16, fp32) the scale is fixed at 1
    and no step is skipped.
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0 ** 16, growth_interval: int = 1000,
                 min_scale: float = 1.0, max_skipped: int = 100):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.min_scale, self.max_skipped = min_scale, max_skipped
        self.good_steps = 0
        self.skipped_steps = 0
        self.skipped_in_a_row = 0

    def unscale_(self, parameters) -> None:
        if self.enabled:
            for p in parameters:
                if p.grad is not None:
                    p.grad.mul_(1.0 / self.scale)

    def update(self, grad_norm: torch.Tensor) -> bool:
        """Record one step from its (unscaled) gradient norm; returns True when it must be skipped.

        With fp16 this reads the norm on the host: the one step-time synchronisation the skip decision needs.
        """
        if not self.enabled:
            return False
        if not math.isfinite(grad_norm.item()):
            self.good_steps = 0
            self.skipped_steps += 1
            self.skipped_in_a_row += 1
            if self.scale <= self.min_scale:
                raise LossScaleFloor(f"fp16 gradients overflow at the minimum loss scale {self.min_scale:g} "
                                     f"(train.min_loss_scale; {self.summary()}): lower train.lr, or train in bf16")
            if self.max_skipped and self.skipped_in_a_row >= self.max_skipped:
                raise LossScaleFloor(f"{self.skipped_in_a_row} fp16 steps in a row overflowed "
                                     f"(train.max_skipped_steps={self.max_skipped}; {self.summary()}): "
                                     f"lower train.lr, or train in bf16")
            self.scale = max(self.scale / 2, self.min_scale)
            return True
        self.skipped_in_a_row = 0
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2
        return False

    def summary(self) -> str:
        return f"{self.skipped_steps} step(s) skipped for overflow, loss scale {self.scale:g}"

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps,
                "skipped_in_a_row": self.skipped_in_a_row}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps, self.skipped_steps = state["scale"], state["good_steps"], state["skipped_steps"]
        self.skipped_in_a_row = state.get("skipped_in_a_row", 0)  # absent from checkpoints before it
