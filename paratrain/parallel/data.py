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
``optimizer_shard=true`` means stage 1. Batch-norm layers (ResNet) normalise with the
statistics of the whole data-parallel batch, as one process would. ``gradient_aggregation_group`` sets how many
groups of consecutive layers are gathered and reduced together (communication buckets); by default
(0) each layer is its own FSDP unit, so one layer's parameters are gathered at a time.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.nn.functional import all_reduce

from paratrain.config import ParallelConfig
from paratrain.mesh import Layout
from paratrain.models.transformer import pipeline_blocks


def layer_groups(layers: list[nn.Module], num_groups: int) -> list[list[nn.Module]]:
    """Split ``layers`` into ``num_groups`` contiguous groups of near-equal size (none without layers: a user's
    net of plain modules)."""
    if not layers:
        return []
    bounds = [round(i * len(layers) / num_groups) for i in range(num_groups + 1)]
    return [layers[a:b] for a, b in zip(bounds, bounds[1:])]


def apply_data_parallel(model: nn.Module, config: ParallelConfig, layout: Layout,
                        mp_policy: MixedPrecisionPolicy | None = None, root: nn.Module | None = None) -> nn.Module:
    """Shard (or replicate) ``model`` over the data-parallel ranks as ``zero_stage`` says.

    ``root`` (default ``model``) is the module whose forward runs the rest: a pipeline
    stage module wrapping ``model``.
    """
    sync_batch_norm(model, layout.dp_group, layout.device)
    reshard = config.effective_zero_stage == 3
    kwargs = {"mesh": layout.fsdp_mesh, "reshard_after_forward": reshard}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    layers = [model.get_submodule(name) for name, _, _ in pipeline_blocks(model)]
    for group in layer_groups(layers, config.aggregation_groups(len(layers))):
        fully_shard(group, **kwargs)
    fully_shard(root if root is not None else model, **kwargs)
    return model


class GlobalBatchNorm(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics are those of the whole data-parallel batch: (B, C, H, W) -> same.

    Per-channel sums, squared sums and counts are all-reduced (with their gradient)
    over ``group`` before normalising. torch's SyncBatchNorm does this on GPU only.
    """

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
        return (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps) * self.weight.view(shape) \
            + self.bias.view(shape)


def sync_batch_norm(model: nn.Module, group: dist.ProcessGroup, device: torch.device) -> nn.Module:
    """Replace every BatchNorm2d of ``model`` by one with global-batch statistics over ``group``:
    torch's SyncBatchNorm when the run's ``device`` is a GPU, else ``GlobalBatchNorm``."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model, group)
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.BatchNorm2d:
                synced = GlobalBatchNorm(child.num_features, group, eps=child.eps, momentum=child.momentum,
                                         device=child.weight.device)
                synced.load_state_dict(child.state_dict())
                setattr(parent, name, synced)
    return model
