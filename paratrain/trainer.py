"""The training loop of one rank: its share of each global batch, micro-batches, AdamW, logging."""
from __future__ import annotations

import math
import time

import torch

from paratrain.config import Config, check
from paratrain.data import ShardedBatches, build_dataset
from paratrain.metrics import MetricsLogger
from paratrain.models import build_model, token_loss_sum
from paratrain.optim import build_optimizer, build_scheduler, clip_grad_norm

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
        self.cfg = check(cfg, world_size=1)
        torch.manual_seed(cfg.run.seed)
        self.model = build_model(cfg.model).to(DTYPES[cfg.model.dtype])
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.data = ShardedBatches(build_dataset(cfg), cfg.train.global_batch_size)
        self.run_dir = cfg.run.path
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg.save(self.run_dir / "config.toml")
        self.metrics = MetricsLogger(self.run_dir, cfg.metrics, cfg.train.steps)
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
        pad = self.cfg.model.pad_token_id
        num_tokens = (batch["labels"] != pad).sum()
        micro_batches = [dict(zip(batch, parts)) for parts in
                         zip(*(v.chunk(self.cfg.parallel.micro_batch_num) for v in batch.values()))]
        self.model.train()
        loss = torch.zeros(())
        for micro in micro_batches:
            labels = micro.pop("labels")
            micro_loss = token_loss_sum(self.model(**micro).float(), labels, pad) / num_tokens
            micro_loss.backward()
            loss += micro_loss.detach()
        if not math.isfinite(loss.item()):
            raise TrainingDiverged(f"loss is {loss.item()} at step {self.step + 1}: lower train.lr, "
                                   f"raise train.warmup_steps or check the data")
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.train.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        step_time = time.perf_counter() - start
        tokens = int(num_tokens)
        return {"step": self.step + 1, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(),
                "step_time_s": step_time, "tokens": tokens, "tokens_per_s": tokens / step_time,
                "samples_per_s": self.cfg.train.global_batch_size / step_time}
