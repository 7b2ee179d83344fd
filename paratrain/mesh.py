"""The device mesh of a run and where this rank sits in it.

Dims ("pp", "dp_replicate", "dp_shard", "cp", "tp"): data parallelism lives in ``dp_replicate`` when
parameters stay whole (zero stages 0 and 1) and in ``dp_shard`` when FSDP2 shards them (stages 2 and
3); the other has size 1 and is never handed to FSDP2 (it would cost a collective per layer and step).
``cp`` (context parallelism) splits each sequence: its ranks read the same batch rows, but each holds its own
tokens, so gradients and token counts are summed over data parallel x context parallel (``dp_cp``, as torchtitan
flattens ``dp_shard_cp``), and FSDP2 shards or replicates over that flattened mesh.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paratrain.config import ParallelConfig
from paratrain.device import configure, device


class Layout:
    """A ParallelConfig placed on the processes of this job: its device, mesh, groups (None where a dim has one
    rank) and this rank's coordinates. A ``data_parallel`` not given is derived here from ``world_size``.

    ``dp_*``: the data-parallel ranks, which read different rows of the batch; ``cp_*``: the context-parallel
    ranks, which read the same rows and split their sequence; ``dp_cp_*``: both together, over which gradients
    are reduced and the loss's tokens counted."""

    def __init__(self, config: ParallelConfig, world_size: int = 1):
        self.config = config.derive(world_size)
        self.world_size, self.dp_size, self.cp_size = world_size, config.data_parallel, config.context_parallel
        self.dp_cp_size = self.dp_size * self.cp_size
        self.device = device()
        configure(self.device)
        self.dp_dim = "dp_shard" if config.shards_parameters else "dp_replicate"
        self.mesh: DeviceMesh | None = None
        self._dp_cp_mesh: DeviceMesh | None = None
        self.pp_rank = self.dp_rank = self.cp_rank = self.tp_rank = 0
        self.pp_group = self.dp_group = self.cp_group = self.dp_cp_group = None
        if world_size > 1 or config.offloads:  # FSDP2's offload needs a mesh, even of one rank
            sharded = config.shards_parameters
            shape = (config.pipeline_stage, 1 if sharded else config.data_parallel,
                     config.data_parallel if sharded else 1, config.context_parallel, config.model_parallel)
            mesh = init_device_mesh(self.device.type, shape,
                                    mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
            self.mesh = mesh
            self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = (
                mesh.get_local_rank(d) for d in ("pp", self.dp_dim, "cp", "tp"))
            self.pp_group = mesh.get_group("pp") if config.pipeline_stage > 1 else None
            self.dp_group = mesh.get_group(self.dp_dim) if self.dp_size > 1 else None
            self.cp_group = mesh.get_group("cp") if self.cp_size > 1 else None
            # every rank flattens, in the same order: it makes the process group
            self._dp_cp_mesh = mesh[self.dp_dim, "cp"]._flatten("dp_cp") if self.cp_size > 1 else mesh[self.dp_dim]
            self.dp_cp_group = self._dp_cp_mesh.get_group() if self.dp_cp_size > 1 else None

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the data-parallel dim (without the context-parallel ranks)."""
        return self.mesh[self.dp_dim]

    @property
    def dp_cp_mesh(self) -> DeviceMesh:
        """The 1-D mesh of data parallel x context parallel: FSDP2 shards over it, or replicates over it at stage
        0; the data-parallel dim's own without context parallelism."""
        return self._dp_cp_mesh

    def all_reduce_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the data-parallel ranks (in place; returned for chaining)."""
        if self.dp_group is not None:
            dist.all_reduce(tensor, group=self.dp_group)
        return tensor

    def all_reduce_cp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the context-parallel ranks, which hold the tokens of the same sequences (in place;
        returned for chaining)."""
        if self.cp_group is not None:
            dist.all_reduce(tensor, group=self.cp_group)
        return tensor

    def all_reduce_dp_cp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the data- and context-parallel ranks, which together hold every token of the global
        batch (in place; returned for chaining)."""
        if self.dp_cp_group is not None:
            dist.all_reduce(tensor, group=self.dp_cp_group)
        return tensor

    def all_reduce_pp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the pipeline stages (in place; returned for chaining)."""
        if self.pp_group is not None:
            dist.all_reduce(tensor, group=self.pp_group)
        return tensor
