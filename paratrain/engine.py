"""The one training step of every net, under both faces, and the life of its records.

``paratrain train`` (the built-in models: ``paratrain.trainer``) and MindSpore's ``Model.train`` (a user's
net: ``paratrain.train.model``) build a model, its placement and an optimizer, then run each step here. The
placement does what depends on it, forward and backward of one global batch::

    out = run(loss_scale)   # {"loss": the global batch's loss (a device tensor, the same on every rank),
                            #  "tokens": ..., "samples": ..., "flops": ..., optionally "grad_scale"}

leaving on every parameter the gradient of ``loss * loss_scale`` that one device would compute (times
``1 / grad_scale``, when the normalisation is known only after the backward). Every net runs its micro-batches
through :func:`forward_backward` and normalises its loss with :class:`StepLoss`, also under a pipeline schedule.
The engine does the rest the same way for every net: unscale, clip by the global norm, optimizer and LR steps (an
fp16 overflow skips the update, decided on the device), the loss-scale update, ``zero_grad``; then the
step's record, whose device values (loss, grad norm, tokens, loss scale) stay on the device until a step
that needs them on the host (``flush``): logged, saved, evaluated or the last. They come over together, then
the record gets its rates (tokens/s, samples/s, MFU, memory), and a NaN or infinite loss raises
:class:`TrainingDiverged` naming its step.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from paratrain import progress
from paratrain.config import ParallelConfig
from paratrain.mesh import Layout
from paratrain.metrics.timer import StepTimer
from paratrain.optim import clip_grad_norm
from paratrain.parallel.loss import loss_context, whole
from paratrain.precision import LossScaler, autocast

# record values that stay on the device until a flush (the last two: fp16 only)
ON_DEVICE = ("loss", "grad_norm", "tokens", "loss_scale", "skipped_steps", "aux_loss", "dropped")


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the message names the step. Both faces exit with code 3."""

    EXIT_CODE = 3


class StepLoss:
    """The one normalisation of a step's loss, for every net and layout: the global batch's summed token loss over
    its token count (the built-in models, a user's loss that returns its sum and count), else the mean of a plain
    scalar loss over the micro-batches and the data-parallel replicas. Whatever the split, the loss and the
    gradients are one device's.

    ``token_sum`` and ``mean`` give what backward runs on for one micro-batch (times the loss scale) and keep its
    value; ``result`` adds them up over the ranks. A token count known before the forward (``tokens``: computed
    from the labels) divides each micro-batch's loss; counts that come out of the forward (``counted``) are added
    up after, and divide the gradients in the engine's unscale (``grad_scale``): no pass of its own over them."""

    def __init__(self, layout: Layout, micro_batch_num: int, loss_scale: torch.Tensor | float,
                 tokens: torch.Tensor | None = None, counted: bool = False):
        self.layout, self.micro_batch_num, self.loss_scale = layout, micro_batch_num, loss_scale
        self.tokens, self.counted = tokens, counted
        # (value, token count or None) of each micro-batch's loss; a pipeline schedule may call its loss function
        # before the micro-batches too (torch 2.13 infers the backward's shapes so): only the last ones count
        self.kept: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def token_sum(self, loss_sum: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
        """A micro-batch's summed token loss (and its token count when ``counted``), times the data-parallel size
        (gradient reduction averages where a sum is wanted)."""
        factor = self.layout.dp_size * self.loss_scale
        return self._kept(loss_sum * (factor if self.tokens is None else factor / self.tokens), count)

    def mean(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's plain scalar loss: its share of the mean over the micro-batches."""
        return self._kept(loss * (self.loss_scale / self.micro_batch_num))

    def added(self, loss: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        """A micro-batch's ``loss`` (``token_sum``'s or ``mean``'s) plus another term of the training loss (a
        mixture of experts' load-balancing loss, weighted by the micro-batch's share of the batch already)."""
        extra = extra * (self.layout.dp_size * self.loss_scale)
        value, count = self.kept[-1]
        self.kept[-1] = (value + extra.detach(), count)
        if isinstance(loss, DTensor):  # the vocab-parallel loss, replicated
            extra = DTensor.from_local(extra, loss.device_mesh, loss.placements)
        return loss + extra

    def _kept(self, loss: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
        self.kept.append((whole(loss.detach()), None if count is None else whole(count.detach())))
        return loss

    def _sum(self, values: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(values).sum() if values else torch.zeros((), device=self.layout.device)

    def result(self) -> dict:
        """{"loss": the global batch's loss, the same on every rank} and, when ``counted``, ``grad_scale``."""
        layout, kept = self.layout, self.kept[-self.micro_batch_num:]  # only the last pipeline stage has any
        loss = layout.all_reduce_dp(self._sum([value for value, _ in kept]) / (layout.dp_size * self.loss_scale))
        out = {}
        if self.counted:
            count = layout.all_reduce_pp(layout.all_reduce_dp(self._sum([count for _, count in kept])))
            loss, out["grad_scale"] = loss / count, count.reciprocal()
        out["loss"] = layout.all_reduce_pp(loss)  # only the last stage has it
        return out


def forward_backward(batch: dict | tuple, config: ParallelConfig, precision: str, device: torch.device, phase, *,
                     module: torch.nn.Module | None = None, loss_of: Callable | None = None,
                     pipeline: Callable | None = None) -> None:
    """Forward and backward of this rank's rows of a global batch (a dict or tuple of tensors, rows first) in
    ``config.micro_batch_num`` micro-batches, gradients accumulated, forward in ``precision``: ``pipeline(batch)``
    (a pipeline schedule's step, its loss function a :class:`StepLoss`'s), else ``module``'s, where
    ``loss_of(micro_batch)`` runs the forward and returns what backward runs on (a :class:`StepLoss`'s); with
    ZeRO < 3 gradients are then reduced once, during the last backward. ``phase``: a StepTimer's."""
    if pipeline is not None:
        with loss_context(config), autocast(precision, device), phase("pipeline"):
            pipeline(batch)
        return
    chunks = zip(*(t.chunk(config.micro_batch_num) for t in (batch.values() if isinstance(batch, dict) else batch)))
    micro_batches = [dict(zip(batch, c)) if isinstance(batch, dict) else c for c in chunks]
    sync = hasattr(module, "set_requires_gradient_sync") and config.effective_zero_stage < 3
    for i, micro in enumerate(micro_batches):
        if sync:
            module.set_requires_gradient_sync(i == len(micro_batches) - 1)
        with loss_context(config):  # vocab-sharded logits: the loss and its backward are loss_parallel's
            with phase("forward"), autocast(precision, device):
                loss = loss_of(micro)
            with phase("backward"):
                loss.backward()


class Engine:
    """Runs training steps for this rank's ``parts`` (the modules holding its parameters) and keeps their records.

    ``scheduler`` may be None (the optimizer sets its own rate, as MindSpore's optimizers with a
    schedule do; the record's ``lr`` is then the first group's after the step). ``counted_in_norm`` (parameter
    ids) and the pipeline group make the gradient norm count a parameter held by several stages once.
    ``diverged_hint`` ends the message of a non-finite loss with what to change, in the face's words.
    """

    def __init__(self, parts: list[torch.nn.Module], optimizer: torch.optim.Optimizer, scheduler, layout,
                 loss_scaler: LossScaler, timer: StepTimer, *, grad_clip: float = 0.0, counted_in_norm=None,
                 diverged_hint: str = ""):
        self.parts, self.optimizer, self.scheduler, self.layout = parts, optimizer, scheduler, layout
        self.loss_scaler, self.timer = loss_scaler, timer
        self.grad_clip, self.counted_in_norm, self.diverged_hint = grad_clip, counted_in_norm, diverged_hint
        self.device = layout.device
        self._pending: list[dict] = []  # records whose device values are not on the host yet
        self._window_start, self._outside = time.perf_counter(), 0.0

    def parameters(self):
        for part in self.parts:
            yield from part.parameters()

    def step(self, number: int, run: Callable[[torch.Tensor], dict], to_host: bool) -> dict:
        """Step ``number`` (counting from 1): ``run(loss_scale)`` then the optimizer's part; returns its record,
        whose device values are on the host when ``to_host`` (with those of the steps before it)."""
        start = time.perf_counter()
        with self.timer.step():
            out = run(self.loss_scaler.scale)
            with self.timer.phase("optimizer"):
                self.loss_scaler.unscale_(self.parameters(), out.get("grad_scale"))
                grad_norm = clip_grad_norm(list(self.parameters()), self.grad_clip, self.counted_in_norm,
                                           self.layout.pp_group, self.device)
                lr = self.scheduler.get_last_lr()[0] if self.scheduler is not None else None
                self.loss_scaler.step(self.optimizer, self.scheduler, grad_norm)  # fp16: overflows skip the update
                self.optimizer.zero_grad(set_to_none=True)
        record = {"step": number, "loss": out["loss"], "grad_norm": grad_norm, "tokens": out["tokens"],
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

