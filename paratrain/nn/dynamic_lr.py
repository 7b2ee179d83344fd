"""MindSpore's ``nn.dynamic_lr``: learning rates as lists, one float per step, for an optimizer's
``learning_rate``: step ``i`` takes ``paratrain.optim``'s schedule of its epoch, ``i // step_per_epoch``.
Arguments are checked as MindSpore checks them (rates are floats, counts ints > 0)."""
from __future__ import annotations

from paratrain.errors import UserError
from paratrain.optim import (cosine_decay, exponential_decay, inverse_decay, natural_exp_decay, polynomial_decay,
                             warmup)

_RULES = {
    "an int > 0": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
    "a float": lambda v: isinstance(v, float), "a float > 0": lambda v: isinstance(v, float) and v > 0,
    "a float >= 0": lambda v: isinstance(v, float) and v >= 0, "a bool": lambda v: isinstance(v, bool),
    "a number > 0": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}


def check_args(owner: str, rule: str, **values) -> None:
    """Refuses the first of ``values`` that ``_RULES[rule]`` does not accept, naming it (the schedules' check too)."""
    for name, value in values.items():
        if not _RULES[rule](value):
            raise UserError(f"{owner}({name}={value!r}): expected {rule}")


def _epochs(owner: str, total_step: int, step_per_epoch: int, **epochs) -> list[int]:
    """The epoch of each of ``total_step`` steps, the counts checked (``epochs``: the schedule's)."""
    check_args(owner, "an int > 0", total_step=total_step, step_per_epoch=step_per_epoch, **epochs)
    return [i // step_per_epoch for i in range(total_step)]


def _decays(owner, learning_rate, decay_rate, total_step, step_per_epoch, decay_epoch, is_stair) -> list[int]:
    """The epochs of the steps of the exponential, natural-exponential and inverse decays, arguments checked."""
    check_args(owner, "a float > 0", learning_rate=learning_rate, decay_rate=decay_rate)
    check_args(owner, "a bool", is_stair=is_stair)
    return _epochs(owner, total_step, step_per_epoch, decay_epoch=decay_epoch)


def natural_exp_decay_of_steps(step: float, start: float, rate: float, steps: int, stair: bool = False) -> float:
    """MindSpore's natural exponential decay, of its list and of ``NaturalExpDecayLR`` alike: ``start * e **
    (-rate * step)``, with ``stair`` the step floored to a multiple of ``steps`` (MindSpore's documentation divides
    the step by ``steps``; its code does not)."""
    # rate * steps over p = step / steps (floored) is rate over the step (floored to a multiple of steps)
    return natural_exp_decay(step, start, rate * steps, steps, stair)


def piecewise_constant_lr(milestone, learning_rates) -> list[float]:
    """``learning_rates[t]`` for the steps in ``[milestone[t - 1], milestone[t])`` (``milestone[-1]`` steps in
    all); ``milestone``: non-decreasing ints > 0."""
    owner = "piecewise_constant_lr"
    for name, value in (("milestone", milestone), ("learning_rates", learning_rates)):
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{owner}({name}={value!r}): expected a list or a tuple")
    if len(milestone) != len(learning_rates):
        raise UserError(f"{owner}: milestone has {len(milestone)} entries and learning_rates "
                        f"{len(learning_rates)}; expected one rate per milestone")
    rates, last = [], 0
    for i, (end, rate) in enumerate(zip(milestone, learning_rates)):
        check_args(owner, "an int > 0", **{f"milestone[{i}]": end})
        check_args(owner, "a float", **{f"learning_rates[{i}]": rate})
        if end < last:
            raise UserError(f"{owner}(milestone={milestone!r}): milestone[{i}]={end} is below milestone[{i - 1}]="
                            f"{last}; expected non-decreasing milestones")
        rates += [rate] * (end - last)
        last = end
    return rates


def exponential_decay_lr(learning_rate, decay_rate, total_step, step_per_epoch, decay_epoch,
                         is_stair=False) -> list[float]:
    """``learning_rate * decay_rate ** (epoch / decay_epoch)`` (floored with ``is_stair``): ``ExponentialDecayLR``
    over epochs."""
    epochs = _decays("exponential_decay_lr", learning_rate, decay_rate, total_step, step_per_epoch, decay_epoch,
                     is_stair)
    return [exponential_decay(e, learning_rate, decay_rate, decay_epoch, is_stair) for e in epochs]


def natural_exp_decay_lr(learning_rate, decay_rate, total_step, step_per_epoch, decay_epoch,
                         is_stair=False) -> list[float]:
    """``learning_rate * e ** (-decay_rate * epoch)``; with ``is_stair`` the epoch is floored to a multiple of
    ``decay_epoch``: ``NaturalExpDecayLR`` over epochs."""
    epochs = _decays("natural_exp_decay_lr", learning_rate, decay_rate, total_step, step_per_epoch, decay_epoch,
                     is_stair)
    return [natural_exp_decay_of_steps(e, learning_rate, decay_rate, decay_epoch, is_stair) for e in epochs]


def inverse_decay_lr(learning_rate, decay_rate, total_step, step_per_epoch, decay_epoch,
                     is_stair=False) -> list[float]:
    """``learning_rate / (1 + decay_rate * epoch / decay_epoch)`` (the fraction floored with ``is_stair``):
    ``InverseDecayLR`` over epochs."""
    epochs = _decays("inverse_decay_lr", learning_rate, decay_rate, total_step, step_per_epoch, decay_epoch,
                     is_stair)
    return [inverse_decay(e, learning_rate, decay_rate, decay_epoch, is_stair) for e in epochs]


def cosine_decay_lr(min_lr, max_lr, total_step, step_per_epoch, decay_epoch) -> list[float]:
    """``min_lr + (max_lr - min_lr) * (1 + cos(pi * min(epoch, decay_epoch) / decay_epoch)) / 2``:
    ``CosineDecayLR`` over epochs."""
    owner = "cosine_decay_lr"
    check_args(owner, "a float >= 0", min_lr=min_lr)
    check_args(owner, "a float > 0", max_lr=max_lr)
    epochs = _epochs(owner, total_step, step_per_epoch, decay_epoch=decay_epoch)
    if min_lr >= max_lr:
        raise UserError(f"{owner}(min_lr={min_lr!r}): expected it below max_lr={max_lr!r}")
    return [cosine_decay(e, max_lr, min_lr, decay_epoch) for e in epochs]


def polynomial_decay_lr(learning_rate, end_learning_rate, total_step, step_per_epoch, decay_epoch, power,
                        update_decay_epoch=False) -> list[float]:
    """``(learning_rate - end_learning_rate) * (1 - min(epoch, decay_epoch) / decay_epoch) ** power +
    end_learning_rate``; with ``update_decay_epoch`` the decay restarts every ``decay_epoch`` epochs:
    ``PolynomialDecayLR`` over epochs."""
    owner = "polynomial_decay_lr"
    check_args(owner, "a float > 0", learning_rate=learning_rate, power=power)
    check_args(owner, "a float >= 0", end_learning_rate=end_learning_rate)
    check_args(owner, "a bool", update_decay_epoch=update_decay_epoch)
    epochs = _epochs(owner, total_step, step_per_epoch, decay_epoch=decay_epoch)
    return [polynomial_decay(e, learning_rate, end_learning_rate, decay_epoch, power, restart=update_decay_epoch)
            for e in epochs]


def warmup_lr(learning_rate, total_step, step_per_epoch, warmup_epoch) -> list[float]:
    """``learning_rate * min(epoch, warmup_epoch) / warmup_epoch``: ``WarmUpLR`` over epochs."""
    check_args("warmup_lr", "a float >= 0", learning_rate=learning_rate)
    epochs = _epochs("warmup_lr", total_step, step_per_epoch, warmup_epoch=warmup_epoch)
    return [warmup(e, warmup_epoch, 0.0, learning_rate) for e in epochs]
