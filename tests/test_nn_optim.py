"""MindSpore's AdamWeightDecay and learning-rate schedules: the update and the rates written out from
MindSpore's formulas, a tutorial-style composed schedule, refusals, resume, and a schedule kept when
``Model`` rebuilds the optimizer on two data-parallel ranks."""
import contextlib
import io
import math

import pytest
import torch

from multiprocess import run_distributed
from paratrain.errors import UserError
from paratrain.nn import AdamWeightDecay, CosineDecayLR, ExponentialDecayLR, PolynomialDecayLR, WarmUpLR


def reference_updates(param, grads, lr_of_step, beta1, beta2, eps, weight_decay):
    """MindSpore's AdamWeightDecay written element by element (no bias correction)."""
    p, m, v = param.clone(), torch.zeros_like(param), torch.zeros_like(param)
    out = []
    for step, g in enumerate(grads):
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr_of_step(step) * (m / (v.sqrt() + eps) + weight_decay * p)
        out.append(p.clone())
    return out


@pytest.mark.parametrize("learning_rate", [0.05, WarmUpLR(0.05, 2)], ids=["number", "warmup"])
def test_the_update_is_mindspores_without_bias_correction(learning_rate):
    torch.manual_seed(0)
    start = torch.randn(5)
    grads = [torch.randn(5) for _ in range(4)]
    param = torch.nn.Parameter(start.clone())
    opt = AdamWeightDecay([{"params": [param], "weight_decay": 0.1}, {"order_params": [param]}],
                          learning_rate=learning_rate, beta1=0.8, beta2=0.9, eps=1e-6)
    got = []
    for g in grads:
        param.grad = g.clone()
        opt.step()
        got.append(param.detach().clone())
    rate = (lambda s: 0.05 * min(s, 2) / 2) if callable(learning_rate) else (lambda s: 0.05)
    for a, b in zip(got, reference_updates(start, grads, rate, 0.8, 0.9, 1e-6, 0.1)):
        torch.testing.assert_close(a, b)
    adamw = torch.nn.Parameter(start.clone())  # torch's AdamW corrects the bias: another trajectory
    torch_opt = torch.optim.AdamW([adamw], lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    adamw.grad = grads[0].clone()
    torch_opt.step()
    assert not torch.allclose(adamw.detach(), reference_updates(start, grads[:1], lambda s: 0.05, 0.8, 0.9, 1e-6,
                                                                0.1)[0])


@pytest.mark.parametrize("schedule, formula", [
    (WarmUpLR(0.1, 4), lambda s: 0.1 * min(s, 4) / 4),
    (PolynomialDecayLR(0.1, 0.01, 5, 2.0), lambda s: 0.09 * (1 - min(s, 5) / 5) ** 2 + 0.01),
    (PolynomialDecayLR(0.1, 0.01, 5, 1.0, update_decay_steps=True),
     lambda s: 0.09 * (1 - s / (5 * max(math.ceil(s / 5), 1))) + 0.01),
    (CosineDecayLR(0.01, 0.1, 5), lambda s: 0.01 + 0.09 * (1 + math.cos(math.pi * min(s, 5) / 5)) / 2),
    (ExponentialDecayLR(0.1, 0.5, 2), lambda s: 0.1 * 0.5 ** (s / 2)),
    (ExponentialDecayLR(0.1, 0.5, 2, is_stair=True), lambda s: 0.1 * 0.5 ** (s // 2)),
], ids=["warmup", "polynomial", "polynomial-restarting", "cosine", "exponential", "exponential-stair"])
def test_schedules_follow_mindspores_formulas(schedule, formula):
    for step in range(12):
        assert float(schedule(torch.tensor(step))) == pytest.approx(formula(step), rel=1e-5, abs=1e-7), step


class TutorialLearningRate(torch.nn.Module):
    """The MindSpore tutorial's LearningRate: warm-up, then polynomial or cosine decay, mixed with tensor ops."""

    def __init__(self, learning_rate, end_learning_rate, warmup_steps, decay_steps):
        super().__init__()
        self.warmup_lr = WarmUpLR(learning_rate, warmup_steps)
        self.decay_lr = CosineDecayLR(end_learning_rate, learning_rate, decay_steps)
        self.warmup_steps = torch.tensor(float(warmup_steps))

    def forward(self, global_step):
        is_warmup = (self.warmup_steps > global_step).float()
        return (1 - is_warmup) * self.decay_lr(global_step) + is_warmup * self.warmup_lr(global_step)


def test_a_composed_schedule_of_tensor_ops_drives_the_rate():
    param = torch.nn.Parameter(torch.ones(3))
    opt = AdamWeightDecay([param], learning_rate=TutorialLearningRate(0.1, 0.01, 2, 6))
    rates = []
    for _ in range(5):
        param.grad = torch.ones(3)
        opt.step()
        rates.append(opt.param_groups[0]["lr"])
    cosine = [0.01 + 0.09 * (1 + math.cos(math.pi * s / 6)) / 2 for s in range(5)]
    assert rates == pytest.approx([0.0, 0.05, cosine[2], cosine[3], cosine[4]])


@pytest.mark.parametrize("kwargs, message", [
    ({"learning_rate": -1.0}, "learning_rate=-1.0"),
    ({"learning_rate": "fast"}, "learning_rate='fast'"),
    ({"beta1": 1.0}, "beta1=1.0"),
    ({"eps": 0.0}, "eps=0.0"),
])
def test_bad_arguments_are_refused_naming_them(kwargs, message):
    with pytest.raises(UserError, match=message):
        AdamWeightDecay([torch.nn.Parameter(torch.ones(2))], **kwargs)


def test_schedule_arguments_are_checked():
    with pytest.raises(UserError, match="WarmUpLR\\(warmup_steps=0\\)"):
        WarmUpLR(0.1, 0)
    with pytest.raises(UserError, match="end_learning_rate=0.5"):
        PolynomialDecayLR(0.1, 0.5, 10, 1.0)


def test_a_reloaded_optimizer_goes_on_from_its_step():
    torch.manual_seed(0)
    grads = [torch.randn(4) for _ in range(4)]

    def run(split):
        param = torch.nn.Parameter(torch.ones(4))
        opt = AdamWeightDecay([param], learning_rate=WarmUpLR(0.1, 3))
        for i, g in enumerate(grads):
            if i == split:
                state = opt.state_dict()
                opt = AdamWeightDecay([param], learning_rate=WarmUpLR(0.1, 3))
                opt.load_state_dict(state)
            param.grad = g.clone()
            opt.step()
        return param.detach()

    torch.testing.assert_close(run(split=2), run(split=-1))


def _model_train_losses(schedule_steps, directory=None):
    from paratrain.train import CheckpointConfig, LossMonitor, Model, ModelCheckpoint
    from test_train_api import Net, dataset, printed_losses

    torch.manual_seed(0)
    net = Net()
    decay = [p for n, p in net.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in net.named_parameters() if not n.endswith("weight")]
    opt = AdamWeightDecay([{"params": decay, "weight_decay": 0.01}, {"params": rest}],
                          learning_rate=WarmUpLR(0.02, schedule_steps))
    callbacks = [LossMonitor()]
    if directory:  # the optimizer's state (its step counts included) is saved with the weights
        callbacks.append(ModelCheckpoint(prefix="adw", directory=directory,
                                         config=CheckpointConfig(save_checkpoint_steps=3)))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        Model(net, optimizer=opt).train(2, dataset(), callbacks=callbacks)
    return [loss for _, _, loss in printed_losses(out.getvalue())]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_model_keeps_the_schedule_when_it_rebuilds_the_optimizer_on_two_ranks(tmp_path):
    from paratrain.train import load_checkpoint

    one = _model_train_losses(3)
    assert len(one) == 6 and one[-1] < one[0]
    two = run_distributed(_model_train_losses, 2, 3, str(tmp_path))[0]
    assert two == pytest.approx(one, rel=1e-5)
    assert set(load_checkpoint(tmp_path / "adw-2_3")) >= {"fc1.weight"}
    assert _model_train_losses(100) != pytest.approx(one, rel=1e-3)  # the schedule matters to these losses
