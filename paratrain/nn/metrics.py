"""MindSpore's evaluation metrics: ``Metric``, ``Accuracy``, ``Loss`` and ``rearrange_inputs`` (``mindspore.train``
in 2.x, ``mindspore.nn`` in 1.x; ``paratrain.train`` exports them too). Under data parallel ``Model.eval`` adds the
state each metric names in ``summed`` over the ranks, so every rank returns what one process would."""
from __future__ import annotations

import functools

import torch
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
    ``update`` decorated with ``rearrange_inputs`` take inputs ``i`` and ``j`` of those it is given. ``summed``
    (paratrain's): the state attributes that add up over rows, which ``Model.eval`` sums over data-parallel ranks."""

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
