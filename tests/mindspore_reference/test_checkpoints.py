"""Checkpoints cross between MindSpore 2.7.0 and paratrain: the same tiny encoder-decoder (embedding, attention,
cross-attention, FFN or mixture of experts, LayerNorms) built in both, and a net of MindSpore's ``nn`` cells beside
torch's (Embedding, Conv2d, BatchNorm2d, Dense, LayerNorm); what one saves the other loads, with the same outputs and
nothing left unloaded; both ``load_param_into_net`` report the same on a partly matching file."""
import mindspore
import numpy as np
import pytest
import torch
from mindspore import nn as ms_nn
from mindspore.parallel._transformer import MoEConfig as MsMoEConfig
from mindspore.parallel._transformer import Transformer as MsTransformer
from mindspore.parallel._transformer import VocabEmbedding as MsVocabEmbedding

import paratrain
import paratrain.nn as pnn
from reference import Gelu, in_fp32

VOCAB, HIDDEN, FFN, HEADS, BATCH, SRC, TGT = 11, 8, 12, 2, 2, 5, 4
FP32 = dict(layernorm_compute_type=mindspore.float32, softmax_compute_type=mindspore.float32,
            param_init_type=mindspore.float32)


class MsNet(ms_nn.Cell):
    def __init__(self, experts: int):
        super().__init__()
        self.embedding = MsVocabEmbedding(VOCAB, HIDDEN)
        moe = {"moe_config": MsMoEConfig(expert_num=experts)} if experts > 1 else {}
        self.transformer = MsTransformer(HIDDEN, BATCH, FFN, SRC, TGT, encoder_layers=1, decoder_layers=1,
                                         num_heads=HEADS, hidden_act=Gelu, **FP32, **moe)

    def construct(self, src, tgt, encoder_mask, decoder_mask, memory_mask):
        source, _ = self.embedding(src)
        target, _ = self.embedding(tgt)
        return self.transformer(source, encoder_mask, target, decoder_mask, memory_mask)[0]


class Net(pnn.Cell):
    def __init__(self, experts: int):
        super().__init__()
        self.embedding = pnn.VocabEmbedding(VOCAB, HIDDEN)
        moe = {"moe_config": pnn.MoEConfig(expert_num=experts)} if experts > 1 else {}
        self.transformer = pnn.Transformer(HIDDEN, BATCH, FFN, SRC, TGT, encoder_layers=1, decoder_layers=1,
                                           num_heads=HEADS, hidden_act="gelu", **moe)

    def forward(self, src, tgt, encoder_mask, decoder_mask, memory_mask):
        return self.transformer(self.embedding(src)[0], encoder_mask, self.embedding(tgt)[0], decoder_mask,
                                memory_mask)[0]


def inputs():
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(0, VOCAB, (BATCH, SRC)), rng.integers(0, VOCAB, (BATCH, TGT))
    encoder_mask = np.ones((BATCH, SRC, SRC), np.float32)
    encoder_mask[1, :, 3:] = 0  # the second source padded after 3 tokens
    decoder_mask = np.tril(np.ones((TGT, TGT), np.float32))[None].repeat(BATCH, 0)
    memory_mask = np.ones((BATCH, TGT, SRC), np.float32)
    memory_mask[1, :, 3:] = 0
    return src.astype(np.int32), tgt.astype(np.int32), encoder_mask, decoder_mask, memory_mask


def ms_output(net: MsNet) -> np.ndarray:
    net.set_train(False)
    return net(*(mindspore.Tensor(x) for x in inputs())).asnumpy()


@torch.no_grad()
def pt_output(net: Net) -> np.ndarray:
    return net.eval()(*(torch.from_numpy(x).long() if x.dtype == np.int32 else torch.from_numpy(x)
                        for x in inputs())).numpy()


def assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal to 1e-5 relative to the size of the output (the outputs of weights of MindSpore's initial scale, 0.01,
    are small: elementwise, float32's rounding alone reaches 1e-3 relative on the smallest elements)."""
    error = np.linalg.norm(actual - expected) / np.linalg.norm(expected)
    assert error <= 1e-5, error


def nets(experts: int):
    mindspore.set_seed(1)
    torch.manual_seed(2)
    return in_fp32(MsNet(experts)), Net(experts)


def spread(ms_net: ms_nn.Cell) -> None:
    """Weights of MindSpore's net away from their initial scale (0.01), LayerNorms and biases away from 1 and 0, so
    that the outputs are of order 1 and a weight in the wrong place or layout shows."""
    rng = np.random.default_rng(3)
    for p in ms_net.get_parameters():
        value = rng.normal(0, 0.3, p.shape) + (1 if p.name.endswith(("gamma", "moving_variance")) else 0)
        p.set_data(mindspore.Tensor(value.astype(np.float32)))


def moe_weights_agree(ms_net: MsNet, net: Net) -> None:
    """MindSpore's MoE does not run stand-alone on the CPU in 2.7.0 (its BatchMatMul does not broadcast there): the
    experts' weights are compared, MindSpore's (experts, in, out) and biases (1, experts, 1, out)."""
    for stack in ("encoder", "decoder"):
        ms_moe, moe = (getattr(n.transformer, stack).blocks[0].output for n in (ms_net, net))
        pairs = [(moe.router.weight, ms_moe.router.dense.weight), (moe.experts.w1, ms_moe.ffn.mapping.weight),
                 (moe.experts.w2, ms_moe.ffn.projection.weight),
                 (moe.experts.b1, ms_moe.ffn.mapping.bias.reshape(2, FFN)),
                 (moe.experts.b2, ms_moe.ffn.projection.bias.reshape(2, HIDDEN))]
        for ours, theirs in pairs:
            torch.testing.assert_close(ours.detach(), torch.from_numpy(theirs.asnumpy()), rtol=0, atol=0)


EXPERTS = [pytest.param(1, id="ffn"), pytest.param(2, id="moe")]


@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_a_mindspore_checkpoint_loads_into_paratrains_net_with_the_same_outputs(tmp_path, fmt, experts):
    ms_net, net = nets(experts)
    spread(ms_net)
    file = str(tmp_path / f"net.{fmt}")
    mindspore.save_checkpoint(ms_net, file, format=fmt)

    params = paratrain.load_checkpoint(file, format=fmt)
    assert len(params) == len(list(ms_net.get_parameters()))
    assert paratrain.load_param_into_net(net, params) == ([], [])
    if experts > 1:
        moe_weights_agree(ms_net, net)
    else:
        assert_close(pt_output(net), ms_output(ms_net))


@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_a_paratrain_checkpoint_loads_into_mindspores_net_with_the_same_outputs(tmp_path, fmt, experts):
    ms_net, net = nets(experts)
    with torch.no_grad():  # weights of order 1, LayerNorms and biases away from 1 and 0
        for name, p in net.named_parameters():
            p.normal_(0, 0.3).add_(1 if "layernorm" in name and name.endswith("weight") else 0)
    file = str(tmp_path / f"net.{fmt}")
    paratrain.save_checkpoint(net, file, format=fmt, crc_check=True)

    params = mindspore.load_checkpoint(file, format=fmt, crc_check=True)
    assert mindspore.load_param_into_net(ms_net, params) == ([], [])
    if experts > 1:
        moe_weights_agree(ms_net, net)
    else:
        assert_close(ms_output(ms_net), pt_output(net))


def test_both_load_param_into_net_report_the_same_of_a_partly_matching_checkpoint(tmp_path):
    ms_net, net = nets(1)
    entries = [{"name": p.name, "data": p} for p in ms_net.get_parameters()]
    kept = [e for e in entries if "decoder" not in e["name"] or "dense2" not in e["name"]]
    moved = [{"name": "backbone." + e["name"], "data": e["data"]} for e in entries if "layernorm2.gamma" in e["name"]]
    extra = [{"name": "head.weight", "data": mindspore.Tensor(np.ones((3, 3), np.float32))}]
    file = str(tmp_path / "partial.ckpt")
    mindspore.save_checkpoint([e for e in kept if "layernorm2.gamma" not in e["name"]] + moved + extra, file)

    expected = mindspore.load_param_into_net(ms_net, mindspore.load_checkpoint(file))
    param_not_load, ckpt_not_load = paratrain.load_param_into_net(net, paratrain.load_checkpoint(file))
    assert len(expected[0]) == 4 and "backbone.transformer.encoder.blocks.0.layernorm2.gamma" in expected[1]
    assert sorted(param_not_load) == sorted(expected[0]) and ckpt_not_load == expected[1]
    torch.testing.assert_close(net.transformer.encoder.blocks[0].layernorm2.weight.detach(),
                               torch.from_numpy(ms_net.transformer.encoder.blocks[0].layernorm2.gamma.asnumpy()))


class MsCells(ms_nn.Cell):
    def __init__(self):
        super().__init__()
        self.embedding = ms_nn.Embedding(VOCAB, 6)
        self.conv = ms_nn.Conv2d(1, 3, 3, pad_mode="valid", has_bias=True)
        self.bn = ms_nn.BatchNorm2d(3)
        self.dense = ms_nn.Dense(3 * 4 * 4, 5)
        self.norm = ms_nn.LayerNorm((5,), epsilon=1e-5)

    def construct(self, ids):
        x = self.bn(self.conv(self.embedding(ids).expand_dims(1)))
        return self.norm(self.dense(x.reshape(x.shape[0], -1)))


class TorchModules(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, 6)
        self.conv = torch.nn.Conv2d(1, 3, 3)
        self.bn = torch.nn.BatchNorm2d(3)
        self.dense = torch.nn.Linear(3 * 4 * 4, 5)
        self.norm = torch.nn.LayerNorm(5)

    def forward(self, ids):
        x = self.bn(self.conv(self.embedding(ids).unsqueeze(1)))
        return self.norm(self.dense(x.flatten(1)))


IDS = np.random.default_rng(4).integers(0, VOCAB, (BATCH, 6)).astype(np.int32)


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_mindspores_nn_cells_and_torchs_modules_exchange_checkpoints(tmp_path, fmt):
    mindspore.set_seed(1)
    ms_net, net = MsCells(), TorchModules()
    spread(ms_net)
    ms_net.set_train(False)
    mindspore.save_checkpoint(ms_net, str(tmp_path / f"ms.{fmt}"), format=fmt)
    assert paratrain.load_param_into_net(net, paratrain.load_checkpoint(tmp_path / f"ms.{fmt}")) == ([], [])
    with torch.no_grad():
        assert_close(net.eval()(torch.from_numpy(IDS).long()).numpy(), ms_net(mindspore.Tensor(IDS)).asnumpy())

    torch.manual_seed(5)
    with torch.no_grad():  # paratrain's side trained on: new weights and statistics
        for name, t in net.state_dict().items():
            if t.is_floating_point():
                t.copy_(torch.rand_like(t) + 0.5 if name.endswith("running_var") else torch.randn_like(t) * 0.3)
    paratrain.save_checkpoint(net, tmp_path / f"pt.{fmt}", format=fmt)
    fresh = MsCells()
    assert mindspore.load_param_into_net(fresh, mindspore.load_checkpoint(str(tmp_path / f"pt.{fmt}"),
                                                                          format=fmt)) == ([], [])
    fresh.set_train(False)
    with torch.no_grad():
        assert_close(fresh(mindspore.Tensor(IDS)).asnumpy(), net(torch.from_numpy(IDS).long()).numpy())
