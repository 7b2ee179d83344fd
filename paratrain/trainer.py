"""The training loop of one rank: its share of each global batch, micro-batches, AdamW, logging."""
from __future__ import annotations

import math
import os
import time

import torch

from paratrain.checkpoint import Checkpointer
from paratrain.config import Config, check
from paratrain.data.loader import ShardedBatches, build_dataset
from paratrain.distributed import init_from_env
from paratrain.mesh import Layout
from paratrain.metrics import MetricsLogger, StepTimer
from paratrain.models import build_model, token_loss_sum
from paratrain.optim import build_optimizer, build_scheduler, clip_grad_norm
from paratrain.parallel import parallelize
from paratrain.parallel.loss import loss_context, whole
from paratrain.parallel.pipeline import Pipeline
from paratrain.precision import LossScaler, autocast

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the message names the step."""


class Trainer:
    """Trains the model a Config describes and logs one record per step.

    The loss of a step is the summed token cross-entropy of every micro-batch
    divided by the non-pad target tokens of the whole global batch, so it does
    not depend on how the batch is split.
    """

    def __init__(self, cfg: Config):
        rank, world_size = init_from_env()
        if cfg.parallel.auto:  # parallel.auto: the planner picks the layout for this world size
            from paratrain.plan import choose_layout
            cfg.parallel, why = choose_layout(cfg, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
            if rank == 0:
                print(why, flush=True)
        self.cfg = check(cfg, world_size)
        self.layout = Layout(cfg.parallel, world_size)
        torch.manual_seed(cfg.run.seed)  # every rank builds the same full model, then shards it
        model = build_model(cfg.model).to(DTYPES[cfg.model.dtype])
        parallel = parallelize(model, cfg.parallel, self.layout, loss_fn=self._loss)
        self.pipeline = parallel if isinstance(parallel, Pipeline) else None
        self.model = self.pipeline.modules if self.pipeline else parallel  # every parameter of this rank
        torch.manual_seed(cfg.run.seed + self.layout.dp_rank)  # dropout: shared by tensor-parallel peers
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.loss_scaler = LossScaler(cfg.train.mixed_precision == "fp16", cfg.train.initial_loss_scale)
        self.data = ShardedBatches(build_dataset(cfg), cfg.train.global_batch_size,
                                   self.layout.dp_rank, self.layout.dp_size)
        self.is_main = rank == 0
        if self.is_main and self.data.sampler is not None and self.data.sampler.lengths is not None:
            steps = min(cfg.train.steps, 1000)
            print(f"data: {self.data.sampler.padding_fraction(steps):.1%} padding in the first {steps} global batches "
                  f"padded to their longest example (bucket_size={cfg.data.bucket_size})", flush=True)
        self.run_dir = cfg.run.path
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            cfg.save(self.run_dir / "config.toml")
        self.metrics = MetricsLogger(self.run_dir, cfg.metrics, cfg.train.steps, enabled=self.is_main)
        self.timer = StepTimer(cfg.metrics, cfg.model, self.pipeline, self.layout.dp_size)  # mfu, memory, breakdown
        self.step = 0
        self.checkpointer = Checkpointer(self)  # checkpoint.dir, default <run dir>/checkpoints
        self.step = self.checkpointer.resume()  # checkpoint.resume: "auto" | path | "none"

    def train(self) -> list[dict]:
        """Run until ``train.steps``; returns every step's record."""
        history = []
        evaluate = self.bleu_evaluator()  # None unless train.eval_steps applies (warns once if it cannot)
        try:
            while self.step < self.cfg.train.steps:
                record = self.train_step()
                if evaluate is not None:
                    evaluate(self.step + 1, record)  # every rank decodes; rank 0's record gets "bleu"
                history.append(record)
                if self.metrics.should_log(self.step) or "bleu" in record:
                    self.metrics.log(record)
                self.step += 1
                self.checkpointer.maybe_save(self.step)
        finally:
            self.metrics.close()
        return history

    def bleu_evaluator(self):
        """BLEU on held-out pairs every ``train.eval_steps`` (paratrain.evaluate.BleuEvaluator), or None."""
        from paratrain.evaluate import BleuEvaluator
        return BleuEvaluator.for_trainer(self)

    def train_step(self) -> dict:
        """One optimizer step; its record gets mfu, memory and (``metrics.breakdown``) the time breakdown."""
        with self.timer.step():
            record = self._train_step()
        record = self.timer.finish(record)
        self.metrics.advance(record)  # progress bar
        return record

    def _train_step(self) -> dict:
        start = time.perf_counter()
        batch = self.data.batch(self.step)
        self.timer.observe_batch(batch)
        num_tokens = self.layout.all_reduce_dp((batch["labels"] != self.cfg.model.ignore_index).sum())
        self.model.train()
        if self.pipeline:
            with loss_context(self.cfg.parallel), autocast(self.cfg.train.mixed_precision), \
                    self.timer.phase("pipeline"):
                loss = self.pipeline.step(batch, {"num_tokens": num_tokens})
        else:
            loss = self._forward_backward(batch, num_tokens)
        loss /= self.layout.dp_size * self.loss_scaler.scale
        self.layout.all_reduce_dp(loss)
        self.layout.all_reduce_pp(loss)  # only the last stage has it
        if not math.isfinite(loss.item()):
            raise TrainingDiverged(f"loss is {loss.item()} at step {self.step + 1}: lower train.lr, "
                                   f"raise train.warmup_steps or check the data")
        lr = self.scheduler.get_last_lr()[0]
        with self.timer.phase("optimizer"):
            self.loss_scaler.unscale_(self.model.parameters())
            counted = self.pipeline.counted_in_norm() if self.pipeline else None
            grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.train.grad_clip, counted,
                                       self.layout.pp_group).item()
            if not self.loss_scaler.update(grad_norm):  # an fp16 overflow skips the update and the LR step
                self.optimizer.step()
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        step_time = time.perf_counter() - start
        tokens = int(num_tokens)
        record = {"step": self.step + 1, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm,
                  "step_time_s": step_time, "tokens": tokens, "tokens_per_s": tokens / step_time,
                  "samples_per_s": self.cfg.train.global_batch_size / step_time}
        if self.loss_scaler.enabled:
            record.update(loss_scale=self.loss_scaler.scale, skipped_steps=self.loss_scaler.skipped_steps)
        return record

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
        """A micro-batch's summed token loss over the global batch's token count, times the data-parallel
        size (gradient reduction averages where a sum is wanted) and the fp16 loss scale."""
        scale = self.layout.dp_size * self.loss_scaler.scale
        return token_loss_sum(logits.float(), labels, self.cfg.model.ignore_index) * (scale / num_tokens)

    def _forward_backward(self, batch: dict[str, torch.Tensor], num_tokens: torch.Tensor) -> torch.Tensor:
        """Gradient accumulation over ``micro_batch_num`` micro-batches; returns the summed (scaled) loss."""
        micro_batches = [dict(zip(batch, parts)) for parts in
                         zip(*(v.chunk(self.cfg.parallel.micro_batch_num) for v in batch.values()))]
        loss = torch.zeros(())
        for i, micro in enumerate(micro_batches):
            self._sync_gradients(last_micro_batch=i == len(micro_batches) - 1)
            labels = micro.pop("labels")
            with loss_context(self.cfg.parallel):
                with self.timer.phase("forward"):
                    with autocast(self.cfg.train.mixed_precision):
                        logits = self.model(**micro)
                    micro_loss = self._loss(logits, labels, num_tokens)
                with self.timer.phase("backward"):
                    micro_loss.backward()
            loss += whole(micro_loss.detach())
        return loss

    def _sync_gradients(self, last_micro_batch: bool) -> None:
        """With ZeRO < 3, reduce gradients once per step, after the last micro-batch."""
        if hasattr(self.model, "set_requires_gradient_sync") and self.cfg.parallel.effective_zero_stage < 3:
            self.model.set_requires_gradient_sync(last_micro_batch)
