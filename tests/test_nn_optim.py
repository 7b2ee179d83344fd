"""MindSpore's AdamWeightDecay, Momentum and learning-rate schedules: the update and the rates written out from
MindSpore's formulas, a tutorial-style composed schedule, Momentum on a list or a schedule against torch's SGD
driven by hand, refusals, resume, and a schedule kept when ``Model`` rebuilds the optimizer on two data-parallel
ranks."""
import contextlib
import copy
import io
import math
from functools import partial
import re

import numpy as np
import pytest
import torch

from forked_ranks import run_distributed
from paratrain.errors import UserError
from paratrain.nn import (AdamWeightDecay, CosineDecayLR, ExponentialDecayLR, InverseDecayLR, Momentum,
                          NaturalExpDecayLR, PolynomialDecayLR, WarmUpLR)


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


def test_beta_and_eps_are_float32_as_mindspores():
    """MindSpore keeps beta1, beta2 and eps as float32 tensors, so 1 - beta2 is 1 - float32(0.999), 1.3e-5 below
    0.001: every update is that much (6e-6, through the square root) larger than in double precision."""
    torch.manual_seed(0)
    grads = [torch.randn(64) for _ in range(3)]
    param = torch.nn.Parameter(torch.zeros(64))
    opt = AdamWeightDecay([param], learning_rate=0.01, beta1=0.9, beta2=0.999, eps=1e-6)
    got = []
    for g in grads:
        param.grad = g.clone()
        opt.step()
        got.append(param.detach().clone())
    float32 = partial(torch.tensor, dtype=torch.float32)
    want = reference_updates(torch.zeros(64), grads, lambda s: 0.01, float32(0.9), float32(0.999), float32(1e-6), 0.0)
    got, want = torch.stack(got), torch.stack(want)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * float(want.abs().max()))


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
    # MindSpore 2.7.0's code, not its documentation's p = step / decay_steps
    (NaturalExpDecayLR(0.1, 0.3, 4), lambda s: 0.1 * math.exp(-0.3 * s)),
    (NaturalExpDecayLR(0.1, 0.3, 4, is_stair=True), lambda s: 0.1 * math.exp(-0.3 * (s // 4 * 4))),
    (InverseDecayLR(0.1, 0.5, 3), lambda s: 0.1 / (1 + 0.5 * s / 3)),
    (InverseDecayLR(0.1, 0.5, 3, is_stair=True), lambda s: 0.1 / (1 + 0.5 * (s // 3))),
], ids=["warmup", "polynomial", "polynomial-restarting", "cosine", "exponential", "exponential-stair",
        "natural-exp", "natural-exp-stair", "inverse", "inverse-stair"])
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
    with pytest.raises(UserError, match="NaturalExpDecayLR\\(decay_rate=0\\)"):
        NaturalExpDecayLR(0.1, 0, 10)
    with pytest.raises(UserError, match="InverseDecayLR\\(decay_steps=-1\\)"):
        InverseDecayLR(0.1, 0.5, -1)


@pytest.mark.parametrize("optimizer", [Momentum, AdamWeightDecay])
@pytest.mark.parametrize("learning_rate, named", [
    ([], "learning_rate=[]"), ([0.1, -0.1], "learning_rate[1]=-0.1"), ("fast", "learning_rate='fast'"),
    ((0.1, "fast"), "learning_rate[1]='fast'"), (None, "learning_rate=None"),
])
def test_each_optimizer_refuses_a_learning_rate_it_cannot_use_naming_it(optimizer, learning_rate, named):
    with pytest.raises(UserError, match=re.escape(f"{optimizer.__name__}({named}): expected a number >= 0")):
        optimizer([torch.nn.Parameter(torch.ones(2))], learning_rate=learning_rate, **(
            {"momentum": 0.9} if optimizer is Momentum else {}))


def _momentum_run(learning_rate, grads, nesterov=False, split=None):
    """Momentum(learning_rate, 0.9, weight_decay 0.01) over ``grads`` from ones: the parameter after each step
    and the rate its group holds then; at step ``split`` the optimizer is saved, made again and loaded."""
    param = torch.nn.Parameter(torch.ones(3))

    def make():
        return Momentum([param], learning_rate, 0.9, weight_decay=0.01, use_nesterov=nesterov)

    opt, params, rates = make(), [], []
    for i, g in enumerate(grads):
        if i == split:
            state = opt.state_dict()
            opt = make()
            opt.load_state_dict(state)
        param.grad = g.clone()
        opt.step()
        params.append(param.detach().clone())
        rates.append(opt.param_groups[0]["lr"])
    return params, rates


def _sgd_by_hand(rates, grads, nesterov=False):
    """torch's SGD (momentum 0.9, weight_decay 0.01, no dampening) with its ``lr`` set to ``rates[i]`` at step
    ``i``: the parameter after each step."""
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.0, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
    out = []
    for rate, g in zip(rates, grads):
        opt.param_groups[0]["lr"] = rate
        param.grad = g.clone()
        opt.step()
        out.append(param.detach().clone())
    return out


@pytest.mark.parametrize("learning_rate, rates", [
    ([0.1, 0.05, 0.02, 0.01], [0.1, 0.05, 0.02, 0.01, 0.01, 0.01, 0.01]),  # past the end: the last one
    ((0.2, 0.1), [0.2, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]),
    (CosineDecayLR(0.01, 0.1, 4), [0.01 + 0.09 * (1 + math.cos(math.pi * min(s, 4) / 4)) / 2 for s in range(7)]),
    (InverseDecayLR(0.1, 0.5, 2, is_stair=True), [0.1 / (1 + 0.5 * (s // 2)) for s in range(7)]),
    (torch.tensor([0.3, 0.2, 0.1]), [0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1]),
    (np.array([0.3, 0.2], dtype=np.float32), [0.3, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2]),
], ids=["list", "tuple", "cosine", "inverse-stair", "tensor", "numpy"])
@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
def test_momentum_follows_a_list_or_a_schedule_step_by_step_as_sgd_driven_by_hand(learning_rate, rates, nesterov):
    torch.manual_seed(0)
    grads = [torch.randn(3) for _ in rates]
    params, got = _momentum_run(learning_rate, grads, nesterov)
    assert got == pytest.approx(rates, rel=1e-6)  # float32 tensor elements: to float32's precision
    for a, b in zip(params, _sgd_by_hand(got, grads, nesterov)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    resumed, resumed_rates = _momentum_run(learning_rate, grads, nesterov, split=3)
    assert resumed_rates == got and all(torch.equal(a, b) for a, b in zip(resumed, params))


def test_momentum_with_a_number_is_torchs_sgd_that_torchs_schedulers_drive():
    torch.manual_seed(0)
    grads = [torch.randn(3) for _ in range(4)]
    param = torch.nn.Parameter(torch.ones(3))
    opt = Momentum([param], 0.1, 0.9, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    params = []
    for g in grads:
        param.grad = g.clone()
        opt.step()
        scheduler.step()
        params.append(param.detach().clone())
    for a, b in zip(params, _sgd_by_hand([0.1, 0.1, 0.05, 0.05], grads)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert "step" not in opt.state[param]  # a plain SGD state


def test_adam_weight_decay_takes_a_list_and_a_reload_goes_on_with_its_rates():
    torch.manual_seed(0)
    grads = [torch.randn(4) for _ in range(5)]
    rates = [0.05, 0.04, 0.03]

    def run(split):
        param = torch.nn.Parameter(torch.ones(4))
        opt, seen = AdamWeightDecay([param], learning_rate=rates), []
        for i, g in enumerate(grads):
            if i == split:
                state = opt.state_dict()
                opt = AdamWeightDecay([param], learning_rate=rates)
                opt.load_state_dict(state)
            param.grad = g.clone()
            opt.step()
            seen.append(opt.param_groups[0]["lr"])
        return param.detach(), seen

    param, seen = run(split=-1)
    assert seen == [0.05, 0.04, 0.03, 0.03, 0.03]
    want = reference_updates(torch.ones(4), grads, lambda s: rates[min(s, 2)], 0.9, 0.999, 1e-6, 0.0)[-1]
    torch.testing.assert_close(param, want)
    resumed, resumed_seen = run(split=2)
    assert resumed_seen == seen and torch.equal(resumed, param)


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


@pytest.mark.parametrize("make_optimizer", [
    lambda params: Momentum(params, [0.1, 0.05, 0.02, 0.01], 0.9, weight_decay=0.1),
    lambda params: AdamWeightDecay(params, CosineDecayLR(0.01, 0.1, 4), weight_decay=0.1),
], ids=["momentum-list", "adam-weight-decay-cosine"])
def test_a_resume_through_torchs_distributed_checkpoint_goes_on_as_if_uninterrupted(make_optimizer):
    """The checkpointer's path: the net loaded, then the optimizer state by ``set_optimizer_state_dict``, which
    steps a fresh optimizer once with zero gradients and its groups' ``lr`` zeroed to make its state."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2, device="cpu")
    batches = [torch.randn(4, 3, device="cpu") for _ in range(4)]

    def train(net, opt, batches):
        rates = []
        for x in batches:
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            rates.append(opt.param_groups[0]["lr"])
        return rates

    opt = make_optimizer(net.parameters())
    train(net, opt, batches[:2])
    saved_net = {k: v.clone() for k, v in net.state_dict().items()}
    saved_opt = copy.deepcopy(get_optimizer_state_dict(net, opt, options=options))  # as written to disk
    rates = train(net, opt, batches[2:])

    resumed = torch.nn.Linear(3, 2, device="cpu")
    resumed.load_state_dict(saved_net)
    resumed_opt = make_optimizer(resumed.parameters())
    set_optimizer_state_dict(resumed, resumed_opt, saved_opt, options=options)
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in saved_net.items())  # not moved by the load
    assert train(resumed, resumed_opt, batches[2:]) == rates and len(set(rates)) == 2
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), net.parameters()))


@pytest.mark.parametrize("learning_rate", [[0.1, 0.05, 0.02], CosineDecayLR(0.01, 0.1, 2), 0.1],
                         ids=["list", "schedule", "number"])
def test_model_rebuilds_momentum_with_its_learning_rate_and_groups(learning_rate):
    from paratrain.train.placement import group_names, rebuild_optimizer

    net = torch.nn.Linear(3, 2, device="cpu")
    opt = Momentum([{"params": [net.weight], "weight_decay": 0.01}, {"params": [net.bias]}], learning_rate, 0.9)
    rebuilt = rebuild_optimizer(opt, group_names(opt, net), net.named_parameters())
    assert type(rebuilt) is Momentum and rebuilt.scheduled == opt.scheduled
    assert [g["weight_decay"] for g in rebuilt.param_groups] == [0.01, 0.0]
    assert all("learning_rate" not in g for g in rebuilt.param_groups)
    rates = []
    for _ in range(4):
        net(torch.ones(1, 3, device="cpu")).sum().backward()
        rebuilt.step()
        rebuilt.zero_grad()
        rates.append(rebuilt.param_groups[1]["lr"])
    assert rates == [opt.rate(s) for s in range(4)]


def test_ungrouped_trainable_params_leave_layer_norms_undecayed_as_mindspore():
    """MindSpore's default filter: ungrouped, a parameter named with ``beta`` or ``gamma`` (a LayerNorm's, as
    ``trainable_params()`` names them) is not decayed; the others are, and unnamed torch parameters too."""
    from paratrain.nn import Cell, Dense
    from paratrain.nn.layers import _LayerNorm

    class Net(Cell):
        def __init__(self):
            super().__init__()
            self.dense, self.norm = Dense(3, 3), _LayerNorm(3, torch.float32, torch.float32)

    net = Net()
    params = net.trainable_params()
    assert [p.param_name for p in params] == ["dense.weight", "dense.bias", "norm.gamma", "norm.beta"]
    before = [p.detach().clone() for p in params]
    opt = AdamWeightDecay(params, learning_rate=0.1, weight_decay=0.5)
    for _ in range(3):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
    for p, old in zip(params, before):
        torch.testing.assert_close(p.detach(), old * (1 - 0.05) ** 3 if "dense" in p.param_name else old)
    unnamed = torch.nn.Parameter(torch.ones(2))
    unnamed.grad = torch.zeros(2)
    AdamWeightDecay([unnamed], learning_rate=0.1, weight_decay=0.5).step()
    torch.testing.assert_close(unnamed.detach(), torch.full((2,), 0.95))


def test_ungrouped_net_parameters_leave_the_blocks_layer_norms_undecayed_as_mindspore():
    """torch's idiom ``AdamWeightDecay(net.parameters())``: the blocks' LayerNorm parameters, MindSpore's ``gamma``
    and ``beta``, are left out of the decay by MindSpore's default filter (``'beta' not in name and 'gamma' not in
    name``), as from ``trainable_params()``."""
    from paratrain.nn import TransformerEncoderLayer

    net = TransformerEncoderLayer(batch_size=2, hidden_size=8, ffn_hidden_size=16, num_heads=2, seq_length=4)
    names = {p: name for name, p in net.named_parameters()}
    opt = AdamWeightDecay(net.parameters(), learning_rate=0.1, weight_decay=0.5)
    undecayed = {names[p] for group in opt.param_groups if group["weight_decay"] == 0.0 for p in group["params"]}
    assert undecayed == {name for name in names.values() if name.startswith("layernorm")}
    assert {names[p] for p in opt.param_groups[0]["params"]} == set(names.values()) - undecayed
    assert opt.param_groups[0]["weight_decay"] == 0.5
