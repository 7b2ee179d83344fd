"""What the reference tests share: MindSpore's blocks made to compute in fp32, their weights copied into the same
paratrain net, gradients from both libraries, and the comparison (max relative difference, recorded for the
summary that ``conftest.py`` prints)."""
from __future__ import annotations

import mindspore
import numpy as np
import torch
from mindspore import nn as ms_nn
from mindspore import ops

TOLERANCE = 1e-5
measured: dict[str, float] = {}  # what each comparison found, for the run's summary


class Gelu(ms_nn.Cell):
    """MindSpore's ``nn.GELU()`` (tanh approximation) as the Cell class a block's ``hidden_act`` takes: the string
    ``"gelu"`` fails stand-alone in MindSpore 2.7.0. paratrain's ``hidden_act="gelu"`` is the same function."""

    def __init__(self):
        super().__init__()
        self.gelu = ms_nn.GELU()

    def construct(self, x):
        return self.gelu(x)


class _CastToFp32(ms_nn.Cell):
    """In place of a block's ``P.Cast()`` that casts to a fixed fp16: casts to fp32 whatever it is asked."""

    def construct(self, x, dtype):
        return ops.cast(x, mindspore.float32)


def in_fp32(net: ms_nn.Cell) -> ms_nn.Cell:
    """``net`` computing in fp32 throughout: MindSpore's layers fix their matmuls' dtype at fp16 (``self.dtype``
    of the layers, attentions and ``_Linear``s; ``FeedForward`` casts its input to fp16), whatever the arguments."""
    for _, cell in net.cells_and_names():
        if getattr(cell, "dtype", None) == mindspore.float16:
            cell.dtype = mindspore.float32
        if type(cell).__name__ == "FeedForward":
            cell.cast = _CastToFp32()
    return net


# MindSpore's _Linear layers built with transpose_b=False, the FFN's and the attention's output projections, store
# their weight (in, out), torch's (out, in)
TRANSPOSED = ("mapping", "projection")
RENAMED = {"gamma": "weight", "beta": "bias", "embedding_table": "embedding.weight"}


def paratrain_name(name: str) -> str:
    """A MindSpore parameter's name in the same paratrain net."""
    *owner, leaf = name.split(".")
    return ".".join([*owner, RENAMED.get(leaf, leaf)])


def is_transposed(name: str) -> bool:
    """Whether MindSpore stores the weight ``name`` transposed to paratrain's layout."""
    *owner, leaf = name.split(".")
    return leaf == "weight" and bool(owner) and owner[-1] in TRANSPOSED


def ms_parameters(net: ms_nn.Cell) -> dict[str, mindspore.Parameter]:
    """The trainable parameters of ``net`` by their paths in it."""
    return {name: p for name, p in net.parameters_and_names() if p.requires_grad}


def to_paratrain(name: str, value: np.ndarray) -> np.ndarray:
    """MindSpore's ``value`` of the parameter ``name`` in paratrain's layout."""
    return value.T if is_transposed(name) else value


def copy_weights(ms_net: ms_nn.Cell, net: torch.nn.Module) -> None:
    """Every parameter of ``ms_net`` into ``net``: both nets must hold the same parameters (names mapped by
    ``paratrain_name``, shapes by ``is_transposed``), no more, no less."""
    source = {paratrain_name(name): (name, p) for name, p in ms_parameters(ms_net).items()}
    target = dict(net.named_parameters())
    assert sorted(source) == sorted(target), (sorted(source), sorted(target))
    with torch.no_grad():
        for name, (ms_name, p) in source.items():
            value = torch.from_numpy(to_paratrain(ms_name, p.asnumpy()).copy())
            assert value.shape == target[name].shape, (ms_name, value.shape, target[name].shape)
            target[name].copy_(value)


def ms_tensor(array: np.ndarray) -> mindspore.Tensor:
    """A MindSpore tensor of ``array``: int32 for integers (ids, labels), float32 otherwise."""
    return mindspore.Tensor(array.astype(np.int32 if array.dtype.kind in "iu" else np.float32))


def torch_tensor(array: np.ndarray, requires_grad: bool = False) -> torch.Tensor:
    """A torch tensor of ``array``: int64 for integers, float32 (a leaf that may take a gradient) otherwise."""
    if array.dtype.kind in "iu":
        return torch.from_numpy(array.astype(np.int64))
    return torch.tensor(array.astype(np.float32), requires_grad=requires_grad)


def ms_value_and_grads(ms_net: ms_nn.Cell, loss_fn, inputs: list[np.ndarray], grad_inputs: tuple[int, ...] = ()):
    """``loss_fn(*inputs)`` (a scalar of ``ms_net``'s outputs) -> (its value, {paratrain parameter name: gradient in
    paratrain's layout}, [gradients of the inputs at ``grad_inputs``]), as numpy."""
    params = ms_parameters(ms_net)
    names = list(params)
    grad_fn = mindspore.value_and_grad(loss_fn, grad_position=grad_inputs or None, weights=list(params.values()))
    value, grads = grad_fn(*(ms_tensor(x) for x in inputs))
    input_grads, param_grads = grads if grad_inputs else ((), grads)
    input_grads = (input_grads,) if isinstance(input_grads, mindspore.Tensor) else input_grads
    by_name = {paratrain_name(n): to_paratrain(n, g.asnumpy()) for n, g in zip(names, param_grads)}
    return value.asnumpy(), by_name, [g.asnumpy() for g in input_grads]


def torch_value_and_grads(net: torch.nn.Module, loss_fn, inputs: list[np.ndarray], grad_inputs: tuple[int, ...] = ()):
    """``ms_value_and_grads`` of the paratrain ``net``: ``loss_fn(*inputs)`` a scalar of its outputs."""
    tensors = [torch_tensor(x, requires_grad=i in grad_inputs) for i, x in enumerate(inputs)]
    net.zero_grad()
    value = loss_fn(*tensors)
    value.backward()
    grads = {name: p.grad.numpy() for name, p in net.named_parameters() if p.requires_grad}
    return value.detach().numpy(), grads, [tensors[i].grad.numpy() for i in grad_inputs]


def relative_difference(actual, expected, floor: float = 0.0) -> float:
    """max |actual - expected| over max |expected|, or over ``floor`` where that is larger (the absolute difference
    where both are 0)."""
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(np.abs(expected).max(initial=0.0), floor)
    return float(np.abs(actual - expected).max(initial=0.0) / (scale if scale > 0 else 1.0))


def assert_close(what: str, actual, expected, tolerance: float = TOLERANCE, floor: float = 0.0, name: str = "") -> None:
    """paratrain's ``actual`` within ``tolerance`` of MindSpore's ``expected`` (``relative_difference``), recorded
    as ``what`` (``name``: the parameter, for the message)."""
    difference = relative_difference(actual, expected, floor)
    measured[what] = max(difference, measured.get(what, 0.0))
    assert difference <= tolerance, f"{what} {name}: max relative difference {difference:.3g} > {tolerance:g}"


# the key bias's gradient is 0 but for rounding (the softmax ignores what is added to all of a row's scores): it is
# compared relative to the net's largest gradient; the others relative to their own largest element or, where that
# is smaller, to GRADIENT_FLOOR times the net's largest gradient: at MindSpore's initial weights, normal(0, 0.01),
# the attention is near uniform and the query and key weights' gradients, 1e-4 to 1e-3 of the largest, are
# differences of near-equal terms, equal in both libraries only to about 1e-4 of themselves
ZERO_GRADIENTS = ("dense2.bias",)
GRADIENT_FLOOR = 1e-3


def assert_same_grads(what: str, grads: dict, ms_grads: dict) -> None:
    """Each parameter's gradient from paratrain within the tolerance of MindSpore's, recorded as ``what``."""
    assert sorted(grads) == sorted(ms_grads), (sorted(grads), sorted(ms_grads))
    largest = max(np.abs(g).max(initial=0.0) for g in ms_grads.values())
    for name, ms_grad in ms_grads.items():
        floor = largest * (1.0 if name.endswith(ZERO_GRADIENTS) else GRADIENT_FLOOR)
        assert_close(what, grads[name], ms_grad, floor=floor, name=name)


def ms_weights(ms_net: ms_nn.Cell) -> dict[str, np.ndarray]:
    """``ms_net``'s parameters under paratrain's names and in its layout."""
    return {paratrain_name(n): to_paratrain(n, p.asnumpy()) for n, p in ms_parameters(ms_net).items()}
