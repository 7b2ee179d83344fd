"""MindSpore's ``set_seed(seed)`` / ``get_seed()``: one seed for torch, NumPy and Python's ``random``, so that a
net built after it draws the same initial values in every run and on every rank."""
from __future__ import annotations

import random

from paratrain.errors import UserError

_seed: int | None = None


def set_seed(seed: int) -> None:
    """Seed torch, NumPy and ``random`` with ``seed`` (an int >= 0)."""
    global _seed
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UserError(f"set_seed({seed!r}): expected an int >= 0")
    import numpy as np
    import torch

    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
    _seed = seed


def get_seed() -> int | None:
    """The seed ``set_seed`` last set (None: none)."""
    return _seed
