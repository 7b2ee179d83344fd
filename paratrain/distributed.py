"""Process-group set-up from the environment torchrun gives (RANK, WORLD_SIZE, MASTER_ADDR, ...).

A rank that joins a process group also gets stack dumps: on SIGTERM (how the
launcher stops the other ranks when one fails, and how ``paratrain stop`` ends a
job) and on SIGUSR1 (``kill -USR1 PID`` on a hung rank) the Python stacks of all
its threads go to stderr, which the launcher writes into ``rank{R}.log``. A
collective that does not complete within the timeout (``PARATRAIN_COLLECTIVE_TIMEOUT``
seconds, ``paratrain launch --collective-timeout``) raises on its rank, which
then fails and the launcher stops the others, whose stacks are dumped.
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import signal

import torch.distributed as dist

from paratrain.device import backend, configure, device


def collective_timeout(default_s: float = 600.0) -> float:
    """Seconds a collective may take: ``$PARATRAIN_COLLECTIVE_TIMEOUT`` or ``default_s``."""
    value = os.environ.get("PARATRAIN_COLLECTIVE_TIMEOUT", "")
    try:
        return float(value) if value else default_s
    except ValueError:
        raise ValueError(f"PARATRAIN_COLLECTIVE_TIMEOUT={value!r} is not a number of seconds") from None


def install_stack_dumps() -> None:
    """Dump all threads' Python stacks to stderr on a crash, on SIGUSR1 (then continue) and on SIGTERM
    (then terminate as SIGTERM would)."""
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)


def init_from_env(timeout_s: float | None = None, offload: bool = False) -> tuple[int, int]:
    """Join the process group torchrun described, if any; returns (rank, world_size).

    ``timeout_s`` bounds every collective (default: :func:`collective_timeout`). ``offload`` (ZeRO-Offload):
    the group also reduces host tensors, and one process gets a group of its own (FSDP2 needs one).
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1 and not offload:
        return 0, 1
    install_stack_dumps()
    configure(device())
    timeout = datetime.timedelta(seconds=collective_timeout() if timeout_s is None else timeout_s)
    if world_size == 1:
        dist.init_process_group(backend(offload), store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend(offload), timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


class StopRequest:
    """SIGTERM or SIGINT on any rank asks every rank to stop at the same step boundary.

    The signal only sets a flag. Each step, ``agreed()`` starts an all-reduce (max) of this
    rank's flag on a gloo group of its own, so it never waits for a GPU, and reads the one it
    started a step earlier: every rank learns the same answer at the same step, one step after
    the signal. ``close()`` puts the previous handlers back.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, world_size: int):
        import torch

        self.requested = False
        self.flag = torch.zeros(1, dtype=torch.int32, device="cpu")
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        self.pending: tuple[dist.Work, torch.Tensor] | None = None
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def agreed(self) -> bool:
        """Whether every rank is to stop now."""
        if self.group is None:
            return self.requested
        stop = False
        if self.pending is not None:
            work, flag = self.pending
            work.wait()
            stop = bool(flag.item())  # a host tensor of the gloo group: no device synchronisation
        flag = self.flag.clone().fill_(int(self.requested))
        self.pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag)
        return stop

    def close(self) -> None:
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
