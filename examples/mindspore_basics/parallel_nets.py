"""The distributed-basics tutorial's nets with paratrain: one process per device, any device count.

    paratrain launch --nproc-per-node 4 -- examples/mindspore_basics/parallel_nets.py --mode semi_auto
    python examples/mindspore_basics/parallel_nets.py --mode semi_auto     # one device: the same losses

``--mode data``: ``DataParallelNet`` under ``DATA_PARALLEL`` (gradients averaged); ``semi_auto``:
``SemiAutoParallelNet``, whose MatMul splits the weight's columns over every device; ``auto``: the
``DataParallelNet`` under ``AUTO_PARALLEL`` (paratrain's search picks the strategies); ``hybrid``:
``HybridParallelNet``, each device holding its columns of the weight and summing the parts itself.
MindSpore -> paratrain: ``mindspore.ops`` -> ``paratrain.ops``, ``nn.Cell``/``construct`` ->
``torch.nn.Module``/``forward``, ``mindspore.Parameter`` -> ``paratrain.nn.Parameter``, ``nn.Momentum``
-> ``paratrain.nn.Momentum``, ``mindspore.train`` -> ``paratrain.train``. The weights are the
tutorial's ``np.random.rand(128, 128)``, drawn from one seed on every rank (and scaled by 1/128 so
that plain SGD on a squared error converges); every rank reads the whole batch (``full_batch``).
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

from paratrain import ParallelMode, ops, set_auto_parallel_context
from paratrain import communication as D
from paratrain.errors import UserError
from paratrain.nn import Momentum, Parameter
from paratrain.train import LossMonitor, Model

SIZE = 128  # the weight is (SIZE, SIZE), as the tutorial's


def weight_init() -> torch.Tensor:
    """The tutorial's ``np.random.rand(128, 128)``, the same on every rank, scaled by 1/128."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    return torch.rand(SIZE, SIZE, generator=generator, device="cpu") / SIZE


class DataParallelNet(nn.Module):
    """x (N, 128) -> (N,): the row sums of x @ weight; no strategy: data-parallel over every device."""

    def __init__(self):
        super().__init__()
        self.weight = Parameter(weight_init())
        self.fc = ops.MatMul()
        self.reduce = ops.ReduceSum()

    def forward(self, x):
        x = self.fc(x, self.weight)
        x = self.reduce(x, -1)
        return x


class SemiAutoParallelNet(DataParallelNet):
    """x (N, 128) -> (N,) as ``DataParallelNet``, the MatMul given the strategy ``((1, 1), (1, devices))``: x
    whole on every device, the weight's columns split over them; paratrain inserts the communication."""

    def __init__(self):
        super().__init__()
        self.fc = ops.MatMul().shard(((1, 1), (1, D.get_group_size())))


class HybridParallelNet(nn.Module):
    """x (N, 128) -> (N,): this device's columns of the weight (``layerwise_parallel``: left out of the
    gradient reduction), a local MatMul and ReduceSum, then the user's AllReduce sums the devices' parts."""

    def __init__(self):
        super().__init__()
        if SIZE % D.get_group_size():
            raise UserError(f"HybridParallelNet: {SIZE} weight columns do not split over {D.get_group_size()} "
                            f"devices: run on a number of processes that divides {SIZE}")
        columns = SIZE // D.get_group_size()
        start = D.get_rank() * columns
        self.weight = Parameter(weight_init()[:, start:start + columns], layerwise_parallel=True)
        self.fc = ops.MatMul()
        self.reduce = ops.ReduceSum()
        self.allreduce = ops.AllReduce(op="sum")

    def forward(self, x):
        x = self.fc(x, self.weight)
        x = self.reduce(x, -1)
        x = self.allreduce(x)
        return x


MODES = {"data": (ParallelMode.DATA_PARALLEL, DataParallelNet),
         "semi_auto": (ParallelMode.SEMI_AUTO_PARALLEL, SemiAutoParallelNet),
         "auto": (ParallelMode.AUTO_PARALLEL, DataParallelNet),
         "hybrid": (ParallelMode.HYBRID_PARALLEL, HybridParallelNet)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=sorted(MODES), default="semi_auto")
    p.add_argument("--batch", type=int, default=32, help="global batch size")
    p.add_argument("--steps", type=int, default=10, help="batches per epoch")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    return p.parse_args(argv)


def regression_batches(batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of (x (batch, 128), y (batch,)), y a fixed linear function of x, the same on every rank."""
    generator = torch.Generator(device="cpu").manual_seed(1)
    target = torch.randn(SIZE, generator=generator, device="cpu") * 0.1
    out = []
    for _ in range(steps):
        x = torch.randn(batch, SIZE, generator=generator, device="cpu")
        out.append((x, x @ target))
    return out


def main(argv=None, extra_callbacks=()) -> Model:
    a = parse_args(argv)
    D.init()
    mode, net_class = MODES[a.mode]
    set_auto_parallel_context(parallel_mode=mode, gradients_mean=True, full_batch=True)
    net = net_class()
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=Momentum(net.parameters(), a.lr, 0.9))
    model.train(a.epochs, regression_batches(a.batch, a.steps), callbacks=[LossMonitor(), *extra_callbacks])
    return model


if __name__ == "__main__":
    main()
