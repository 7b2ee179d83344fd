"""MindSpore's checkpoint files without MindSpore: ``save_checkpoint`` writes ``.ckpt`` (byte for byte as MindSpore
2.7.0) and safetensors in MindSpore's names and layouts, ``load_checkpoint`` reads them back marked as in that
layout, and ``load_param_into_net`` maps them onto paratrain's blocks and reports as MindSpore's
(``tests/mindspore_reference/test_checkpoints.py`` checks the same against MindSpore itself)."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from forked_ranks import run_distributed
import paratrain
import paratrain.nn as pnn
from paratrain import load_checkpoint, load_param_into_net, save_checkpoint
from paratrain.errors import UserError
from paratrain.train.mindspore_checkpoint import mindspore_parameter

# MindSpore 2.7.0's save_checkpoint of [dense.weight float32 arange(6) (2, 3), norm.gamma float16 [1.5, -2], step
# int64 7 (a scalar)] with append_dict={"note": "hi"} and crc_check=True
MINDSPORE_CKPT = bytes.fromhex(
    "0a370a0c64656e73652e7765696768741227080208031207466c6f617433321a18000000000000803f0000004000004040000080400000"
    "a0400a1f0a0a6e6f726d2e67616d6d61121108021207466c6f617431361a04003e00c00a190a047374657012111205496e7436341a0807"
    "000000000000000a190a046e6f74651211080012037374721a0868000000690000006372635f6e756d000000000000b9b7a3be")
GOLDEN = {"dense.weight": torch.arange(6.0).reshape(2, 3), "norm.gamma": torch.tensor([1.5, -2.0], dtype=torch.float16),
          "step": torch.tensor(7)}


class Net(pnn.Cell):
    """Every block: VocabEmbedding, an encoder-decoder Transformer (attention, cross-attention, FeedForward,
    LayerNorms), a mixture of experts, Dense, and a torch LayerNorm."""

    def __init__(self):
        super().__init__()
        self.embedding = pnn.VocabEmbedding(7, 4)
        self.transformer = pnn.Transformer(4, 2, 6, 3, 3, encoder_layers=1, decoder_layers=1, num_heads=2)
        self.moe = pnn.MoE(4, 6, 0.0, moe_config=pnn.MoEConfig(expert_num=2))
        self.head = pnn.Dense(4, 5)
        self.norm = nn.LayerNorm(5)

    def forward(self, src, tgt):
        x = self.transformer(self.embedding(src)[0], None, self.embedding(tgt)[0])[0]
        return self.norm(self.head(self.moe(x)[0]))


def randomised(net: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_()
    return net


@pytest.fixture(scope="module")
def net():
    return randomised(Net(), 0)


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_a_net_saved_in_mindspores_names_and_layouts_loads_back_with_the_same_values(tmp_path, net, fmt):
    save_checkpoint(net, tmp_path / "net", format=fmt)
    file = tmp_path / f"net.{fmt}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [file.name]  # no temporary file left

    params = load_checkpoint(file)
    assert all(p.checkpoint_layout == "mindspore" for p in params.values())
    layer = "transformer.decoder.blocks.0"
    assert {"embedding.embedding_table", f"{layer}.layernorm1.gamma", f"{layer}.cross_attention_layernorm.beta",
            "norm.gamma", "moe.router.dense.weight", "moe.ffn.mapping.weight"} <= params.keys()
    assert not any(name.endswith(("embedding.weight", "layernorm1.weight")) for name in params)
    block = net.transformer.decoder.blocks[0]
    for ms_name, ours in [(f"{layer}.output.mapping.weight", block.output.mapping.weight),  # MindSpore's (in, out)
                          (f"{layer}.cross_attention.projection.weight", block.cross_attention.projection.weight)]:
        assert torch.equal(params[ms_name], ours.detach().T)
    assert torch.equal(params[f"{layer}.attention.dense1.weight"], block.attention.dense1.weight.detach())
    assert torch.equal(params["moe.ffn.mapping.bias"], net.moe.experts.b1.detach().reshape(1, 2, 1, 6))
    assert torch.equal(params["head.weight"], net.head.weight.detach())  # Dense is (out, in) as torch

    fresh = randomised(Net(), 1)
    assert load_param_into_net(fresh, params) == ([], [])
    for (name, ours), theirs in zip(net.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(ours, theirs), name


def test_the_ckpt_format_is_mindspores_byte_for_byte(tmp_path):
    (tmp_path / "mindspore.ckpt").write_bytes(MINDSPORE_CKPT)
    params = load_checkpoint(tmp_path / "mindspore.ckpt", crc_check=True)
    assert list(params) == [*GOLDEN, "note"] and params["note"] == "hi"
    for name, value in GOLDEN.items():
        assert params[name].dtype == value.dtype and torch.equal(params[name], value), name

    save_checkpoint([{"name": k, "data": v} for k, v in GOLDEN.items()], str(tmp_path / "ours.ckpt"),
                    append_dict={"note": "hi"}, crc_check=True)
    assert (tmp_path / "ours.ckpt").read_bytes() == MINDSPORE_CKPT
    save_checkpoint(dict(GOLDEN), tmp_path / "dict.ckpt", choice_func=lambda name: name != "step")
    assert list(load_checkpoint(tmp_path / "dict.ckpt")) == ["dense.weight", "norm.gamma"]


def test_a_batch_norm_saves_as_mindspores_and_its_batch_count_is_left_out(tmp_path):
    net = randomised(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)), 9)
    net[1].running_var.uniform_(0.5, 1.5)
    save_checkpoint(net, tmp_path / "bn.ckpt")
    params = load_checkpoint(tmp_path / "bn.ckpt")
    assert list(params) == ["0.weight", "0.bias", "1.gamma", "1.beta", "1.moving_mean", "1.moving_variance"]
    fresh = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    assert load_param_into_net(fresh, params) == ([], [])
    assert torch.equal(fresh[1].running_var, net[1].running_var)


def test_mindspore_safetensors_are_read_in_mindspores_layout_and_paratrains_in_its_own(tmp_path, net):
    save_checkpoint(net, tmp_path / "ms.safetensors", format="safetensors", crc_check=True)
    raw = load_file(tmp_path / "ms.safetensors")
    assert "embedding.embedding_table" in raw
    assert raw["transformer.encoder.blocks.0.output.mapping.weight"].shape == (4, 6)  # (in, out)
    assert load_checkpoint(tmp_path / "ms.safetensors", crc_check=True).keys() == raw.keys()

    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, tmp_path / "pt.safetensors")
    params = load_checkpoint(tmp_path / "pt.safetensors")  # paratrain's names, torch's layout
    assert not any(getattr(p, "checkpoint_layout", None) for p in params.values())
    fresh = randomised(Net(), 2)
    assert load_param_into_net(fresh, params) == ([], [])
    assert torch.equal(fresh.transformer.encoder.blocks[0].output.mapping.weight,
                       net.transformer.encoder.blocks[0].output.mapping.weight)


def test_load_param_into_net_returns_what_is_not_loaded_and_follows_mindspores_prefix_rule(tmp_path):
    source = randomised(Net(), 3)
    save_checkpoint(source, tmp_path / "net.ckpt")
    params = load_checkpoint(tmp_path / "net.ckpt")
    dropped = "transformer.encoder.blocks.0.attention.dense2.weight"
    moved = {"network." + k: params.pop(k) for k in list(params) if k.startswith("head.")}
    params.pop(dropped)
    params["unknown.weight"] = load_checkpoint(tmp_path / "net.ckpt", specify_prefix="norm.")["norm.gamma"]
    params.update(moved)

    fresh = randomised(Net(), 4)
    param_not_load, ckpt_not_load = load_param_into_net(fresh, params)
    assert param_not_load == [dropped]
    # entries found under the prefix ``network.`` are loaded, and stay in ckpt_not_load as in MindSpore
    assert ckpt_not_load == ["unknown.weight", "network.head.weight", "network.head.bias"]
    assert torch.equal(fresh.head.weight, source.head.weight)

    strict = randomised(Net(), 5)
    assert load_param_into_net(strict, params, strict_load=True)[0] == [dropped, "head.weight", "head.bias"]
    assert not torch.equal(strict.head.weight, source.head.weight)


def test_dtypes_convert_float_to_float_unless_strict_and_never_across_kinds(tmp_path):
    net = nn.Linear(2, 3)
    save_checkpoint({"weight": torch.ones(3, 2, dtype=torch.float16), "bias": torch.ones(3, dtype=torch.float64)},
                    tmp_path / "half.ckpt")
    assert load_param_into_net(net, load_checkpoint(tmp_path / "half.ckpt")) == ([], [])
    assert net.weight.dtype == torch.float32 and torch.equal(net.weight, torch.ones(3, 2))
    with pytest.raises(UserError, match="weight is torch.float16 in the checkpoint, torch.float32 in the net: "
                                        "strict_load=True converts no dtype"):
        load_checkpoint(tmp_path / "half.ckpt", net=net, strict_load=True)
    save_checkpoint({"weight": torch.ones(3, 2, dtype=torch.int32)}, tmp_path / "int.ckpt")
    with pytest.raises(UserError, match="only float to float and int to int convert"):
        load_checkpoint(tmp_path / "int.ckpt", net=net)


def test_a_shape_that_does_not_fit_names_the_parameter_and_both_shapes(tmp_path, net):
    save_checkpoint(net, tmp_path / "net.ckpt")
    params = load_checkpoint(tmp_path / "net.ckpt")
    name = "transformer.encoder.blocks.0.attention.projection.weight"
    params[name] = mindspore_parameter(name, params[name][:, :3])  # still in MindSpore's layout
    with pytest.raises(UserError, match=rf"{name} has shape \[4, 3\] in the checkpoint, \[4, 4\] in the net's "
                                        rf"transformer.encoder.blocks.0.attention.projection.weight \[4, 4\] in "
                                        rf"MindSpore's layout"):
        load_param_into_net(randomised(Net(), 6), params)
    plain = {"head.weight": torch.zeros(5, 3)}
    with pytest.raises(RuntimeError, match=r"head.weight has shape \[5, 3\] in the checkpoint, \[5, 4\] in the net"):
        load_param_into_net(randomised(Net(), 6), plain)


def test_a_damaged_ckpt_is_refused_naming_the_file_and_the_cause(tmp_path):
    file = tmp_path / "cut.ckpt"
    file.write_bytes(MINDSPORE_CKPT[:40])
    with pytest.raises(UserError, match=rf"{file} is not a readable MindSpore checkpoint: its protobuf content does "
                                        rf"not parse"):
        load_checkpoint(file)
    flipped = bytearray(MINDSPORE_CKPT)
    flipped[50] ^= 1  # a byte of dense.weight's content
    file.write_bytes(bytes(flipped))
    with pytest.raises(UserError, match=rf"{file} is damaged: its content fails the CRC it records"):
        load_checkpoint(file, crc_check=True)
    file.write_bytes(b"not a checkpoint at all")
    with pytest.raises(UserError, match=str(file)):
        load_checkpoint(file)
    with pytest.raises(UserError, match="missing.ckpt does not exist"):
        load_checkpoint(tmp_path / "missing.ckpt")


def test_encryption_and_what_cannot_be_saved_are_refused(tmp_path, net):
    (tmp_path / "net.ckpt").write_bytes(MINDSPORE_CKPT)
    with pytest.raises(UserError, match="does not read encrypted checkpoints"):
        load_checkpoint(tmp_path / "net.ckpt", dec_key=b"0123456789abcdef")
    with pytest.raises(UserError, match="does not encrypt"):
        save_checkpoint(net, tmp_path / "x.ckpt", enc_key=b"0123456789abcdef")
    with pytest.raises(UserError, match="format='npz' is not one of 'ckpt', 'safetensors'"):
        save_checkpoint(net, tmp_path / "x", format="npz")
    with pytest.raises(UserError, match="note is str, which a MindSpore safetensors file cannot hold"):
        save_checkpoint({"note": "hi"}, tmp_path / "x", format="safetensors")
    with pytest.raises(UserError, match="nothing of .* is left after"):
        load_checkpoint(tmp_path / "net.ckpt", filter_prefix=("dense", "norm", "step", "note"))
    assert not list(tmp_path.glob("x*")) and not list(tmp_path.glob(".*tmp"))


def test_a_failed_save_leaves_the_file_before_it_and_no_temporary_file(tmp_path, net, monkeypatch):
    import errno
    import os

    import safetensors.torch

    file = tmp_path / "net.safetensors"
    save_checkpoint({"w": torch.ones(2)}, file, format="safetensors")
    before = file.read_bytes()

    def full_disk(tensors, name, metadata=None):
        Path(name).write_bytes(b"half a file")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(UserError, match=rf"cannot write {file} \(No space left on device\)"):
        save_checkpoint(net, file, format="safetensors")
    assert file.read_bytes() == before and sorted(tmp_path.iterdir()) == [file]


def test_a_dict_mixing_mindspore_and_other_tensors_is_refused(tmp_path, net):
    save_checkpoint(net, tmp_path / "net.ckpt")
    params = load_checkpoint(tmp_path / "net.ckpt") | {"head.weight": torch.zeros(5, 4)}
    with pytest.raises(UserError, match="mixes tensors read from a MindSpore file"):
        load_param_into_net(net, params)


def test_a_net_with_a_method_named_parts_loads(tmp_path):
    class Parts(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def parts(self):
            return [self.fc]

    source, target = randomised(Parts(), 7), randomised(Parts(), 8)
    save_checkpoint(source, tmp_path / "parts.ckpt")
    assert load_checkpoint(tmp_path / "parts.ckpt", net=target).keys() == {"fc.weight", "fc.bias"}
    assert torch.equal(target.fc.weight, source.fc.weight)


def test_save_checkpoint_is_exported_where_mindspore_has_it():
    import paratrain.train

    assert paratrain.save_checkpoint is paratrain.train.save_checkpoint is save_checkpoint


def test_a_tensor_over_the_slice_size_spans_several_values_and_reads_back_whole(tmp_path, monkeypatch):
    import paratrain.train.mindspore_checkpoint as ms_files

    monkeypatch.setattr(ms_files, "SLICE_BYTES", 8)  # MindSpore's is 512 MiB
    weight = torch.arange(10.0)
    save_checkpoint({"w": weight, "b": torch.ones(1)}, tmp_path / "split.ckpt")
    assert (tmp_path / "split.ckpt").read_bytes().count(b"Float32") == 5 + 1
    params = load_checkpoint(tmp_path / "split.ckpt")
    assert list(params) == ["w", "b"] and torch.equal(params["w"], weight)


def _save_sharded_feed_forward(file):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)  # the same weights on both ranks
    ffn = pnn.FeedForward(4, 6, 0.0)
    ffn.mapping.weight = nn.Parameter(distribute_tensor(ffn.mapping.weight.detach(), mesh, [Shard(0)]))
    whole = ffn.mapping.weight.full_tensor().clone()
    save_checkpoint(ffn, file)  # every rank takes part in gathering the slices; each writes the same file
    return whole.tolist(), ffn.projection.weight.tolist()


@pytest.mark.timeout(120)
def test_a_sharded_net_is_saved_whole_from_every_rank(tmp_path):
    file = str(tmp_path / "ffn.ckpt")
    (mapping, projection), _ = run_distributed(_save_sharded_feed_forward, 2, file)
    params = load_checkpoint(file)
    assert torch.equal(params["mapping.weight"], torch.tensor(mapping).T)  # whole, in MindSpore's (in, out)
    assert torch.equal(params["projection.weight"], torch.tensor(projection).T)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ffn.ckpt"]
