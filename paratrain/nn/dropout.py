"""MindSpore's ``nn.Dropout`` built on ``paratrain.ops.Dropout``, so its ``dropout`` takes a strategy."""
from __future__ import annotations

import numbers

import torch

from paratrain import ops
from paratrain.errors import UserError
from paratrain.nn.cell import Cell


class Dropout(Cell):
    """``Dropout(keep_prob=0.5, p=None, dtype=paratrain.float32)``: x (any shape) -> x's shape, each element kept
    with probability ``keep_prob`` (or ``1 - p`` when ``p`` is given) and scaled by its inverse while training;
    x itself when not training or nothing is dropped. ``self.dropout`` is the ``ops.Dropout`` it runs, which
    takes MindSpore's strategy: ``dropout.dropout.shard(((dp, 1, 1),))``. ``dtype`` is accepted and unused, as in
    MindSpore 2.x."""

    def __init__(self, keep_prob: float = 0.5, p: float | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        if p is None:
            if not _is_number(keep_prob) or not 0 < keep_prob <= 1:
                raise UserError(f"Dropout(keep_prob={keep_prob!r}): expected a number in (0, 1], the share kept")
            rate = 1 - keep_prob
        else:
            if not _is_number(p) or not 0 <= p < 1:
                raise UserError(f"Dropout(p={p!r}): expected a number in [0, 1), the share dropped")
            rate = p
        self.keep_prob, self.p = keep_prob, p
        self.dropout = ops.Dropout(1 - rate)
        self.drops = rate > 0

    def construct(self, x):
        if not self.training or not self.drops:
            return x
        output, _ = self.dropout(x)
        return output

    def extra_repr(self) -> str:
        return f"keep_prob={self.keep_prob}" if self.p is None else f"p={self.p}"


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
