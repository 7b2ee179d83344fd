"""The device mesh of a run and where this rank sits in it.

Dims ("pp", "dp_replicate", "dp_shard", "tp"): data parallelism lives in ``dp_replicate`` when
parameters stay whole (zero stages 0 and 1) and in ``dp_shard`` when FSDP2 shards them (stages 2 and
3); the other has size 1 and is never handed to FSDP2 (it would cost a collective per layer and step).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paratrain.config import ParallelConfig
from paratrain.device import configure, device


class Layout:
    """A ParallelConfig placed on the processes of this job: its device, mesh, groups (None where a dim has one
    rank) and this rank's coordinates. A ``data_parallel`` not given is derived here from ``world_size``."""

    def __init__(self, config: ParallelConfig, world_size: int = 1):
        self.config = config.derive(world_size)
        self.world_size, self.dp_size = world_size, config.data_parallel
        self.device = device()
        configure(self.device)
        self.dp_dim = "dp_shard" if config.shards_parameters else "dp_replicate"
        self.mesh: DeviceMesh | None = None
        self.pp_rank = self.dp_rank = self.tp_rank = 0
        self.pp_group = self.dp_group = None
        if world_size > 1 or config.offloads:  # FSDP2's offload needs a mesh, even of one rank
            sharded = config.shards_parameters
            shape = (config.pipeline_stage, 1 if sharded else config.data_parallel,
                     config.data_parallel if sharded else 1, config.model_parallel)
            mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
            self.mesh = mesh
            self.pp_rank, self.dp_rank, self.tp_rank = (mesh.get_local_rank(d) for d in ("pp", self.dp_dim, "tp"))
            self.pp_group = mesh.get_group("pp") if config.pipeline_stage > 1 else None
            self.dp_group = mesh.get_group(self.dp_dim) if self.dp_size > 1 else None

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the data-parallel dim: FSDP2 shards over it, or replicates over it at stage 0."""
        return self.mesh[self.dp_dim]

    def all_reduce_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the data-parallel ranks (in place; returned for chaining)."""
        if self.dp_group is not None:
            dist.all_reduce(tensor, group=self.dp_group)
        return tensor

    def all_reduce_pp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the pipeline stages (in place; returned for chaining)."""
        if self.pp_group is not None:
            dist.all_reduce(tensor, group=self.pp_group)
        return tensor
