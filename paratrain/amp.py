"""MindSpore's loss-scale managers (``mindspore.amp``) for ``Model(..., amp_level=..., loss_scale_manager=...)``:
they ask for fp16 compute with loss scaling, run by ``paratrain.precision.LossScaler`` as ``paratrain train``'s
fp16 is (the floor and the exit code 5 included)."""
from __future__ import annotations

import torch

from paratrain.config_rules import value_problem
from paratrain.errors import UserError
from paratrain.precision import LossScaler

AMP_LEVELS = ("O0", "O1", "O2", "O3", "fp8")


class LossScaleManager:
    """Base of the loss-scale managers: ``scaler(device)`` is the ``LossScaler`` that runs it."""

    def _check(self, name: str, value, default, least: float) -> None:
        """Refuse ``value`` for argument ``name`` unless it is of the type of ``default`` (``paratrain train``'s rule,
        ``value_problem``: finite numbers, no strings or bools), at least ``least`` and finite in float32 (the
        scale's dtype)."""
        problem = value_problem(name, value, default) or (
            f"{name}={value!r} must be at least {least:g}" if value < least else
            f"{name}={value!r} overflows float32: use at most 2**24" if value > torch.finfo(torch.float32).max else None)
        if problem:
            raise UserError(f"{type(self).__name__}: {problem}")


class FixedLossScaleManager(LossScaleManager):
    """A fixed loss scale ``loss_scale``; with ``drop_overflow_update`` (MindSpore's default) a step whose gradients
    overflow is skipped, which paratrain always does (an update with infinite gradients would ruin the weights)."""

    def __init__(self, loss_scale: float = 128.0, drop_overflow_update: bool = True):
        self._check("loss_scale", loss_scale, 1.0, 1)
        self._check("drop_overflow_update", drop_overflow_update, True, 0)
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
        self._check("init_loss_scale", init_loss_scale, 1.0, 1)
        self._check("scale_factor", scale_factor, 1.0, 1)
        self._check("scale_window", scale_window, 1, 1)
        if scale_factor != 2:
            raise UserError(f"DynamicLossScaleManager(scale_factor={scale_factor!r}): only 2 is offered (the scale "
                            f"halves and doubles, as paratrain train's fp16 does)")
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
