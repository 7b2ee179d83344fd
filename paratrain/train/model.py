"""MindSpore's ``Model(net, loss_fn, optimizer).train(epoch, dataset, callbacks)`` for a user's own net on
this job's layout (``paratrain.parallel.user.place_net``)."""
from __future__ import annotations

import dataclasses
import functools
from contextlib import ExitStack
from typing import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain import loop, progress, run_lock
from paratrain.amp import LossScaleManager, precision_of
from paratrain.auto_parallel import AutoParallel
from paratrain.config import MetricsConfig, ParallelConfig
from paratrain.context import get_auto_parallel_context, parallel_config_for
from paratrain.distributed import init_from_env
from paratrain.engine import Engine
from paratrain.errors import UserError
from paratrain.mesh import Layout
from paratrain.metrics.timer import StepTimer
from paratrain.nn import PipelineCell
from paratrain.parallel.data import shard_optimizer_state
from paratrain.config_rules import fp8_tensor_parallel_problems
from paratrain.preflight import net_memory_problem
from paratrain.precision import LossScaler
from paratrain.train.batches import (BatchCheck, as_batch, batch_position, dataset_shards, endless_batches,
                                     first_batch, ids_per_row, with_last)
from paratrain.train.callbacks import Callback, CallbackParams, ModelCheckpoint, RunContext, SummaryCollector
from paratrain.train.evaluation import Evaluation, eval_shards
from paratrain.train.metrics import get_metrics
from paratrain.train.placement import group_names, parallel_configs, place_by_mode, rebuild_optimizer


class WithLoss(nn.Module):
    """MindSpore's ``WithLossCell``: the loss of ``network(*inputs)`` against the batch's last tensor.

    Under semi-auto parallel a ``loss_fn`` without ``paratrain.ops`` (a torch loss) gets the whole output
    and label rather than sharded ones (DTensors): DTensor's rules for torch losses are not all right
    (torch 2.13: ``mse_loss`` of a row-split prediction and a replicated target doubles the gradient)."""

    def __init__(self, network: nn.Module, loss_fn: nn.Module):
        from paratrain.ops import Primitive

        super().__init__()
        self.network, self.loss_fn = network, loss_fn
        self.whole_tensors = not (isinstance(loss_fn, nn.Module)  # a function is a torch loss too
                                  and any(isinstance(m, Primitive) for m in loss_fn.modules()))

    def forward(self, *batch):
        return self.evaluate(*batch)[0]

    def evaluate(self, *batch) -> tuple:
        """(loss, output, label) of a batch: what MindSpore's ``WithEvalCell`` gives ``Model.eval``'s metrics."""
        output, label = self.network(*batch[:-1]), batch[-1]
        if self.whole_tensors:
            output, label = (t.full_tensor() if isinstance(t, DTensor) else t for t in (output, label))
        return self.loss_fn(output, label), output, label


class _Callbacks(ExitStack):
    """The callbacks of one ``Model.train``, entered together and called in order."""

    def __init__(self, callbacks):
        super().__init__()
        callbacks = [] if callbacks is None else [callbacks] if isinstance(callbacks, Callback) else list(callbacks)
        bad = [type(c).__name__ for c in callbacks if not isinstance(c, Callback)]
        if bad:
            raise UserError(f"Model.train: callbacks must be paratrain.train.Callback objects, got {', '.join(bad)}")
        self.callbacks = callbacks

    def __enter__(self) -> "_Callbacks":
        for callback in self.callbacks:
            self.enter_context(callback)
        return self

    def call(self, hook: str, run_context: RunContext) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(run_context)


class _Training(loop.Face):
    """One ``Model.train`` call in ``paratrain.loop``: its epochs, sinks and resumed position (``steps``) and
    MindSpore's callbacks and step counts around the loop's steps."""

    def __init__(self, model: "Model", hooks: _Callbacks, run_context: RunContext, sink_mode: bool):
        self.model, self.hooks, self.run_context, self.sink_mode = model, hooks, run_context, sink_mode
        self.params = run_context.original_args()
        self.step_ends = True  # whether the step being taken ends a callbacks' step (in sink mode: a sink)

    @property
    def engine(self) -> Engine | None:
        return self.model._engine

    def steps(self, epochs: int, dataset: Iterable, sink_size: int, done: dict):
        """The steps of ``epochs`` epochs over ``dataset`` from the position ``done`` (epoch, step in it), with the
        epoch and step callbacks between them."""
        params, run_context, call = self.params, self.run_context, self.hooks.call
        sinks = self.sink_mode and sink_size > 0
        stream = endless_batches(dataset) if sinks else None
        config = params.parallel_config
        for current in range(done["epoch"] or 1, epochs + 1):  # a resumed run skips the epochs done
            params.update(cur_epoch_num=current, cur_step_in_epoch=0)
            call("on_train_epoch_begin", run_context)
            batches = (next(stream) for _ in range(sink_size)) if sinks else iter(dataset)
            if current == done["epoch"]:
                for _ in range(done["step_in_epoch"]):
                    next(batches, None)
                params.cur_step_in_epoch = done["step_in_epoch"]
            if self.sink_mode:
                call("on_train_step_begin", run_context)
            for batch, self.step_ends in with_last(batches) if self.sink_mode else ((b, True) for b in batches):
                batch = as_batch(batch)  # checked on the host as it is drawn, before its step begins
                self.model._batch_check(batch, config, batch_position(params), params.rows_of_this_rank)
                if not self.sink_mode:
                    call("on_train_step_begin", run_context)
                yield functools.partial(self.model._step, batch, config, params, self.hooks)
                if run_context.get_stop_requested() and not self.sink_mode:
                    break
            if params.cur_step_in_epoch == 0:
                raise UserError(f"Model.train: train_dataset gave no batch in epoch {params.cur_epoch_num}: "
                                f"it must be iterable again each epoch (a list, or an object with __iter__)")
            if params.batch_num is None:
                params.batch_num = params.cur_step_in_epoch
            if self.engine is not None:
                self.engine.flush()
            call("on_train_epoch_end", run_context)
            if run_context.get_stop_requested():
                return

    def after_step(self, record: dict) -> bool:
        loss, params = record["loss"], self.params
        params.net_outputs = loss if isinstance(loss, torch.Tensor) else torch.tensor(loss, device="cpu")
        params.cur_step_num += 1
        params.cur_step_in_epoch += 1
        if self.step_ends:
            self.hooks.call("on_train_step_end", self.run_context)
        return self.step_ends

    def save(self) -> None:
        if self.step_ends:
            for saver in self.hooks.callbacks:
                if isinstance(saver, ModelCheckpoint):
                    saver.save_due(self.run_context)

    def end(self, stopped: bool) -> int | None:
        self.params.exit_requested = stopped
        self.hooks.call("on_train_end", self.run_context)  # ModelCheckpoint saves the last step, stopped or not
        return max((c.last_saved_step for c in self.hooks.callbacks if isinstance(c, ModelCheckpoint)),
                   default=0) or None


def _check_arguments(**arguments) -> None:
    """Refuse ``Model``'s arguments of the wrong kind (the net, the loss, the optimizer), naming them."""
    expected = {"network": ("the net, a torch.nn.Module (or paratrain.AutoParallel)", (nn.Module, AutoParallel)),
                "loss_fn": ("None or a loss, a torch.nn.Module or function of (output, label)", None),
                "optimizer": ("None or a torch.optim.Optimizer built on the net's parameters, e.g. "
                              "torch.optim.AdamW(net.parameters(), lr=1e-3)", (torch.optim.Optimizer,)),
                "eval_network": ("None or a torch.nn.Module", (nn.Module,))}
    for name, value in arguments.items():
        what, kinds = expected[name]
        fits = callable(value) if kinds is None else isinstance(value, kinds)
        if not fits and (value is not None or name == "network"):
            raise UserError(f"Model({name}={value!r:.60}): expected {what}")


def _check_dataset(owner: str, name: str, dataset) -> None:
    """Refuse a dataset that gives no batches by iteration, naming the argument."""
    if isinstance(dataset, (str, bytes, torch.Tensor)) or not hasattr(dataset, "__iter__"):
        raise UserError(f"{owner}({name}={dataset!r:.60}): expected an iterable of batches (tuples of tensors), "
                        f"e.g. a list or a paratrain.data dataset")


class Model:
    """Trains a user's net, as MindSpore's ``Model``, on the layout its blocks' ``TransformerOpParallelConfig``
    and the auto-parallel context describe (``paratrain.context``), with the loss of one device.

    ``network`` returns its loss, or with ``loss_fn`` its output, which ``loss_fn(output, label)`` turns into the loss
    (the label is the batch's last tensor). ``optimizer`` is a plain ``torch.optim`` optimizer built on the unsharded
    net; it is rebuilt on this rank's parameters (``rebuild_optimizer``), its groups' parameters matched by name.
    ``amp_level`` "O1"/"O2"/"O3" computes in bf16 with fp32 weights, as ``train.mixed_precision = "bf16"`` does, or in
    fp16 with loss scaling when a ``loss_scale_manager`` (``paratrain.amp``) is given; "O0" in fp32. Steps run on
    ``paratrain.engine``, as ``paratrain train``'s do. After ``train``, ``train_network`` is the placed net and
    ``optimizer`` the rebuilt optimizer.

    ``metrics`` (a dict {name: ``Metric``}, or a set of names: "acc"/"accuracy", "loss") are what ``eval``
    computes, on the outputs of ``eval_network`` (which shares the network's modules) or, without one, on
    ``(loss_fn(output, label), output, label)`` of the network; ``eval_indexes`` [loss, output, label] say
    which of the eval network's outputs the ``Loss`` metric and the others get (None: all of them to each).
    """

    def __init__(self, network: nn.Module, loss_fn: nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, metrics=None, eval_network: nn.Module | None = None,
                 eval_indexes: list[int] | None = None, amp_level: str = "O0",
                 loss_scale_manager: LossScaleManager | None = None):
        _check_arguments(network=network, loss_fn=loss_fn, optimizer=optimizer, eval_network=eval_network)
        self.metrics = get_metrics(metrics)
        if self.metrics and eval_network is None and loss_fn is None:
            raise UserError("Model(metrics=...) needs an eval_network, or a loss_fn to build one from the network "
                            "(MindSpore's WithEvalCell: the network's output and the batch's last tensor, the label)")
        if eval_indexes is not None and (eval_network is None or not isinstance(eval_indexes, list)
                                         or len(eval_indexes) != 3):
            raise UserError(f"Model(eval_indexes={eval_indexes!r}): give eval_network and a list of 3 indexes, the "
                            f"positions of the loss, the output and the label among its outputs")
        self.eval_network = eval_network
        self.eval_indexes = [0, 1, 2] if eval_network is None else eval_indexes
        self.precision = precision_of(amp_level, loss_scale_manager)
        self.loss_scale_manager = loss_scale_manager
        if isinstance(network, AutoParallel):  # its settings are in the context already
            network = network.network
        self.network, self.loss_fn, self.optimizer = network, loss_fn, optimizer
        self.loss_scaler: LossScaler | None = None  # made with the placed net; kept across train calls
        self._engine: Engine | None = None  # one per train call
        self._parameter_count = sum(p.numel() for p in network.parameters())
        self._flops_per_row: float | None = None  # counted on the net when a SummaryCollector asks for its MFU
        self.train_network = None  # the placed net, from the first batch of ``train`` on
        self._batch_check = BatchCheck(network)
        self._placement: tuple[ParallelConfig, Layout] | None = None  # kept for later ``train`` calls

    def train(self, epoch: int, train_dataset: Iterable, callbacks=None, dataset_sink_mode: bool = False,
              sink_size: int = -1, resume: str = "none", trust_unverified: bool = False) -> None:
        """Train ``epoch`` epochs over ``train_dataset``, an iterable of global batches (tuples of tensors: the net's
        forward arguments, then the label with ``loss_fn``), iterated again each epoch; every rank gives the whole
        global batch and keeps its rows, but for a dataset split per rank (``num_shards`` > 1, as
        ``paratrain.data.cifar_dataset.Cifar10Dataset`` gives): its batches are this rank's rows. Callbacks see
        MindSpore's step counts: ``cur_step_num`` over the run, the step within the epoch in ``cur_step_in_epoch``.
        With ``dataset_sink_mode`` step callbacks run once per sink: a whole epoch, or ``sink_size`` batches per epoch
        drawn on across epochs.

        ``resume``: "none"; "auto", the newest intact checkpoint in the ``ModelCheckpoint``'s directory, if
        any; or a checkpoint's path. The run continues exactly where that one was saved, under any layout:
        weights, optimizer state, random state and the position in the data (the batches of the epochs
        done and of the current epoch up to that step are skipped), with the losses an uninterrupted run
        would have. ``trust_unverified``: resume from a checkpoint of format 1, which records no checksums."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
            raise UserError(f"Model.train: epoch must be a positive int, got {epoch!r}")
        _check_dataset("Model.train", "train_dataset", train_dataset)
        if not isinstance(dataset_sink_mode, bool):
            raise UserError(f"Model.train(dataset_sink_mode={dataset_sink_mode!r}): expected True or False")
        if dataset_sink_mode and (isinstance(sink_size, bool) or not isinstance(sink_size, int)
                                  or (sink_size < 1 and sink_size != -1)):
            raise UserError(f"Model.train: sink_size must be -1 (the whole dataset) or positive, got {sink_size!r}")
        if self.optimizer is None:
            raise UserError("Model.train needs an optimizer: Model(net, optimizer=torch.optim.AdamW(...))")
        rank, world_size = init_from_env()
        progress.start(rank)  # under `paratrain launch`: the job's records show the steps and saves
        config, layout = self._layout_for(world_size)
        shards = dataset_shards("Model.train", config, world_size, train_dataset)
        sinks = dataset_sink_mode and sink_size > 0
        params = CallbackParams(
            network=self.network, train_network=self.train_network, loss_fn=self.loss_fn, optimizer=self.optimizer,
            epoch_num=epoch, batch_num=sink_size if sinks else len(train_dataset) if hasattr(train_dataset, "__len__")
            else None, cur_epoch_num=0, cur_step_num=0, cur_step_in_epoch=0, net_outputs=None,
            train_dataset=train_dataset, dataset_sink_mode=dataset_sink_mode, mode="train", device_number=world_size,
            rank=rank, parallel_mode=get_auto_parallel_context("parallel_mode"), parallel_config=config, layout=layout,
            rows_of_this_rank=shards > 1, exit_requested=False, loss_scaler=self.loss_scaler, step_record=None)
        # one run per checkpoint directory, from before a resume is decided
        locked = [("ModelCheckpoint directory", c.directory) for c in _Callbacks(callbacks).callbacks
                  if isinstance(c, ModelCheckpoint)]
        run_lock.hold(locked)
        try:
            first, train_dataset = first_batch("Model.train", "train_dataset", train_dataset)
            if self.train_network is None:  # placed on the first batch, checked first as its step checks it
                first = as_batch(first)
                self._batch_check(first, config, "batch index 0 of epoch 1", params.rows_of_this_rank)
                summaries = any(isinstance(c, SummaryCollector) for c in _Callbacks(callbacks).callbacks)
                self._place(first, config, layout, params, count_flops=summaries)
            self.train_network.loss.rows_of_this_rank = params.rows_of_this_rank
            done = self._resume(resume, callbacks, dataset_sink_mode, params, trust_unverified)
            training = _Training(self, _Callbacks(callbacks), RunContext(params), dataset_sink_mode)
            self._engine = self._make_engine(layout, training.hooks)
            with training.hooks:
                training.hooks.call("on_train_begin", training.run_context)
                steps = training.steps(epoch, train_dataset, sink_size, done)
                code = loop.exit_code(lambda: loop.run(training, steps, world_size), rank,
                                      "no ModelCheckpoint callback")
        finally:
            for _, directory in locked:
                run_lock.release(directory)
        if code:
            raise SystemExit(code)

    def _resume(self, spec: str, callbacks, sink_mode: bool, params: CallbackParams, trust_unverified: bool) -> dict:
        """Apply ``Model.train``'s ``resume``; returns the saved position (epoch and step in it, 0 for none)."""
        if not isinstance(spec, str) or not spec.strip():
            raise UserError(f"Model.train(resume={spec!r}): expected 'none', 'auto' or a checkpoint's path")
        if spec.strip().lower() == "none":
            return {"epoch": 0, "step_in_epoch": 0}
        savers = [c for c in _Callbacks(callbacks).callbacks if isinstance(c, ModelCheckpoint)]
        if len(savers) != 1:
            raise UserError(f"Model.train(resume={spec!r}) resumes from a ModelCheckpoint's directory: give exactly "
                            f"one ModelCheckpoint callback, not {len(savers)}")
        if sink_mode:
            raise UserError(f"Model.train(resume={spec!r}) with dataset_sink_mode: a sink's batches are not "
                            f"counted per epoch; resume without sink mode")
        return savers[0].resume(params, spec.strip(), bool(trust_unverified))

    def _place(self, batch: tuple, config: ParallelConfig, layout: Layout, params: CallbackParams,
               count_flops: bool = False) -> None:
        """Place the net on the layout (``batch``: an example) and rebuild the optimizer on its shards;
        ``count_flops``: its training FLOPs per row counted first (a ``SummaryCollector``'s MFU)."""
        net = self.network.network if isinstance(self.network, PipelineCell) else self.network
        net = net if self.loss_fn is None else WithLoss(net, self.loss_fn)
        if count_flops:
            self._flops_per_row = _flops_per_row(net, batch, config, params)
        problem = net_memory_problem(net, layout.world_size) or next(iter(fp8_tensor_parallel_problems(
            self.precision, config.model_parallel, "Model(amp_level='fp8')", "the blocks' model_parallel",
            "amp_level='O2' (bf16)")), None)
        if problem:
            raise UserError(f"Model.train: {problem}")
        names = group_names(self.optimizer, net) if self.optimizer is not None else None  # none: only eval
        self.train_network = place_by_mode(net, config, layout, batch, self.precision)
        if isinstance(self.network, PipelineCell):
            self.network.placed = self.train_network
        if self.optimizer is not None:
            self.optimizer = rebuild_optimizer(self.optimizer, names, self.train_network.named_parameters())
            # (a net on op strategies is placed on one device's layout: its optimizer is sharded by placements)
            shard_optimizer_state(self.optimizer, self.train_network.config, self.train_network.layout)
        self.loss_scaler = (self.loss_scale_manager.scaler(layout.device) if self.loss_scale_manager is not None
                            else LossScaler(False, device=layout.device))
        params.update(train_network=self.train_network, optimizer=self.optimizer, loss_scaler=self.loss_scaler)

    def _step(self, batch: tuple, config: ParallelConfig, params: CallbackParams, hooks: "_Callbacks") -> dict:
        """One optimizer step on a global batch (``paratrain.engine``). Returns its record (device values, unless a
        callback reads this step's values). A loss that is no scalar is refused naming the batch (a batch unlike
        the first was, as it was drawn: ``BatchCheck``)."""
        rows = len(batch[0]) * (config.data_parallel if params.rows_of_this_rank else 1)
        tokens = rows * ids_per_row(batch[0])
        flops = (self._flops_per_row * rows if self._flops_per_row is not None
                 else 6.0 * self._parameter_count * tokens)
        fields = {"tokens": tokens, "samples": rows, "flops": flops}
        step = params.cur_step_num + 1
        try:
            record = self._engine.step(step, batch, fields, any(c.needs_host_values(step) for c in hooks.callbacks))
        except UserError as exc:  # a batch that does not split, a loss that is no scalar
            raise UserError(f"Model.train: {batch_position(params)}: {exc}") from None
        params.step_record = record
        return record

    def _make_engine(self, layout: Layout, hooks: "_Callbacks") -> Engine:
        """The engine of one ``train`` call: MFU and the time breakdown only when a SummaryCollector asks."""
        summaries = [c for c in hooks.callbacks if isinstance(c, SummaryCollector)]
        timer = StepTimer(MetricsConfig(breakdown=any(c.breakdown for c in summaries)), device=layout.device,
                          mfu=bool(summaries))
        return Engine(self.train_network, self.optimizer, None, layout, self.loss_scaler, timer,
                      diverged_hint=": lower the learning rate, use a loss_scale_manager with amp_level or check "
                                    "the data")

    def _layout_for(self, world_size: int) -> tuple[ParallelConfig, Layout]:
        """The net's config and layout on ``world_size`` ranks, decided once for every later call."""
        if self._placement is None:
            segments = 1 + max((vars(m).get("pipeline_segment", 0) for m in self.network.modules()
                                if "pipeline_stage" in vars(m)), default=0)
            config = parallel_config_for(parallel_configs(self.network), world_size, segments)
            if isinstance(self.network, PipelineCell):  # MindSpore's micro_size is the micro-batch count
                config = dataclasses.replace(config, micro_batch_num=self.network.micro_size)
            self._placement = config, Layout(config, world_size)
        return self._placement

    def eval(self, valid_dataset: Iterable, callbacks=None, dataset_sink_mode: bool = False) -> dict:
        """MindSpore's ``Model.eval``: ``{name: metric.eval()}`` of the ``metrics`` over ``valid_dataset`` (global
        batches as ``train`` takes them, or a dataset split per rank), in eval mode without gradients, on the
        layout the net was trained on (placed on the first batch when not trained yet). Each data-parallel rank
        evaluates its rows and the metrics' sums are added over the ranks: every rank returns what one process
        would. Callbacks get the ``on_eval_*`` hooks (in sink mode the step hooks once, around the dataset).
        A pipeline (pipeline_stage > 1) is refused: its traced stages end in the loss, not the output."""
        _check_dataset("Model.eval", "valid_dataset", valid_dataset)
        if not self.metrics:
            raise UserError("Model.eval needs metrics: Model(net, loss_fn, optimizer, metrics={'acc': Accuracy(), "
                            "'loss': Loss()})")
        rank, world_size = init_from_env()
        config, layout = self._layout_for(world_size)
        shards = eval_shards(config, world_size, valid_dataset)
        params = CallbackParams(
            network=self.network, eval_network=self.eval_network, valid_dataset=valid_dataset, metrics=self.metrics,
            batch_num=len(valid_dataset) if hasattr(valid_dataset, "__len__") else None, cur_epoch_num=1,
            cur_step_num=0, net_outputs=None, dataset_sink_mode=dataset_sink_mode, mode="eval",
            device_number=world_size, rank=rank, parallel_mode=get_auto_parallel_context("parallel_mode"),
            parallel_config=config, layout=layout)
        run_context = RunContext(params)
        first, valid_dataset = first_batch("Model.eval", "valid_dataset", valid_dataset)
        if self.train_network is None:
            self._place(as_batch(first), config, layout, params)
        evaluation = Evaluation(self.train_network, self.eval_network, self.metrics, self.eval_indexes,
                                self.precision, shards > 1)
        return evaluation.run(valid_dataset, _Callbacks(callbacks), run_context, dataset_sink_mode)


def _flops_per_row(net: nn.Module, batch: tuple, config: ParallelConfig, params: CallbackParams) -> float | None:
    """The training FLOPs of one row of ``net``'s batches (``paratrain.plan.counts.net_train_flops``: as the
    built-in models' are counted), on one micro-batch of this rank as the placed net runs it; None, said on rank 0,
    where the net's forward does not run on tensors without values (MFU then counts 6 x parameters x tokens)."""
    from paratrain.plan.counts import net_train_flops

    parts = config.micro_batch_num * (1 if params.rows_of_this_rank else config.data_parallel)
    rows = max(1, len(batch[0]) // parts)  # (fewer rows than parts: refused by the step)
    micro = tuple(t[:rows] if isinstance(t, torch.Tensor) and t.ndim > 0 else t for t in batch)
    try:
        return net_train_flops(net, micro) / rows
    except Exception as exc:  # noqa: BLE001 -- any op the net runs may need values
        if params.rank == 0:
            print(f"SummaryCollector: the net's FLOPs are taken as 6 x parameters x tokens: its forward does not run "
                  f"on tensors without values ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})", flush=True)
        return None

