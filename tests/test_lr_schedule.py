"""One LR-schedule implementation under both faces: the TOML face's scheduler gives, step by step, the rates of
MindSpore's schedule classes composed to the same schedule; MindSpore's ``dynamic_lr`` lists are the classes'
rates over epochs (and MindSpore's documented examples); a MindSpore schedule drives its optimizer under the meta
default device without reading a value from the device."""
import math

import pytest
import torch

from conftest import host_reads
from paratrain import config_file
from paratrain import nn as ms
from paratrain.errors import UserError
from paratrain.nn import AdamWeightDecay, CosineDecayLR, Momentum, PolynomialDecayLR, WarmUpLR
from paratrain.optim import build_scheduler


def toml_rates(cfg, steps: int) -> list[float]:
    """The LRs the TOML face's scheduler sets for optimizer steps 0 .. steps - 1."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1, device="cpu"))], lr=cfg.lr)
    scheduler, rates = build_scheduler(optimizer, cfg), []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def mindspore_rates(cfg, steps: int, rate) -> list[float]:
    """The rates of TOML steps 0 .. steps - 1 by MindSpore's schedule classes, each read as ``rate(schedule, step)``."""
    total, lr = cfg.lr_decay_steps or cfg.steps, cfg.lr
    if cfg.lr_schedule == "cosine":  # step s is the warmup's step s + 1, then the decay's step s - warmup_steps
        warmup_steps = cfg.warmup_steps
        decay = CosineDecayLR(cfg.min_lr, lr, total - warmup_steps)
        return [rate(WarmUpLR(lr, warmup_steps), s + 1) if s < warmup_steps else rate(decay, s - warmup_steps)
                for s in range(steps)]
    w = max(2, cfg.warmup_steps)  # DeepSpeed's schedules: step s at iteration s - 1
    decay, start = {"warmup_lr": (WarmUpLR(lr, w), 0),
                    "warmup_decay_lr": (PolynomialDecayLR(lr, 0.0, total - w, 1.0), w),
                    "warmup_cosine_lr": (CosineDecayLR(cfg.min_lr, lr, total - w), w - 1)}[cfg.lr_schedule]
    return [rate(WarmUpLR(lr, w), max(0, s - 1)) if s - 1 < w else rate(decay, s - 1 - start) for s in range(steps)]


@pytest.mark.parametrize("kind, train", [
    ("cosine", {"warmup_steps": 0, "min_lr": 1e-4}),
    ("cosine", {"warmup_steps": 5, "lr_decay_steps": 15, "min_lr": 0.0}),
    ("warmup_lr", {"warmup_steps": 6}),
    ("warmup_decay_lr", {"warmup_steps": 4, "lr_decay_steps": 12}),
    ("warmup_cosine_lr", {"warmup_steps": 3, "lr_decay_steps": 15, "min_lr": 2e-4}),
], ids=["cosine", "warmup-cosine", "warmup", "warmup-polynomial", "deepspeed-warmup-cosine"])
def test_the_toml_scheduler_and_mindspores_classes_give_the_same_rates(kind, train):
    cfg = config_file.from_dict({"train": {"lr_schedule": kind, "steps": 20, "lr": 3e-3, **train}}).train
    # WarmupCosineLR's cosine rises again past its end where MindSpore's holds: compared up to the end
    steps = (cfg.lr_decay_steps or cfg.steps) + 1 if kind == "warmup_cosine_lr" else 26
    want = toml_rates(cfg, steps)
    assert len(set(want)) > 5  # a schedule, not a constant
    assert mindspore_rates(cfg, steps, lambda schedule, s: schedule.rate(s)) == pytest.approx(want, rel=1e-12)
    as_tensors = mindspore_rates(cfg, steps, lambda schedule, s: float(schedule(torch.tensor(s, device="cpu"))))
    assert as_tensors == pytest.approx(want, rel=1e-6)  # float32, as MindSpore's


def per_epoch(schedule, total_step: int, step_per_epoch: int) -> list[float]:
    """``schedule``'s rate at the epoch of each step, as MindSpore's ``dynamic_lr`` defines it."""
    return [float(schedule.rate(math.floor(i / step_per_epoch))) for i in range(total_step)]


@pytest.mark.parametrize("stair", [False, True], ids=["smooth", "stair"])
def test_each_dynamic_lr_list_is_its_schedule_class_over_epochs(stair):
    total, per = 23, 3
    cases = [
        (ms.exponential_decay_lr(0.1, 0.7, total, per, 2, stair), ms.ExponentialDecayLR(0.1, 0.7, 2, stair)),
        (ms.inverse_decay_lr(0.1, 0.7, total, per, 2, stair), ms.InverseDecayLR(0.1, 0.7, 2, stair)),
        (ms.natural_exp_decay_lr(0.1, 0.7, total, per, 2, stair), ms.NaturalExpDecayLR(0.1, 0.7, 2, stair)),
        (ms.cosine_decay_lr(0.01, 0.1, total, per, 5), ms.CosineDecayLR(0.01, 0.1, 5)),
        (ms.polynomial_decay_lr(0.1, 0.01, total, per, 3, 2.0, update_decay_epoch=stair),
         ms.PolynomialDecayLR(0.1, 0.01, 3, 2.0, update_decay_steps=stair)),
        (ms.warmup_lr(0.1, total, per, 4), ms.WarmUpLR(0.1, 4)),
    ]
    for got, schedule in cases:
        assert all(type(rate) is float for rate in got) and len(set(got)) > 2, type(schedule).__name__
        assert got == pytest.approx(per_epoch(schedule, total, per), rel=1e-12), type(schedule).__name__


@pytest.mark.parametrize("build, documented", [
    (lambda: ms.piecewise_constant_lr([2, 5, 10], [0.1, 0.05, 0.01]),
     [0.1, 0.1, 0.05, 0.05, 0.05, 0.01, 0.01, 0.01, 0.01, 0.01]),
    (lambda: ms.exponential_decay_lr(0.1, 0.9, 6, 2, 1), [0.1, 0.1, 0.09, 0.09, 0.081, 0.081]),
    (lambda: ms.natural_exp_decay_lr(0.1, 0.9, 6, 2, 2, True), [0.1] * 4 + [0.016529888822158657] * 2),
    (lambda: ms.inverse_decay_lr(0.1, 0.5, 6, 1, 1, True), [0.1, 0.1 / 1.5, 0.05, 0.04, 0.1 / 3, 0.1 / 3.5]),
    (lambda: ms.cosine_decay_lr(0.01, 0.1, 6, 2, 2), [0.1, 0.1, 0.055, 0.055, 0.01, 0.01]),
    (lambda: ms.polynomial_decay_lr(0.1, 0.01, 6, 2, 2, 0.5), [0.1, 0.1] + [0.07363961030678928] * 2 + [0.01] * 2),
    (lambda: ms.warmup_lr(0.1, 6, 2, 2), [0.0, 0.0, 0.05, 0.05, 0.1, 0.1]),
], ids=["piecewise", "exponential", "natural-exp-stair", "inverse-stair", "cosine", "polynomial", "warmup"])
def test_dynamic_lr_gives_mindspores_documented_examples(build, documented):
    assert build() == pytest.approx(documented, rel=1e-12)


@pytest.mark.parametrize("build, message", [
    (lambda: ms.exponential_decay_lr(1, 0.9, 6, 2, 1), r"exponential_decay_lr\(learning_rate=1\): expected a float > 0"),
    (lambda: ms.natural_exp_decay_lr(0.1, 0.9, 6, 0, 1), r"natural_exp_decay_lr\(step_per_epoch=0\)"),
    (lambda: ms.inverse_decay_lr(0.1, 0.9, 6, 2, 1, is_stair=1), r"inverse_decay_lr\(is_stair=1\): expected a bool"),
    (lambda: ms.cosine_decay_lr(0.1, 0.1, 6, 2, 1), r"cosine_decay_lr\(min_lr=0.1\): expected it below max_lr"),
    (lambda: ms.polynomial_decay_lr(0.1, 0.0, 6, 2, 2.0, 1.0), r"polynomial_decay_lr\(decay_epoch=2.0\)"),
    (lambda: ms.warmup_lr(0.1, True, 2, 2), r"warmup_lr\(total_step=True\): expected an int > 0"),
    (lambda: ms.piecewise_constant_lr([2, 5], [0.1]), r"piecewise_constant_lr: milestone has 2 entries"),
    (lambda: ms.piecewise_constant_lr([5, 2], [0.1, 0.2]), r"milestone\[1\]=2 is below milestone\[0\]=5"),
    (lambda: ms.piecewise_constant_lr([2, 5], [0.1, 1]), r"learning_rates\[1\]=1\): expected a float"),
])
def test_dynamic_lr_checks_arguments_as_mindspore_does(build, message):
    with pytest.raises(UserError, match=message):
        build()


def _train_linear(make_optimizer, steps: int = 4):
    """A Linear trained by ``make_optimizer(parameters)``: its parameters and last rate."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2, device="cpu")
    optimizer = make_optimizer(net.parameters())
    x = torch.randn(8, 4, device="cpu")
    for _ in range(steps):
        optimizer.zero_grad()
        net(x).square().mean().backward()
        optimizer.step()
    return [p.detach() for p in net.parameters()], optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("make_optimizer", [
    lambda params: AdamWeightDecay(params, learning_rate=PolynomialDecayLR(0.1, 0.01, 3, 2.0), weight_decay=0.01),
    lambda params: Momentum(params, PolynomialDecayLR(0.1, 0.01, 3, 2.0), 0.9, weight_decay=0.01),
    lambda params: Momentum(params, ms.polynomial_decay_lr(0.1, 0.01, 4, 1, 3, 2.0), 0.9),
], ids=["adam-weight-decay", "momentum", "momentum-list"])
def test_a_mindspore_schedule_trains_under_the_meta_default_device_without_host_reads(monkeypatch, make_optimizer):
    normal, normal_lr = _train_linear(make_optimizer)
    torch.set_default_device("meta")
    try:
        reads = host_reads(monkeypatch)
        meta, meta_lr = _train_linear(make_optimizer)
    finally:
        torch.set_default_device(None)
    assert reads == []
    assert meta_lr == normal_lr == pytest.approx(0.01) and all(torch.equal(a, b) for a, b in zip(meta, normal))
