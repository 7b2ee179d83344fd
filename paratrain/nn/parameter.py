"""MindSpore's ``Parameter(tensor, layerwise_parallel=False, name=None)``, and MindSpore's ``name`` given to any
parameter (``with_name``)."""
from __future__ import annotations

import copy

import torch
from torch import nn


class Named:
    """MindSpore's ``name`` of a parameter, kept as its ``param_name`` (a torch tensor's own ``name`` is read-only)."""

    @property
    def name(self) -> str | None:
        return getattr(self, "param_name", None)

    @name.setter
    def name(self, value: str | None) -> None:
        self.param_name = value


class Parameter(Named, nn.Parameter):
    """An ``nn.Parameter`` with MindSpore's ``name`` and ``layerwise_parallel`` flag: under ``hybrid_parallel`` a
    parameter with it set is this device's own slice, left out of the data-parallel gradient reduction (the net's own
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
            memo[id(self)] = type(self)(self.data.clone(), self.requires_grad,
                                        getattr(self, "layerwise_parallel", False), self.name)
            memo[id(self)].checkpoint_layout = self.checkpoint_layout
        return memo[id(self)]

    def __repr__(self):  # MindSpore's form: a list of parameters prints one short line each
        return (f"Parameter (name={self.name}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"requires_grad={self.requires_grad}, layerwise_parallel={getattr(self, 'layerwise_parallel', False)})")


_NAMED_CLASSES: dict[type, type] = {}


def _named_class(cls: type) -> type:
    """``cls`` (a parameter class of a tensor subclass: a DTensor) with ``Named``'s ``name``; a deep copy is of
    ``cls`` again, as the tensor subclass copies itself, named as the original."""

    def __deepcopy__(self, memo):
        named = type(self)
        self.__class__ = cls
        try:
            result = copy.deepcopy(self, memo)
        finally:
            self.__class__ = named
        result.__class__ = named
        return result

    if cls not in _NAMED_CLASSES:
        name = f"Named{cls.__name__}"
        named = type(name, (Named, cls), {"__deepcopy__": __deepcopy__, "__module__": __name__})
        globals()[name] = _NAMED_CLASSES[cls] = named  # found by its name, as pickle looks a class up
    return _NAMED_CLASSES[cls]


def with_name(param: nn.Parameter, name: str) -> nn.Parameter:
    """``param`` itself, its MindSpore ``name`` set: a plain ``nn.Parameter`` becomes a ``Parameter``, a parameter of a
    tensor subclass (a placed net's DTensor) gets a class of its own class with ``name``."""
    if not isinstance(param, Named):
        if type(param) is nn.Parameter:
            param.__class__ = Parameter
            param.layerwise_parallel = getattr(param, "layerwise_parallel", False)
        else:
            param.__class__ = _named_class(type(param))
    param.name = name
    return param


def __getattr__(name: str):
    # a process unpickling a named DTensor parameter before naming one itself
    if name == "NamedDTensor":
        from torch.distributed.tensor import DTensor

        return _named_class(DTensor)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
