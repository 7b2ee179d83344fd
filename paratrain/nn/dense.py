"""MindSpore's ``nn.Dense`` built of ``paratrain.ops``, so its ``matmul`` and ``bias_add`` take strategies."""
from __future__ import annotations

import torch
from torch import nn

from paratrain import ops
from paratrain.nn.cell import Cell
from paratrain.nn.config import check_sizes
from paratrain.nn.layers import activation as make_activation, initialize


class Dense(Cell):
    """``Dense(in_channels, out_channels, weight_init='normal', bias_init='zeros', has_bias=True,
    activation=None)``: (..., in) -> (..., out), ``x @ weight.T + bias`` with ``weight`` (out, in), inputs of
    more dimensions flattened to (N, in) around ``self.matmul`` (``ops.MatMul(transpose_b=True)``) and
    ``self.bias_add``. As in MindSpore, ``dense.matmul.shard(((dp, 1), (mp, 1)))`` splits the output features,
    ``((dp, mp), (1, mp))`` the input features."""

    def __init__(self, in_channels: int, out_channels: int, weight_init="normal", bias_init="zeros",
                 has_bias: bool = True, activation=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        check_sizes("Dense", in_channels=in_channels, out_channels=out_channels)
        self.in_channels, self.out_channels, self.has_bias = in_channels, out_channels, has_bias
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, dtype=dtype))
        initialize(self.weight, weight_init, "Dense")
        self.bias = None
        if has_bias:
            self.bias = nn.Parameter(torch.empty(out_channels, dtype=dtype))
            initialize(self.bias, bias_init, "Dense")
        self.matmul = ops.MatMul(transpose_b=True)
        self.bias_add = ops.BiasAdd()
        self.activation = make_activation(activation, "Dense") if activation is not None else None

    def forward(self, x):
        shape = x.shape
        if len(shape) != 2:
            x = x.reshape(-1, shape[-1])
        x = self.matmul(x, self.weight)
        if self.has_bias:
            x = self.bias_add(x, self.bias)
        if self.activation is not None:
            x = self.activation(x)
        if len(shape) != 2:
            x = x.reshape(*shape[:-1], self.out_channels)
        return x

    def extra_repr(self) -> str:
        return f"in_channels={self.in_channels}, out_channels={self.out_channels}, has_bias={self.has_bias}"
