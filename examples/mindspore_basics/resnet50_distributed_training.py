"""The tutorial's data-parallel ResNet-50 on CIFAR-10 with paratrain: one process per device.

    paratrain launch --nproc-per-node 2 -- examples/mindspore_basics/resnet50_distributed_training.py
    paratrain launch --nproc-per-node 2 -- examples/mindspore_basics/resnet50_distributed_training.py --sync-bn
    # ResNet-50's depth at a quarter of its width: a few seconds a step on a laptop CPU
    paratrain launch --nproc-per-node 2 -- examples/mindspore_basics/resnet50_distributed_training.py --width 16

Each rank reads its share of CIFAR-10 (``Cifar10Dataset(num_shards=get_group_size(),
shard_id=get_rank())``), ``--batch`` images per device per step; gradients are averaged over the
devices (``gradients_mean=True``). Batch norm normalises each device's images alone, as MindSpore's
``BatchNorm2d``; with ``--sync-bn`` (``paratrain.nn.SyncBatchNorm``) it uses the statistics of the whole
global batch, and the losses are those of one process with ``--batch`` times the devices.
``--save-steps N`` saves ``resnet50-<epoch>_<step>`` under ``--out``: the whole model in
``model.safetensors`` plus every rank's slice, or with ``--sliced`` (``integrated_save=False``) the
slices only; ``paratrain.load_checkpoint`` reads either back as whole tensors.
``--data`` is a ``cifar-10-batches-bin`` directory; without one a sample in CIFAR-10's binary format
is written there (images whose colour tells their class). MindSpore -> paratrain:
``mindspore.dataset.Cifar10Dataset`` -> ``paratrain.data.cifar_dataset.Cifar10Dataset`` (the random crop,
flip and resize to 224 left out), ``mindspore.ops`` -> ``paratrain.ops``, ``nn.Momentum`` ->
``paratrain.nn.Momentum``, ``mindspore.train`` -> ``paratrain.train``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from paratrain import ParallelMode, ops, set_auto_parallel_context
from paratrain import communication as D
from paratrain.data.cifar_dataset import Cifar10Dataset, write_cifar10_sample
from paratrain.models.resnet import resnet50
from paratrain.nn import Momentum, SyncBatchNorm
from paratrain.train import CheckpointConfig, LossMonitor, Model, ModelCheckpoint


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path("runs/data/cifar10_sample"), help="cifar-10-batches-bin")
    p.add_argument("--sample-images", type=int, default=256, help="images of the sample written when --data has none")
    p.add_argument("--batch", type=int, default=32, help="images per device per step")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--width", type=int, default=64, help="the first stage's bottleneck width (64: ResNet-50)")
    p.add_argument("--blocks", type=int, nargs=4, default=[3, 4, 6, 3], help="bottlenecks per stage")
    p.add_argument("--sync-bn", action="store_true", help="batch-norm statistics of the global batch")
    p.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every this many steps (0: never)")
    p.add_argument("--sliced", action="store_true", help="save one slice per rank only (integrated_save=False)")
    p.add_argument("--out", type=Path, default=Path("runs/resnet50_ckpt"), help="checkpoints go here")
    return p.parse_args(argv)


def create_dataset(data_path: Path, batch_size: int = 32):
    """This rank's share of the CIFAR-10 training images, in batches of ``batch_size``."""
    rank_id = D.get_rank()
    rank_size = D.get_group_size()
    data_set = Cifar10Dataset(data_path, num_shards=rank_size, shard_id=rank_id)
    return data_set.batch(batch_size=batch_size, drop_remainder=True)


class SoftmaxCrossEntropyExpand(nn.Module):
    """The tutorial's loss, written with ops: logits (N, C), labels (N,) int (``sparse``) or (N, C) -> the mean
    cross-entropy, a scalar."""

    def __init__(self, sparse: bool = False):
        super().__init__()
        self.exp = ops.Exp()
        self.sum = ops.ReduceSum(keep_dims=True)
        self.onehot = ops.OneHot()
        self.div = ops.RealDiv()
        self.log = ops.Log()
        self.sum_cross_entropy = ops.ReduceSum(keep_dims=False)
        self.mul = ops.Mul()
        self.mul2 = ops.Mul()
        self.mean = ops.ReduceMean(keep_dims=False)
        self.sparse = sparse
        self.max = ops.ReduceMax(keep_dims=True)
        self.sub = ops.Sub()

    def forward(self, logit, label):
        logit_max = self.max(logit, -1)
        exp = self.exp(self.sub(logit, logit_max))
        exp_sum = self.sum(exp, -1)
        softmax_result = self.div(exp, exp_sum)
        if self.sparse:
            on_value = torch.ones((), device=logit.device)
            label = self.onehot(label, logit.shape[1], on_value, torch.zeros((), device=logit.device))
        softmax_result_log = self.log(softmax_result)
        loss = self.sum_cross_entropy(self.mul(softmax_result_log, label), -1)
        loss = self.mul2(torch.full((), -1.0, device=logit.device), loss)
        loss = self.mean(loss, -1)
        return loss


def prepare_data(a: argparse.Namespace) -> None:
    """Write the sample when ``--data`` has no training batch (rank 0; the others wait)."""
    if D.get_rank() == 0 and not any(a.data.glob("data_batch_*.bin")):
        write_cifar10_sample(a.data, a.sample_images)
    if D.get_group_size() > 1:
        torch.distributed.barrier()


def main(argv=None, extra_callbacks=()) -> Model:
    a = parse_args(argv)
    D.init()
    prepare_data(a)
    set_auto_parallel_context(parallel_mode=ParallelMode.DATA_PARALLEL, gradients_mean=True)
    dataset = create_dataset(a.data, a.batch)
    torch.manual_seed(0)
    net = resnet50(10, a.width, SyncBatchNorm if a.sync_bn else nn.BatchNorm2d, a.blocks)
    loss = SoftmaxCrossEntropyExpand(sparse=True)
    opt = Momentum(filter(lambda x: x.requires_grad, net.parameters()), a.lr, 0.9)
    model = Model(net, loss_fn=loss, optimizer=opt)
    callbacks = [LossMonitor()]
    if a.save_steps:
        config = CheckpointConfig(save_checkpoint_steps=a.save_steps, keep_checkpoint_max=1,
                                  integrated_save=not a.sliced)
        callbacks.append(ModelCheckpoint(prefix="resnet50", directory=a.out, config=config))
    model.train(a.epochs, dataset, callbacks=[*callbacks, *extra_callbacks], dataset_sink_mode=False)
    return model


if __name__ == "__main__":
    main()
