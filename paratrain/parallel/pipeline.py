"""Pipeline parallelism: layers split into stages, micro-batches run by torch.distributed.pipelining.

Each rank holds one model chunk per virtual stage: a copy of the whole model with the layers and parts of other chunks
removed, so parameter names stay those of the whole model (checkpoints load under any layout). Where the layers go
comes from ``layer_chunks``; the other parts follow the model's own ``pipeline_parts`` (with the first layer, the
last, or a named one). The model's forward runs whatever its chunk holds and carries float tensors across the
boundary; token ids reach every stage as keyword arguments.

A parameter used by parts of several chunks (the word table of the source and target embeddings and a tied head) is
copied to each, under its name in the whole model, and the copies' gradients are summed.
"""
from __future__ import annotations

import copy
import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate import DDP, replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                    ScheduleInterleavedZeroBubble, ScheduleLoopedBFS,
                                                    ScheduleZBVZeroBubble)
from torch.distributed.tensor import DTensor

from paratrain.config import ParallelConfig
from paratrain.mesh import Layout
from paratrain.modules.moe import moe_totals
from paratrain.modules.transformer import pipeline_blocks

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "looped_bfs": ScheduleLoopedBFS, "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
             "zbv_zero_bubble": ScheduleZBVZeroBubble}


def layer_chunks(blocks: list[tuple], config: ParallelConfig, costs: list[int] | None = None) -> list[int]:
    """The chunk (virtual stage, 0..pp*v-1) of every layer, for ``pipeline_blocks``' (name, layer_id, offset).

    Default: the split that balances ``costs``, the work of each layer with the parts placed with it (equal when
    not given; ``paratrain.plan.cost.layer_costs`` gives a built-in model's FLOPs, its output head's with the last
    layer): see ``balanced_split``. Else the user's ``layer_stages`` list or function.
    """
    chunks = config.pipeline_stage * config.virtual_pipeline_stage
    if callable(config.layer_stages):
        return [config.layer_stages(layer_id, offset, config) for _, layer_id, offset in blocks]
    if config.layer_stages:
        return list(config.layer_stages)
    if len(blocks) < chunks:
        raise ValueError(f"cannot split {len(blocks)} layers into {chunks} pipeline chunks")
    return balanced_split(costs or [1] * len(blocks), chunks)


def balanced_split(costs: list[int], chunks: int) -> list[int]:
    """The chunk of each item of ``costs`` (positive integers, len >= ``chunks``): contiguous chunks, none empty,
    whose largest total is the smallest possible (the slowest pipeline stage sets the pace); of such splits, the
    one with the later chunks as full as that allows, since earlier stages keep more micro-batches in flight."""

    def fill(limit: int) -> list[int] | None:  # from the last item back; None when ``chunks`` do not suffice
        owner, chunk, total = [0] * len(costs), chunks - 1, 0
        for i in reversed(range(len(costs))):
            if total and (total + costs[i] > limit or i < chunk):  # i < chunk: one item a chunk left
                chunk, total = chunk - 1, 0
            if chunk < 0:
                return None
            owner[i], total = chunk, total + costs[i]
        return owner

    low, high = max(max(costs), -(-sum(costs) // chunks)), sum(costs)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if fill(middle) else (middle + 1, high)
    return fill(low)


def chunk_rank(chunk: int, config: ParallelConfig) -> int:
    """The pipeline rank of a chunk: round robin, or V-shaped for the zero-bubble V schedule."""
    pp = config.pipeline_stage
    if config.pipeline_schedule == "zbv_zero_bubble" and chunk >= pp:
        return 2 * pp - 1 - chunk
    return chunk % pp


def part_chunks(pipeline_parts: dict[str, str], layers: list[str], owner: list[int]) -> dict[str, int]:
    """The chunk of each part a model declares in ``pipeline_parts`` (part -> "first", "last" or a layer
    name), given the names of its layers in execution order and the chunk of each (``owner``)."""
    chunk_of = dict(zip(layers, owner))
    anchors = {"first": layers[0], "last": layers[-1]}
    return {part: chunk_of[anchors.get(where, where)] for part, where in pipeline_parts.items()}


def unit_chunks(model: nn.Module, config: ParallelConfig, costs: list[int] | None = None) -> dict[str, int]:
    """The chunk of every layer and part of ``model``, by module name (``costs``: as ``layer_chunks``)."""
    blocks = pipeline_blocks(model)
    owner = layer_chunks(blocks, config, costs)
    layers = [name for name, _, _ in blocks]
    return dict(zip(layers, owner)) | part_chunks(model.pipeline_parts, layers, owner)


def parameter_holders(model: nn.Module, units: dict[str, int]) -> dict[str, list[int]]:
    """Name (in the whole model) of every parameter -> the chunks whose layers or parts use it, sorted."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    holders: dict[str, set[int]] = {}
    for unit, chunk in units.items():
        for _, p in model.get_submodule(unit).named_parameters(remove_duplicate=False):
            holders.setdefault(name_of[id(p)], set()).add(chunk)
    return {name: sorted(chunks) for name, chunks in holders.items()}


def _prune(model: nn.Module, units: set[str], keep: set[str]) -> nn.Module:
    """Remove from ``model`` (in place) the layers and parts in ``units`` but not in ``keep``.

    A removed part that holds, under its name in the whole model, a parameter a kept one uses (the word table of a
    removed source embedding, used by the target embedding) stays as a skeleton holding only that parameter.
    """
    name_of = {id(p): name for name, p in model.named_parameters()}
    used = {name_of[id(p)] for unit in keep for _, p in model.get_submodule(unit).named_parameters(remove_duplicate=False)}
    for unit in units - keep:
        needed = [name[len(unit) + 1:] for name in used if name.startswith(unit + ".")]
        if needed:
            _keep_only(model.get_submodule(unit), needed)
            continue
        parent, _, key = unit.rpartition(".")
        container = model.get_submodule(parent)
        if isinstance(container, nn.ModuleDict):
            del container[key]
        else:
            setattr(container, key, None)
    return model


def _keep_only(module: nn.Module, needed: list[str]) -> None:
    """Set every child of ``module`` holding none of the ``needed`` parameters (names relative to it) to None."""
    for name, child in list(module.named_children()):
        inner = [n[len(name) + 1:] for n in needed if n.startswith(name + ".")]
        if inner:
            _keep_only(child, inner)
        else:
            setattr(module, name, None)


class _StageModule(nn.Module):
    """What a PipelineStage runs: it calls ``forward(*carried, **batch inputs)``; the model takes the
    carried tensors as ``hidden``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *hidden, **inputs):
        return self.model(**inputs, hidden=hidden)


class StageFixes:
    """What every pipeline stage here needs besides torch's stage (mixed into the built-in models' stages and
    a user's traced ones): a stage module replicated by DDP's reducer (composable ``replicate``), which torch's
    stage treats as a plain module, accumulates its gradients locally over the micro-batches
    (``set_requires_gradient_sync(False)``, set when the stage is built) and all-reduces them, bucket by
    bucket, during the step's last backward; no warm-up of a link to a stage on the same rank; and no input
    gradients handed between stages on the same rank when the schedule runs forward only (``eval``)."""

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        # torch 2.11 warms up the links to both neighbouring stages with a send and a receive each way,
        # also to a neighbour on this rank (zbv_zero_bubble's V), where gloo waits forever; stages on one
        # rank pass tensors directly, so those links are left out (2.12 and 2.13 warm up otherwise)
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    def _forward_metadata_inference(self, *args, **kwargs):
        try:  # torch 2.13: a forward of the first micro-batch (or of uninitialised inputs), no micro-batch's own
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            moe_totals(self.submod)  # so its mixture-of-experts statistics are dropped

    def _shape_inference(self, *args, **kwargs):
        try:  # torch 2.11: a forward on the meta device
            return super()._shape_inference(*args, **kwargs)
        finally:
            moe_totals(self.submod)

    def get_local_bwd_output(self, mb_index: int):
        # the V-shaped schedule (zbv_zero_bubble) hands a stage's input gradients to the stage before it on this
        # rank after each backward action, which its forward-only ``eval`` runs too, as no-ops: there are none
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs: tuple, mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if last_backward and isinstance(self.submod, DDP):
            # what torch's stage does for a DistributedDataParallel module: arm the reducer for this backward
            replicate.state(self.submod)._ddp.reducer.prepare_for_backward([])
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


class _Stage(StageFixes, PipelineStage):
    """A PipelineStage of a built-in model's chunk (``StageFixes``)."""


def _parameters_by_name(module: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters under their names in the whole model (without the recompute wrapper's prefix)."""
    return {name.replace(_CHECKPOINT_PREFIX, ""): p for name, p in module.named_parameters()}


def build_schedule(stages: list[PipelineStage], config: ParallelConfig, loss_fn):
    """``config.pipeline_schedule`` over this rank's ``stages`` (one, or one per virtual stage) in
    ``micro_batch_num`` micro-batches; ``loss_fn`` normalises the loss, so the schedule does not scale gradients."""
    schedule = SCHEDULES[config.pipeline_schedule]
    single = schedule in (ScheduleGPipe, Schedule1F1B)
    return schedule(stages[0] if single else stages, n_microbatches=config.micro_batch_num, loss_fn=loss_fn,
                    scale_grads=False)


class Pipeline:
    """This rank's model chunks (``parts``), their PipelineStages and the schedule that runs a step over
    micro-batches.

    ``parallelize_chunk(chunk, root=stage_module)`` applies the other dimensions to each chunk; ``layer_costs`` weigh
    the layers in the split (``layer_chunks``).
    """

    def __init__(self, model: nn.Module, config: ParallelConfig, layout: Layout, parallelize_chunk,
                 layer_costs: list[int] | None = None):
        self.config, self.layout = config, layout
        units = unit_chunks(model, config, layer_costs)
        num_chunks = config.pipeline_stage * config.virtual_pipeline_stage
        # a parameter several chunks use: summed gradients, counted once (in its first chunk) in the norm
        self.shared = {name: chunks for name, chunks in parameter_holders(model, units).items() if len(chunks) > 1}
        self.chunk_ids = [c for c in range(num_chunks) if chunk_rank(c, config) == layout.pp_rank]
        self.parts, self.stages = [], []
        for c in self.chunk_ids:
            chunk = _prune(copy.deepcopy(model), set(units), {u for u, o in units.items() if o == c})
            stage_module = _StageModule(chunk)
            parallelize_chunk(chunk, root=stage_module)
            if isinstance(stage_module, DDP):
                stage_module.set_requires_gradient_sync(False)
            self.parts.append(chunk)
            self.stages.append(_Stage(stage_module, c, num_chunks, layout.device, group=layout.pp_group))
        self.loss_fn = None  # the step's (torch's schedules take loss_kwargs themselves only from 2.13 on)
        self.schedule = build_schedule(self.stages, config, lambda output, target: self.loss_fn(output, target))
        self.has_last = num_chunks - 1 in self.chunk_ids
        self.shared_groups = self._shared_groups()

    def _shared_groups(self) -> dict[str, dist.ProcessGroup]:
        """Shared parameter -> group of the pipeline ranks holding a copy, at this rank's dp/tp coordinate."""
        grid = self.layout.mesh.mesh  # (pp, dp_replicate, dp_shard, tp) -> global rank
        by_ranks: dict[tuple, list[str]] = {}
        for name, chunks in self.shared.items():
            by_ranks.setdefault(tuple(sorted({chunk_rank(c, self.config) for c in chunks})), []).append(name)
        groups = {}
        for stages in sorted(r for r in by_ranks if len(r) > 1):  # the same order on every rank
            for index in itertools.product(*(range(n) for n in grid.shape[1:])):
                ranks = [int(grid[(stage, *index)]) for stage in stages]
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    groups.update(dict.fromkeys(by_ranks[stages], group))
        return groups

    def counted_in_norm(self) -> set[int]:
        """Parameters counted in the global gradient norm: copies of a shared one outside its first chunk are not."""
        return {id(p) for c, chunk in zip(self.chunk_ids, self.parts) for name, p in _parameters_by_name(chunk).items()
                if name not in self.shared or self.shared[name][0] == c}

    def time_compute(self, timed) -> None:
        """Wrap the stages' forward and backward passes and the loss in ``timed(method, phase)`` (the breakdown)."""
        for stage in self.stages:
            for attr, phase in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                                ("backward_weight_one_chunk", "backward")):
                setattr(stage, attr, timed(getattr(stage, attr), phase))
        self.schedule._compute_loss = timed(self.schedule._compute_loss, "forward")

    def step(self, batch: dict[str, torch.Tensor], loss_fn) -> None:
        """Forward and backward over ``micro_batch_num`` micro-batches; ``loss_fn(logits, labels)`` runs on the last
        stage per micro-batch and keeps the losses (the step's ``StepLoss``). The last stage keeps no micro-batch's
        output (``return_outputs=False``)."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        self.loss_fn = loss_fn
        self.schedule.step(**inputs, target=batch["labels"] if self.has_last else None, return_outputs=False)
        self._sum_shared_grads()

    def evaluate(self, batch: dict[str, torch.Tensor], loss_fn) -> torch.Tensor:
        """Forward only over ``micro_batch_num`` micro-batches (the schedule's ``eval``): the sum of
        ``loss_fn(logits, labels)`` (a plain scalar) over them on the last stage's rank, 0 on the others."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        self.loss_fn, losses = loss_fn, []
        self.schedule.eval(**inputs, target=batch["labels"] if self.has_last else None, losses=losses,
                           return_outputs=False)
        return torch.stack(losses).sum() if losses else torch.zeros((), device=self.layout.device)

    def _sum_shared_grads(self) -> None:
        params = [_parameters_by_name(chunk) for chunk in self.parts]
        for name in self.shared:
            copies = [p[name] for p in params if name in p and p[name].grad is not None]
            group = self.shared_groups.get(name)
            if len(copies) < 2 and group is None:
                continue
            local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in copies]
            total = torch.stack(local).sum(0)
            if group is not None:
                dist.all_reduce(total, group=group)
            for grad in local:
                grad.copy_(total)
