"""``Primitive``: the base of MindSpore's ops as torch modules, with ``.shard(strategy)``.

Once the semi-auto placement gave an op the job's ``StrategyMesh``, it redistributes each tensor
input to the placements its strategy asks before calling the torch op; DTensor derives the output's
layout (a MatMul split along its contraction gives a ``Partial`` sum). Without a mesh it is the torch
op on plain tensors. An op without a strategy runs data-parallel, as MindSpore's default.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.errors import UserError
from paratrain.ops.strategy import OpLayout, Strategy, StrategyMesh, as_strategy


class Primitive(nn.Module):
    """A MindSpore primitive: ``forward(*inputs)`` is ``compute`` on tensors placed by the strategy.

    Subclasses define ``compute(*inputs)`` and, for their own strategy rules, ``rules`` and ``layout``.
    """

    def __init__(self):
        super().__init__()
        self.strategy: Strategy | None = None
        self.mesh: StrategyMesh | None = None  # set by paratrain.train.parallel_modes.semi_auto

    def shard(self, in_strategy, out_strategy=None) -> "Primitive":
        """Set the strategy: one tuple per tensor input, the number of slices of each dimension. Returns self."""
        if out_strategy is not None:
            raise UserError(f"{type(self).__name__}.shard(out_strategy=...): output layouts follow from the "
                            f"input strategies here; leave out_strategy out")
        self.strategy = as_strategy(in_strategy, type(self).__name__)
        return self

    def drop_scalar_entries(self, args: tuple) -> None:
        """MindSpore gives a scalar input (``NotEqual()(x, 1)``) an empty tuple in the strategy, ``((1, 1), ())``;
        here a strategy has one tuple per tensor input: the empty tuples of ``args``' non-tensor inputs are dropped
        (any other mismatch is left for ``problems`` to name)."""
        strategy = self.strategy
        if strategy is None or len(strategy) != len(args):
            return
        tensor = [isinstance(a, torch.Tensor) for a in args]
        if not all(tensor) and all(t or s == () for t, s in zip(tensor, strategy)):
            self.strategy = tuple(s for t, s in zip(tensor, strategy) if t)

    def extra_repr(self) -> str:
        return f"strategy={self.strategy}" if self.strategy is not None else ""

    # --- what a strategy means for this op ---------------------------------------------------

    def expected_dims(self, shapes: list[tuple[int, ...]]) -> list[int]:
        """The length of each input's strategy tuple: the input's rank (OneHot's describes its output)."""
        return [len(s) for s in shapes]

    def split_sizes(self, shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """The sizes the strategy's slice counts must divide, per input."""
        return shapes

    def rules(self, strategy: Strategy, shapes: list[tuple[int, ...]]) -> list[str]:
        """This op's own rules broken by ``strategy`` (the tuple counts and divisibility are checked already)."""
        return []

    def layout(self, strategy: Strategy, shapes: list[tuple[int, ...]]) -> OpLayout:
        """Device matrix and tensor maps: by default every input split as the first (elementwise, unary)."""
        return OpLayout(strategy[0], tuple(tuple(range(len(s))) for s in strategy))

    def splits_batch_only(self, strategy: Strategy, data_parallel: int) -> bool:
        """Whether ``strategy`` splits nothing but each input's dimension 0 (the batch's), over a divisor of
        ``data_parallel``: what data parallelism does anyway."""
        return all(all(n == 1 for n in s[1:]) and (not s or data_parallel % s[0] == 0) for s in strategy)

    def problems(self, strategy: Strategy, shapes: list[tuple[int, ...]], device_num: int) -> list[str]:
        """Every rule ``strategy`` breaks on inputs of ``shapes`` over ``device_num`` devices."""
        if len(strategy) != len(shapes):
            return [f"it gives {len(strategy)} tuples for {len(shapes)} tensor inputs"]
        found = []
        for k, (s, want, sizes) in enumerate(zip(strategy, self.expected_dims(shapes), self.split_sizes(shapes))):
            if len(s) != want:
                found.append(f"input {k} has {want} dimensions to split (shape {list(shapes[k])}) but its tuple has "
                             f"{len(s)} entries")
                continue
            found += [f"{n} slices do not divide dimension {d} of input {k} (size {size})"
                      for d, (n, size) in enumerate(zip(s, sizes)) if size % n]
        if found:
            return found
        found = self.rules(strategy, shapes)
        if not found:
            used = math.prod(self.layout(strategy, shapes).device_matrix)
            if device_num % used:
                found.append(f"its device matrix uses {used} devices, which does not divide device_num={device_num}")
        return found

    def default_strategy(self, shapes: list[tuple[int, ...]], is_param: list[bool], device_num: int) -> Strategy:
        """MindSpore's default (data parallel): dimension 0 of the non-parameter inputs of the highest rank
        split over every device where it divides; everything whole when that breaks a rule."""
        top = max((len(s) for s in shapes), default=0)
        split = tuple(tuple(device_num if d == 0 and len(s) == top and not p and s[0] % device_num == 0 else 1
                            for d in range(n))
                      for s, p, n in zip(shapes, is_param, self.expected_dims(shapes)))
        if not self.problems(split, shapes, device_num):
            return split
        return tuple((1,) * n for n in self.expected_dims(shapes))

    # --- running ----------------------------------------------------------------------------

    def placed_inputs(self, args: tuple) -> tuple[tuple, OpLayout]:
        """``args`` with each tensor redistributed to this op's placements on the mesh, and the op's layout."""
        mesh = self.mesh
        self.drop_scalar_entries(args)
        index = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        tensors = [args[i] for i in index]
        shapes = [tuple(t.shape) for t in tensors]
        strategy = self.strategy or self.default_strategy(shapes, [isinstance(t, nn.Parameter) for t in tensors],
                                                          mesh.device_num)
        layout = self.layout(strategy, shapes)
        out = list(args)
        for k, i in enumerate(index):
            x = args[i]
            if not isinstance(x, DTensor):  # a whole tensor, the same on every device: the batch, a constant
                x = DTensor.from_local(x, mesh.mesh, mesh.replicate(), run_check=False)
            out[i] = x.redistribute(mesh.mesh, mesh.placements(layout, layout.tensor_maps[k]))
        return tuple(out), layout

    def forward(self, *args):
        if self.mesh is not None:
            args, _ = self.placed_inputs(args)
        return self.compute(*args)

    def compute(self, *args):
        raise NotImplementedError
