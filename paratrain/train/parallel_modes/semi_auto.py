"""MindSpore's semi-auto parallel for a user's net of ``paratrain.ops``: ``place_semi_auto``.

Before the first step the net's forward runs once on a micro-batch of the example batch (plain
tensors, no gradient) to record, in call order, each op's input shapes and the parameters it reads. Then:

- every strategy is checked (``Primitive.problems``), and so is the seed's rule that one
  parameter is not split two ways by two ops; all refusals are raised together, each naming the
  op's module path, its strategy and the rule;
- one ``StrategyMesh`` is built that every op's device matrix coarsens, and handed to the ops;
- each parameter becomes a DTensor split as the first op with a strategy that reads it says
  (replicated when no such op reads it); with ``optimizer_shard`` a parameter is also split over
  the devices that hold it whole, along a dimension nothing else splits -- MindSpore's parallel
  optimizer: each op that reads it gathers it back (DTensor redistribute), and the gradient
  arrives reduce-scattered, so optimizer state and parameters are held once per slice.

The batches enter as DTensors and the optimizer runs on the DTensor parameters (``place_semi_auto``).
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from paratrain.config import ParallelConfig
from paratrain.device import to_device
from paratrain.errors import UserError
from paratrain.mesh import Layout
from paratrain.modules.moe import MoE
from paratrain.ops.primitive import Primitive
from paratrain.ops.strategy import StrategyError, StrategyMesh, mesh_factors
from paratrain.ops.strategy import placements as placements_on
from paratrain.parallel.micro_batches import has_rows
from paratrain.parallel.model_loss import NetLoss
from paratrain.parallel.placed import PlacedModel
from paratrain.train.parallel_modes import refuse_options

# a tensor split along one dimension over several mesh dims is reduced one mesh dim at a time; DTensor
# warns about it on every redistribute
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


@dataclass
class Call:
    """One op call seen by the recording forward: the op's module path, the op, and per tensor input its
    shape, the name of the parameter it is (or None), and the ids of the tensors in and out."""

    path: str
    op: Primitive
    shapes: list[tuple[int, ...]]
    params: list[str | None]
    inputs: list[int]
    output: int

    def strategy(self, device_num: int):
        """The op's strategy, or its data-parallel default on these shapes."""
        if self.op.strategy is not None:
            return self.op.strategy
        return self.op.default_strategy(self.shapes, [p is not None for p in self.params], device_num)

    def describe(self) -> str:
        return f"{self.path} ({type(self.op).__name__}) strategy {self.op.strategy}"


def record_calls(net: nn.Module, example: tuple) -> list[Call]:
    """The op calls of ``net(*example)`` in the order they run (each op call once per time it runs)."""
    names = {}
    for name, param in net.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    calls, alive = [], []

    def hook(module, args, output, path):
        module.drop_scalar_entries(args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        alive.extend([*tensors, output])  # ids stay unique while the recording lasts
        calls.append(Call(path, module, [tuple(t.shape) for t in tensors], [names.get(id(t)) for t in tensors],
                          [id(t) for t in tensors], id(output)))

    handles = [m.register_forward_hook(lambda m, a, o, p=path: hook(m, a, o, p))
               for path, m in net.named_modules() if isinstance(m, Primitive)]
    try:
        with torch.no_grad():
            net(*example)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def check_strategies(calls: list[Call], device_num: int) -> tuple[int, ...]:
    """The mesh factors for ``calls``' strategies on ``device_num`` devices; raises StrategyError listing every
    refused strategy."""
    problems = []
    for call in calls:
        if call.op.strategy is not None:
            problems += [f"{call.describe()}: {p}" for p in call.op.problems(call.op.strategy, call.shapes,
                                                                             device_num)]
    if problems:
        raise StrategyError(problems)
    matrices = [call.op.layout(call.strategy(device_num), call.shapes).with_repeat(device_num) for call in calls]
    factors = mesh_factors(matrices, device_num)
    if factors is None:
        listed = ", ".join(f"{c.path} {m}" for c, m in zip(calls, matrices) if c.op.strategy is not None)
        raise StrategyError([f"the device matrices of the strategies ({listed}) cannot share one numbering of "
                             f"device_num={device_num} devices: make each a refinement of the others"])
    return factors


def parameter_placements(calls: list[Call], factors: tuple[int, ...]) -> dict[str, list]:
    """Placements of each parameter read by an op with a strategy: the first such op's; StrategyError when a
    later one asks for others."""
    placed: dict[str, tuple[list, Call, tuple]] = {}
    problems = []
    for call in calls:
        if call.op.strategy is None:
            continue
        layout = call.op.layout(call.op.strategy, call.shapes)
        for name, split, tensor_map in zip(call.params, call.op.strategy, layout.tensor_maps):
            if name is None:
                continue
            placements = placements_on(factors, layout, tensor_map)
            if name not in placed:
                placed[name] = placements, call, split
                continue
            first, other, other_split = placed[name]
            if first != placements and other.op is not call.op:
                how = "" if split != other_split else " (the same slices over other devices: another device matrix)"
                problems.append(f"{call.describe()}: parameter {name} is split {split} here but {other_split} by "
                                f"{other.describe()}{how}: a parameter shared by two ops needs one strategy for it")
    if problems:
        raise StrategyError(problems)
    return {name: placements for name, (placements, _, _) in placed.items()}


def optimizer_shard(placements: list, shape: tuple[int, ...], mesh: StrategyMesh) -> list:
    """``placements`` with the mesh dims that hold the tensor whole split along the first dimension that nothing
    splits yet and that they divide; unchanged when none does."""
    whole = [i for i, p in enumerate(placements) if isinstance(p, Replicate) and mesh.factors[i] > 1]
    ways = math.prod(mesh.factors[i] for i in whole)
    taken = {p.dim for p in placements if isinstance(p, Shard)}
    for dim, size in enumerate(shape):
        if dim not in taken and size % ways == 0:
            return [Shard(dim) if i in whole else p for i, p in enumerate(placements)]
    return placements


def as_input(mesh: StrategyMesh, device: torch.device, value, rows_of_this_rank: bool):
    """A batch tensor as the DTensor the ops take: replicated, or with ``rows_of_this_rank`` split by rows."""
    if not isinstance(value, torch.Tensor):
        return value
    value = to_device(value, device)
    placements = mesh.batch() if rows_of_this_rank and value.ndim else mesh.replicate()
    return DTensor.from_local(value, mesh.mesh, placements, run_check=False)


def gradients_in_placements(placed: PlacedModel) -> None:
    """Each gradient in its parameter's placement."""
    for param in placed.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def place_semi_auto(net: nn.Module, config: ParallelConfig, layout: Layout, *, example_batch: tuple,
                    precision: str = "none", choose=None) -> PlacedModel:
    """Place ``net`` (built identically on every rank) on its op strategies over the ``layout``'s devices, in
    ``config``'s micro-batches, with MindSpore's parallel optimizer at any ZeRO stage; ``example_batch`` is one
    global batch. ``choose(calls)``, when given (auto parallel), sets strategies on the ops before they are
    checked.

    Each micro-batch's tensors enter as DTensors (``as_input``) and DTensor computes the loss of the whole
    micro-batch, so every rank holds one device's loss and each parameter its one-device gradient of it (times
    ``loss_scale``) in its placement: the placed model's layout is one device's (no replica to add). Its batch is
    the whole global batch, or with ``rows_of_this_rank`` this rank's rows of it (ranks in order). ``parts`` is
    ``[net]``."""
    refuse_options(config, net, "semi_auto_parallel (and auto_parallel) of paratrain.ops")
    device, device_num = layout.device, layout.world_size
    net.to(device)
    # recorded on a micro-batch: what each op runs on
    example = tuple(t[:len(t) // config.micro_batch_num] if has_rows(t) else t for t in example_batch)
    calls = record_calls(net, tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in example))
    if not calls:
        raise UserError("semi_auto_parallel: the net calls no paratrain.ops op, so there is no strategy to apply; "
                        "use data_parallel, or paratrain.nn blocks with a TransformerOpParallelConfig")
    if choose is not None:
        choose(calls)
    factors = check_strategies(calls, device_num)
    placements = parameter_placements(calls, factors)
    mesh = StrategyMesh(factors, device.type)
    placed: dict[int, nn.Parameter] = {}
    for name, param in net.named_parameters():
        where = placements.get(name, mesh.replicate())
        if config.effective_zero_stage > 0:
            where = optimizer_shard(where, tuple(param.shape), mesh)
        tensor = distribute_tensor(param.detach(), mesh.mesh, where, src_data_rank=None)
        placed[id(param)] = nn.Parameter(tensor, requires_grad=param.requires_grad)
    for module in net.modules():
        for key, param in module._parameters.items():
            if param is not None:
                module._parameters[key] = placed[id(param)]
        if isinstance(module, Primitive):
            module.mesh = mesh
    return PlacedModel([net], config, Layout(ParallelConfig()), precision, finish_gradients=gradients_in_placements,
                       loss=NetLoss(net, config, as_input=functools.partial(as_input, mesh, device)),
                       experts=any(isinstance(m, MoE) for m in net.modules()))
