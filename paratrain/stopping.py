"""Stop requests: SIGTERM and SIGINT (``paratrain stop``, the launcher, Ctrl-C) end a run saved, never lost.

A signal while the run starts ends it at once with :class:`StopRequested` (nothing trained, nothing lost); once
the loop trains it only sets a flag, and :class:`StopAgreement` makes every rank stop, and save, at one step.
Nothing heavy is imported here: it runs before torch is.
"""
from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(BaseException):
    """A stop signal arrived before the first training step: there is nothing to save. A
    ``BaseException``, as ``KeyboardInterrupt``, so that no ``except Exception`` of the start-up keeps it."""


class _Catcher:
    """The process's SIGTERM/SIGINT handler: raises while the run starts, only records once it trains."""

    def __init__(self):
        self.signal: int | None = None  # the first stop signal of this run
        self.training = False  # set for good by the first StopAgreement

    def handle(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum
            if not self.training:
                raise StopRequested(signal.Signals(signum).name)

    def install(self) -> dict:
        """Handle the stop signals here; returns the handlers they had."""
        return {sig: signal.signal(sig, self.handle) for sig in SIGNALS}


_catcher = _Catcher()


def catch() -> None:
    """From now on SIGTERM/SIGINT ask this process to stop (see the module's docstring): a new run."""
    _catcher.signal = None
    _catcher.install()


def requested() -> bool:
    """Whether this run has received a stop signal."""
    return _catcher.signal is not None


class StopAgreement:
    """The training loop's side of a stop: every rank stops at the same step boundary.

    Each step, ``agreed()`` starts an all-reduce (max) of the flag on a gloo group of its own (it never waits for
    a GPU) and reads the one started a step earlier: every rank learns the same answer one step after the signal.
    ``finish()`` makes a last, blocking agreement, so a signal during the last steps or the save still counts.
    """

    def __init__(self, world_size: int):
        import torch
        import torch.distributed as dist

        self.dist = dist
        self.flag = torch.zeros(1, dtype=torch.int32, device="cpu")
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        self.pending = None  # (work, flag tensor) of the all-reduce started last step
        if _catcher.signal is not None and not _catcher.training:  # its StopRequested was lost on the way up
            raise StopRequested(signal.Signals(_catcher.signal).name)
        _catcher.signal, _catcher.training = None, True  # a signal before this point ended the start-up
        self.previous = _catcher.install()

    def _read(self) -> bool:
        work, flag = self.pending
        self.pending = None
        work.wait()
        return bool(flag.item())  # a host tensor of the gloo group: no device synchronisation

    def agreed(self) -> bool:
        """Whether every rank is to stop now."""
        if self.group is None:
            return requested()
        stop = self._read() if self.pending is not None else False
        flag = self.flag.clone().fill_(int(requested()))
        self.pending = self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX, group=self.group, async_op=True), flag
        return stop

    def finish(self) -> bool:
        """After the loop, on every rank: whether any rank was asked to stop."""
        stop = self.agreed()
        return stop if self.group is None else self._read() or stop

    def close(self) -> None:
        """Wait for the all-reduce in flight, if any (no new collective: a failed run closes it too), and
        give the signals back the handlers they had."""
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
