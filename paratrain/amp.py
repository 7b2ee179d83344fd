"""MindSpore's loss-scale managers (``mindspore.amp``) for ``Model(..., amp_level=..., loss_scale_manager=...)``:
they ask for fp16 compute with loss scaling, run by ``paratrain.precision.LossScaler`` as ``paratrain train``'s
fp16 is (the floor and the exit code 5 included)."""
from __future__ import annotations

import torch

from paratrain.errors import UserError
from paratrain.precision import LossScaler

AMP_LEVELS = ("O0", "O1", "O2", "O3", "fp8")


class LossScaleManager:
    """Base of the loss-scale managers: ``scaler(device)`` is the ``LossScaler`` that runs it."""


class FixedLossScaleManager(LossScaleManager):
    """A fixed loss scale ``loss_scale``; with ``drop_overflow_update`` (MindSpore's default) a step whose
    gradients overflow is skipped, which paratrain always does (an update with infinite gradients would
    ruin the weights)."""

    def __init__(self, loss_scale: float = 128.0, drop_overflow_update: bool = True):
        if not (isinstance(loss_scale, (int, float)) and loss_scale >= 1):
            raise UserError(f"FixedLossScaleManager(loss_scale={loss_scale!r}): expected a number >= 1")
        if not drop_overflow_update:
            raise UserError("FixedLossScaleManager(drop_overflow_update=False) is not offered: an update with "
                            "overflowed gradients would ruin the weights; a step that overflows is skipped")
        self.loss_scale = float(loss_scale)

    def get_loss_scale(self) -> float:
        return self.loss_scale

    def scaler(self, device: torch.device) -> LossScaler:
        return LossScaler(True, self.loss_scale, min_scale=self.loss_scale, device=device, dynamic=False)


class DynamicLossScaleManager(LossScaleManager):
    """MindSpore's dynamic loss scale: starts at ``init_loss_scale``, halves on an overflow (the step is
    skipped) and doubles after ``scale_window`` good steps. paratrain's floor is a scale of 1: an overflow
    there ends the run (exit 5)."""

    def __init__(self, init_loss_scale: float = 2 ** 24, scale_factor: int = 2, scale_window: int = 2000):
        if not (isinstance(init_loss_scale, (int, float)) and init_loss_scale >= 1):
            raise UserError(f"DynamicLossScaleManager(init_loss_scale={init_loss_scale!r}): expected a number >= 1")
        if scale_factor != 2:
            raise UserError(f"DynamicLossScaleManager(scale_factor={scale_factor!r}): only 2 is offered (the scale "
                            f"halves and doubles, as paratrain train's fp16 does)")
        if isinstance(scale_window, bool) or not isinstance(scale_window, int) or scale_window < 1:
            raise UserError(f"DynamicLossScaleManager(scale_window={scale_window!r}): expected an int >= 1")
        self.init_loss_scale, self.scale_window = float(init_loss_scale), scale_window

    def scaler(self, device: torch.device) -> LossScaler:
        return LossScaler(True, self.init_loss_scale, growth_interval=self.scale_window, device=device)


def precision_of(amp_level: str, loss_scale_manager: LossScaleManager | None) -> str:
    """``Model``'s ``amp_level`` as ``train.mixed_precision``: "O0" fp32; "O1"/"O2"/"O3" bf16 compute with
    fp32 weights, or fp16 with loss scaling when a loss-scale manager is given; "fp8" (paratrain's own level)
    the Linear layers in fp8 and the rest in bf16, refused where fp8 cannot run."""
    if amp_level not in AMP_LEVELS:
        raise UserError(f"Model(amp_level={amp_level!r}): expected one of {', '.join(AMP_LEVELS)}")
    if loss_scale_manager is not None and not isinstance(loss_scale_manager, LossScaleManager):
        raise UserError(f"Model(loss_scale_manager=...): expected a FixedLossScaleManager or DynamicLossScaleManager, "
                        f"got {type(loss_scale_manager).__name__}")
    if amp_level == "O0":
        if loss_scale_manager is not None:
            raise UserError("Model(amp_level='O0', loss_scale_manager=...): fp32 needs no loss scaling; use "
                            "amp_level='O2' for fp16 with loss scaling")
        return "none"
    if amp_level == "fp8":
        from paratrain.device import device
        from paratrain.precision import fp8_unavailable

        why = "bf16 needs no loss scaling" if loss_scale_manager is not None else fp8_unavailable(device())
        if why:
            raise UserError(f"Model(amp_level='fp8') cannot run here: {why}; use amp_level='O2' (bf16)")
        return "fp8"
    return "fp16" if loss_scale_manager is not None else "bf16"
