"""Expert parallelism, MindSpore's ``expert_parallel``: the experts of every ``MoE`` block are split over
``expert_parallel`` (ep) ranks among the data-parallel ones, and the tokens travel to them and back with all-to-all.

The data-parallel ranks form groups of ep consecutive ranks (``ep``), and the ranks at the same place in each group
hold the same experts (``edp``, dp / ep of them). A block's ``Experts`` gets its parameters as DTensors sharded on the
expert dim over ``ep`` (rank r holds experts r*E/ep .. (r+1)*E/ep - 1, so checkpoints hold them sliced and reload
under any ep), and two hooks around its forward, applied from outside as torchtitan's ``ExpertParallel``:

- dispatch: the (E, M, H) capacity slots of this rank's tokens are cut into ep chunks of E/ep experts, chunk
  r sent to rank r (``all_to_all_single_autograd``: backward sends the gradients back); the experts
  run on (E/ep, ep*M, H), the slots of every rank of the group;
- combine: the outputs go back the same way, (E, M, H) again.

Every rank sends E*C*H values per block and group of tokens and receives as many (equal splits: the capacity
is fixed), so no sizes are exchanged first. Gloo has ``all_to_all`` on the CPU.

Under ``model_parallel`` each expert is split as the dense FFN is (Megatron's column and row parallel
linears): ``w1`` and ``b1`` on F, ``w2`` on its input F, ``b2`` replicated, over the tensor-parallel ranks
(``tp``). The experts' input becomes a DTensor replicated over ``tp`` (backward sums its partial gradients
there), DTensor runs the experts' forward on the slices and sums the partial outputs over ``tp``
before ``b2``; the output goes back to a plain tensor for the combine.

The experts' gradients skip data parallelism (``is_expert_parallel``: DDP and FSDP ignore them): each
backward's gradient of a rank's experts, which already holds the tokens of its whole ep group, is summed
over ``edp`` and divided by dp, as data parallelism averages the other gradients over dp. This happens per
backward (per micro-batch), before accumulation, so gradient accumulation needs no signal.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from paratrain.config import ParallelConfig
from paratrain.errors import UserError
from paratrain.mesh import Layout
from paratrain.modules.moe import MoE, moe_totals


def is_expert_parallel(module: nn.Module) -> bool:
    """Whether ``module`` holds experts split by expert parallelism (its gradients are reduced here)."""
    return getattr(module, "expert_mesh", None) is not None


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is a slice of experts split by expert parallelism (each rank steps its own)."""
    return isinstance(param, DTensor) and "ep" in param.device_mesh.mesh_dim_names


def apply_expert_parallel(model: nn.Module, config: ParallelConfig, layout: Layout) -> None:
    """Place ``model``'s MoE blocks on ``layout``: one token group per data-parallel rank where a block was
    built for ``groups`` of them (MindSpore's grouping), and with ``expert_parallel`` or ``model_parallel`` > 1
    the experts split as the module docstring says."""
    ep = config.expert_parallel
    if config.data_parallel % ep:
        raise UserError(f"expert_parallel={ep} does not divide data_parallel={config.data_parallel}: the experts "
                        f"are split over data-parallel ranks; use a divisor of {config.data_parallel}")
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    for block in blocks:
        block.groups = max(block.groups // layout.dp_size, 1)
    tp = config.model_parallel
    if ep == tp == 1 or not blocks:
        return
    if ep > 1:  # (ep, tp): FSDP leaves these alone; without ep the tp mesh is the one FSDP composes with
        mesh = _expert_mesh(layout, ep)
        edp = mesh.get_group("edp") if layout.dp_size > ep else None
        placed = mesh["ep", "tp"]
    else:
        placed = layout.tp_mesh
    for block in blocks:
        experts = block.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            placements = ([Shard(0)] if ep > 1 else []) + [_TENSOR_PARALLEL[name]]
            local = param.detach()
            for dim, (placement, size) in enumerate(zip(placements, placed.shape)):
                if isinstance(placement, Shard):
                    local = local.chunk(size, placement.dim)[placed.get_local_rank(dim)]
            sharded = DTensor.from_local(local.clone(), placed, placements, run_check=False)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        # the slots the experts run on: split on E over ep like the experts, whole on every tp rank
        experts.placed, experts.slots = placed, [Shard(0), Replicate()] if ep > 1 else [Replicate()]
        if ep > 1:
            experts.expert_mesh, experts.edp_group, experts.dp_size = mesh["ep"], edp, layout.dp_size
        experts.register_forward_pre_hook(_dispatch)
        experts.register_forward_hook(_combine)


# each expert's FFN over the tensor-parallel ranks: w1 by output features, w2 by input features
_TENSOR_PARALLEL = {"w1": Shard(2), "b1": Shard(1), "w2": Shard(1), "b2": Replicate()}


def moe_step_metrics(model: nn.Module, layout: Layout, used: bool) -> dict[str, torch.Tensor]:
    """``aux_loss`` (summed over the blocks) and ``dropped`` (the fraction of (token, choice) assignments over
    capacity, averaged over the blocks) of this step's micro-batches through the MoE blocks of ``model`` and of
    the other pipeline stages, averaged over the data-parallel ranks: the values of one process. ``used``:
    whether the whole model has MoE blocks (a stage may hold none); empty without."""
    if not used:
        return {}
    totals = moe_totals(model)
    if totals is None:
        totals = torch.zeros(3, device=layout.device)
    aux, dropped, blocks = layout.all_reduce_pp(layout.all_reduce_dp(totals))
    return {"aux_loss": aux / layout.dp_size, "dropped": dropped / blocks}


def _expert_mesh(layout: Layout, ep: int) -> DeviceMesh:
    """All ranks as (pp, edp, ep, tp): a data-parallel rank d is at (d // ep, d % ep), as in ``Layout``'s mesh."""
    c = layout.config
    ranks = torch.arange(layout.world_size, device="cpu").reshape(c.pipeline_stage, c.data_parallel // ep, ep,
                                                                  c.model_parallel)
    return DeviceMesh(layout.device.type, ranks, mesh_dim_names=("pp", "edp", "ep", "tp"))


def _exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Chunk r of x's first dim to rank r of ``group``; the chunks received, in rank order."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x.contiguous(), None, None, group))


def _dispatch(experts: nn.Module, args: tuple) -> tuple:
    """(E, M, H) slots of this rank -> (E/ep, ep*M, H) slots of this rank's experts from every rank, a DTensor
    (sharded on E over ep, replicated over tp)."""
    (x,) = args
    if is_expert_parallel(experts):
        _reduce_gradients_once(experts)
        ep = experts.expert_mesh.size()
        e, m, h = x.shape
        received = _exchange(x, experts.expert_mesh.get_group())  # (ep * E/ep, M, H), rank s's chunk s-th
        x = received.reshape(ep, e // ep, m, h).transpose(0, 1).reshape(e // ep, ep * m, h)
    return (DTensor.from_local(x, experts.placed, experts.slots, run_check=False),)


def _combine(experts: nn.Module, args: tuple, output: DTensor) -> torch.Tensor:
    """(E/ep, ep*M, H) outputs of this rank's experts (partial sums over tp reduced) -> (E, M, H) outputs for
    this rank's slots."""
    output = output.redistribute(placements=experts.slots).to_local()
    if not is_expert_parallel(experts):
        return output
    ep = experts.expert_mesh.size()
    local, tokens, h = output.shape
    back = output.reshape(local, ep, tokens // ep, h).transpose(0, 1)  # chunk s: rank s's slots
    return _exchange(back, experts.expert_mesh.get_group()).reshape(ep * local, tokens // ep, h)


def _reduce_gradients_once(experts: nn.Module) -> None:
    """Hook this rank's expert parameters (those of now: materialising the model replaces them) once."""
    for param in experts.parameters(recurse=False):
        if not getattr(param, "expert_gradient_hooked", False):
            param.register_hook(lambda grad, e=experts: _reduce(grad, e))
            param.expert_gradient_hooked = True


@torch.no_grad()
def _reduce(grad: torch.Tensor, experts: nn.Module) -> torch.Tensor:
    """One backward's gradient of a rank's experts: summed over the ranks holding the same experts, over dp."""
    local = grad.to_local().clone()  # the parameters are DTensors sharded over ep, and so are their gradients
    if experts.edp_group is not None:
        dist.all_reduce(local, group=experts.edp_group)
    local /= experts.dp_size
    return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)
