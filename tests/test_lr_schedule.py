"""The TOML face's LR schedules are composed of paratrain.nn's schedule pieces and give the rates of the
formulas they replaced (kept here, as they were, as the reference)."""
import math

import pytest
import torch

from paratrain.config import Config
from paratrain.optim import build_scheduler, lr_schedule


def reference_lr(step: int, cfg) -> float:
    """paratrain.optim's ``lr_at`` and ``deepspeed_lr`` before the schedules were made of paratrain.nn's pieces."""
    total = cfg.lr_decay_steps or cfg.steps
    if cfg.lr_schedule == "cosine":
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))
    i, w = step - 1, max(2, cfg.warmup_steps)
    if i < 0 and cfg.lr_schedule == "warmup_cosine_lr":
        return 0.0
    if i < w:
        fraction = 0.0 if i < 0 else (math.log(i + 1) / math.log(w) if cfg.warmup_type == "log" else i / w)
        return cfg.warmup_min_lr + (cfg.lr - cfg.warmup_min_lr) * fraction
    if cfg.lr_schedule == "warmup_lr":
        return cfg.lr
    if cfg.lr_schedule == "warmup_decay_lr":
        return cfg.warmup_min_lr + (cfg.lr - cfg.warmup_min_lr) * max(0.0, (total - i) / max(1, total - w))
    cosine = (1 + math.cos(math.pi * (i - w + 1) / (total - w))) / 2
    return max(0.0, cfg.min_lr + (cfg.lr - cfg.min_lr) * cosine)


STEPS = 200
# warmup_steps, lr_decay_steps (0: steps), lr, min_lr, warmup_min_lr: no warmup, a decay that ends before the
# last step (or, for warmup_decay_lr, before the warmup does), min_lr = lr, warmup_min_lr above lr
SETTINGS = [(10, 0, 1e-3, 1e-4, 0.0), (0, 150, 3e-4, 0.0, 1e-5), (37, 120, 1.0, 1.0, 2e-3),
            (1, 60, 2e-3, 2e-4, 5e-3), (64, 50, 5e-4, 5e-5, 1e-4)]


def train_configs(kind: str, warmup_type: str):
    for warmup, decay, lr, min_lr, warmup_min_lr in SETTINGS:
        if kind == "warmup_cosine_lr" and (decay or STEPS) <= max(2, warmup):
            continue  # refused by the config's checks
        yield Config.from_dict({"train": {"lr_schedule": kind, "warmup_type": warmup_type, "steps": STEPS,
                                          "warmup_steps": warmup, "lr_decay_steps": decay, "lr": lr,
                                          "min_lr": min_lr, "warmup_min_lr": warmup_min_lr}}).train


@pytest.mark.parametrize("warmup_type", ["linear", "log"])
@pytest.mark.parametrize("kind", ["cosine", "warmup_lr", "warmup_decay_lr", "warmup_cosine_lr"])
def test_toml_schedules_give_the_rates_of_the_formulas_they_replaced(kind, warmup_type):
    """At every step, as the schedule and as the optimizer's rate; within rounding (the cosine and the
    products are taken in another order, and by torch's cos) of the largest rate."""
    for cfg in train_configs(kind, warmup_type):
        schedule, tolerance = lr_schedule(cfg), 1e-14 * max(cfg.lr, cfg.warmup_min_lr)
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
        scheduler = build_scheduler(optimizer, cfg)
        for step in range(STEPS):
            want = reference_lr(step, cfg)
            assert float(schedule(torch.tensor(step, dtype=torch.float64))) == pytest.approx(want, rel=0,
                                                                                            abs=tolerance), step
            assert optimizer.param_groups[0]["lr"] == pytest.approx(want, rel=0, abs=tolerance), step
            optimizer.step()
            scheduler.step()


def test_a_saved_scheduler_state_loads_and_goes_on():
    """A LambdaLR state saved mid-run (as by the formulas before) loads into a new scheduler, which continues."""
    cfg = next(train_configs("cosine", "linear"))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    old = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: reference_lr(step, cfg) / cfg.lr)
    for _ in range(15):
        optimizer.step()
        old.step()
    resumed = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr), cfg)
    resumed.load_state_dict(old.state_dict())
    resumed.optimizer.step()
    resumed.step()
    assert resumed.last_epoch == 16
    assert resumed.get_last_lr()[0] == pytest.approx(reference_lr(16, cfg), rel=1e-14)
