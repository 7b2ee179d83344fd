"""MindSpore's evaluation metrics: ``Metric``, ``Accuracy``, ``Loss`` and ``rearrange_inputs``
(``mindspore.train`` in 2.x, ``mindspore.nn`` in 1.x), and what ``Model.eval`` needs to run them on any layout:
``get_metrics`` (MindSpore's ``metrics=`` dict or set of names), ``eval_rows`` (the rows of a batch this rank
evaluates, and the ranks whose rows add up) and ``reduce_metrics``.

Under data parallel each rank evaluates its rows and the metrics' sums are added over the data-parallel ranks:
a metric names the state attributes that add up over rows in ``summed`` (paratrain's addition to MindSpore's
class), so every rank returns what one process would.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.errors import UserError

EVAL_TYPES = ("classification", "multilabel")


def rearrange_inputs(update):
    """MindSpore's decorator for a metric's ``update``: the inputs reordered by the metric's ``indexes``
    (``set_indexes``), when set."""

    @functools.wraps(update)
    def wrapper(self, *inputs):
        if self.indexes is not None:
            inputs = tuple(inputs[i] for i in self.indexes)
        return update(self, *inputs)

    return wrapper


def as_tensor(data) -> torch.Tensor:
    """A metric's input as a plain tensor without gradient: a DTensor whole, a list or numpy array on the CPU."""
    if isinstance(data, DTensor):
        data = data.full_tensor()
    if isinstance(data, torch.Tensor):
        return data.detach()
    return torch.as_tensor(data, device="cpu")


class Metric:
    """MindSpore's base of the metrics: ``clear()`` resets the state, ``update(*inputs)`` adds a batch's, ``eval()``
    gives the result; calling the metric does the three on one batch. ``set_indexes([i, j])`` makes an
    ``update`` decorated with ``rearrange_inputs`` take inputs ``i`` and ``j`` of those it is given.

    ``summed`` (paratrain): the state attributes that add up over the rows of a batch, which ``Model.eval`` sums
    over the data-parallel ranks; a metric of your own under data parallel must name them."""

    summed: tuple[str, ...] = ()

    def __init__(self):
        self._indexes = None

    @property
    def indexes(self):
        return getattr(self, "_indexes", None)

    def set_indexes(self, indexes: list[int]) -> "Metric":
        if not isinstance(indexes, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in indexes):
            raise UserError(f"{type(self).__name__}.set_indexes: indexes must be a list of ints, got {indexes!r}")
        self._indexes = indexes
        return self

    def clear(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define clear()")

    def update(self, *inputs) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define update(*inputs)")

    def eval(self):
        raise NotImplementedError(f"{type(self).__name__} must define eval()")

    def __call__(self, *inputs):
        self.clear()
        self.update(*inputs)
        return self.eval()


def is_one_hot(y: torch.Tensor) -> bool:
    """Whether ``y`` (N, C, ...) holds only 0 and 1 with exactly one 1 along dimension 1 (MindSpore's test)."""
    return y.ndim > 1 and bool(((y == 0) | (y == 1)).all()) and bool((y.sum(dim=1) == 1).all())


class Accuracy(Metric):
    """MindSpore's ``Accuracy(eval_type)``: correct / total over every update.

    ``"classification"``: ``update(y_pred, y)`` with scores ``y_pred`` (N, C, ...) and ``y`` the class ids (N, ...)
    or one-hot (N, C, ...); a row is correct when the argmax over C is its class. ``"multilabel"``: ``y_pred``
    and ``y`` of 0s and 1s of one shape (N, C, ...); a row (each position of ...) is correct when all C match."""

    summed = ("_correct_num", "_total_num")

    def __init__(self, eval_type: str = "classification"):
        super().__init__()
        if eval_type not in EVAL_TYPES:
            raise UserError(f"Accuracy(eval_type={eval_type!r}): use one of {', '.join(EVAL_TYPES)}")
        self._type = eval_type
        self.clear()

    def clear(self) -> None:
        self._correct_num, self._total_num, self._class_num = 0, 0, 0

    @rearrange_inputs
    def update(self, *inputs) -> None:
        if len(inputs) != 2:
            raise UserError(f"Accuracy.update takes 2 inputs (prediction, label), got {len(inputs)}")
        y_pred = as_tensor(inputs[0])
        y = as_tensor(inputs[1]).to(y_pred.device)
        if self._type == "classification" and y_pred.ndim == y.ndim and is_one_hot(y):
            y = y.argmax(dim=1)
        self._check_shapes(y_pred, y)
        if self._class_num == 0:
            self._class_num = y_pred.shape[1]
        elif y_pred.shape[1] != self._class_num:
            raise UserError(f"Accuracy.update: the prediction has {y_pred.shape[1]} classes, earlier ones "
                            f"{self._class_num}: give every batch the same classes")
        if self._type == "classification":
            correct = y_pred.argmax(dim=1) == y
        else:
            correct = (y_pred.movedim(1, -1).reshape(-1, self._class_num)
                       == y.movedim(1, -1).reshape(-1, self._class_num)).all(dim=1)
        self._correct_num += int(correct.sum())
        self._total_num += correct.numel()

    def _check_shapes(self, y_pred: torch.Tensor, y: torch.Tensor) -> None:
        if self._type == "classification":
            if y_pred.ndim < 2 or tuple(y.shape) != (y_pred.shape[0], *y_pred.shape[2:]):
                raise UserError(f"Accuracy.update (classification): a prediction of shape {list(y_pred.shape)} "
                                f"(N, C, ...) needs labels of shape (N, ...) or one-hot (N, C, ...), got "
                                f"{list(y.shape)}")
            return
        if y_pred.ndim < 2 or y_pred.shape != y.shape:
            raise UserError(f"Accuracy.update (multilabel): prediction {list(y_pred.shape)} and label "
                            f"{list(y.shape)} must have one shape (N, C, ...)")
        if not (((y_pred == 0) | (y_pred == 1)).all() and ((y == 0) | (y == 1)).all()):
            raise UserError("Accuracy.update (multilabel): prediction and label must hold only 0 and 1")

    def eval(self) -> float:
        if self._total_num == 0:
            raise UserError("Accuracy.eval: no sample was given (update was not called, or with empty inputs)")
        return self._correct_num / self._total_num


class Loss(Metric):
    """MindSpore's ``Loss``: the mean over updates of each update's loss (a scalar, or a 1-d tensor of losses
    whose mean is taken)."""

    summed = ("_sum_loss", "_total_num")

    def __init__(self):
        super().__init__()
        self.clear()

    def clear(self) -> None:
        self._sum_loss, self._total_num = 0.0, 0

    @rearrange_inputs
    def update(self, *inputs) -> None:
        if len(inputs) != 1:
            raise UserError(f"Loss.update takes 1 input (the loss), got {len(inputs)}")
        loss = as_tensor(inputs[0])
        if loss.ndim > 1:
            raise UserError(f"Loss.update: the loss must be a scalar or 1-d, got shape {list(loss.shape)}")
        self._sum_loss += float(loss.double().mean())
        self._total_num += 1

    def eval(self) -> float:
        if self._total_num == 0:
            raise UserError("Loss.eval: no loss was given (update was not called)")
        return self._sum_loss / self._total_num


NAMES = {"acc": Accuracy, "accuracy": Accuracy, "loss": Loss}


def get_metrics(metrics) -> dict[str, Metric] | None:
    """MindSpore's ``metrics=``: None, a dict {name: Metric}, or a set of names ("acc"/"accuracy", "loss")."""
    if metrics is None:
        return None
    if isinstance(metrics, dict):
        bad = [f"{name!r}: {type(m).__name__}" for name, m in metrics.items()
               if not isinstance(name, str) or not isinstance(m, Metric)]
        if bad:
            raise UserError(f"Model(metrics=...): a dict maps names to paratrain.train.Metric objects, got "
                            f"{', '.join(bad)}")
        return dict(metrics)
    if isinstance(metrics, (set, frozenset)):
        unknown = sorted(str(name) for name in metrics if name not in NAMES)
        if unknown:
            raise UserError(f"Model(metrics=...): unknown metric name {', '.join(map(repr, unknown))}; the names are "
                            f"{', '.join(map(repr, NAMES))}, or give a dict {{name: Metric()}} with a Metric of your "
                            f"own (a subclass of paratrain.train.Metric)")
        return {name: NAMES[name]() for name in sorted(metrics)}
    raise UserError(f"Model(metrics=...): expected None, a dict or a set of names, got {type(metrics).__name__}")


def update_metrics(metrics: dict[str, Metric], outputs: list, indexes: list[int] | None) -> None:
    """Give a batch's ``outputs`` to the metrics as MindSpore's ``Model.eval`` does: all of them to each metric, or
    with ``indexes`` [loss, output, label] the loss to ``Loss`` and (output, label) to the others."""
    for metric in metrics.values():
        if indexes is None:
            metric.update(*outputs)
        elif isinstance(metric, Loss):
            metric.update(outputs[indexes[0]])
        else:
            metric.update(outputs[indexes[1]], outputs[indexes[2]])


def eval_rows(placed, batch: tuple, sharded: bool) -> tuple[tuple, dist.ProcessGroup | None]:
    """The inputs this rank runs ``placed`` (a ``PlacedNet``, ``OpPlacedNet`` or ``HybridNet``) on for ``batch``,
    on its device, and the group of ranks whose rows add up to the global batch (None: this rank saw all of
    it). ``sharded``: the batch is this rank's rows already (a dataset split per rank)."""
    from paratrain.parallel.semi_auto import OpPlacedNet
    from paratrain.parallel.user import PlacedNet

    if isinstance(placed, OpPlacedNet):  # DTensor inputs: the outputs are the global batch's
        return tuple(placed.as_input(t, sharded) for t in batch), None
    batch = tuple(t.to(placed.device) if isinstance(t, torch.Tensor) else t for t in batch)
    if isinstance(placed, PlacedNet):
        layout = placed.layout
        if not sharded and layout.dp_size > 1:
            batch = tuple(t.tensor_split(layout.dp_size)[layout.dp_rank] if isinstance(t, torch.Tensor) else t
                          for t in batch)
        return batch, layout.dp_group
    world = dist.get_world_size() if dist.is_initialized() else 1  # hybrid: the whole net on every rank
    return batch, dist.group.WORLD if sharded and world > 1 else None


@contextmanager
def evaluating(root: nn.Module, forward, modules: list[nn.Module | None]):
    """Within: no gradients, every module of ``modules`` in eval mode, and ``root`` (the placed net's module)
    calling ``forward``, when given, instead of its own forward, its hooks still running (FSDP's and DDP's,
    which gather and track its parameters); each module's mode and the root's forward are restored afterwards."""
    modes = {m: m.training for module in modules if module is not None for m in module.modules()}
    own = vars(root).get("forward")
    for module in modes:
        module.training = False
    if forward is not None:
        object.__setattr__(root, "forward", forward)  # an attribute, not a submodule, whatever ``forward`` is
    try:
        with torch.no_grad():
            yield
    finally:
        if own is not None:
            object.__setattr__(root, "forward", own)
        elif forward is not None:
            del root.forward
        for module, mode in modes.items():
            module.training = mode


def global_loss(loss, rows: int, summed: bool, group, device: torch.device) -> torch.Tensor:
    """The loss of the global batch from this rank's: its (sum, count) pair when the net's losses return one
    (``summed``), else its mean weighted by this rank's ``rows``, added over ``group``."""
    loss = as_tensor(loss).to(device)
    if group is None:
        return loss
    pair = loss.double().reshape(2) if summed and loss.numel() == 2 else \
        torch.stack([loss.double().mean() * rows, torch.tensor(float(rows), dtype=torch.float64, device=device)])
    dist.all_reduce(pair, group=group)
    return pair[0] / pair[1]


def reduce_metrics(metrics: dict[str, Metric], group, device: torch.device) -> None:
    """Add each metric's ``summed`` state over ``group`` (in place), so every rank holds the global batch's."""
    if group is None:
        return
    for metric in metrics.values():
        if not metric.summed:
            continue
        values = torch.tensor([float(getattr(metric, name)) for name in metric.summed], dtype=torch.float64,
                              device=device)
        dist.all_reduce(values, group=group)
        for name, value in zip(metric.summed, values.tolist()):
            setattr(metric, name, type(getattr(metric, name))(value))


def check_reducible(metrics: dict[str, Metric], group) -> None:
    """Refuse, before evaluating, a metric whose state cannot be added over ranks that each see some rows."""
    unsummed = [f"{name!r} ({type(m).__name__})" for name, m in metrics.items() if not m.summed]
    if group is not None and unsummed:
        raise UserError(f"Model.eval: metric {', '.join(unsummed)} names no state to add over the "
                        f"{dist.get_world_size(group)} data-parallel ranks, each of which evaluates its rows: set its "
                        f"class attribute summed = ('_attribute', ...) to the state attributes that add up over rows, "
                        f"or evaluate on one data-parallel rank")
