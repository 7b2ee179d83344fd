"""Process-group set-up from the environment torchrun gives (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def backend() -> str:
    """NCCL when CUDA is present, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_from_env(timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the process group torchrun described, if any; returns (rank, world_size)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend(), timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0
