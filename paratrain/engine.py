"""The one training step of every net, under both faces, and the life of its records.

``paratrain train`` (``paratrain.trainer``) and MindSpore's ``Model.train`` (``paratrain.train.model``) place a
model (``paratrain.parallel.placed.PlacedModel``) and build an optimizer, then run each step here, top to bottom in
``Engine.step``. The gradients are divided by the loss scale and the clipping factor in the optimizer's own pass
(``paratrain.optim.step_dividing``; an fp16 overflow skips the update, decided on the device). A record's device
values stay on the device until a step that needs them on the host (``flush``): logged, saved, evaluated or the
last; they come over together, then the records get their rates and a NaN or infinite loss raises
:class:`TrainingDiverged` naming its step.
"""
from __future__ import annotations

import contextlib
import math
import time
import torch

from paratrain import progress
from paratrain.metrics.timer import StepTimer
from paratrain.optim import clip_divisor, grad_norm, step_dividing
from paratrain.parallel.placed import PlacedModel
from paratrain.precision import LossScaler

# record values that stay on the device until a flush (the last two: fp16 only)
ON_DEVICE = ("loss", "grad_norm", "tokens", "loss_scale", "skipped_steps", "aux_loss", "dropped")


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the message names the step. Both faces exit with code 3."""

    EXIT_CODE = 3


class Engine:
    """Runs training steps of ``placed`` (this rank's share of the model: its parts, their forward and backward, the
    parameters its gradient norm counts) and keeps their records; it gives the placed model its timer's ``phase``.

    ``scheduler`` may be None (the optimizer sets its own rate, as MindSpore's optimizers with a
    schedule do; the record's ``lr`` is then the first group's after the step).
    ``diverged_hint`` ends the message of a non-finite loss with what to change, in the face's words.
    """

    def __init__(self, placed: PlacedModel, optimizer: torch.optim.Optimizer, scheduler, layout,
                 loss_scaler: LossScaler, timer: StepTimer, *, grad_clip: float = 0.0, diverged_hint: str = ""):
        self.placed, self.optimizer, self.scheduler, self.layout = placed, optimizer, scheduler, layout
        self.loss_scaler, self.timer, self.grad_clip, self.diverged_hint = loss_scaler, timer, grad_clip, diverged_hint
        self.device = layout.device
        placed.phase = timer.phase
        self._pending: list[dict] = []  # records whose device values are not on the host yet
        self._window_start, self._outside = time.perf_counter(), 0.0

    def step(self, number: int, batch, fields: dict, to_host: bool) -> dict:
        """Step ``number`` (counting from 1) on this rank's ``batch``; returns its record, with ``fields`` (those of
        ``tokens``, ``samples`` and ``flops`` the placed model does not give), whose device values are on the host
        when ``to_host`` (with those of the steps before it)."""
        start = time.perf_counter()
        with self.timer.step():
            # without loss scaling the scale is the number 1, which multiplies nothing on the device
            out = {**fields, **self.placed.forward_backward(
                batch, self.loss_scaler.scale if self.loss_scaler.enabled else 1.0)}
            with self.timer.phase("optimizer"):
                # the gradients are the loss's times the loss scale (over grad_scale): their norm is divided by
                # that, and the optimizer divides them by it and the clipping factor in the pass of its update
                divisor = self.loss_scaler.divisor(out.get("grad_scale"))
                norm = grad_norm(self.placed.parameters(), self.placed.counted_in_norm, self.layout.pp_group,
                                 self.device)
                if divisor is not None:
                    norm = norm / divisor
                if self.grad_clip > 0:
                    clip = clip_divisor(norm, self.grad_clip)
                    divisor = clip if divisor is None else divisor * clip
                lr = self.scheduler.get_last_lr()[0] if self.scheduler is not None else None
                skip = self.loss_scaler.overflow(norm)  # fp16: a step whose gradients overflowed is skipped
                if skip is not None and getattr(self.optimizer, "_step_supports_amp_scaling", False):
                    step_dividing(self.optimizer, divisor, found_inf=skip.float())  # decided on the device
                elif skip is None or not bool(skip):  # any other optimizer waits for the decision
                    step_dividing(self.optimizer, divisor)
                if self.scheduler is not None:
                    self.scheduler.step()  # the schedule advances over skipped steps too
                self.loss_scaler.update(norm)
                self.optimizer.zero_grad(set_to_none=True)
        record = {"step": number, "loss": out["loss"], "grad_norm": norm, "tokens": out["tokens"],
                  "samples": out["samples"], "flops": out["flops"],
                  "lr": lr if lr is not None else float(self.optimizer.param_groups[0]["lr"])}
        record.update({k: out[k] for k in ("aux_loss", "dropped") if k in out})  # mixture of experts
        if self.loss_scaler.enabled:
            record.update(loss_scale=self.loss_scaler.scale, skipped_steps=self.loss_scaler.skipped_steps)
        record["step_time_s"] = time.perf_counter() - start
        self._pending.append(self.timer.finish(record))
        progress.step_done(number)
        if to_host:
            self.flush()
        return record

    @contextlib.contextmanager
    def between_steps(self):
        """Context for work between steps (logging, evaluation, saving): its time is no step's."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._outside += time.perf_counter() - start

    def flush(self) -> None:
        """Bring the pending records' device values to the host in one copy and finish them (rates, MFU,
        memory). Their step times are shares of the wall time since the last flush (the device has finished
        their work now), minus the time spent between steps."""
        records, self._pending = self._pending, []
        if not records:
            return
        keys = [k for k in ON_DEVICE if isinstance(records[0].get(k), torch.Tensor)]
        values = torch.stack([r[k].double() for r in records for k in keys]).tolist()
        self.loss_scaler.check()
        now = time.perf_counter()
        window = now - self._window_start - self._outside
        host = sum(r["step_time_s"] for r in records)
        self._window_start, self._outside = now, 0.0
        for i, r in enumerate(records):
            r.update(zip(keys, values[i * len(keys):(i + 1) * len(keys)]))
            r["tokens"] = int(r["tokens"])
            if "skipped_steps" in r:
                r["skipped_steps"] = int(r["skipped_steps"])
            if not math.isfinite(r["loss"]):
                raise TrainingDiverged(f"loss is {r['loss']} at step {r['step']}{self.diverged_hint}")
            r["step_time_s"] *= window / host if host > 0 else 1.0
            r.update(tokens_per_s=r["tokens"] / r["step_time_s"], samples_per_s=r.pop("samples") / r["step_time_s"])
            self.timer.rates(r)
        progress.loss_known(records[-1]["step"], records[-1]["loss"])

