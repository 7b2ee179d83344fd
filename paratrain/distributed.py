"""Process-group set-up from the environment torchrun gives (RANK, WORLD_SIZE, MASTER_ADDR, ...), or that
:mod:`paratrain.cluster` fills from SLURM, MPI or Kubeflow's variables.

A rank that joins a process group dumps the Python stacks of all its threads to stderr (its
``rank{R}.log``) on SIGTERM (how the launcher stops the ranks) and on SIGUSR1 (``kill -USR1 PID`` on a
hung rank). A collective that does not complete within ``PARATRAIN_COLLECTIVE_TIMEOUT`` seconds raises
on its rank, which fails, and the launcher stops the others.
"""
from __future__ import annotations

import atexit
import datetime
import faulthandler
import os
import signal

import torch.distributed as dist

from paratrain.cluster import fill_env
from paratrain.device import backend, configure, device


def collective_timeout(default_s: float = 600.0) -> float:
    """Seconds a collective may take: ``$PARATRAIN_COLLECTIVE_TIMEOUT`` or ``default_s``."""
    value = os.environ.get("PARATRAIN_COLLECTIVE_TIMEOUT", "")
    try:
        return float(value) if value else default_s
    except ValueError:
        raise ValueError(f"PARATRAIN_COLLECTIVE_TIMEOUT={value!r} is not a number of seconds") from None


def init_from_env(timeout_s: float | None = None, offload: bool = False) -> tuple[int, int]:
    """Join the process group torchrun, SLURM, MPI or Kubeflow described (:func:`paratrain.cluster.fill_env`),
    if any; returns (rank, world_size). ``timeout_s`` and ``offload``: :func:`join_group`'s."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    fill_env()
    return join_group(timeout_s, offload)


def join_group(timeout_s: float | None = None, offload: bool = False) -> tuple[int, int]:
    """Join the process group the torch.distributed variables describe (``RANK``, ``WORLD_SIZE``, ...; from
    another launcher than torchrun once :func:`paratrain.cluster.fill_env` filled them), if any; returns (rank,
    world_size). ``timeout_s`` bounds every collective (default: :func:`collective_timeout`). With ``offload``
    (ZeRO-Offload) the group also reduces host tensors, and one process gets a group of its own (FSDP2 needs one)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1 and not offload:
        return 0, 1
    faulthandler.enable(all_threads=True)  # and on SIGUSR1 (then continue) and SIGTERM (then terminate)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    configure(device())
    alone = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if world_size == 1 else {}
    timeout = datetime.timedelta(seconds=collective_timeout() if timeout_s is None else timeout_s)
    dist.init_process_group(backend(offload), timeout=timeout, **alone)
    atexit.register(_leave)
    return dist.get_rank(), dist.get_world_size()


def _leave() -> None:
    """At a normal exit, leave the process group: a group still alive while the interpreter tears down can abort the
    process after its work is done ("terminate called without an active exception", SIGABRT; seen with a
    MindSpore-style script that never calls ``communication.release()``)."""
    if dist.is_initialized():
        dist.destroy_process_group()
