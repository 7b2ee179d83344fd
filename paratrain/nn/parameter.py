"""MindSpore's ``Parameter(tensor, layerwise_parallel=False)``."""
from __future__ import annotations

import torch
from torch import nn


class Parameter(nn.Parameter):
    """An ``nn.Parameter`` with MindSpore's ``layerwise_parallel`` flag: under ``hybrid_parallel`` a parameter
    with it set is this device's own slice, left out of the data-parallel gradient reduction (the net's own
    collectives, ``paratrain.ops.AllReduce``, combine the slices). The attribute may also be set on any
    existing ``nn.Parameter``. ``data``: a tensor or anything ``torch.as_tensor`` takes (a numpy array).
    ``checkpoint_layout`` is ``"mindspore"`` for a tensor read from a MindSpore checkpoint file
    (``paratrain.load_checkpoint``): it is named and laid out as in MindSpore's net, which ``load_param_into_net``
    maps onto paratrain's; else None."""

    checkpoint_layout = None

    def __new__(cls, data=None, requires_grad: bool = True, layerwise_parallel: bool = False, name: str | None = None):
        data = torch.empty(0) if data is None else torch.as_tensor(data)
        param = super().__new__(cls, data, requires_grad)
        param.layerwise_parallel, param.param_name = layerwise_parallel, name
        return param

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = type(self)(self.data.clone(), self.requires_grad, self.layerwise_parallel,
                                        self.param_name)
            memo[id(self)].checkpoint_layout = self.checkpoint_layout
        return memo[id(self)]

    def __repr__(self):
        return f"Parameter(layerwise_parallel={self.layerwise_parallel}) containing:\n{self.data!r}"
