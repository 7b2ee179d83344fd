"""Semi-auto, hybrid and auto parallel for a user's net through ``Model.train``: the losses of one process over
8+ steps, with and without the optimizer shard."""
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from forked_ranks import loss_recorder, run_distributed
from paratrain import ParallelMode, load_checkpoint, ops, reset_auto_parallel_context, set_auto_parallel_context
from paratrain.nn import Dense, Momentum, Parameter
from paratrain.train import Model

STEPS = 8


class MLP(nn.Module):
    """Two Dense layers; ``mp`` > 1: Megatron's split, the first by output features, the second by input
    features, each over ``mp`` devices, the batch over ``dp``."""

    def __init__(self, dp: int = 1, mp: int = 1):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.relu, self.fc2 = Dense(16, 32, weight_init="xavier_uniform"), ops.ReLU(), Dense(32, 8)
        if dp * mp > 1:
            self.fc1.matmul.shard(((dp, 1), (mp, 1)))
            self.fc1.bias_add.shard(((dp, mp), (mp,)))
            self.relu.shard(((dp, mp),))
            self.fc2.matmul.shard(((dp, mp), (1, mp)))

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


class SquaredError(nn.Module):
    """Mean squared error of ops (any strategy): (N, D), (N, D) -> ()."""

    def __init__(self):
        super().__init__()
        self.sub, self.mul, self.mean = ops.Sub(), ops.Mul(), ops.ReduceMean()

    def forward(self, output, label):
        diff = self.sub(output, label)
        return self.mean(self.mul(diff, diff))


def data(steps=STEPS, rows=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 16, generator=g), torch.randn(rows, 8, generator=g)) for _ in range(steps)]


def reference_losses(net, loss_fn, steps=STEPS, lr=0.05, batches=None):
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x, y in batches or data(steps):
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train(net, mode, batches=None, callbacks=(), **context):
    reset_auto_parallel_context()
    set_auto_parallel_context(parallel_mode=mode, **context)
    losses = loss_recorder()
    model = Model(net, loss_fn=SquaredError(), optimizer=Momentum(net.parameters(), 0.05, 0.9))
    model.train(1, batches or data(), callbacks=[losses, *callbacks])
    return model, losses.values


def megatron(world):
    out = {}
    for shard in (False, True):
        model, losses = train(MLP(2, 2), ParallelMode.SEMI_AUTO_PARALLEL, enable_parallel_optimizer=shard)
        placements = {n: [str(p) for p in t.placements] for n, t in model.train_network.named_parameters()}
        out[shard] = losses, placements
    return out


@pytest.mark.slow
def test_megatron_mlp_semi_auto_on_4_processes_prints_one_process_losses_with_and_without_optimizer_shard():
    expected = reference_losses(MLP(), SquaredError())
    results = run_distributed(megatron, 4, 4, timeout=180)[0]
    for shard, (losses, placements) in results.items():
        assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6), shard
    plain, sharded = results[False][1], results[True][1]
    # fc1's weight (32, 16) is split by rows over mp (mesh dim 1) and, with the optimizer shard, by columns over dp
    assert plain["network.fc1.weight"] == ["R", "S(0)"]
    assert sharded["network.fc1.weight"] == ["S(1)", "S(0)"]
    assert plain["network.fc2.bias"] == ["R", "R"]
    assert sharded["network.fc2.bias"] == ["S(0)", "S(0)"]


class HybridParallelNet(nn.Module):
    """The seed's hybrid net: this device's columns of a (16, 8 * devices) weight, a local MatMul, ReduceSum
    over the columns, and the user's AllReduce summing the devices' parts."""

    def __init__(self, rank: int, devices: int, width: int = 8):
        super().__init__()
        torch.manual_seed(0)
        full = torch.rand(16, width * 4)  # the one-process weight; 4 devices at most
        columns = width * 4 // devices
        self.weight = Parameter(full[:, rank * columns:(rank + 1) * columns], layerwise_parallel=True)
        self.bias = nn.Parameter(torch.zeros(()))  # shared: reduced over the devices
        self.fc, self.reduce, self.allreduce = ops.MatMul(), ops.ReduceSum(), ops.AllReduce(op="sum")

    def forward(self, x):
        return self.allreduce(self.reduce(self.fc(x, self.weight), -1)) + self.bias


def scalar_data(steps=STEPS):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, generator=g)) for _ in range(steps)]


def hybrid(world):
    from paratrain.communication import get_rank

    set_auto_parallel_context(parallel_mode=ParallelMode.HYBRID_PARALLEL)
    net = HybridParallelNet(get_rank(), world)
    losses = loss_recorder()
    Model(net, loss_fn=nn.MSELoss(), optimizer=Momentum(net.parameters(), 0.001, 0.9)).train(
        1, scalar_data(), callbacks=[losses])
    return losses.values, net.weight.detach().tolist()


def hybrid_reference() -> tuple[list[float], HybridParallelNet]:
    """The losses and trained net of one process, MindSpore's Momentum as torch's SGD with momentum."""
    one = HybridParallelNet(0, 1)
    opt = torch.optim.SGD(one.parameters(), lr=0.001, momentum=0.9)
    expected = []
    for x, y in scalar_data():
        loss = nn.functional.mse_loss(one(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    return expected, one


@pytest.mark.slow
def test_hybrid_parallel_net_with_a_user_allreduce_prints_one_process_losses():
    expected, one = hybrid_reference()
    (losses0, w0), (losses1, w1) = run_distributed(hybrid, 2, 2, timeout=120)
    assert losses0 == losses1 == pytest.approx(expected, rel=1e-5)
    assert torch.allclose(torch.cat([torch.tensor(w0), torch.tensor(w1)], 1), one.weight.detach(), atol=1e-6)


def auto(world, directory):
    out = {}
    reset_auto_parallel_context()
    model, losses = train(MLP(), ParallelMode.AUTO_PARALLEL, strategy_ckpt_save_file=f"{directory}/s.json")
    out["searched"] = losses
    model, losses = train(MLP(), ParallelMode.AUTO_PARALLEL, strategy_ckpt_load_file=f"{directory}/s.json")
    out["loaded"] = losses, {n: [str(p) for p in t.placements] for n, t in model.train_network.named_parameters()}
    net = MLP()
    net.fc1.matmul.shard(((1, 1), (world, 1)))
    model, losses = train(net, ParallelMode.AUTO_PARALLEL, search_mode="sharding_propagation")
    out["propagated"] = losses, {p: op.strategy for p, op in model.train_network.model.named_modules()
                                 if isinstance(op, ops.Primitive)}
    return out


@pytest.mark.slow
def test_auto_parallel_chooses_saves_and_reloads_strategies_training_to_one_process_losses(tmp_path, capfd):
    expected = reference_losses(MLP(), SquaredError())
    out = run_distributed(auto, 2, 2, str(tmp_path), timeout=180)[0]
    saved = json.loads((tmp_path / "s.json").read_text())["strategies"]
    # the cost model keeps the weights split rather than the batch: Megatron's column then row split
    assert saved["network.fc1.matmul"] == [[1, 1], [2, 1]]
    assert saved["network.fc2.matmul"] == [[1, 2], [1, 2]]
    assert "auto_parallel: network.fc1.matmul (MatMul) strategy ((1, 1), (2, 1))" in capfd.readouterr().out
    for key in ("searched", "loaded", "propagated"):
        losses = out[key][0] if key != "searched" else out[key]
        assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6), key
    assert out["loaded"][1]["network.fc1.weight"] == ["S(0)"]
    propagated = out["propagated"][1]
    assert propagated["network.fc1.bias_add"] == ((1, 2), (2,))
    assert propagated["network.relu"] == ((1, 2),)
    assert propagated["network.fc2.matmul"] == ((1, 2), (1, 2))


def save_under_dp2_mp2(world, directory):
    from paratrain.train import CheckpointConfig, ModelCheckpoint

    for prefix, integrated in (("sliced", False), ("whole", True)):
        config = CheckpointConfig(save_checkpoint_steps=4, integrated_save=integrated)
        train(MLP(2, 2), ParallelMode.SEMI_AUTO_PARALLEL, data()[:4],
              [ModelCheckpoint(prefix=prefix, directory=directory, config=config)])


def load_under_mp2(world, directory):
    from paratrain import load_checkpoint, load_distributed_checkpoint, load_param_into_net
    from paratrain.config import ParallelConfig
    from paratrain.mesh import Layout
    from paratrain.train.parallel_modes.semi_auto import place_semi_auto
    from paratrain.train import WithLoss

    out = {}
    net = MLP(1, 2)
    out["sliced"] = load_distributed_checkpoint(net, f"{directory}/sliced-1_4"), \
        train(net, ParallelMode.SEMI_AUTO_PARALLEL, data()[4:])[1]
    net = MLP(1, 2)
    net.extra = nn.Parameter(torch.zeros(3))
    out["whole"] = load_param_into_net(net, load_checkpoint(f"{directory}/whole-1_4/model.safetensors"))[0], \
        train(net, ParallelMode.SEMI_AUTO_PARALLEL, data()[4:])[1]
    placed = place_semi_auto(WithLoss(MLP(1, 2), SquaredError()), ParallelConfig(), Layout(ParallelConfig(), world),
                             example_batch=data()[0])
    out["placed"] = load_distributed_checkpoint(placed, sorted(Path(f"{directory}/sliced-1_4").iterdir())), {
        name: (str(p.placements), p.full_tensor().tolist()) for name, p in placed.named_parameters()}
    return out


@pytest.mark.slow
def test_whole_and_sliced_checkpoints_of_4_devices_load_under_another_strategy_on_2(tmp_path):
    reference = MLP()
    expected = reference_losses(reference, SquaredError(), batches=data()[:4])
    trained = {f"network.{k}": v.clone() for k, v in reference.state_dict().items()}
    expected += reference_losses(reference, SquaredError(), batches=data()[4:])  # a fresh optimizer: weights only
    run_distributed(save_under_dp2_mp2, 4, 4, str(tmp_path), timeout=180)
    assert (tmp_path / "whole-1_4" / "model.safetensors").is_file()  # integrated_save: one whole-model file
    assert not (tmp_path / "sliced-1_4" / "model.safetensors").exists()
    assert sorted(p.name for p in (tmp_path / "sliced-1_4").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    whole = load_checkpoint(tmp_path / "whole-1_4" / "model.safetensors")
    sliced = load_checkpoint(tmp_path / "sliced-1_4")
    assert sorted(whole) == sorted(sliced) == sorted(trained)  # {name: whole tensor} from either kind
    for name, value in whole.items():
        assert torch.equal(value, sliced[name]) and torch.allclose(value, trained[name], atol=1e-6), name
    out = run_distributed(load_under_mp2, 2, 2, str(tmp_path), timeout=180)[0]
    assert out["sliced"][0] == [] and out["whole"][0] == ["extra"]
    for key in ("sliced", "whole"):
        assert out[key][1] == pytest.approx(expected[4:], rel=1e-5, abs=1e-6), key
    not_loaded, params = out["placed"]
    assert not_loaded == []
    assert params["network.fc1.weight"][0] == "(Shard(dim=0),)"  # split by rows over the 2 devices
    for name, (_, value) in params.items():
        assert torch.allclose(torch.tensor(value), trained[name], atol=1e-6), name


class Classifier(nn.Module):
    """``MLP`` ending in paratrain.nn's CrossEntropyLoss of (logits, labels, mask): (N, 16), (N,), (N,) -> ()."""

    def __init__(self, dp: int = 1):
        from paratrain.nn import CrossEntropyLoss

        super().__init__()
        self.mlp, self.loss = MLP(dp), CrossEntropyLoss()

    def forward(self, x, labels, mask):
        return self.loss(self.mlp(x), labels, mask)


def _classifier_losses(dp):
    reset_auto_parallel_context()
    set_auto_parallel_context(parallel_mode=ParallelMode.SEMI_AUTO_PARALLEL)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 8, (8,), generator=g),
                (torch.rand(8, generator=g) > 0.25).float()) for _ in range(4)]
    net, losses = Classifier(dp), loss_recorder()
    Model(net, optimizer=Momentum(net.parameters(), 0.05, 0.9)).train(1, batches, callbacks=[losses])
    return losses.values


@pytest.mark.slow
def test_cross_entropy_loss_of_rows_split_by_a_strategy_gives_one_process_losses():
    one = _classifier_losses(1)
    for losses in run_distributed(_classifier_losses, 2, 2, timeout=120):
        assert losses == pytest.approx(one, rel=1e-5)
