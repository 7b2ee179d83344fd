"""Where a step's time goes: forward, backward, optimizer, exposed communication, pipeline idle, other.

The trainer brackets its work with ``timer.phase(name)``; with ``metrics.breakdown``
off every phase is the same no-op context and nothing is synchronized or measured.
When it is on:

* phase boundaries synchronize the device (``synchronize``: CUDA only), like
  DeepSpeed's ``wall_clock_breakdown``; phases nest, a phase's time excludes its
  inner phases';
* a ``TorchDispatchMode`` active during the step times every collective
  (``c10d.*``, ``_c10d_functional.*``) until it completes (it waits for the
  collective right there), so time spent communicating is taken out of the phase it
  ran in and reported as exposed communication. Point-to-point sends/receives of
  the pipeline are not timed: waiting for a neighbour stage is pipeline idle time;
* for a pipeline step (``phase("pipeline")`` around ``Pipeline.step``) the stages'
  forward and backward (``forward_one_chunk``, ``backward_one_chunk``,
  ``backward_weight_one_chunk`` and the loss) are timed inside the schedule; the
  rest of the schedule's step minus communication is pipeline idle.

``other`` is everything else (data, loss bookkeeping), so the parts add up to the step.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from paratrain.config import MetricsConfig, ModelConfig
from paratrain.metrics import flops as F

PARTS = ("forward", "backward", "optimizer", "comm", "pipeline_idle", "other")
COMM_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
NOT_TIMED = {"send", "recv_", "recv_any_source_", "_wrap_tensor_autograd"}  # p2p: pipeline idle; wrapping: no comm
_NULL = contextlib.nullcontext()


def synchronize() -> None:
    """Wait for the device's queued work (the breakdown's synchronization point; nothing to wait for on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _wait(namespace: str, name: str, out) -> None:
    """Block until the collective that returned ``out`` is complete."""
    if name == "wait_tensor":
        return
    if namespace == "c10d":
        for item in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(item, torch.ScriptObject):
                dist.Work.unbox(item).wait()
        return
    for item in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(item, torch.Tensor):
            torch.ops._c10d_functional.wait_tensor(item)


def _comm_clock_class():
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class CommClock(TorchDispatchMode):
        """Times each collective from its launch to its completion and reports it to the timer."""

        def __init__(self, timer: "StepTimer"):
            super().__init__()
            self.timer = timer

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # DTensor dispatches; its collectives come back through this mode
            if func.namespace not in COMM_NAMESPACES:
                return func(*args, **kwargs)
            name = func._schema.name.split("::")[-1]
            if name in NOT_TIMED:
                return func(*args, **kwargs)
            start = time.perf_counter()
            out = func(*args, **kwargs)
            _wait(func.namespace, name, out)
            self.timer.add_comm(time.perf_counter() - start)
            return out

    return CommClock


class StepTimer:
    """Per-step timing phases plus what the record needs besides the loss: MFU, memory, skipped steps.

    ``cfg`` is the ``[metrics]`` section; ``pipeline`` a ``paratrain.parallel.pipeline.Pipeline`` or None.
    """

    def __init__(self, cfg: MetricsConfig, model: ModelConfig, pipeline=None, dp_size: int = 1):
        self.enabled, self.model_cfg, self.dp_size = cfg.breakdown, model, dp_size
        peak, self.peak_source = F.device_peak_tflops(cfg.peak_tflops)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if dist.is_initialized() and not torch.cuda.is_available() and cfg.peak_tflops <= 0:
            total = torch.tensor([peak], dtype=torch.float64)  # each CPU rank measured its own share
            dist.all_reduce(total)
            self.peak_tflops = float(total)
        else:
            self.peak_tflops = peak * world
        self.flops = 0.0
        self._stack: list[list] = []  # [phase, time it (re)started]
        self.times: dict[str, float] = defaultdict(float)
        self.comm: dict[str, float] = defaultdict(float)  # communication time by the phase it ran in
        self.wall = 0.0
        if self.enabled:
            self._clock = _comm_clock_class()(self)
            with self._clock:  # the first dispatch mode imports a lot: not inside the first step
                torch.zeros(1).add_(1)
            if pipeline is not None:
                self._time_pipeline_stages(pipeline)

    # --- phases ---------------------------------------------------------------------------------

    def phase(self, name: str):
        """``with timer.phase("forward"):`` -- a no-op when the breakdown is off."""
        return self._phase(name) if self.enabled else _NULL

    @contextlib.contextmanager
    def _phase(self, name: str):
        synchronize()
        now = time.perf_counter()
        if self._stack:
            outer = self._stack[-1]
            self.times[outer[0]] += now - outer[1]
        self._stack.append([name, now])
        try:
            yield
        finally:
            synchronize()
            now = time.perf_counter()
            inner, started = self._stack.pop()
            self.times[inner] += now - started
            if self._stack:
                self._stack[-1][1] = now

    def step(self):
        """Context of one whole step: resets the phases and times collectives (breakdown only)."""
        return self._step() if self.enabled else _NULL

    @contextlib.contextmanager
    def _step(self):
        self.times.clear()
        self.comm.clear()
        self._stack.clear()
        synchronize()
        start = time.perf_counter()
        try:
            with self._clock:
                yield
        finally:
            synchronize()
            self.wall = time.perf_counter() - start

    def add_comm(self, seconds: float) -> None:
        self.comm[self._stack[-1][0] if self._stack else "other"] += seconds

    def _time_pipeline_stages(self, pipeline) -> None:
        """Wrap the stages' forward/backward and the schedule's loss so they count as forward/backward."""
        schedule = pipeline.schedule
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        targets = [(stage, attr, phase) for stage in stages for attr, phase in
                   (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                    ("backward_weight_one_chunk", "backward"))]
        targets.append((schedule, "_compute_loss", "forward"))
        for obj, attr, phase in targets:
            if hasattr(obj, attr):
                setattr(obj, attr, self._timed(getattr(obj, attr), phase))

    def _timed(self, method, phase: str):
        def timed(*args, **kwargs):
            with self._phase(phase):
                return method(*args, **kwargs)
        return timed

    # --- the record -----------------------------------------------------------------------------

    def observe_batch(self, batch: dict[str, torch.Tensor]) -> None:
        """The step's model FLOPs, from this rank's batch shapes times the data-parallel ranks."""
        self.flops = F.batch_flops(self.model_cfg, batch, self.dp_size)

    def breakdown(self) -> dict[str, float]:
        """``<part>_s`` and ``<part>_pct`` for each of PARTS, over the measured step time ``step_s``."""
        comm = float(sum(self.comm.values()))
        seconds = {
            "forward": self.times["forward"] - self.comm["forward"],
            "backward": self.times["backward"] - self.comm["backward"],
            "optimizer": self.times["optimizer"] - self.comm["optimizer"],
            "comm": comm,
            "pipeline_idle": self.times["pipeline"] - self.comm["pipeline"],
        }
        seconds["other"] = self.wall - sum(seconds.values())
        out = {"step_s": self.wall}
        for part in PARTS:
            out[f"{part}_s"] = max(seconds[part], 0.0)
            out[f"{part}_pct"] = 100.0 * max(seconds[part], 0.0) / self.wall if self.wall > 0 else 0.0
        return out

    def finish(self, record: dict) -> dict:
        """Add ``mfu``, ``tflops``, ``memory_mb``, ``skipped_steps`` and (breakdown on) ``breakdown`` to a record."""
        step_time = record["step_time_s"]
        achieved = self.flops / step_time / 1e12 if step_time > 0 else 0.0
        record["tflops"] = achieved
        record["mfu"] = achieved / self.peak_tflops if self.peak_tflops > 0 else 0.0
        memory = F.memory_mb()
        if self.enabled and dist.is_initialized():  # a synchronization point: breakdown only
            peak = torch.tensor([memory], dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            memory = float(peak)
        record["memory_mb"] = memory
        record.setdefault("skipped_steps", 0)
        if self.enabled:
            record["breakdown"] = self.breakdown()
        return record
