"""The TOML face (``paratrain train``): a built-in model, its placement, AdamW, the data, metrics, evaluation and
checkpoints from a Config, trained in ``paratrain.loop`` one step at a time on ``paratrain.engine``."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from torch import nn

from paratrain.checkpoint import Checkpointer
from paratrain.config import Config
from paratrain.data.loader import ShardedBatches, build_dataset
from paratrain.device import DTYPES, device
from paratrain import cluster, config_file, host_memory, loop, preflight, progress, run_lock
from paratrain.distributed import join_group
from paratrain.engine import Engine, TrainingDiverged
from paratrain.evaluate import BleuEvaluator, HeldOutLoss, build_evaluator
from paratrain.mesh import Layout
from paratrain.metrics import MetricsLogger, StepTimer
from paratrain.models import build_model
from paratrain.models.hf import load_hf_weights
from paratrain.lora import add_adapters, hold_base_in
from paratrain.metrics.flops import batch_flops
from paratrain.optim import build_optimizer, build_scheduler
from paratrain.parallel import parallelize, place, shard_optimizer_state
from paratrain.parallel.deferred_init import record_init
from paratrain.parallel.placed import PlacedModel
from paratrain.plan.cost import layer_costs, tokens_per_rank
from paratrain.precision import LossScaler, resolve_mixed_precision

__all__ = ["Started", "Trainer", "TrainingDiverged", "start"]


class Started(NamedTuple):
    """What :func:`start` returns: the run's Config (resolved), this process's rank and the job's layout."""

    cfg: Config
    rank: int
    layout: Layout


def start(config: Config | Callable[[int], Config], plan: Callable[[Config, int], object] | None = None) -> Started:
    """Start a run once in this process: the launcher's variables filled (``paratrain.cluster``), ``config`` (a
    Config, or what makes it for the job's size: ``paratrain train``'s DeepSpeed batch rule needs it) resolved in
    place for this device and checked (``paratrain.preflight``, unless ``paratrain launch`` checked that same config
    for this rank), the process group joined and, given ``plan`` (``paratrain train``:
    ``paratrain.plan.resolve_auto``), ``parallel.auto``'s layout chosen for the group's size and checked."""
    cluster.fill_env()
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = config(ranks) if callable(config) else config
    planned = plan is not None and cfg.parallel.auto
    checked = preflight.launcher_checked(cfg, ranks, resolved=not planned)  # the config as the launcher loaded it
    precision_asked = cfg.train.mixed_precision
    cfg.train.mixed_precision = resolve_mixed_precision(precision_asked, device())
    if not checked:
        preflight.check(cfg, ranks, resolved=not planned)
    rank, world_size = join_group(offload=cfg.parallel.offloads)
    progress.start(rank)
    if planned:
        plan(cfg, world_size)
        preflight.check(cfg, world_size, resolved=True)  # the layout the plan chose
    layout = Layout(cfg.parallel, world_size)
    if rank == 0:
        print(f"precision: {cfg.train.mixed_precision} on {layout.device} (train.mixed_precision = "
              f"{precision_asked!r})", flush=True)
    return Started(cfg, rank, layout)


class Trainer(loop.Face):
    """Trains the model a Config describes and logs one record per step. ``run``: the Config (the trainer starts
    the run: ``start(cfg)``, ``parallel.auto`` already resolved) or what ``start`` returned (``paratrain train``,
    which starts it with the planner). A step's loss is the global batch's token mean however the batch is split
    (``PlacedModel``); its device values come to the host only at logged, saved, evaluated and last steps
    (``paratrain.engine``), so other steps do not wait."""

    cfg: Config  # resolved by ``start``
    layout: Layout
    device: torch.device
    is_main: bool  # rank 0: prints, logs and writes the run directory's config
    locked: list[tuple[str, Path]]  # (key, directory): locked for this run from its start
    placed: PlacedModel  # this rank's model chunks (one without a pipeline), their pipeline and step
    model: nn.Module  # every parameter of this rank as one module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loss_scaler: LossScaler
    data: ShardedBatches
    metrics: MetricsLogger
    timer: StepTimer
    checkpointer: Checkpointer
    evaluator: HeldOutLoss | BleuEvaluator | None  # train.eval_steps: a decoder's held-out loss, or BLEU
    engine: Engine
    step: int  # the steps done, resumed ones included
    stopped_at: int | None  # the step saved when a stop was asked (SIGTERM/SIGINT)
    history: list[dict]  # the records of the last train()

    def __init__(self, run: Config | Started):
        cfg, rank, self.layout = run if isinstance(run, Started) else start(run)
        self.cfg, self.device, self.is_main = cfg, self.layout.device, rank == 0
        # one run per directory, from before anything is written there or a resume is decided
        self.locked = [("run.dir", cfg.run.path), ("checkpoint.dir", cfg.checkpoint_path)]
        run_lock.hold(self.locked)
        # the model is built on the meta device, placed, and only this rank's shards are materialized, with the
        # values a plain build from this seed has (paratrain.parallel.deferred_init)
        torch.manual_seed(cfg.run.seed)
        record = record_init(lambda: add_adapters(build_model(cfg.model), cfg.lora))
        model = record.model.to(DTYPES[cfg.model.dtype])
        if cfg.lora.enabled and cfg.lora.base_dtype != "float32":
            hold_base_in(model, DTYPES[cfg.lora.base_dtype])
        costs = layer_costs(cfg.model) if cfg.parallel.pipeline_stage > 1 else None  # what a pipeline balances
        self.placed = place(model, cfg.parallel, self.layout, parallelize, precision=cfg.train.mixed_precision,
                            init=record, model_config=cfg.model, compile_layers=cfg.train.compile, layer_costs=costs,
                            tokens_per_rank=tokens_per_rank(cfg, self.layout.dp_size),
                            # offloaded parameters are made on the host (FSDP2 pins them), never whole on the device
                            params_on=torch.device("cpu") if cfg.parallel.offloads else None)
        self.model = self.placed.model
        torch.manual_seed(cfg.run.seed + self.layout.dp_rank)  # dropout: shared by tensor-parallel peers
        self.optimizer = build_optimizer(self.model, cfg.train)
        shard_optimizer_state(self.optimizer, self.layout.config, self.layout)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        t = cfg.train
        self.loss_scaler = LossScaler(t.mixed_precision == "fp16", t.initial_loss_scale, t.loss_scale_window,
                                      t.min_loss_scale, t.max_skipped_steps, t.loss_scale_hysteresis,
                                      t.consecutive_hysteresis, self.device)
        self.data = ShardedBatches(build_dataset(cfg), cfg.train.global_batch_size, self.layout.dp_rank,
                                   self.layout.dp_size, self.device,
                                   cfg.model.pad_token_id if cfg.model.spec.encoder_decoder else None)
        if self.is_main and hasattr(self.data.source, "summary"):
            print(self.data.source.summary(), flush=True)
        if self.is_main and self.data.sampler is not None and self.data.sampler.lengths is not None:
            steps = min(cfg.train.steps, 1000)
            print(f"data: {self.data.sampler.padding_fraction(steps):.1%} padding in the first {steps} global batches "
                  f"padded to their longest example (bucket_size={cfg.data.bucket_size})", flush=True)
        cfg.run.path.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            config_file.save(cfg, cfg.run.path / "config.toml")
        self.metrics = MetricsLogger(cfg.run.path, cfg.metrics, cfg.train.steps, enabled=self.is_main)
        self.timer = StepTimer(cfg.metrics, self.placed.pipeline, self.device)
        if self.is_main:
            print(f"mfu: peak {self.timer.peak_tflops:.4g} TFLOP/s for the job ({self.timer.peak_source})", flush=True)
            if self.device.type == "cpu":
                print(f"host memory: {host_memory.describe()}", flush=True)
        self.checkpointer = Checkpointer(cfg, self.layout, self.placed.parts, self.optimizer, self.scheduler,
                                         {"loss_scaler": self.loss_scaler, "data": self.data})
        self.step = self.checkpointer.resume()  # checkpoint.resume: "auto" | path | "none"
        # a resumed run goes on from its own checkpoint, which holds a frozen base only when no from_hf has it
        if cfg.model.from_hf and (self.step == 0 or not self.checkpointer.saves_frozen):
            with torch.device("meta"):
                whole = build_model(cfg.model)
            load_hf_weights(self.placed.parts, whole, cfg.model.from_hf)
        self.evaluator = build_evaluator(cfg, self.placed, self.is_main)
        self.stopped_at = None
        self.history = []
        self.engine = Engine(self.placed, self.optimizer, self.scheduler, self.layout, self.loss_scaler, self.timer,
                             grad_clip=cfg.train.grad_clip,
                             diverged_hint=": lower train.lr, raise train.warmup_steps or check the data")

    def train(self) -> list[dict]:
        """Run until ``train.steps``, or until a stop is asked (SIGTERM/SIGINT on any rank: every rank stops
        at the same step, saves it and sets ``stopped_at``; ``paratrain.loop``); returns every step's record.
        With checkpoints on (``checkpoint.save_steps``) the last step is always saved."""
        self.run()
        return self.history

    def run(self) -> loop.Outcome:
        """``train``, returning how the run ended (``paratrain.loop.exit_code`` makes it ``paratrain train``'s)."""
        self.history = []
        steps = (self.train_step for _ in range(self.step, self.cfg.train.steps))
        outcome = loop.run(self, steps, self.layout.world_size)
        self.stopped_at = self.step if outcome.stopped else None
        return outcome

    def train_step(self) -> dict:
        """One optimizer step (``paratrain.engine``), its record's device values brought over when it needs them."""
        step = self.step + 1
        to_host = (self.metrics.should_log(step - 1) or self.checkpointer.due(step) or step == self.cfg.train.steps
                   or (self.evaluator is not None and self.evaluator.due(step)))
        batch = self.data.batch(self.step)
        with self.engine.between_steps():  # counted on the model once for each batch shape: no step's time
            flops = batch_flops(self.cfg.model, batch, self.layout.dp_size)
        return self.engine.step(step, batch, {"samples": self.cfg.train.global_batch_size, "flops": flops}, to_host)

    # the loop's Face: metrics, evaluation and checkpoints between steps
    def after_step(self, record: dict) -> bool:
        self.history.append(record)
        self.step += 1
        self.metrics.advance(self.step)
        evaluated = self.evaluator is not None and self.evaluator.due(self.step)
        if evaluated:
            self.evaluator(self.step, record)  # every rank evaluates; the main rank's record gets the results
        if self.metrics.should_log(self.step - 1) or evaluated:
            self.metrics.log(record)
        return True

    def save(self) -> None:
        self.checkpointer.maybe_save(self.step)

    def end(self, stopped: bool) -> int | None:
        if (stopped or self.cfg.checkpoint.save_steps > 0) and self.checkpointer.last_saved_step != self.step:
            self.checkpointer.save(self.step)
        return self.checkpointer.last_saved_step or None

    def close(self) -> None:
        self.metrics.close()
        for _, directory in self.locked:
            run_lock.release(directory)
        if self.is_main and self.loss_scaler.skipped_steps:
            print(f"fp16: {self.loss_scaler.summary()}", flush=True)
