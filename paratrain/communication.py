"""MindSpore's ``mindspore.communication`` on the environment torchrun gives each rank.

``init()`` joins the job's process group (``paratrain.distributed.init_from_env``: NCCL on GPUs,
gloo on the CPU; nothing to join in a single process); ``get_rank()`` and ``get_group_size()``
answer for the whole job, before or after ``init()``.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from paratrain.device import backend
from paratrain.distributed import init_from_env
from paratrain.errors import UserError

# MindSpore's names of the group of all ranks; paratrain has only that one to offer here
WORLD_GROUPS = (None, "hccl_world_group", "nccl_world_group", "mccl_world_group")


def init(backend_name: str | None = None) -> None:
    """Join the process group of this job (no-op when it runs as one process); ``backend_name``, when given,
    must be the device's (``"nccl"`` or ``"gloo"``)."""
    if backend_name is not None and backend_name != backend():
        raise UserError(f"communication.init({backend_name!r}): this rank's device uses {backend()!r} (NCCL on GPUs, "
                        f"gloo on the CPU; PARATRAIN_DEVICE chooses the device): call init() with no backend")
    init_from_env()


def _check_group(group: str | None) -> None:
    if group not in WORLD_GROUPS:
        raise UserError(f"communication group {group!r}: only the group of all ranks exists here "
                        f"(leave group out)")


def get_rank(group: str | None = None) -> int:
    """This process's rank in the job (0 in a single process)."""
    _check_group(group)
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def get_group_size(group: str | None = None) -> int:
    """The number of ranks in the job (1 in a single process)."""
    _check_group(group)
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def get_local_rank(group: str | None = None) -> int:
    """This process's rank on its node."""
    _check_group(group)
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_local_rank_size(group: str | None = None) -> int:
    """The number of ranks on this node."""
    _check_group(group)
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def release() -> None:
    """Leave the process group (MindSpore's ``release``); a later ``init()`` joins again."""
    if dist.is_initialized():
        dist.destroy_process_group()
