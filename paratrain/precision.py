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


class LossScaler:
    """Dynamic loss scale for fp16: the loss is multiplied by ``scale`` before backward so
    small gradients do not underflow; a step whose gradients overflow is skipped and the
    scale halved; after ``growth_interval`` good steps in a row it doubles.

    With ``enabled=False`` (bf16, fp32) the scale is fixed at 1 and no step is skipped.
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0 ** 16, growth_interval: int = 1000):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped_steps = 0

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
            self.scale /= 2
            self.good_steps = 0
            self.skipped_steps += 1
            return True
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps, self.skipped_steps = state["scale"], state["good_steps"], state["skipped_steps"]
