"""Data parallelism and ZeRO over the data-parallel ranks, with FSDP2 (``fully_shard``).

What each ``zero_stage`` keeps on a rank (P = parameter bytes, dp ranks) and sends per step:
- 0: whole parameters, gradients and optimizer state (DDP-like: HSDP whose shard dim has
     size 1). Communication: one all-reduce of the gradients, 2P(dp-1)/dp per rank.
- 1, 2: parameters, gradients and optimizer state sharded at rest (P/dp each); parameters
     are all-gathered once in forward and stay whole until backward has used them
     (``reshard_after_forward=False``), gradients are reduce-scattered. Communication:
     all-gather + reduce-scatter, 2P(dp-1)/dp, the same volume as stage 0. Stage 1 is
     served by stage 2: sharding the gradients as well costs no extra communication.
- 3: as 2, but parameters are freed after forward and all-gathered again in backward:
     3P(dp-1)/dp, in exchange for only one layer group's whole parameters alive at a time.
``optimizer_shard=true`` means stage 1. ``gradient_aggregation_group`` sets how many
groups of consecutive layers are gathered and reduced together (communication buckets).
"""
from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from paratrain.config import ParallelConfig
from paratrain.mesh import Layout
from paratrain.models.transformer import pipeline_blocks


def layer_groups(layers: list[nn.Module], num_groups: int) -> list[list[nn.Module]]:
    """Split ``layers`` into at most ``num_groups`` contiguous groups of near-equal size."""
    num_groups = max(1, min(num_groups, len(layers)))
    bounds = [round(i * len(layers) / num_groups) for i in range(num_groups + 1)]
    return [layers[a:b] for a, b in zip(bounds, bounds[1:])]


def apply_data_parallel(model: nn.Module, config: ParallelConfig, layout: Layout,
                        mp_policy: MixedPrecisionPolicy | None = None, root: nn.Module | None = None) -> nn.Module:
    """Shard (or replicate) ``model`` over the data-parallel ranks as ``zero_stage`` says.

    ``root`` (default ``model``) is the module whose forward runs the rest: a pipeline
    stage module wrapping ``model``.
    """
    reshard = config.effective_zero_stage == 3
    kwargs = {"mesh": layout.fsdp_mesh, "reshard_after_forward": reshard}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    layers = [model.get_submodule(name) for name, _, _ in pipeline_blocks(model)]
    for group in layer_groups(layers, config.gradient_aggregation_group):
        fully_shard(group, **kwargs)
    fully_shard(root if root is not None else model, **kwargs)
    return model
