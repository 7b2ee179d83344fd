"""One LR-schedule implementation under both faces: the TOML face's scheduler gives, step by step, the rates of
MindSpore's schedule classes composed to the same schedule, and a MindSpore schedule drives its optimizer under
the meta default device without reading a value from the device."""
import pytest
import torch

from conftest import host_reads
from paratrain import config_file
from paratrain.nn import AdamWeightDecay, CosineDecayLR, PolynomialDecayLR, WarmUpLR
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


def _train_linear(steps: int = 4):
    """A Linear trained by AdamWeightDecay on a polynomial decay: its parameters and last rate."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2, device="cpu")
    optimizer = AdamWeightDecay(net.parameters(), learning_rate=PolynomialDecayLR(0.1, 0.01, 3, 2.0),
                                weight_decay=0.01)
    x = torch.randn(8, 4, device="cpu")
    for _ in range(steps):
        optimizer.zero_grad()
        net(x).square().mean().backward()
        optimizer.step()
    return [p.detach() for p in net.parameters()], optimizer.param_groups[0]["lr"]


def test_a_mindspore_schedule_trains_under_the_meta_default_device_without_host_reads(monkeypatch):
    normal, normal_lr = _train_linear()
    torch.set_default_device("meta")
    try:
        reads = host_reads(monkeypatch)
        meta, meta_lr = _train_linear()
    finally:
        torch.set_default_device(None)
    assert reads == []
    assert meta_lr == normal_lr == pytest.approx(0.01) and all(torch.equal(a, b) for a, b in zip(meta, normal))
