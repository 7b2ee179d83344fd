"""MindSpore's primitives with their strategy rules and device matrices.

Shapes: MatMul (M, K) x (K, N) -> (M, N), strategy ((a, b), (b, c)) on device matrix [a, b, c]; BatchMatMul (..., M,
K) x (..., K, N) on [batch..., a, b, c]; elementwise ops broadcast from the right, their device matrix the longest
strategy; unary, reduce, Softmax, Reshape, Transpose: the input's strategy is the device matrix.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from paratrain.errors import UserError
from paratrain.ops.primitive import Primitive
from paratrain.ops.strategy import OpLayout, Strategy


def _axes(axis, ndim: int) -> tuple[int, ...]:
    """MindSpore's ``axis`` (an int, a tuple, or () for all) as sorted non-negative dims."""
    axis = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(sorted(a % ndim for a in axis)) if axis else tuple(range(ndim))


def _local(value) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else torch.as_tensor(value)


# --- matrix products -------------------------------------------------------------------------

class MatMul(Primitive):
    """``MatMul(transpose_a=False, transpose_b=False)(x, w)``: (M, K) x (K, N) -> (M, N), either transposed."""

    def __init__(self, transpose_a: bool = False, transpose_b: bool = False):
        super().__init__()
        self.transpose_a, self.transpose_b = transpose_a, transpose_b

    def _abc(self, strategy: Strategy) -> tuple[int, int, int, int]:
        """(a, b of x, b of w, c): rows, contraction as x and w split it, columns; of the inputs' shapes: their
        sizes."""
        (x0, x1), (w0, w1) = strategy
        a, b = (x1, x0) if self.transpose_a else (x0, x1)
        b2, c = (w1, w0) if self.transpose_b else (w0, w1)
        return a, b, b2, c

    def rules(self, strategy, shapes):
        if any(len(s) != 2 for s in shapes):
            return [f"MatMul takes 2-D inputs, got shapes {[list(s) for s in shapes]}"]
        _, b, b2, _ = self._abc(strategy)
        if b != b2:
            return [f"the contraction dimension is split {b} ways in the first input and {b2} in the second: they "
                    f"must be equal"]
        return []

    def layout(self, strategy, shapes):
        a, b, _, c = self._abc(strategy)
        x_map = (1, 0) if self.transpose_a else (0, 1)
        w_map = (2, 1) if self.transpose_b else (1, 2)
        return OpLayout((a, b, c), (x_map, w_map))

    def compute(self, x, w):
        return (x.mT if self.transpose_a else x) @ (w.mT if self.transpose_b else w)

    def splits_batch_only(self, strategy, data_parallel):
        # the second input is the weight: any split of it is model parallelism
        return super().splits_batch_only(strategy[:1], data_parallel) and all(n == 1 for s in strategy[1:] for n in s)


class BatchMatMul(MatMul):
    """``BatchMatMul(transpose_a=False, transpose_b=False)(x, w)``: (..., M, K) x (..., K, N) -> (..., M, N);
    ``w`` may have fewer batch dimensions (broadcast from the right)."""

    def rules(self, strategy, shapes):
        (sx, sw), (x, w) = strategy, shapes
        if len(x) < 3 or len(w) < 2 or len(w) > len(x):
            return [f"BatchMatMul takes (..., M, K) and (..., K, N) with no more batch dims in the second, got "
                    f"shapes {list(x)} and {list(w)}"]
        found = super().rules((sx[-2:], sw[-2:]), [x[-2:], w[-2:]])
        offset = len(x) - len(w)
        found += [f"batch dimension {offset + j} is split {sx[offset + j]} ways in the first input and {sw[j]} in "
                  f"the second: they must be equal" for j in range(len(w) - 2) if w[j] > 1 and sw[j] != sx[offset + j]]
        return found

    def layout(self, strategy, shapes):
        sx, sw = strategy
        batch = len(sx) - 2
        inner = super().layout((sx[-2:], sw[-2:]), shapes)
        x_map = tuple(range(batch)) + tuple(batch + d for d in inner.tensor_maps[0])
        offset = len(sx) - len(sw)
        w_map = tuple(offset + j for j in range(len(sw) - 2)) + tuple(batch + d for d in inner.tensor_maps[1])
        return OpLayout(tuple(sx[:batch]) + inner.device_matrix, (x_map, w_map))


# --- elementwise -----------------------------------------------------------------------------

class _Elementwise(Primitive):
    """Two inputs broadcast from the right; where both have a dimension larger than 1 they must split it alike."""

    def rules(self, strategy, shapes):
        n = max(len(s) for s in shapes)
        found = []
        for j in range(n):
            splits = {s[j - n + len(s)] for s, shape in zip(strategy, shapes)
                      if j - n + len(s) >= 0 and shape[j - n + len(s)] > 1}
            if len(splits) > 1:
                found.append(f"the inputs split broadcast dimension {j} differently ({sorted(splits)}): they must be "
                             f"equal")
        return found

    def layout(self, strategy, shapes):
        n = max(len(s) for s in strategy)
        matrix = [1] * n
        for s in strategy:
            for t, k in enumerate(s):
                matrix[n - len(s) + t] = max(matrix[n - len(s) + t], k)
        return OpLayout(tuple(matrix), tuple(tuple(n - len(s) + t for t in range(len(s))) for s in strategy))


def _op(name: str, base: type, doc: str, **functions) -> type:
    """The primitive ``name``: ``base`` with ``functions`` (its torch function as ``compute`` or ``reduce``)."""
    return type(name, (base,), {"__doc__": doc, **{k: staticmethod(f) for k, f in functions.items()}})


Add = _op("Add", _Elementwise, "``Add()(x, y)``: x + y, broadcast.", compute=operator.add)
Sub = _op("Sub", _Elementwise, "``Sub()(x, y)``: x - y, broadcast.", compute=operator.sub)
Mul = _op("Mul", _Elementwise, "``Mul()(x, y)``: x * y, broadcast.", compute=operator.mul)
RealDiv = _op("RealDiv", _Elementwise, "``RealDiv()(x, y)``: x / y, broadcast.", compute=operator.truediv)


class NotEqual(_Elementwise):
    """``NotEqual()(x, y)``: x != y (bool), broadcast."""

    def compute(self, x, y):
        return torch.logical_not(x == y)  # the same, NaN included; torch 2.11's DTensor has no rule for `!=`


class BiasAdd(Primitive):
    """``BiasAdd()(x, bias)``: (N, C, ...) + (C,) along dimension 1; strategy ((n, c, ...), (c,))."""

    def rules(self, strategy, shapes):
        if len(shapes[0]) < 2 or len(shapes[1]) != 1:
            return [f"BiasAdd takes (N, C, ...) and (C,), got shapes {[list(s) for s in shapes]}"]
        if strategy[1][0] != strategy[0][1]:
            return [f"the bias is split {strategy[1][0]} ways but the channel dimension {strategy[0][1]}: they must "
                    f"be equal"]
        return []

    def layout(self, strategy, shapes):
        return OpLayout(strategy[0], (tuple(range(len(strategy[0]))), (1,)))

    def compute(self, x, bias):
        return x + bias.reshape((-1,) + (1,) * (x.ndim - 2))


# --- one input ---------------------------------------------------------------------------------

Exp = _op("Exp", Primitive, "``Exp()(x)``: e ** x.", compute=torch.exp)
Log = _op("Log", Primitive, "``Log()(x)``: the natural logarithm.", compute=torch.log)
ReLU = _op("ReLU", Primitive, "``ReLU()(x)``: max(x, 0).", compute=torch.relu)


class _Reduce(Primitive):
    """``Reduce*(keep_dims=False)(x, axis=())``: over ``axis`` (all dimensions when empty)."""

    reduce = None  # torch's reduction, called with dim= and keepdim=

    def __init__(self, keep_dims: bool = False):
        super().__init__()
        self.keep_dims = keep_dims

    def compute(self, x, axis=()):
        return self.reduce(x, dim=_axes(axis, x.ndim), keepdim=self.keep_dims)


ReduceSum = _op("ReduceSum", _Reduce, _Reduce.__doc__.replace("Reduce*", "ReduceSum") + " Sum.", reduce=torch.sum)
ReduceMean = _op("ReduceMean", _Reduce, _Reduce.__doc__.replace("Reduce*", "ReduceMean") + " Mean.", reduce=torch.mean)
ReduceMax = _op("ReduceMax", _Reduce, _Reduce.__doc__.replace("Reduce*", "ReduceMax") + " Maximum.",
                reduce=torch.amax)


class Softmax(Primitive):
    """``Softmax(axis=-1)(x)``; the softmax axis cannot be split."""

    def __init__(self, axis=-1):
        super().__init__()
        self.axis = axis

    def rules(self, strategy, shapes):
        split = [a for a in _axes(self.axis, len(shapes[0])) if strategy[0][a] > 1]
        return [f"the softmax axis {a} cannot be split (it is split {strategy[0][a]} ways)" for a in split]

    def compute(self, x):
        dims = _axes(self.axis, x.ndim)
        if len(dims) == 1:
            return torch.softmax(x, dims[0])
        shifted = torch.exp(x - torch.amax(x, dim=dims, keepdim=True))
        return shifted / shifted.sum(dim=dims, keepdim=True)


class Cast(Primitive):
    """``Cast()(x, dtype)``: x in ``dtype`` (a torch dtype: ``paratrain.float32``...); the strategy splits x."""

    def compute(self, x, dtype):
        return x.to(dtype)


class Dropout(Primitive):
    """``Dropout(keep_prob=0.5, Seed0=0, Seed1=0)(x)``: ``(output, mask)``, each element of x kept with probability
    ``keep_prob`` and scaled by 1 / keep_prob, mask 1 where kept (x's shape and dtype); the strategy splits x.
    The seeds are MindSpore's and unused: the draws come from torch's random state."""

    def __init__(self, keep_prob: float = 0.5, Seed0: int = 0, Seed1: int = 0):  # noqa: N803 (MindSpore's names)
        super().__init__()
        if isinstance(keep_prob, bool) or not isinstance(keep_prob, (int, float)) or not 0 < keep_prob <= 1:
            raise UserError(f"Dropout(keep_prob={keep_prob!r}): expected a number in (0, 1]")
        self.keep_prob = keep_prob

    def compute(self, x):
        mask = (torch.rand_like(x) < self.keep_prob).to(x.dtype)
        return x * mask / self.keep_prob, mask


def shape(input_x) -> tuple[int, ...]:
    """``ops.shape(x)``: x's shape as a tuple of ints."""
    return tuple(input_x.shape)


class Reshape(Primitive):
    """``Reshape()(x, shape)``: the whole tensor's new shape; the strategy splits the input."""

    def compute(self, x, shape):
        return x.reshape(tuple(shape))


class Transpose(Primitive):
    """``Transpose()(x, perm)``: dimensions permuted; the strategy splits the input."""

    def compute(self, x, perm):
        return x.permute(tuple(perm))


# --- lookups -----------------------------------------------------------------------------------

class Gather(Primitive):
    """``Gather()(params, indices, axis)``: the slices of ``params`` along ``axis`` at ``indices``:
    (P0, ..., Pn) with (I...) -> P[:axis] + I + P[axis+1:]. Strategy ((p...), (i...)) on device matrix
    [p..., i...]; with axis 0 on a 2-D table (an embedding) rows or columns may be split."""

    def layout(self, strategy, shapes):
        sp, si = strategy
        return OpLayout(tuple(sp) + tuple(si), (tuple(range(len(sp))), tuple(len(sp) + t for t in range(len(si)))))

    def rules(self, strategy, shapes):
        if len(shapes[0]) != 2 and any(k > 1 for k in strategy[0]):
            return ["only a 2-D table (gathered along axis 0) may be split"]
        return []

    def compute(self, params, indices, axis=0):
        axis %= params.ndim
        if axis == 0 and params.ndim == 2:
            out = F.embedding(indices, params)
            if isinstance(out, DTensor) and any(p.is_partial() for p in out.placements):
                # rows split: each device looked up its own rows; sum now, while DTensor still knows which
                out = out.redistribute(out.device_mesh, [Replicate() if p.is_partial() else p for p in out.placements])
            return out
        if isinstance(params, DTensor):
            raise UserError("Gather: in a parallel run only a 2-D table gathered along axis 0 is offered")
        flat = params.index_select(axis, indices.reshape(-1))
        return flat.reshape(params.shape[:axis] + indices.shape + params.shape[axis + 1:])


class OneHot(Primitive):
    """``OneHot(axis=-1)(indices, depth, on_value, off_value)``: (N,) int -> (N, depth), ``on_value`` at each
    index, ``off_value`` elsewhere. Strategy ((n, d), (), ()): the output's split, as MindSpore's."""

    def __init__(self, axis: int = -1):
        super().__init__()
        if axis != -1:
            raise UserError(f"OneHot(axis={axis}): only axis=-1 is offered")
        self.axis = axis

    def expected_dims(self, shapes):
        return [2] + [len(s) for s in shapes[1:]]

    def split_sizes(self, shapes):
        return [(shapes[0][0], self._depth)] + list(shapes[1:])

    def problems(self, strategy, shapes, device_num):
        if len(shapes[0]) != 1:
            return [f"OneHot takes 1-D indices, got shape {list(shapes[0])}"]
        return super().problems(strategy, shapes, device_num)

    def layout(self, strategy, shapes):
        return OpLayout(strategy[0], ((0,),) + tuple(() for _ in strategy[1:]))

    def forward(self, indices, depth, on_value, off_value):
        self._depth = depth
        if self.mesh is None:
            return self.compute(indices, depth, on_value, off_value)
        (indices, _, on_value, off_value), layout = self.placed_inputs((indices, depth, on_value, off_value))
        mesh = self.mesh
        placements = mesh.placements(layout, (0, 1))
        shape = (indices.shape[0], depth)
        local_shape, offset = compute_local_shape_and_global_offset(shape, mesh.mesh, placements)
        local = self._one_hot(indices.to_local(), offset[1], local_shape[1], _local(on_value), _local(off_value))
        return DTensor.from_local(local, mesh.mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=(depth, 1))

    @staticmethod
    def _one_hot(indices, start: int, width: int, on_value, off_value):
        hit = indices.unsqueeze(-1) == torch.arange(start, start + width, device=indices.device)
        return torch.where(hit, on_value, off_value)

    def compute(self, indices, depth, on_value, off_value):
        return self._one_hot(indices, 0, depth, torch.as_tensor(on_value), torch.as_tensor(off_value))
