"""The training loop of one rank: its share of each global batch, micro-batches, AdamW, logging."""
from __future__ import annotations

import math
import time

import torch

from torch.distributed.tensor import DTensor

from paratrain.config import Config, check
from paratrain.data import ShardedBatches, build_dataset
from paratrain.distributed import init_from_env
from paratrain.mesh import Layout
from paratrain.metrics import MetricsLogger
from paratrain.models import build_model, token_loss_sum
from paratrain.optim import build_optimizer, build_scheduler, clip_grad_norm
from paratrain.parallel import parallelize
from paratrain.parallel.loss import loss_context
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
        self.cfg = check(cfg, world_size)
        self.layout = Layout(cfg.parallel, world_size)
        torch.manual_seed(cfg.run.seed)  # every rank builds the same full model, then shards it
        model = build_model(cfg.model).to(DTYPES[cfg.model.dtype])
        self.model = parallelize(model, cfg.parallel, self.layout)
        torch.manual_seed(cfg.run.seed + self.layout.dp_rank)  # dropout: shared by tensor-parallel peers
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.loss_scaler = LossScaler(cfg.train.mixed_precision == "fp16", cfg.train.initial_loss_scale)
        self.data = ShardedBatches(build_dataset(cfg), cfg.train.global_batch_size,
                                   self.layout.dp_rank, self.layout.dp_size)
        self.is_main = rank == 0
        self.run_dir = cfg.run.path
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            cfg.save(self.run_dir / "config.toml")
        self.metrics = MetricsLogger(self.run_dir, cfg.metrics, cfg.train.steps, enabled=self.is_main)
        self.step = 0

    def train(self) -> list[dict]:
        """Run until ``train.steps``; returns every step's record."""
        history = []
        try:
            while self.step < self.cfg.train.steps:
                record = self.train_step()
                history.append(record)
                if self.metrics.should_log(self.step):
                    self.metrics.log(record)
                self.step += 1
        finally:
            self.metrics.close()
        return history

    def train_step(self) -> dict:
        start = time.perf_counter()
        batch = self.data.batch(self.step)
        pad, dp_size = self.cfg.model.pad_token_id, self.layout.dp_size
        num_tokens = self.layout.all_reduce_dp((batch["labels"] != pad).sum())
        micro_batches = [dict(zip(batch, parts)) for parts in
                         zip(*(v.chunk(self.cfg.parallel.micro_batch_num) for v in batch.values()))]
        self.model.train()
        loss = torch.zeros(())
        for i, micro in enumerate(micro_batches):
            self._sync_gradients(last_micro_batch=i == len(micro_batches) - 1)
            labels = micro.pop("labels")
            with loss_context(self.cfg.parallel):
                with autocast(self.cfg.train.mixed_precision):
                    logits = self.model(**micro)
                micro_loss = token_loss_sum(logits.float(), labels, pad) / num_tokens
                # data parallel averages gradients where we want their sum
                (micro_loss * (dp_size * self.loss_scaler.scale)).backward()
            loss += _whole(micro_loss.detach())
        self.layout.all_reduce_dp(loss)
        if not math.isfinite(loss.item()):
            raise TrainingDiverged(f"loss is {loss.item()} at step {self.step + 1}: lower train.lr, "
                                   f"raise train.warmup_steps or check the data")
        lr = self.scheduler.get_last_lr()[0]
        self.loss_scaler.unscale_(self.model.parameters())
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.train.grad_clip).item()
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

    def _sync_gradients(self, last_micro_batch: bool) -> None:
        """With ZeRO < 3, reduce gradients once per step, after the last micro-batch."""
        if hasattr(self.model, "set_requires_gradient_sync") and self.cfg.parallel.effective_zero_stage < 3:
            self.model.set_requires_gradient_sync(last_micro_batch)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
