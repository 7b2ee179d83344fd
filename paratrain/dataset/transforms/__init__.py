"""MindSpore's ``mindspore.dataset.transforms``: ``TypeCast``."""
from __future__ import annotations

import numpy as np
import torch

from paratrain.errors import UserError

__all__ = ["TypeCast"]


class TypeCast:
    """``TypeCast(data_type)``: a value (an array, tensor or number) as a torch tensor of ``data_type`` (a torch
    dtype: ``paratrain.dtype.int32``, as ``mindspore.dtype.int32``), for ``GeneratorDataset.map``."""

    def __init__(self, data_type: torch.dtype):
        if not isinstance(data_type, torch.dtype):
            raise UserError(f"TypeCast(data_type={data_type!r}): expected a dtype, e.g. paratrain.dtype.int32")
        self.data_type = data_type

    def __call__(self, value) -> torch.Tensor:
        if isinstance(value, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(value)).to(self.data_type)
        return torch.as_tensor(value).to(self.data_type)

    def __repr__(self) -> str:
        return f"TypeCast({self.data_type})"
