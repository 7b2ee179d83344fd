"""Where a step's time goes: forward, backward, optimizer, exposed communication, pipeline idle, other.

With ``metrics.breakdown`` on, ``timer.phase(name)`` synchronizes the device at its boundaries (like
DeepSpeed's ``wall_clock_breakdown``) and phases nest, excluding their inner phases' time. A
``TorchDispatchMode`` times each collective to its completion and takes it out of its phase as exposed
communication; point-to-point sends/receives are not timed, so waiting for a neighbour stage, like the rest
of a pipeline schedule outside its stages' forward and backward, is pipeline idle. ``other`` is the rest.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from paratrain.config import MetricsConfig
from paratrain.metrics import flops as F

PARTS = ("forward", "backward", "optimizer", "comm", "pipeline_idle", "other")
COMM_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
NOT_TIMED = {"send", "recv_", "recv_any_source_", "_wrap_tensor_autograd"}  # p2p: pipeline idle; wrapping: no comm
no_phase = contextlib.nullcontext  # a placement's ``phase(name)`` until a timer's is given: no timing


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (the breakdown's synchronization point; nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wait(namespace: str, name: str, out) -> None:
    """Block until the collective that returned ``out`` is complete."""
    if name == "wait_tensor":
        return
    for item in out if isinstance(out, (tuple, list)) else (out,):
        if namespace == "c10d" and isinstance(item, torch.ScriptObject):
            dist.Work.unbox(item).wait()
        elif namespace != "c10d" and isinstance(item, torch.Tensor):
            torch.ops._c10d_functional.wait_tensor(item)


class CommClock(TorchDispatchMode):
    """Times each collective from its launch to its completion and reports it to the timer."""

    def __init__(self, timer: "StepTimer"):
        super().__init__()
        self.timer = timer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor dispatches; its collectives come back through this mode
        name = func._schema.name.split("::")[-1]
        if func.namespace not in COMM_NAMESPACES or name in NOT_TIMED:
            return func(*args, **kwargs)
        if self.timer.device.type == "cuda":  # the collective runs on the device: time it there
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = func(*args, **kwargs)
            _wait(func.namespace, name, out)  # the current stream waits for the collective's
            end.record()
            self.timer.add_comm((start, end))
        else:
            start = time.perf_counter()
            out = func(*args, **kwargs)
            _wait(func.namespace, name, out)
            self.timer.add_comm(time.perf_counter() - start)
        return out


class StepTimer:
    """Per-step timing phases plus what the record needs besides the loss: MFU, memory, skipped steps.

    ``cfg`` is the ``[metrics]`` section; ``pipeline`` a ``paratrain.parallel.pipeline.Pipeline`` or None.
    The job's peak FLOP/s is taken at start (``peak_source`` says how; a CPU peak is measured per rank and
    summed); with ``mfu=False`` records get no ``tflops``/``mfu``.
    """

    def __init__(self, cfg: MetricsConfig, pipeline=None, device: torch.device | None = None, mfu: bool = True):
        self.enabled, self.mfu = cfg.breakdown, mfu
        self.device = device or torch.device("cpu")
        self.local_peak, self.peak_source = F.device_peak_tflops(cfg.peak_tflops, self.device) if mfu else (0.0, "")
        self.measured = mfu and cfg.peak_tflops <= 0 and self.device.type == "cpu"
        world = dist.get_world_size() if dist.is_initialized() else 1
        if dist.is_initialized() and self.measured:
            total = torch.tensor([self.local_peak], dtype=torch.float64, device=self.device)
            dist.all_reduce(total)
            self.peak_tflops = float(total)
        else:
            self.peak_tflops = self.local_peak * world
        self._stack: list[list] = []  # [phase, time it (re)started]
        self.times: dict[str, float] = defaultdict(float)
        self.comm: dict[str, float] = defaultdict(float)  # communication time by the phase it ran in
        self._comm_events: list[tuple] = []  # (phase, start, end) CUDA events of this step's collectives
        self.wall = 0.0
        if self.enabled:
            self._clock = CommClock(self)
            with self._clock:  # the first dispatch mode imports a lot: not inside the first step
                torch.zeros(1, device=self.device).add_(1)
            if pipeline is not None:
                pipeline.time_compute(self._timed)

    @contextlib.contextmanager
    def phase(self, name: str):
        """``with timer.phase("forward"):`` -- a no-op when the breakdown is off."""
        if not self.enabled:
            yield
            return
        synchronize(self.device)
        now = time.perf_counter()
        if self._stack:
            outer = self._stack[-1]
            self.times[outer[0]] += now - outer[1]
        self._stack.append([name, now])
        try:
            yield
        finally:
            synchronize(self.device)
            now = time.perf_counter()
            inner, started = self._stack.pop()
            self.times[inner] += now - started
            if self._stack:
                self._stack[-1][1] = now

    @contextlib.contextmanager
    def step(self):
        """Context of one whole step: resets the phases and times collectives (breakdown only)."""
        if not self.enabled:
            yield
            return
        self.times.clear()
        self.comm.clear()
        self._stack.clear()
        self._comm_events.clear()
        synchronize(self.device)
        start = time.perf_counter()
        try:
            with self._clock:
                yield
        finally:
            synchronize(self.device)
            self.wall = time.perf_counter() - start
            for phase, begin, end in self._comm_events:
                self.comm[phase] += begin.elapsed_time(end) / 1e3

    def add_comm(self, elapsed) -> None:
        """A collective's time, in seconds or as a pair of CUDA events read once the step is over."""
        phase = self._stack[-1][0] if self._stack else "other"
        if isinstance(elapsed, tuple):
            self._comm_events.append((phase, *elapsed))
        else:
            self.comm[phase] += elapsed

    def _timed(self, method, phase: str):
        def timed(*args, **kwargs):
            with self.phase(phase):
                return method(*args, **kwargs)
        return timed

    def breakdown(self) -> dict[str, float]:
        """``<part>_s`` and ``<part>_pct`` for each of PARTS, over the measured step time ``step_s``."""
        phases = {"forward": "forward", "backward": "backward", "optimizer": "optimizer", "pipeline_idle": "pipeline"}
        seconds = {part: self.times[phase] - self.comm[phase] for part, phase in phases.items()}
        seconds["comm"] = float(sum(self.comm.values()))
        seconds["other"] = self.wall - sum(seconds.values())
        out = {"step_s": self.wall}
        for part in PARTS:
            out[f"{part}_s"] = max(seconds[part], 0.0)
            out[f"{part}_pct"] = 100.0 * max(seconds[part], 0.0) / self.wall if self.wall > 0 else 0.0
        return out

    def finish(self, record: dict) -> dict:
        """At the end of a step: its ``breakdown`` (when on) and the job's peak memory so far."""
        if self.enabled:
            peak = torch.tensor([F.memory_mb(self.device)], dtype=torch.float64, device=self.device)
            if dist.is_initialized():  # a synchronization point: breakdown only
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            record["memory_mb"] = float(peak)
            record["breakdown"] = self.breakdown()
        return record

    def rates(self, record: dict) -> dict:
        """Once the record's step time is known: ``tflops``, ``mfu`` (of the record's ``flops``), ``memory_mb``
        (this rank's, unless the breakdown measured the job's) and ``skipped_steps``."""
        record.setdefault("memory_mb", F.memory_mb(self.device))
        record.setdefault("skipped_steps", 0)
        if not self.mfu:
            return record
        step_time = record["step_time_s"]
        achieved = record["flops"] / step_time / 1e12 if step_time > 0 else 0.0
        if achieved > self.peak_tflops > 0 and self.measured:
            # the start-up measurement was slowed by load: measure this rank's share again, scaling the job's total
            again = F.measure_cpu_peak_tflops()
            if again > self.local_peak:
                self.peak_tflops *= again / self.local_peak
                self.local_peak = again
                self.peak_source += f"; measured again at {again:.3g} TFLOP/s when a step beat it"
        if self.peak_tflops > 0:
            self.peak_tflops = max(self.peak_tflops, achieved)  # never a peak below a rate achieved
        record["tflops"] = achieved
        record["mfu"] = min(1.0, achieved / self.peak_tflops) if self.peak_tflops > 0 else 0.0
        return record
