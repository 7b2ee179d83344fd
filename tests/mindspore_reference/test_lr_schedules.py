"""Each learning-rate schedule of paratrain.nn against MindSpore 2.7.0's: the classes' rates over a range of
global steps, the dynamic_lr functions' lists."""
import mindspore
import pytest
from mindspore import nn as ms_nn

import paratrain.nn as pnn
from reference import assert_close

STEPS = range(0, 25)
SCHEDULES = [
    ("WarmUpLR", dict(learning_rate=0.1, warmup_steps=7)),
    ("PolynomialDecayLR", dict(learning_rate=0.1, end_learning_rate=0.01, decay_steps=6, power=2.0)),
    ("PolynomialDecayLR", dict(learning_rate=0.1, end_learning_rate=0.01, decay_steps=6, power=0.5,
                               update_decay_steps=True)),
    ("CosineDecayLR", dict(min_lr=0.01, max_lr=0.1, decay_steps=9)),
    *((name, dict(learning_rate=0.1, decay_rate=0.8, decay_steps=4, is_stair=stair))
      for name in ("ExponentialDecayLR", "NaturalExpDecayLR", "InverseDecayLR") for stair in (False, True)),
]


@pytest.mark.parametrize("name, args", SCHEDULES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(SCHEDULES)])
def test_schedule(name, args):
    ms_schedule, schedule = getattr(ms_nn, name)(**args), getattr(pnn, name)(**args)
    ms_rates = [float(ms_schedule(mindspore.Tensor(step, mindspore.int32)).asnumpy()) for step in STEPS]
    assert_close(f"{name}: rates", [float(schedule(step)) for step in STEPS], ms_rates)
    # what an optimizer reads, without a tensor
    assert_close(f"{name}: rates", [schedule.rate(step) for step in STEPS], ms_rates)


EPOCHS = dict(total_step=30, step_per_epoch=3)
FUNCTIONS = [
    ("piecewise_constant_lr", dict(milestone=[3, 7, 7, 12], learning_rates=[0.1, 0.05, 0.03, 0.01])),
    *((name, dict(learning_rate=0.1, decay_rate=0.8, decay_epoch=2, is_stair=stair, **EPOCHS))
      for name in ("exponential_decay_lr", "natural_exp_decay_lr", "inverse_decay_lr") for stair in (False, True)),
    ("cosine_decay_lr", dict(min_lr=0.01, max_lr=0.1, decay_epoch=4, **EPOCHS)),
    *(("polynomial_decay_lr", dict(learning_rate=0.1, end_learning_rate=0.01, decay_epoch=3, power=2.0,
                                   update_decay_epoch=update, **EPOCHS)) for update in (False, True)),
    ("warmup_lr", dict(learning_rate=0.1, warmup_epoch=4, **EPOCHS)),
]


@pytest.mark.parametrize("name, args", FUNCTIONS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(FUNCTIONS)])
def test_dynamic_lr(name, args):
    assert_close(f"{name}: rates", getattr(pnn, name)(**args), getattr(ms_nn, name)(**args))
