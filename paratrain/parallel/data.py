"""Data parallelism and ZeRO over the data-parallel ranks: DDP's reducer or FSDP2 (``fully_shard``).

What each ``zero_stage`` keeps on a rank (P = parameter bytes, dp ranks) and sends per step:
- 0: whole parameters, gradients and optimizer state. Communication: one all-reduce of the
     gradients, 2P(dp-1)/dp per rank. Plain-tensor parameters are replicated with torch's
     composable ``replicate`` (DDP's reducer): gradients are all-reduced in buckets while
     backward still runs, the buckets being the gradients' own storage
     (``gradient_as_bucket_view``). Tensor-parallel parameters (DTensors), which DDP's
     reducer cannot hold, and pipelines whose schedule splits backward into input and
     weight passes (the weight gradients bypass the reducer's hooks) use FSDP2's
     ``replicate`` instead: no shard dim, one all-reduce per layer group.
- 1: replicas as at stage 0, but each rank keeps the optimizer state of only the parameters it owns
     (whole tensors, dealt out by size so every rank holds about 1/dp of it) and steps only them;
     after the step every parameter is broadcast from its owner, an owner's parameters flattened into
     a few buckets (``shard_optimizer_state``, ``coalesced``).
     Gradients stay whole, so clipping and loss scaling see every gradient as at stage 0.
     Communication: the all-reduce plus the broadcasts, 3P(dp-1)/dp.
- 2: parameters, gradients and optimizer state sharded at rest (P/dp each) by FSDP2; parameters
     are all-gathered once in forward and stay whole until backward has used them
     (``reshard_after_forward=False``), gradients are reduce-scattered. Communication:
     all-gather + reduce-scatter, 2P(dp-1)/dp, the same volume as stage 0. At dp = 2 stage 1
     holds as much at its peak (P + P + P, no all-gather or reduce-scatter buffers); stage 2
     needs less from dp = 4 on.
- 3: as 2, but parameters are freed after forward and all-gathered again in backward:
     3P(dp-1)/dp, in exchange for only one layer group's whole parameters alive at a time.
``optimizer_shard=true`` means stage 1.
With context parallelism each rank of a sequence's ``context_parallel`` ranks holds the gradients of its own tokens:
the reductions and FSDP2's shards span data parallel x context parallel (``Layout.dp_cp_mesh``), the optimizer state
of stage 1 is dealt out over the data-parallel ranks alone (context-parallel peers step the same parameters).
ZeRO-Offload (``offload_optimizer`` / ``offload_param`` = "cpu", stages 1-3 / 3; stage 1 then runs as 2):
FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` keeps this rank's parameter shards, their gradients and the optimizer
state in pinned host memory, and the optimizer step runs on the host (FSDP2 offloads the three together; DeepSpeed
can offload the optimizer alone). It needs an accelerator and runs with one data-parallel rank too.
Batch-norm layers (ResNet) normalise with the statistics of the whole data-parallel batch, as one
process would (in a user's net only ``paratrain.nn.SyncBatchNorm`` ones, as MindSpore's).
``gradient_aggregation_group`` sets how many groups of consecutive layers are gathered and reduced together
(communication buckets); by default (0) each layer is its own FSDP unit, and DDP uses its own 25 MB buckets.
At stages 2 and 3 a word table and head whose rows outnumber the tokens of all ranks' micro-batches stay
row-sharded and the tokens travel to them instead (``paratrain.parallel.vocab``).
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed._composable.replicate_with_fsdp import replicate as fsdp_replicate
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.nn.functional import all_reduce
from torch.distributed.tensor import DTensor
from torch.torch_version import __version__ as TORCH_VERSION

from paratrain.config import ParallelConfig
from paratrain.errors import UserError
from paratrain.mesh import Layout
from paratrain.modules.transformer import pipeline_blocks
from paratrain.parallel.expert import is_expert_param, is_expert_parallel
from paratrain.parallel.vocab import shard_vocabulary

SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv_zero_bubble")  # schedules computing weight grads apart
# DDP without buffer broadcasts in forward: torch 2.13 renamed broadcast_buffers (deprecated there) to
# forward_sync_buffers; with init_sync=False the two mean the same
NO_BUFFER_SYNC = {"forward_sync_buffers": False} if TORCH_VERSION >= (2, 13) else {"broadcast_buffers": False}
BUCKET_BYTES = 64 << 20  # the coalesced broadcasts and all-reduces (``coalesced``)


def layer_groups(layers: list[nn.Module], num_groups: int) -> list[list[nn.Module]]:
    """Split ``layers`` into ``num_groups`` contiguous groups of near-equal size (none without layers: a user's
    net of plain modules)."""
    if not layers:
        return []
    bounds = [round(i * len(layers) / num_groups) for i in range(num_groups + 1)]
    return [layers[a:b] for a, b in zip(bounds, bounds[1:])]


def uses_ddp(config: ParallelConfig) -> bool:
    """Whether replicas reduce their gradients with DDP's reducer (zero stages 0 and 1 without tensor
    parallelism and without a split-backward pipeline schedule), rather than with FSDP2."""
    split = config.pipeline_stage > 1 and config.pipeline_schedule in SPLIT_BACKWARD
    return not config.shards_parameters and config.model_parallel == 1 and not split


def fusion_groups(model: nn.Module) -> list[list[nn.Module]]:
    """MindSpore's communication groups of a user's net: the outermost modules of each ``comm_fusion`` value
    (``Cell.set_comm_fusion``), in the order the net holds them; none when no module has one."""
    groups: dict[int, list[nn.Module]] = {}
    inside: set[int] = set()  # modules already in a group through an outer module
    for module in model.modules():
        fusion = getattr(module, "comm_fusion", None)
        if fusion is None or id(module) in inside:
            continue
        groups.setdefault(fusion, []).append(module)
        inside.update(id(m) for m in module.modules())
    return list(groups.values())


def apply_data_parallel(model: nn.Module, config: ParallelConfig, layout: Layout,
                        mp_policy: MixedPrecisionPolicy | None = None, root: nn.Module | None = None,
                        every_batch_norm: bool = True, groups: list[list[nn.Module]] | None = None,
                        tokens_per_rank: int | None = None) -> nn.Module:
    """Shard (or replicate) ``model`` over the data-parallel ranks as ``zero_stage`` says. ``root`` (default
    ``model``) is the module whose forward runs the rest: a pipeline stage module wrapping ``model``. ``mp_policy``
    applies to FSDP2; under DDP the parameters stay fp32 and autocast alone lowers the compute dtype. Batch norm takes
    the global batch's statistics: every BatchNorm2d, or with ``every_batch_norm=False`` (a user's net, as MindSpore)
    only ``paratrain.nn.SyncBatchNorm`` layers (``sync_batch_norm``). ``groups``: the modules gathered and reduced
    together (a user's ``comm_fusion`` groups); default: the layers in ``gradient_aggregation_group`` groups.
    ``tokens_per_rank``: the tokens of a micro-batch when every rank's have the same shape, so that the word tables
    and heads may stay sharded (``paratrain.parallel.vocab``)."""
    sync_batch_norm(model, layout.dp_group, layout.device, every_batch_norm)
    root = root if root is not None else model
    experts = [m for m in root.modules() if is_expert_parallel(m)]  # reduced by paratrain.parallel.expert
    layers = [model.get_submodule(name) for name, _, _ in pipeline_blocks(model)]
    grouped = groups is not None or config.gradient_aggregation_group
    if groups is None:
        groups = layer_groups(layers, config.aggregation_groups(len(layers)))
    if uses_ddp(config):
        bucket_mb = None  # DDP's default
        if grouped and groups:
            bucket_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / len(groups) / 2 ** 20
        # every rank materialises the same weights and buffers (the same seed): nothing to broadcast
        replicate(root, process_group=layout.dp_cp_group, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True,
                  init_sync=False, ignored_modules=experts, **NO_BUFFER_SYNC)
        return model
    kwargs = {"mesh": layout.dp_cp_mesh}
    param_dtype = mp_policy.param_dtype if mp_policy is not None else None
    tables = shard_vocabulary(model, layout, tokens_per_rank, param_dtype)  # not FSDP2's: the tokens travel
    ignored = {p for m in experts for p in m.parameters()} | tables
    if ignored:
        kwargs["ignored_params"] = ignored
    if config.shards_parameters:
        kwargs["reshard_after_forward"] = config.effective_zero_stage == 3
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if config.offloads:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    wrap = fully_shard if config.shards_parameters else fsdp_replicate
    # the parts that run before every layer (embeddings) join the first layer group's unit, those that run
    # after every layer (final norm, head) the last one's: each runs next to that group in forward and in
    # backward, so one all-gather and one reduce-scatter serve both
    ends = {"first": [], "last": []}
    for unit, where in part_groups(model, part_units(model, layers, ignored)):
        if where in ends and groups:
            ends[where] += unit
        else:
            wrap(unit, **kwargs)
    for i, unit in enumerate(groups):
        last = ends["last"] if i == len(groups) - 1 else []
        # the unit with the head runs last in forward and first in backward: resharding it after forward would
        # only gather it again at once (torchtitan keeps its last block, final norm and output the same way)
        keep = {"reshard_after_forward": False} if last and "reshard_after_forward" in kwargs else {}
        wrap((ends["first"] if i == 0 else []) + list(unit) + last, **kwargs | keep)
    wrap(root, **kwargs)
    return model


def part_groups(model: nn.Module, parts: list[nn.Module]) -> list[tuple[list[nn.Module], str]]:
    """The FSDP units of ``parts`` (``part_units``): grouped by where ``pipeline_parts`` places them -- the
    final norm with the head, one all-gather and one reduce-scatter for both -- each with that place
    ("first", "last", a layer's name, or the part's own name when it is not placed)."""
    placed = getattr(model, "pipeline_parts", {})
    names = {id(m): n for n, m in model.named_modules()}
    groups: dict[str, list[nn.Module]] = {}
    for part in parts:
        groups.setdefault(placed.get(names[id(part)], names[id(part)]), []).append(part)
    return [(group, where) for where, group in groups.items()]


def part_units(model: nn.Module, layers: list[nn.Module], ignored: set = frozenset()) -> list[nn.Module]:
    """The parts of ``model`` besides its layers (``pipeline_parts``: embeddings, final norms, head) that this
    chunk holds, each in an FSDP unit besides the root's unless it shares a parameter with another part or a
    layer (a tied word table stays with the root): its gradient is then reduced and freed with its unit's
    (the head's after the last layer group's backward), not at the end with the root's. A part whose parameters
    FSDP2 leaves alone (``ignored``) is none."""
    parts = []
    for name in getattr(model, "pipeline_parts", {}):
        try:
            parts.append(model.get_submodule(name))
        except AttributeError:  # held by another pipeline chunk
            continue
    holders = Counter(id(p) for module in [*layers, *parts] for p in module.parameters())
    return [part for part in parts
            if any(p not in ignored for p in part.parameters()) and all(holders[id(p)] == 1 for p in part.parameters())]


def owners(sizes: list[int], ranks: int) -> list[int]:
    """The rank owning each of tensors of ``sizes`` (elements): the largest first, each to the rank holding
    the fewest elements so far (the lowest such rank); the same answer on every rank."""
    load, owner = [0] * ranks, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owner[i] = min(range(ranks), key=load.__getitem__)
        load[owner[i]] += sizes[i]
    return owner


def parameter_owners(params: list[torch.Tensor], config: ParallelConfig, layout: Layout) -> list[int] | None:
    """The data-parallel rank that steps each of ``params`` at zero stage 1 on replicas over dp > 1 ranks (``owners``
    of the sizes of this rank's tensor-parallel shards), else None: every rank steps every parameter."""
    if not config.shards_only_optimizer_state or layout.dp_group is None:
        return None
    if len(params) < layout.dp_size:
        raise UserError(f"zero_stage=1 over data_parallel={layout.dp_size} ranks needs at least one parameter "
                        f"tensor a rank; this rank's part of the model has {len(params)}: use zero_stage 0 or 2")
    return owners([(p.to_local() if isinstance(p, DTensor) else p).numel() for p in params], layout.dp_size)


def shard_optimizer_state(optimizer: torch.optim.Optimizer, config: ParallelConfig, layout: Layout) -> None:
    """ZeRO stage 1 over replicas (else nothing): ``optimizer`` steps, and so makes state for, only the parameters
    this data-parallel rank owns (``owners``); after each step every parameter is broadcast from its owner. Call it
    before the first step. Its groups keep every parameter, so ``zero_grad`` and the LR schedule see them all; a
    hook before each step sets aside the gradients of the parameters other ranks own (AdamW skips a parameter
    without gradient) and one after it puts them back. Checkpoints hold each state once, saved by its owner."""
    # each rank steps its own experts (paratrain.parallel.expert): only the others are dealt out
    params = [p for group in optimizer.param_groups for p in group["params"] if not is_expert_param(p)]
    owner = parameter_owners(params, config, layout)
    if owner is None:
        return
    foreign = [p for p, o in zip(params, owner) if o != layout.dp_rank]
    group, set_aside = layout.dp_group, []

    def set_aside_foreign_gradients(*_):
        set_aside[:] = [p.grad for p in foreign]
        for p in foreign:
            p.grad = None

    @torch.no_grad()
    def broadcast_parameters(*_):
        for p, grad in zip(foreign, set_aside):
            p.grad = grad
        set_aside.clear()
        local = [p.to_local() if isinstance(p, DTensor) else p.detach() for p in params]
        for rank in range(layout.dp_size):
            mine = rank == layout.dp_rank  # the owner only sends, the others only receive
            coalesced([t for t, o in zip(local, owner) if o == rank],
                      lambda flat: dist.broadcast(flat, group=group, group_src=rank, async_op=True),
                      send=mine, receive=not mine)

    optimizer.register_step_pre_hook(set_aside_foreign_gradients)
    optimizer.register_step_post_hook(broadcast_parameters)


def coalesced(tensors: list[torch.Tensor], collective, bucket_bytes: int = BUCKET_BYTES, send: bool = True,
              receive: bool = True) -> None:
    """Run ``collective(flat)`` -- an async collective (``async_op=True``) that leaves its result in ``flat`` --
    on ``tensors`` packed, per dtype and in order, into flat buckets of up to ``bucket_bytes`` (a larger tensor is
    a bucket of its own), and write the results back: one launch per bucket, as NCCL needs to reach its bandwidth
    and gloo to spare a round trip per tensor. A bucket's collective runs while the next is packed (two buckets of
    extra memory at most). ``send=False`` (a broadcast's destination) packs nothing, ``receive=False`` (its
    source) writes nothing back."""
    buckets: list[list[torch.Tensor]] = []
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        bucket, size = [], 0
        for tensor in same:
            if bucket and size + tensor.nbytes > bucket_bytes:
                buckets.append(bucket)
                bucket, size = [], 0
            bucket.append(tensor)
            size += tensor.nbytes
        buckets.append(bucket)
    pending = None
    for bucket in buckets:
        if send:
            flat = torch.cat([t.reshape(-1) for t in bucket])
        else:
            flat = bucket[0].new_empty(sum(t.numel() for t in bucket))
        work = collective(flat)
        if pending is not None:
            _unpack(*pending, receive)
        pending = work, flat, bucket
    if pending is not None:
        _unpack(*pending, receive)


def _unpack(work, flat: torch.Tensor, bucket: list[torch.Tensor], receive: bool) -> None:
    work.wait()
    if receive:
        torch._foreach_copy_(bucket, [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in bucket]),
                                                                           bucket)])


class GlobalBatchNorm(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics are those of the whole data-parallel batch: (B, C, H, W) -> same.
    Per-channel sums, squared sums and counts are all-reduced (with their gradient) over ``group`` before normalising.
    torch's SyncBatchNorm does this on GPU only."""

    def __init__(self, num_features: int, group: dist.ProcessGroup, **kwargs):
        super().__init__(num_features, **kwargs)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        channels = x.shape[1]
        count = x.new_full((1,), x.numel() // channels)
        stats = all_reduce(torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)), count]), group=self.group)
        n = stats[-1]
        mean = stats[:channels] / n
        var = stats[channels:2 * channels] / n - mean * mean
        with torch.no_grad():
            self.num_batches_tracked += 1
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)
        shape = (1, channels, 1, 1)
        normalised = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return normalised * self.weight.view(shape) + self.bias.view(shape) if self.affine else normalised


def sync_batch_norm(model: nn.Module, group: dist.ProcessGroup, device: torch.device,
                    every_batch_norm: bool = True) -> nn.Module:
    """Replace every BatchNorm2d of ``model`` (or with ``every_batch_norm=False`` those that declare
    ``global_statistics``: ``paratrain.nn.SyncBatchNorm``) by one with global-batch statistics over
    ``group``: torch's SyncBatchNorm when the run's ``device`` is a GPU, else ``GlobalBatchNorm``."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if not (getattr(child, "global_statistics", False) or every_batch_norm and type(child) is nn.BatchNorm2d):
                continue
            if device.type == "cuda":
                synced = nn.SyncBatchNorm.convert_sync_batchnorm(child, group)
            else:
                synced = GlobalBatchNorm(child.num_features, group, eps=child.eps, momentum=child.momentum,
                                         affine=child.affine, device=child.running_mean.device)
                synced.load_state_dict(child.state_dict())
            setattr(parent, name, synced)
    return model
