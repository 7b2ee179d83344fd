"""paratrain.nn's AdamWeightDecay against MindSpore 2.7.0's on the same encoder layer: its parameters after each
of 5 steps, grouped as MindSpore's tutorial groups them and ungrouped (MindSpore's default decay filter), with a
constant rate and with a schedule. Both optimizers take MindSpore's gradients: Adam's normalisation makes the
rounding of a gradient element near ``eps / sqrt(1 - beta2)`` (3e-5) a step 1e-5 of the parameters apart, so
each library's own gradients (compared in ``test_blocks``) would part the parameters by more than the optimizers
do."""
import mindspore
import numpy as np
import pytest
import torch
from mindspore import nn as ms_nn
from mindspore.parallel import _transformer as ms_transformer

import paratrain.nn as pnn
from reference import (Gelu, assert_close, copy_weights, in_fp32, ms_parameters, ms_tensor, ms_value_and_grads,
                       ms_weights, paratrain_name, to_paratrain)

B, S, H = 2, 4, 16
LAYER = dict(batch_size=B, hidden_size=H, ffn_hidden_size=32, num_heads=2, seq_length=S, attention_dropout_rate=0.0,
             hidden_dropout_rate=0.0)


def tutorial_groups(params, name):
    """The tutorial's groups of ``params``: decay 1e-1 but for LayerNorms and biases (by ``name(param)``), then
    ``order_params``."""
    decayed = [p for p in params if "layernorm" not in name(p).lower() and "bias" not in name(p).lower()]
    others = [p for p in params if not any(p is q for q in decayed)]
    return [{"params": decayed, "weight_decay": 1e-1}, {"params": others, "weight_decay": 0.0},
            {"order_params": params}]


OPTIMIZERS = {  # (MindSpore's, paratrain's): net -> optimizer
    "grouped": (lambda ms_net, lr: ms_nn.AdamWeightDecay(
                    tutorial_groups(ms_net.trainable_params(), lambda p: p.name), learning_rate=lr()),
                lambda net, lr: pnn.AdamWeightDecay(
                    tutorial_groups(net.trainable_params(), lambda p: p.param_name), learning_rate=lr())),
    "ungrouped": (lambda ms_net, lr: ms_nn.AdamWeightDecay(ms_net.trainable_params(), learning_rate=lr(),
                                                           weight_decay=1e-1),
                  lambda net, lr: pnn.AdamWeightDecay(net.trainable_params(), learning_rate=lr(), weight_decay=1e-1)),
    # torch's idiom: the parameters without their MindSpore names
    "ungrouped, net.parameters()": (
        lambda ms_net, lr: ms_nn.AdamWeightDecay(ms_net.trainable_params(), learning_rate=lr(), weight_decay=1e-1),
        lambda net, lr: pnn.AdamWeightDecay(net.parameters(), learning_rate=lr(), weight_decay=1e-1)),
}
RATES = {"constant": (lambda: 1e-2, lambda: 1e-2),
         "PolynomialDecayLR": (lambda: ms_nn.PolynomialDecayLR(2e-2, 1e-3, 4, 2.0),
                               lambda: pnn.PolynomialDecayLR(2e-2, 1e-3, 4, 2.0))}


@pytest.mark.parametrize("rate", list(RATES))
@pytest.mark.parametrize("groups", list(OPTIMIZERS))
def test_adam_weight_decay(groups, rate):
    ms_net = in_fp32(ms_transformer.TransformerEncoderLayer(**LAYER, hidden_act=Gelu))
    net = pnn.TransformerEncoderLayer(**LAYER)
    copy_weights(ms_net, net)
    (ms_optimizer, optimizer), (ms_rate, torch_rate) = OPTIMIZERS[groups], RATES[rate]
    ms_optimizer, optimizer = ms_optimizer(ms_net, ms_rate), optimizer(net, torch_rate)
    ms_order = [p.name for p in ms_optimizer.parameters]
    names = {p.name: name for name, p in ms_parameters(ms_net).items()}
    rng = np.random.default_rng(0)
    mask = np.tril(np.ones((S, S), np.float32))[None].repeat(B, 0)
    for step in range(5):
        x = rng.standard_normal((B, S, H)).astype(np.float32)
        weights = rng.standard_normal((B, S, H)).astype(np.float32)
        ms_w = ms_tensor(weights)
        _, ms_grads, _ = ms_value_and_grads(ms_net, lambda *xs: (ms_net(*xs)[0] * ms_w).sum(), [x, mask])
        for name, p in net.named_parameters():
            p.grad = torch.from_numpy(ms_grads[name].copy())
        ms_optimizer(tuple(mindspore.Tensor(to_paratrain(names[n], ms_grads[paratrain_name(names[n])]))
                           for n in ms_order))
        optimizer.step()
        parameters = dict(net.named_parameters())
        for name, value in ms_weights(ms_net).items():
            assert_close(f"AdamWeightDecay ({groups}, {rate}): parameters", parameters[name].detach().numpy(), value,
                         name=name)
