"""MindSpore's ``nn.Momentum`` (torch's SGD) and ``nn.AdamWeightDecay`` optimizers, with MindSpore's forms of
``learning_rate``: a number, a list (a dynamic LR, as ``paratrain.nn.dynamic_lr`` builds) or a schedule."""
from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable

import numpy as np
import torch

from paratrain.errors import UserError
from paratrain.nn.learning_rate_schedule import LearningRateSchedule


def _is_rate(value) -> bool:
    """A number >= 0 (numpy's too, as in a MindSpore user's array of rates)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value >= 0


def rate_function(learning_rate, owner: str) -> Callable[[int], float]:
    """``learning_rate`` as a function from the steps taken to the rate: a number >= 0; an iterable or 1-d tensor
    of them (step ``i`` takes element ``i``, past the end the last); a ``paratrain.nn`` schedule (its ``rate``);
    or any other function of the step, given as a 0-d int32 host tensor."""
    if isinstance(learning_rate, LearningRateSchedule) and learning_rate.rate is not None:
        return learning_rate.rate
    if callable(learning_rate):
        return lambda step: float(learning_rate(torch.tensor(step, dtype=torch.int32, device="cpu")))
    if isinstance(learning_rate, torch.Tensor):
        learning_rate = learning_rate.tolist()
    if _is_rate(learning_rate):
        return lambda step: float(learning_rate)
    rates = list(learning_rate) if isinstance(learning_rate, Iterable) and not isinstance(learning_rate, str) else []
    if not rates:
        raise UserError(f"{owner}(learning_rate={learning_rate!r}): expected a number >= 0, a non-empty list of "
                        f"them (one per step) or a schedule of the global step")
    bad = next((i for i, rate in enumerate(rates) if not _is_rate(rate)), None)
    if bad is not None:
        raise UserError(f"{owner}(learning_rate[{bad}]={rates[bad]!r}): expected a number >= 0")
    rates = [float(rate) for rate in rates]
    return lambda step: rates[min(step, len(rates) - 1)]


class _Scheduled:
    """What both optimizers share: ``rate_function(learning_rate)`` kept as ``rate``; with a list or a schedule
    (``scheduled``) each step sets the groups' ``lr`` to the rate of ``global_step``, the steps taken, which
    ``load_state_dict`` takes back from the parameters' ``step`` state, so a resumed run goes on with the rates
    of an uninterrupted one. A group whose ``lr`` was set from outside since the optimizer last set it keeps it
    for the step: torch's distributed checkpoint zeroes it for the step with which it makes a fresh optimizer's
    state as it loads one, a step that must not move the (already loaded) parameters. ``learning_rate`` stays in
    ``defaults`` (``Model`` builds the optimizer again from them) and out of the groups (a checkpoint holds
    numbers, not a schedule)."""

    def _init_rate(self, learning_rate, owner: str) -> None:
        """Before the groups are added."""
        self.rate = rate_function(learning_rate, owner)
        self.scheduled = not _is_rate(learning_rate)
        self.global_step = 0
        self._lrs_set: list[float] = []  # per group, the lr this optimizer last set there

    def add_param_group(self, param_group: dict) -> None:
        lr = self.rate(self.global_step)
        param_group.setdefault("lr", lr)
        super().add_param_group(param_group)
        self.param_groups[-1].pop("learning_rate", None)
        self._lrs_set.append(lr)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        steps = [s["step"] for s in self.state.values() if "step" in s]
        self.global_step = int(steps[0]) if steps else 0  # once, when resuming
        self._lrs_set = [group["lr"] for group in self.param_groups]  # as the saved run set them

    def _set_rates(self) -> None:
        """Each group's ``lr`` for this step, unless set from outside (a constant is left to torch's schedulers)."""
        if self.scheduled:
            lr = self.rate(self.global_step)
            for i, group in enumerate(self.param_groups):
                if group["lr"] == self._lrs_set[i]:
                    group["lr"] = self._lrs_set[i] = lr

    def _count_step(self, params) -> None:
        """One more step in the ``step`` state of each of ``params`` (a host scalar, as torch's Adam keeps it)."""
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device="cpu")
            state["step"] += 1


class Momentum(_Scheduled, torch.optim.SGD):
    """``Momentum(params, learning_rate, momentum, weight_decay=0.0, use_nesterov=False, loss_scale=1.0)``:
    MindSpore's update, which is torch's SGD with momentum and no dampening; ``lr`` and ``nesterov`` are
    accepted as torch spells them. ``learning_rate`` as ``rate_function`` takes it (a number may be changed by
    torch's LR schedulers)."""

    def __init__(self, params, learning_rate=None, momentum: float | None = None,
                 weight_decay: float = 0.0, use_nesterov: bool = False, loss_scale: float = 1.0,
                 lr=None, nesterov: bool | None = None):
        learning_rate = lr if learning_rate is None else learning_rate
        if not isinstance(momentum, (int, float)) or momentum < 0:
            raise UserError(f"Momentum(momentum={momentum!r}): expected a number >= 0")
        if loss_scale != 1.0:
            raise UserError("Momentum(loss_scale=...): losses are not scaled here (float32); leave it at 1.0")
        self._init_rate(learning_rate, "Momentum")
        super().__init__(params, lr=self.rate(0), momentum=momentum, weight_decay=weight_decay,
                         nesterov=use_nesterov if nesterov is None else nesterov)
        self.defaults["learning_rate"] = learning_rate

    def step(self, closure=None):
        self._set_rates()
        loss = super().step(closure)
        if self.scheduled:
            self._count_step(p for group in self.param_groups for p in group["params"] if p.grad is not None)
        self.global_step += 1
        return loss


def _float32(value: float) -> float:
    """``value`` rounded to float32. MindSpore keeps ``beta1``, ``beta2`` and ``eps`` as float32 tensors and takes
    ``1 - beta`` of them in float32: 1 - float32(0.999) is 1.3e-5 below 0.001, which moves every update by 6e-6."""
    return float(np.float32(value))  # on the host: no tensor, whatever the default device


def decays(param: torch.Tensor) -> bool:
    """MindSpore's default weight-decay filter of ungrouped parameters, on the name ``trainable_params()`` gives."""
    name = getattr(param, "param_name", None) or ""
    return "beta" not in name and "gamma" not in name


class AdamWeightDecay(_Scheduled, torch.optim.Optimizer):
    """``AdamWeightDecay(params, learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0)``,
    MindSpore's update, without torch AdamW's bias correction: ``param -= lr * (m / (sqrt(v) + eps) +
    weight_decay * param)``. ``learning_rate`` as ``rate_function`` takes it; a group may hold its own ``lr``
    with a number. ``params`` may be MindSpore's groups (dicts with ``params`` and their own ``weight_decay``;
    an ``order_params`` group has no effect: torch keeps the parameters' order). Ungrouped, as MindSpore's, a
    parameter whose ``param_name`` contains ``beta`` or ``gamma`` is not decayed (``Cell.trainable_params()`` names a
    LayerNorm's ``gamma`` and ``beta``, and the blocks' LayerNorms carry those names anyway; any other parameter
    without a name is decayed)."""

    def __init__(self, params, learning_rate=1e-3, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-6,
                 weight_decay: float = 0.0):
        for name, value in (("beta1", beta1), ("beta2", beta2)):
            if not 0 <= value < 1:
                raise UserError(f"AdamWeightDecay({name}={value!r}): expected a number in [0, 1)")
        if not eps > 0:
            raise UserError(f"AdamWeightDecay(eps={eps!r}): expected a number > 0")
        params = list(params)
        if params and isinstance(params[0], dict):
            params = [group for group in params if "order_params" not in group]
        else:
            params = [group for group in ({"params": [p for p in params if decays(p)]},
                                          {"params": [p for p in params if not decays(p)], "weight_decay": 0.0})
                      if group["params"]]
        self._init_rate(learning_rate, "AdamWeightDecay")
        super().__init__(params, {"learning_rate": learning_rate, "beta1": beta1, "beta2": beta2, "eps": eps,
                                  "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._set_rates()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            self._count_step(params)
            states = [self.state[p] for p in params]
            for p, s in zip(params, states):
                if "exp_avg" not in s:
                    s.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            grads = [p.grad for p in params]
            m, v = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
            beta1, beta2, eps = (_float32(group[name]) for name in ("beta1", "beta2", "eps"))
            torch._foreach_lerp_(m, grads, _float32(1.0 - beta1))
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, grads, grads, value=_float32(1.0 - beta2))
            denominator = torch._foreach_sqrt(v)
            torch._foreach_add_(denominator, eps)
            update = torch._foreach_div(m, denominator)
            if group["weight_decay"]:
                torch._foreach_add_(update, params, alpha=group["weight_decay"])
            torch._foreach_add_(params, update, alpha=-group["lr"])
        self.global_step += 1
        return loss
