"""MindSpore's ``nn.Momentum`` (torch's SGD) and ``nn.AdamWeightDecay`` optimizers."""
from __future__ import annotations

import torch

from paratrain.errors import UserError
from paratrain.nn.learning_rate_schedule import LearningRateSchedule


class Momentum(torch.optim.SGD):
    """``Momentum(params, learning_rate, momentum, weight_decay=0.0, use_nesterov=False, loss_scale=1.0)``:
    ``accum = momentum * accum + grad + weight_decay * param; param -= learning_rate * accum`` (Nesterov:
    ``param -= learning_rate * (grad + momentum * accum)``), MindSpore's update, which is torch's SGD with
    momentum and no dampening. ``lr`` and ``nesterov`` are accepted as torch spells them.
    ``learning_rate`` is a number (torch's LR schedulers change it)."""

    def __init__(self, params, learning_rate: float | None = None, momentum: float | None = None,
                 weight_decay: float = 0.0, use_nesterov: bool = False, loss_scale: float = 1.0,
                 lr: float | None = None, nesterov: bool | None = None):
        learning_rate = lr if learning_rate is None else learning_rate
        if not isinstance(learning_rate, (int, float)) or isinstance(learning_rate, bool):
            raise UserError(f"Momentum(learning_rate={learning_rate!r}): expected a number")
        if not isinstance(momentum, (int, float)) or momentum < 0:
            raise UserError(f"Momentum(momentum={momentum!r}): expected a number >= 0")
        if loss_scale != 1.0:
            raise UserError("Momentum(loss_scale=...): losses are not scaled here (float32); leave it at 1.0")
        super().__init__(params, lr=learning_rate, momentum=momentum, weight_decay=weight_decay,
                         nesterov=use_nesterov if nesterov is None else nesterov)


class AdamWeightDecay(torch.optim.Optimizer):
    """``AdamWeightDecay(params, learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0)``,
    MindSpore's update, which has no bias correction (unlike torch's AdamW)::

        m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
        param -= lr * (m / (sqrt(v) + eps) + weight_decay * param)

    ``learning_rate`` is a number or a schedule of the number of steps taken so far: ``paratrain.nn``'s
    (computed in plain Python), or any module or function, given the step as a 0-d int32 host tensor.
    ``params`` may be MindSpore's groups: dicts with ``params`` and their own ``weight_decay``; a group of
    ``order_params`` is accepted and has no effect (torch keeps the parameters' order itself).
    """

    def __init__(self, params, learning_rate=1e-3, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-6,
                 weight_decay: float = 0.0):
        for name, value in (("beta1", beta1), ("beta2", beta2)):
            if not 0 <= value < 1:
                raise UserError(f"AdamWeightDecay({name}={value!r}): expected a number in [0, 1)")
        if not eps > 0:
            raise UserError(f"AdamWeightDecay(eps={eps!r}): expected a number > 0")
        if not callable(learning_rate) and not (isinstance(learning_rate, (int, float)) and learning_rate >= 0):
            raise UserError(f"AdamWeightDecay(learning_rate={learning_rate!r}): expected a number >= 0 or a "
                            f"schedule of the global step")
        params = list(params)
        if params and isinstance(params[0], dict):
            params = [group for group in params if "order_params" not in group]
        super().__init__(params, {"learning_rate": learning_rate, "beta1": beta1, "beta2": beta2, "eps": eps,
                                  "weight_decay": weight_decay})
        self.global_step = 0

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        # the rate lives on the optimizer (a schedule is no checkpointable value); groups hold this step's
        self.param_groups[-1]["lr"] = self._rate(getattr(self, "global_step", 0))
        del self.param_groups[-1]["learning_rate"]

    def _rate(self, step: int) -> float:
        rate = self.defaults["learning_rate"]
        if isinstance(rate, LearningRateSchedule) and rate.rate is not None:
            return float(rate.rate(step))
        return float(rate(torch.tensor(step, dtype=torch.int32, device="cpu")) if callable(rate) else rate)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        steps = [s["step"] for s in self.state.values() if "step" in s]
        self.global_step = int(steps[0]) if steps else 0  # once, when resuming

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lr = self._rate(self.global_step)
        for group in self.param_groups:
            group["lr"] = lr
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if not self.state[p]:
                    self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device="cpu"),
                                     "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            states = [self.state[p] for p in params]
            grads = [p.grad for p in params]
            m, v = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
            for s in states:
                s["step"] += 1
            torch._foreach_lerp_(m, grads, 1 - group["beta1"])
            torch._foreach_mul_(v, group["beta2"])
            torch._foreach_addcmul_(v, grads, grads, value=1 - group["beta2"])
            denominator = torch._foreach_sqrt(v)
            torch._foreach_add_(denominator, group["eps"])
            update = torch._foreach_div(m, denominator)
            if group["weight_decay"]:
                torch._foreach_add_(update, params, alpha=group["weight_decay"])
            torch._foreach_add_(params, update, alpha=-lr)
        self.global_step += 1
        return loss
