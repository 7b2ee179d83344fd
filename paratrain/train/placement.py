"""The placement of a user's net on the job's layout from its first batch, as the context's parallel mode says
(``place_by_mode``), and the optimizer built on the unsharded net rebuilt on this rank's parameters
(``group_names``, ``rebuild_optimizer``)."""
from __future__ import annotations

import inspect

import torch
from torch import nn

from paratrain.config import ParallelConfig
from paratrain.context import GRAPH_MODE, ParallelMode, get_auto_parallel_context, get_context
from paratrain.errors import UserError
from paratrain.mesh import Layout
from paratrain.nn.parameter import Parameter
from paratrain.optim import tensor_kind
from paratrain.parallel import place
from paratrain.parallel.deferred_init import deferred_record
from paratrain.parallel.user import place_net


def parallel_configs(network: nn.Module) -> list[ParallelConfig]:
    """The distinct ``TransformerOpParallelConfig`` objects held by the net's modules (its blocks')."""
    found: dict[int, ParallelConfig] = {}
    for module in network.modules():
        for value in vars(module).values():
            if isinstance(value, ParallelConfig):
                found.setdefault(id(value), value)
    return list(found.values())


def group_names(optimizer: torch.optim.Optimizer, net: nn.Module) -> list[list[str]]:
    """The names in ``net`` of each parameter group's parameters (every name of a shared one); call it before
    placing the net, which replaces its parameters."""
    if optimizer.state:
        raise UserError("Model: the optimizer has taken steps already; paratrain rebuilds it on this rank's "
                        "parameters without its state: give Model a fresh optimizer")
    names: dict[int, list[str]] = {}
    for name, param in net.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    groups = []
    for group in optimizer.param_groups:
        foreign = [list(p.shape) for p in group["params"] if id(p) not in names]
        if foreign:
            raise UserError(f"Model: the optimizer holds parameters of shapes {foreign} that are not in the "
                            f"network: build the optimizer on the network's parameters")
        groups.append([name for p in group["params"] for name in names[id(p)]])
    return groups


def rebuild_optimizer(optimizer: torch.optim.Optimizer, names: list[list[str]],
                      named_parameters) -> torch.optim.Optimizer:
    """``optimizer`` (built on the unsharded net) built again, same class, groups and hyperparameters, on this
    rank's ``named_parameters`` (name in the whole net, parameter); ``names``: its groups' parameter names
    (``group_names``). A group with no parameter here is dropped; a group holding both plain and sharded
    tensors is split by tensor kind, which multi-tensor kernels cannot mix. On CUDA a torch Adam or AdamW
    left to torch's default kernels gets the fused one (``fused_where_equal``)."""
    group_of = {name: index for index, group in enumerate(names) for name in group}
    placed: list[dict[object, list[tuple[str, torch.Tensor]]]] = [{} for _ in optimizer.param_groups]
    seen: set[int] = set()
    for name, param in named_parameters:
        if name in group_of and id(param) not in seen:
            seen.add(id(param))
            placed[group_of[name]].setdefault(tensor_kind(param), []).append((name, param))
    groups = []
    for group, kinds in zip(optimizer.param_groups, placed):
        options = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        for members in kinds.values():
            groups.append({**options, "params": [p for _, p in members]}
                          | ({"param_names": [n for n, _ in members]} if "param_names" in group else {}))
    accepted = inspect.signature(type(optimizer).__init__).parameters
    options = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    fused = fused_where_equal(optimizer, options, groups)
    return type(optimizer)([group | fused for group in groups], **(options | fused))


# torch optimizers whose fused CUDA kernel computes the update of their default (foreach) one, in one pass that
# also divides the gradients (``paratrain.optim.step_dividing``'s ``grad_scale``)
FUSED_EQUIVALENT = (torch.optim.Adam, torch.optim.AdamW)


def fused_where_equal(optimizer: torch.optim.Optimizer, options: dict, groups: list[dict]) -> dict:
    """``{"fused": True}`` for a torch Adam or AdamW whose user chose neither ``foreach`` nor ``fused`` (nor
    ``differentiable``) over plain CUDA parameters: the same update as torch's default kernels; else nothing."""
    chosen = [options] + [{k: g[k] for k in ("foreach", "fused", "differentiable") if k in g} for g in groups]
    params = [p for group in groups for p in group["params"]]
    if (type(optimizer) not in FUSED_EQUIVALENT or not params
            or any(c.get("foreach") is not None or c.get("fused") is not None or c.get("differentiable")
                   for c in chosen)):
        return {}
    plain_cuda = all(type(p) in (nn.Parameter, Parameter) and p.is_cuda
                     and p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in params)
    return {"fused": True} if plain_cuda else {}


def place_by_mode(net: nn.Module, config: ParallelConfig, layout: Layout, batch: tuple, precision: str = "none"):
    """``net`` placed (``paratrain.parallel.place``) as the context's ``parallel_mode`` says: whole on every rank
    with its own collectives (hybrid), op by op on its strategies (semi-auto or auto parallel with
    ``paratrain.ops``), else by ``place_net`` (the blocks' plans, pipeline, data parallel). A net built under
    ``no_init_parameters`` is placed on the meta device and only this rank's shards are made (``place_net``; the
    others materialise it whole first). With ``precision`` "fp8" its Linear layers are made fp8 ones first."""
    on_meta = any(p.is_meta for p in net.parameters())
    deferred = deferred_record(net) if on_meta else None
    if on_meta and deferred is None:
        raise UserError("Model: the net's parameters are on the meta device but it was not built under "
                        "paratrain.no_init_parameters(), so nothing says how to initialise them")
    mode, of_ops = get_auto_parallel_context("parallel_mode"), op_by_op(net, config)
    graph_mode = get_context("mode") == GRAPH_MODE
    if graph_mode and (mode == ParallelMode.HYBRID_PARALLEL or of_ops):
        raise UserError("set_context(mode=GRAPH_MODE) compiles the layers of a net of paratrain.nn blocks or "
                        "torch modules; a hybrid-parallel net or one of paratrain.ops runs in PYNATIVE_MODE")
    if graph_mode and config.pipeline_stage > 1:
        raise UserError("set_context(mode=GRAPH_MODE) with pipeline stages: a traced stage runs its layers "
                        "inlined, so they cannot be compiled one by one; use PYNATIVE_MODE with pipeline_stages")
    if get_auto_parallel_context("parameter_broadcast") and layout.world_size > 1 and not on_meta:
        # (a deferred build is replayed from one random state on every rank: nothing to broadcast)
        broadcast_parameters(net.to(layout.device))  # on its device first: NCCL broadcasts only GPU tensors
    common = {"precision": precision, "init": deferred}
    if mode == ParallelMode.HYBRID_PARALLEL:
        from paratrain.train.parallel_modes.hybrid import place_hybrid

        return place(net, config, layout, place_hybrid, values_first=True, **common)
    if mode in (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL) and layout.world_size > 1 and of_ops:
        from paratrain.train.parallel_modes.semi_auto import place_semi_auto

        choose = None
        if mode == ParallelMode.AUTO_PARALLEL:
            from paratrain.train.parallel_modes.auto import StrategyChooser

            choose = StrategyChooser.from_context(layout.world_size)
        return place(net, config, layout, place_semi_auto, values_first=True, example_batch=batch, choose=choose,
                     **common)
    # MindSpore's data parallel without gradients_mean sums the replicas' gradients
    summed = mode == ParallelMode.DATA_PARALLEL and not get_auto_parallel_context("gradients_mean")
    return place(net, config, layout, place_net, example_batch=batch, compile_layers=graph_mode,
                 grad_factor=config.data_parallel if summed else 1.0, **common)


def op_by_op(net: nn.Module, config: ParallelConfig) -> bool:
    """Whether ``net`` is placed op by op on its ``paratrain.ops`` strategies (else by the blocks' placement,
    ``place_net``): it holds ops, and either no ``paratrain.nn`` blocks or ops whose strategies split more than
    the batch, which is refused beside blocks given ``model_parallel`` or ``pipeline_stage``. Ops beside blocks
    whose strategies split only the batch over ``data_parallel`` (``((dp, 1, 1),)``, ``((1, 1), ())``, or none)
    change nothing beyond data parallelism, which the blocks' placement runs."""
    from paratrain.ops import Primitive

    ops = {path: m for path, m in net.named_modules() if isinstance(m, Primitive)}
    if not ops or not parallel_configs(net):
        return bool(ops)
    splitting = [f"{path or type(op).__name__}.shard({op.strategy})" for path, op in ops.items()
                 if op.strategy is not None and not op.splits_batch_only(op.strategy, config.data_parallel)]
    if not splitting:
        return False
    if config.model_parallel > 1 or config.pipeline_stage > 1:
        raise UserError(f"Model: the net mixes paratrain.ops strategies that split more than the batch over "
                        f"data_parallel={config.data_parallel} ({', '.join(splitting)}) with blocks given "
                        f"model_parallel={config.model_parallel} or pipeline_stage={config.pipeline_stage}; the "
                        f"blocks' placement runs ops data parallel: split only dimension 0 by data_parallel, "
                        f"e.g. ((dp, 1, 1),), or use the ops without the blocks")
    return True


@torch.no_grad()
def broadcast_parameters(net: nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers (MindSpore's ``parameter_broadcast``), but a
    ``layerwise_parallel`` parameter, which is each rank's own slice."""
    import torch.distributed as dist

    for tensor in [*net.parameters(), *net.buffers()]:
        if not getattr(tensor, "layerwise_parallel", False):
            dist.broadcast(tensor.data, src=0)
