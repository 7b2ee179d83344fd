"""What ``Model.eval`` needs to run MindSpore's metrics (``paratrain.nn.metrics``) on any layout: the metrics, the
rows of a batch this rank evaluates, and each metric's ``summed`` state added over the ranks that share them."""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from paratrain.errors import UserError
from paratrain.nn.metrics import Accuracy, Loss, Metric, as_tensor

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


def global_loss(loss, rows: int, summed: bool, group, device: torch.device,
                count_epsilon: float | None = None) -> torch.Tensor:
    """The loss of the global batch from this rank's: its (sum, count) pair when the net's losses return one
    (``summed``; the count plus the losses' ``count_epsilon`` divides), else its mean weighted by this rank's
    ``rows``, added over ``group``."""
    loss = as_tensor(loss).to(device)
    epsilon = 0.0
    if summed and loss.numel() == 2:
        pair, epsilon = loss.double().reshape(2), count_epsilon or 0.0
    elif group is None:
        return loss
    else:
        pair = torch.stack([loss.double().mean() * rows, torch.tensor(float(rows), dtype=torch.float64,
                                                                        device=device)])
    if group is not None:
        dist.all_reduce(pair, group=group)
    return pair[0] / (pair[1] + epsilon)


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
