"""MindSpore's ``Model(net, loss_fn, optimizer).train(epoch, dataset, callbacks)`` for a user's own net on
this job's layout (``paratrain.parallel.user.place_net``)."""
from __future__ import annotations

import dataclasses
import functools
import inspect
from contextlib import ExitStack
from typing import Iterable

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain import loop, progress, run_lock
from paratrain.amp import LossScaleManager, precision_of
from paratrain.auto_parallel import AutoParallel
from paratrain.config import MetricsConfig, ParallelConfig
from paratrain.context import GRAPH_MODE, ParallelMode, get_auto_parallel_context, get_context, parallel_config_for
from paratrain.distributed import init_from_env
from paratrain.engine import Engine
from paratrain.errors import UserError
from paratrain.mesh import Layout
from paratrain.modules.moe import MoE
from paratrain.metrics.timer import StepTimer
from paratrain.nn import PipelineCell
from paratrain.optim import tensor_kind
from paratrain.parallel.data import shard_optimizer_state
from paratrain.parallel.deferred_init import deferred_record, materialize
from paratrain.parallel.expert import moe_step_metrics
from paratrain.parallel.user import PlacedNet, place_net
from paratrain.preflight import net_memory_problem
from paratrain.precision import LossScaler, autocast, convert_to_fp8
from paratrain.train.callbacks import Callback, CallbackParams, ModelCheckpoint, RunContext, SummaryCollector
from paratrain.train.metrics import (check_reducible, eval_rows, evaluating, get_metrics, global_loss,
                                     reduce_metrics, update_metrics)


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


def parallel_configs(network: nn.Module) -> list[ParallelConfig]:
    """The distinct ``TransformerOpParallelConfig`` objects held by the net's modules (its blocks')."""
    found: dict[int, ParallelConfig] = {}
    for module in network.modules():
        for value in vars(module).values():
            if isinstance(value, ParallelConfig):
                found.setdefault(id(value), value)
    return list(found.values())


def group_names(optimizer: torch.optim.Optimizer, net: nn.Module) -> list[list[str]]:
    """The names in ``net`` of each parameter group's parameters (every name of a shared one); call it before
    placing the net, which replaces its parameters."""
    if optimizer.state:
        raise UserError("Model: the optimizer has taken steps already; paratrain rebuilds it on this rank's "
                        "parameters without its state: give Model a fresh optimizer")
    names: dict[int, list[str]] = {}
    for name, param in net.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    groups = []
    for group in optimizer.param_groups:
        foreign = [list(p.shape) for p in group["params"] if id(p) not in names]
        if foreign:
            raise UserError(f"Model: the optimizer holds parameters of shapes {foreign} that are not in the "
                            f"network: build the optimizer on the network's parameters")
        groups.append([name for p in group["params"] for name in names[id(p)]])
    return groups


def rebuild_optimizer(optimizer: torch.optim.Optimizer, names: list[list[str]],
                      named_parameters) -> torch.optim.Optimizer:
    """``optimizer`` (built on the unsharded net) built again, same class, groups and hyperparameters, on this
    rank's ``named_parameters`` (name in the whole net, parameter); ``names``: its groups' parameter names
    (``group_names``). A group with no parameter here is dropped; a group holding both plain and sharded
    tensors is split by tensor kind, which multi-tensor kernels cannot mix. On CUDA a torch Adam or AdamW
    left to torch's default kernels gets the fused one (``fused_where_equal``)."""
    group_of = {name: index for index, group in enumerate(names) for name in group}
    placed: list[dict[object, list[tuple[str, torch.Tensor]]]] = [{} for _ in optimizer.param_groups]
    seen: set[int] = set()
    for name, param in named_parameters:
        if name in group_of and id(param) not in seen:
            seen.add(id(param))
            placed[group_of[name]].setdefault(tensor_kind(param), []).append((name, param))
    groups = []
    for group, kinds in zip(optimizer.param_groups, placed):
        options = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        for members in kinds.values():
            groups.append({**options, "params": [p for _, p in members]}
                          | ({"param_names": [n for n, _ in members]} if "param_names" in group else {}))
    accepted = inspect.signature(type(optimizer).__init__).parameters
    options = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    fused = fused_where_equal(optimizer, options, groups)
    return type(optimizer)([group | fused for group in groups], **(options | fused))


# torch optimizers whose fused CUDA kernel computes the update of their default (foreach) one, in one pass that
# also divides the gradients (``paratrain.optim.step_dividing``'s ``grad_scale``)
FUSED_EQUIVALENT = (torch.optim.Adam, torch.optim.AdamW)


def fused_where_equal(optimizer: torch.optim.Optimizer, options: dict, groups: list[dict]) -> dict:
    """``{"fused": True}`` for a torch Adam or AdamW whose user chose neither ``foreach`` nor ``fused`` (nor
    ``differentiable``) over plain CUDA parameters: the same update as torch's default kernels; else nothing."""
    chosen = [options] + [{k: g[k] for k in ("foreach", "fused", "differentiable") if k in g} for g in groups]
    params = [p for group in groups for p in group["params"]]
    if (type(optimizer) not in FUSED_EQUIVALENT or not params
            or any(c.get("foreach") is not None or c.get("fused") is not None or c.get("differentiable")
                   for c in chosen)):
        return {}
    plain_cuda = all(type(p) is nn.Parameter and p.is_cuda and p.dtype in (torch.float32, torch.bfloat16,
                                                                             torch.float16) for p in params)
    return {"fused": True} if plain_cuda else {}


def place(net: nn.Module, config: ParallelConfig, layout: Layout, batch: tuple, precision: str = "none"):
    """``net`` placed as the context's ``parallel_mode`` says: whole on every rank with its own collectives
    (hybrid), op by op on its strategies (semi-auto or auto parallel with ``paratrain.ops``), else by
    ``place_net`` (the blocks' plans, pipeline, data parallel). A net built under ``no_init_parameters`` is placed
    on the meta device and only this rank's shards are made (``place_net``; the others materialise it whole
    first). With ``precision`` "fp8" its Linear layers are made fp8 ones first (``convert_to_fp8``)."""
    if precision == "fp8":
        convert_to_fp8(net)
    on_meta = any(p.is_meta for p in net.parameters())
    deferred = deferred_record(net) if on_meta else None
    if on_meta and deferred is None:
        raise UserError("Model: the net's parameters are on the meta device but it was not built under "
                        "paratrain.no_init_parameters(), so nothing says how to initialise them")
    from paratrain.ops import Primitive

    mode, of_ops = get_auto_parallel_context("parallel_mode"), any(isinstance(m, Primitive) for m in net.modules())
    graph_mode = get_context("mode") == GRAPH_MODE
    if graph_mode and (mode == ParallelMode.HYBRID_PARALLEL or of_ops):
        raise UserError("set_context(mode=GRAPH_MODE) compiles the layers of a net of paratrain.nn blocks or "
                        "torch modules; a hybrid-parallel net or one of paratrain.ops runs in PYNATIVE_MODE")
    if graph_mode and config.pipeline_stage > 1:
        raise UserError("set_context(mode=GRAPH_MODE) with pipeline stages: a traced stage runs its layers "
                        "inlined, so they cannot be compiled one by one; use PYNATIVE_MODE with pipeline_stages")
    if get_auto_parallel_context("parameter_broadcast") and layout.world_size > 1 and not on_meta:
        # (a deferred build is replayed from one random state on every rank: nothing to broadcast)
        broadcast_parameters(net.to(layout.device))  # on its device first: NCCL broadcasts only GPU tensors
    if mode == ParallelMode.HYBRID_PARALLEL:
        from paratrain.train.parallel_modes.hybrid import HybridNet

        _materialize([net], deferred, layout.device)
        return HybridNet(net, config, layout, precision)
    if mode in (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL) and layout.world_size > 1 and of_ops:
        from paratrain.train.parallel_modes.semi_auto import place_semi_auto

        if config.model_parallel > 1 or config.pipeline_stage > 1:
            raise UserError("Model: the net mixes paratrain.ops strategies with blocks given model_parallel or "
                            "pipeline_stage; give the ops strategies only, or use the blocks without ops")
        choose = None
        if mode == ParallelMode.AUTO_PARALLEL:
            from paratrain.train.parallel_modes.auto import StrategyChooser

            choose = StrategyChooser.from_context(layout.world_size)
        _materialize([net], deferred, layout.device)
        return place_semi_auto(net, batch, layout.device, layout.world_size, config, choose, precision)
    placed = place_net(net, config, layout, batch, precision, compile_layers=graph_mode)
    _materialize(placed.parts, deferred, layout.device)
    return placed


def _materialize(parts: list[nn.Module], deferred: tuple | None, device: torch.device) -> None:
    """Make the meta ``parts`` on ``device`` with the values the recorded build (``deferred``; None: not deferred,
    nothing to make) draws from its random state."""
    if deferred is None:
        return
    record, state = deferred
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state)
        materialize(parts, record, device)


@torch.no_grad()
def broadcast_parameters(net: nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers (MindSpore's ``parameter_broadcast``), but a
    ``layerwise_parallel`` parameter, which is each rank's own slice."""
    import torch.distributed as dist

    for tensor in [*net.parameters(), *net.buffers()]:
        if not getattr(tensor, "layerwise_parallel", False):
            dist.broadcast(tensor.data, src=0)


def _as_batch(batch) -> tuple:
    """A dataset's batch as a tuple, its NumPy arrays (what MindSpore's datasets give) as tensors."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        batch = (batch,)
    if isinstance(batch, (tuple, list)):
        return tuple(torch.from_numpy(t) if isinstance(t, np.ndarray) else t for t in batch)
    raise UserError(f"Model.train: a batch must be a tuple of tensors (the net's forward arguments), got "
                    f"{type(batch).__name__}")


def _ids_per_row(first) -> int:
    """The tokens of a row of a batch whose first tensor is ``first``: its ids per row when it holds integer
    ids, else 1 (a row is one sample)."""
    if isinstance(first, torch.Tensor) and first.ndim > 1 and not first.is_floating_point():
        return first.shape[1:].numel()
    return 1


def _kind(value) -> tuple[str, tuple[int, ...] | None]:
    """(dtype, shape) of a tensor of a batch; (type name, None) of anything else."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch."), tuple(value.shape)
    return type(value).__name__, None


def _kinds_text(kinds: list) -> str:
    return "(" + ", ".join(name if shape is None else f"{list(shape)} {name}" for name, shape in kinds) + ")"


def _alike(kinds: list, first: list, rows_may_differ: bool) -> bool:
    """Whether a batch of ``kinds`` is like the first batch: the same tensors, dtypes and shapes, but for the
    rows (the first dimension) when ``rows_may_differ``."""

    def compared(kind):
        name, shape = kind
        return name, shape if shape is None or not rows_may_differ else (len(shape), shape[1:])

    return [compared(k) for k in kinds] == [compared(k) for k in first]


def _declared_shape_problem(net: nn.Module, first: torch.Tensor) -> str | None:
    """What is wrong with a first batch whose first tensor is ``first`` (the net's input: ids (B, T) or hidden
    states (B, T, H)) for the ``batch_size`` and sequence lengths the net's attention blocks were built with; None
    when they declare none or it fits. A length one longer than declared is an input the net shifts itself."""
    from paratrain.nn.layers import MultiHeadAttention

    blocks = [m for m in net.modules() if isinstance(m, MultiHeadAttention)]
    batch_sizes = {m.batch_size for m in blocks}
    lengths = sorted({n for m in blocks for n in (m.src_seq_length, m.tgt_seq_length)})
    if not blocks or first.ndim < 2 or len(batch_sizes) != 1:
        return None
    (batch_size,) = batch_sizes
    if first.shape[0] != batch_size:
        return (f"its first tensor has {first.shape[0]} rows, but the net's blocks were built with batch_size="
                f"{batch_size}: give batches of {batch_size} rows or build the blocks with batch_size="
                f"{first.shape[0]}")
    if first.shape[1] not in lengths and first.shape[1] - 1 not in lengths:
        return (f"its first tensor has length {first.shape[1]}, but the net's blocks were built with sequence "
                f"lengths {lengths}: give sequences of that length or build the blocks with it")
    return None


def _token_problem(net: nn.Module, batch: tuple) -> str | None:
    """An id of the batch's integer (B, T) tensors on the host that no embedding table of the net has a row for
    (it would end the step in an IndexError); None when there is none (the tensors on a device are not read: that
    would wait for the device every step)."""
    vocab = max((m.num_embeddings for m in net.modules() if isinstance(m, nn.Embedding)), default=None)
    if vocab is None:
        return None
    for index, tensor in enumerate(batch):
        if (isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and tensor.ndim >= 2
                and not tensor.is_floating_point() and tensor.dtype != torch.bool and tensor.numel()):
            largest = int(tensor.max())
            if largest >= vocab:
                return (f"tensor {index} holds id {largest}, but the net's largest embedding table has vocab_size="
                        f"{vocab} rows (ids 0..{vocab - 1}): build the embedding with a larger vocab_size or "
                        f"fix the data")
    return None


class _Callbacks:
    """The callbacks of one ``Model.train``, entered together and called in order."""

    def __init__(self, callbacks):
        callbacks = [] if callbacks is None else [callbacks] if isinstance(callbacks, Callback) else list(callbacks)
        bad = [type(c).__name__ for c in callbacks if not isinstance(c, Callback)]
        if bad:
            raise UserError(f"Model.train: callbacks must be paratrain.train.Callback objects, got {', '.join(bad)}")
        self.callbacks = callbacks
        self._stack = ExitStack()

    def __enter__(self) -> "_Callbacks":
        for callback in self.callbacks:
            self._stack.enter_context(callback)
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def call(self, hook: str, run_context: RunContext) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(run_context)


def _stream(dataset: Iterable):
    """The batches of ``dataset`` without end, iterating it again whenever it runs out."""
    while True:
        empty = True
        for batch in dataset:
            empty = False
            yield batch
        if empty:
            raise UserError("Model.train: train_dataset gave no batch")


_END = object()


def _with_last(items: Iterable):
    """(item, whether it is the last) of each of ``items``, drawing each one a step ahead."""
    items = iter(items)
    current = next(items, _END)
    while current is not _END:
        following = next(items, _END)
        yield current, following is _END
        current = following


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
        stream = _stream(dataset) if sinks else None
        config, layout = params.parallel_config, params.layout
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
            for batch, self.step_ends in _with_last(batches) if self.sink_mode else ((b, True) for b in batches):
                if not self.sink_mode:
                    call("on_train_step_begin", run_context)
                yield functools.partial(self.model._step, _as_batch(batch), config, layout, params, self.hooks)
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

    ``network`` returns its loss, or with ``loss_fn`` its output, which ``loss_fn(output, label)`` turns
    into the loss (the label is the batch's last tensor). ``optimizer`` is a plain ``torch.optim``
    optimizer built on the unsharded net; it is rebuilt on this rank's parameters (``rebuild_optimizer``),
    its groups' parameters matched by name.
    ``amp_level`` "O1"/"O2"/"O3" computes in bf16 with fp32 weights, as ``train.mixed_precision = "bf16"``
    does, or in fp16 with loss scaling when a ``loss_scale_manager`` (``paratrain.amp``) is given; "O0" in fp32.
    Steps run on ``paratrain.engine``, as ``paratrain train``'s do.
    After ``train``, ``train_network`` is the placed net and ``optimizer`` the rebuilt optimizer.

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
        self.train_network = None  # the placed net, from the first batch of ``train`` on
        self._first_batch: list | None = None  # the (dtype, shape) of each tensor of the batch it was placed with
        self._placement: tuple[ParallelConfig, Layout] | None = None  # kept for later ``train`` calls

    def train(self, epoch: int, train_dataset: Iterable, callbacks=None, dataset_sink_mode: bool = False,
              sink_size: int = -1, resume: str = "none", trust_unverified: bool = False) -> None:
        """Train ``epoch`` epochs over ``train_dataset``, an iterable of global batches (tuples of tensors: the
        net's forward arguments, then the label with ``loss_fn``), iterated again each epoch; every rank
        gives the whole global batch and keeps its rows, but for a dataset split per rank (``num_shards`` > 1,
        as ``paratrain.data.cifar_dataset.Cifar10Dataset`` gives): its batches are this rank's rows.
        Callbacks see MindSpore's step counts: ``cur_step_num``
        over the run, the step within the epoch in ``cur_step_in_epoch``. With ``dataset_sink_mode`` step
        callbacks run once per sink: a whole epoch, or ``sink_size`` batches per epoch drawn on across
        epochs.

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
        shards = getattr(train_dataset, "num_shards", None) or 1
        if shards > 1 and not shards == config.data_parallel == world_size:
            raise UserError(f"Model.train: the dataset is split into num_shards={shards} for {world_size} ranks, "
                            f"{config.data_parallel} of them data-parallel: a dataset split per rank needs "
                            f"num_shards=get_group_size() and no model or pipeline parallelism")
        sinks = dataset_sink_mode and sink_size > 0
        params = CallbackParams(
            network=self.network, train_network=self.train_network, loss_fn=self.loss_fn, optimizer=self.optimizer,
            epoch_num=epoch, batch_num=sink_size if sinks else len(train_dataset) if hasattr(train_dataset, "__len__")
            else None,
            cur_epoch_num=0, cur_step_num=0, cur_step_in_epoch=0, net_outputs=None, train_dataset=train_dataset,
            dataset_sink_mode=dataset_sink_mode, mode="train", device_number=world_size, rank=rank,
            parallel_mode=get_auto_parallel_context("parallel_mode"), parallel_config=config, layout=layout,
            rows_of_this_rank=shards > 1, exit_requested=False, loss_scaler=self.loss_scaler, step_record=None)
        self._engine = None
        # one run per checkpoint directory, from before a resume is decided
        locked = [("ModelCheckpoint directory", c.directory) for c in _Callbacks(callbacks).callbacks
                  if isinstance(c, ModelCheckpoint)]
        run_lock.hold(locked)
        try:
            done = self._resume(resume, train_dataset, callbacks, dataset_sink_mode, config, layout, params,
                                trust_unverified)
            training = _Training(self, _Callbacks(callbacks), RunContext(params), dataset_sink_mode)
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

    def _resume(self, spec: str, dataset: Iterable, callbacks, sink_mode: bool, config: ParallelConfig,
                layout: Layout, params: CallbackParams, trust_unverified: bool) -> dict:
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
        first = next(iter(dataset), None)
        if first is None:
            raise UserError("Model.train: train_dataset gave no batch")
        if self.train_network is None:
            self._place(_as_batch(first), config, layout, params)
        return savers[0].resume(params, spec.strip(), bool(trust_unverified))

    def _place(self, batch: tuple, config: ParallelConfig, layout: Layout, params: CallbackParams) -> None:
        """Place the net on the layout (``batch``: an example) and rebuild the optimizer on its shards."""
        net = self.network.network if isinstance(self.network, PipelineCell) else self.network
        net = net if self.loss_fn is None else WithLoss(net, self.loss_fn)
        problem = net_memory_problem(net, layout.world_size)
        if problem:
            raise UserError(f"Model.train: {problem}")
        names = group_names(self.optimizer, net) if self.optimizer is not None else None  # none: only eval
        self.train_network = place(net, config, layout, batch, self.precision)
        if isinstance(self.network, PipelineCell):
            self.network.placed = self.train_network
        if self.optimizer is not None:
            self.optimizer = rebuild_optimizer(self.optimizer, names, self.train_network.named_parameters())
            if isinstance(self.train_network, PlacedNet):  # semi-auto shards its optimizer by placements
                shard_optimizer_state(self.optimizer, config, layout)
        self.loss_scaler = (self.loss_scale_manager.scaler(layout.device) if self.loss_scale_manager is not None
                            else LossScaler(False, device=layout.device))
        params.update(train_network=self.train_network, optimizer=self.optimizer, loss_scaler=self.loss_scaler)

    def _check_batch(self, batch: tuple, config: ParallelConfig, where: str, rows_of_this_rank: bool) -> None:
        """Refuse, before it runs, a batch unlike the first (its tensors' count, dtypes and shapes; the rows may differ,
        as in a last, smaller batch, except under a pipeline, traced with the first batch's shapes), a first batch
        unlike the blocks' declared shapes (unless each rank reads its own rows: ``rows_of_this_rank``), and ids
        beyond the net's embedding tables."""
        kinds = [_kind(t) for t in batch]
        problem = _token_problem(self.network, batch)
        if self._first_batch is None and problem is None and not rows_of_this_rank:
            problem = isinstance(batch[0], torch.Tensor) and _declared_shape_problem(self.network, batch[0])
        if problem:
            raise UserError(f"Model.train: {where}: {problem}")
        if self._first_batch is None:
            self._first_batch = kinds
        elif not _alike(kinds, self._first_batch, rows_may_differ=config.pipeline_stage == 1):
            rows = "" if config.pipeline_stage == 1 else " (a pipeline's rows too)"
            raise UserError(f"Model.train: {where} is {_kinds_text(kinds)}, unlike the first batch "
                            f"{_kinds_text(self._first_batch)}: give every batch the first one's tensors, dtypes "
                            f"and shapes{rows}")

    def _step(self, batch: tuple, config: ParallelConfig, layout: Layout, params: CallbackParams,
              hooks: "_Callbacks") -> dict:
        """One optimizer step on a global batch (``paratrain.engine``); places the net on the first. Returns its
        record (device values, unless a callback reads this step's values). A batch unlike the first, or a loss
        that is no scalar, is refused naming the batch."""
        where = f"batch index {params.cur_step_in_epoch} of epoch {params.cur_epoch_num}"
        self._check_batch(batch, config, where, params.rows_of_this_rank)
        if self.train_network is None:
            self._place(batch, config, layout, params)
        if self._engine is None:
            self._engine = self._make_engine(layout, hooks)
        summed = params.parallel_mode == ParallelMode.DATA_PARALLEL and not get_auto_parallel_context("gradients_mean")
        rows = len(batch[0]) * (config.data_parallel if params.rows_of_this_rank else 1)
        tokens = rows * _ids_per_row(batch[0])

        net = self.train_network.parts[0]  # a mixture of experts' aux loss: in the net's own loss, reported too

        def run(loss_scale: torch.Tensor) -> dict:
            try:
                out = self.train_network.forward_backward(batch, loss_scale, params.rows_of_this_rank)
            except UserError as exc:  # a batch that does not split, a loss that is no scalar
                raise UserError(f"Model.train: {where}: {exc}") from None
            if summed:  # MindSpore's default: the ranks' gradients summed (in the engine's optimizer step)
                out["grad_scale"] = out.get("grad_scale", 1.0) * config.data_parallel
            return {**out, "tokens": tokens, "samples": rows, "flops": 6.0 * self._parameter_count * tokens,
                    **moe_step_metrics(net, layout, any(isinstance(m, MoE) for m in net.modules()))}

        step = params.cur_step_num + 1
        record = self._engine.step(step, run, any(c.needs_host_values(step) for c in hooks.callbacks))
        params.step_record = record
        return record

    def _make_engine(self, layout: Layout, hooks: "_Callbacks") -> Engine:
        """The engine of one ``train`` call: MFU and the time breakdown only when a SummaryCollector asks."""
        summaries = [c for c in hooks.callbacks if isinstance(c, SummaryCollector)]
        timer = StepTimer(MetricsConfig(breakdown=any(c.breakdown for c in summaries)), device=layout.device,
                          mfu=bool(summaries))
        self.train_network.phase = timer.phase
        return Engine(self.train_network.parts, self.optimizer, None, layout, self.loss_scaler, timer,
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
        if config.pipeline_stage > 1:
            raise UserError(f"Model.eval: pipeline_stage={config.pipeline_stage}: the traced stages of a pipeline end "
                            f"in the loss, so the metrics cannot see the network's output; evaluate the trained "
                            f"weights in a net placed without pipeline stages (load_checkpoint + load_param_into_net)")
        shards = getattr(valid_dataset, "num_shards", None) or 1
        if shards > 1 and not shards == config.data_parallel == world_size:
            raise UserError(f"Model.eval: the dataset is split into num_shards={shards} for {world_size} ranks, "
                            f"{config.data_parallel} of them data-parallel: a dataset split per rank needs "
                            f"num_shards=get_group_size() and no model parallelism")
        params = CallbackParams(
            network=self.network, eval_network=self.eval_network, valid_dataset=valid_dataset, metrics=self.metrics,
            batch_num=len(valid_dataset) if hasattr(valid_dataset, "__len__") else None, cur_epoch_num=1,
            cur_step_num=0, net_outputs=None, dataset_sink_mode=dataset_sink_mode, mode="eval",
            device_number=world_size, rank=rank, parallel_mode=get_auto_parallel_context("parallel_mode"),
            parallel_config=config, layout=layout)
        run_context = RunContext(params)
        first = next(iter(valid_dataset), None)
        if first is None:
            raise UserError("Model.eval: valid_dataset gave no batch")
        if self.train_network is None:
            self._place(_as_batch(first), config, layout, params)
        placed = self.train_network
        root = placed.parts[0]  # run through it: its hooks gather and track the placed parameters
        if self.eval_network is None:
            forward, run = root.evaluate, root
        elif any(m is root for m in self.eval_network.modules()):  # it calls the placed net itself
            forward, run = None, self.eval_network
        else:
            forward, run = self.eval_network.__call__, root
        loss_at = self.eval_indexes[0] if self.eval_indexes else None
        for metric in self.metrics.values():
            metric.clear()
        group = None
        with _Callbacks(callbacks) as hooks, evaluating(root, forward, [root, self.eval_network]):
            hooks.call("on_eval_begin", run_context)
            hooks.call("on_eval_epoch_begin", run_context)
            if dataset_sink_mode:
                hooks.call("on_eval_step_begin", run_context)
            for batch in valid_dataset:
                if not dataset_sink_mode:
                    hooks.call("on_eval_step_begin", run_context)
                inputs, group = eval_rows(placed, _as_batch(batch), shards > 1)
                if params.cur_step_num == 0:
                    check_reducible(self.metrics, group)
                with autocast(self.precision, placed.device):  # as the net trains: amp_level
                    outputs = run(*inputs)
                outputs = [o.full_tensor() if isinstance(o, DTensor) else o
                           for o in (outputs if isinstance(outputs, (tuple, list)) else (outputs,))]
                if loss_at is not None:  # the same on every rank: the global batch's
                    rows = next((t.shape[0] for t in inputs if isinstance(t, torch.Tensor) and t.ndim), 1)
                    outputs[loss_at] = global_loss(outputs[loss_at], rows, getattr(placed, "summed", False), group,
                                                   placed.device)
                update_metrics(self.metrics, outputs, self.eval_indexes)
                params.net_outputs = tuple(outputs)
                params.cur_step_num += 1
                if not dataset_sink_mode:
                    hooks.call("on_eval_step_end", run_context)
            if dataset_sink_mode:
                hooks.call("on_eval_step_end", run_context)
            reduce_metrics(self.metrics, group, placed.device)
            hooks.call("on_eval_epoch_end", run_context)
            hooks.call("on_eval_end", run_context)
        return {name: metric.eval() for name, metric in self.metrics.items()}
