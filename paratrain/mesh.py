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
    """A ParallelConfig placed on the processes of this job: its device, mesh, groups and this rank's
    coordinates. A ``data_parallel`` not given is derived here from ``world_size``."""

    def __init__(self, config: ParallelConfig, world_size: int = 1):
        self.config = config.derive(world_size)
        self.world_size = world_size
        self.device = device()
        configure(self.device)
        self.mesh: DeviceMesh | None = None
        if world_size > 1 or config.offloads:  # FSDP2's offload needs a mesh, even of one rank
            sharded = config.shards_parameters
            shape = (config.pipeline_stage, 1 if sharded else config.data_parallel,
                     config.data_parallel if sharded else 1, config.model_parallel)
            self.mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))

    def _coordinate(self, dim: str) -> int:
        return self.mesh.get_local_rank(dim) if self.mesh is not None else 0

    @property
    def dp_dim(self) -> str:
        return "dp_shard" if self.config.shards_parameters else "dp_replicate"

    @property
    def dp_rank(self) -> int:
        return self._coordinate(self.dp_dim)

    @property
    def dp_size(self) -> int:
        return self.config.data_parallel

    @property
    def tp_rank(self) -> int:
        return self._coordinate("tp")

    @property
    def pp_rank(self) -> int:
        return self._coordinate("pp")

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the data-parallel dim: FSDP2 shards over it, or replicates over it at stage 0."""
        return self.mesh[self.dp_dim]

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group("pp") if self.mesh is not None and self.config.pipeline_stage > 1 else None

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group(self.dp_dim) if self.mesh is not None and self.dp_size > 1 else None

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
