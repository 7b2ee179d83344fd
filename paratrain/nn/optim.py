"""MindSpore's ``nn.Momentum`` optimizer on torch's SGD."""
from __future__ import annotations

import torch

from paratrain.errors import UserError


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
