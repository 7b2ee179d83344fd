"""MindSpore's shard strategies as DTensor placements.

A strategy gives, for each tensor input of an op, the number of slices of each dimension:
``MatMul().shard(((2, 1), (1, 2)))``. MindSpore turns it into a **device matrix** (one dimension
per independent split: MatMul's ``[a, b, c]`` for ``((a, b), (b, c))``; a last dimension of the
devices that repeat the computation appended when it uses fewer than ``device_num``) and a **tensor
map** per input: which device-matrix dimension splits each tensor dimension.

All ops of a job share one ``StrategyMesh``: a DeviceMesh of prime factors of ``device_num`` ordered
so that every op's device matrix coarsens it; a tensor dimension split along a device-matrix
dimension is ``Shard(d)`` on each of its mesh dimensions, outer first (MindSpore's row-major device
numbering), so DTensor redistributes between the layouts of consecutive ops, with autograd.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from paratrain.errors import UserError

Strategy = tuple[tuple[int, ...], ...]


class StrategyError(UserError):
    """Strategies refused before the first step; ``problems`` lists each (op path, strategy, rule)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("shard strategies refused:\n  - " + "\n  - ".join(problems))


def as_strategy(strategy, owner: str) -> Strategy:
    """``strategy`` as a tuple of tuples of positive ints; a UserError naming ``owner`` otherwise."""
    ok = isinstance(strategy, (tuple, list)) and all(
        isinstance(s, (tuple, list)) and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in s)
        for s in strategy)
    if not ok:
        raise UserError(f"{owner}.shard({strategy!r}): a strategy is one tuple per tensor input of positive slice "
                        f"counts, one per dimension, e.g. ((2, 1), (1, 4))")
    return tuple(tuple(s) for s in strategy)


@dataclass(frozen=True)
class OpLayout:
    """An op's device matrix (without the repeat dimension) and, per tensor input, the device-matrix index
    splitting each of its dimensions (None: not split)."""

    device_matrix: tuple[int, ...]
    tensor_maps: tuple[tuple[int | None, ...], ...]

    def with_repeat(self, device_num: int) -> tuple[int, ...]:
        """The device matrix over all ``device_num`` devices: the repeat dimension appended when needed."""
        repeat = device_num // math.prod(self.device_matrix)
        return self.device_matrix + ((repeat,) if repeat > 1 else ())


def _groups(factors: tuple[int, ...], matrix: tuple[int, ...]) -> list[list[int]] | None:
    """The mesh dimensions (indices into ``factors``) making up each dimension of ``matrix``, or None when
    ``matrix`` is not a coarsening of ``factors`` in order."""
    groups, i = [], 0
    for size in matrix:
        group, product = [], 1
        while product < size and i < len(factors):
            group.append(i)
            product *= factors[i]
            i += 1
        if product != size:
            return None
        groups.append(group)
    return groups if i == len(factors) else None


def _prime_factors(n: int) -> list[int]:
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


def mesh_factors(matrices: list[tuple[int, ...]], device_num: int) -> tuple[int, ...] | None:
    """An order of the prime factors of ``device_num`` that every matrix (with its repeat dimension, size-1
    dimensions left out) coarsens; None when there is none (e.g. (2, 3) and (3, 2) on 6 devices)."""
    wanted = [tuple(d for d in m if d > 1) for m in matrices]
    for order in sorted(set(itertools.permutations(_prime_factors(device_num)))):
        if all(_groups(order, m) is not None for m in wanted):
            return order
    return None


def placements(factors: tuple[int, ...], layout: OpLayout, tensor_map: tuple[int | None, ...]) -> list:
    """DTensor placements on a mesh of ``factors`` of a tensor split as ``tensor_map`` says on ``layout``."""
    matrix = layout.with_repeat(math.prod(factors))
    kept = [i for i, d in enumerate(matrix) if d > 1]
    groups = _groups(factors, tuple(matrix[i] for i in kept))
    if groups is None:
        raise UserError(f"device matrix {matrix} does not fit the job's mesh {factors}")
    result = [Replicate()] * max(1, len(factors))
    owner = dict(zip(kept, groups))
    for tensor_dim, dev in enumerate(tensor_map):
        for mesh_dim in owner.get(dev, []):
            result[mesh_dim] = Shard(tensor_dim)
    return result


class StrategyMesh:
    """The DeviceMesh shared by every op of a job, and the placements of a tensor under an op's layout."""

    def __init__(self, factors: tuple[int, ...], device_type: str):
        self.factors = factors
        self.device_num = math.prod(factors)
        self.mesh: DeviceMesh = init_device_mesh(device_type, factors or (1,),
                                                 mesh_dim_names=tuple(f"m{i}" for i in range(max(1, len(factors)))))

    def placements(self, layout: OpLayout, tensor_map: tuple[int | None, ...]) -> list:
        """DTensor placements, one per mesh dimension, of a tensor split as ``tensor_map`` says on ``layout``."""
        return placements(self.factors, layout, tensor_map)

    def replicate(self) -> list:
        return [Replicate()] * self.mesh.ndim

    def batch(self) -> list:
        """Dimension 0 split over every device: data parallel."""
        return [Shard(0)] * self.mesh.ndim if self.factors else [Replicate()]
