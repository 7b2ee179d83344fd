"""ResNets for CIFAR-10 (He et al. 2016), the data-parallel example models.

The CIFAR ResNet of section 4.2: three stages of ``num_blocks`` basic blocks with ``width``, ``2*width`` and
``4*width`` channels on 32x32, 16x16 and 8x8 maps, then global average pooling and a linear classifier: depth
``6 * num_blocks + 2`` (3 blocks: ResNet-20). With ``block=Bottleneck`` and ``num_blocks=(3, 4, 6, 3)``, ``width=64``
it is ResNet-50 (four stages of 1x1-3x3-1x1 bottlenecks, 256..2048 channels) on a 3x3 CIFAR stem. Plain single-device
module. Under data parallelism its batch-norm statistics must be those of the global batch to match one process: on
GPU convert the layers with ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``; on CPU torch's SyncBatchNorm refuses
CPU tensors, so pass a ``norm_layer`` that all-reduces the statistics over the data-parallel group (built by the
parallel code).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch.nn.functional as F
from torch import nn

from paratrain.config import ModelConfig

NormLayer = Callable[[int], nn.Module]


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus shortcut, then ReLU: (B, C_in, H, W) -> (B, C_out, H/stride, W/stride).

    The shortcut is a 1x1 convolution with normalization when the shape changes.
    """

    expansion = 1  # out_channels over the block's width

    def __init__(self, in_channels: int, out_channels: int, stride: int, norm_layer: NormLayer = nn.BatchNorm2d):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = norm_layer(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = norm_layer(out_channels)
        self.shortcut = shortcut(in_channels, out_channels, stride, norm_layer)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def shortcut(in_channels: int, out_channels: int, stride: int, norm_layer: NormLayer) -> nn.Module:
    """A block's shortcut: the identity, or a 1x1 convolution with normalization when the shape changes."""
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), norm_layer(out_channels))


class Bottleneck(nn.Module):
    """ResNet-50's block: conv1x1-BN-ReLU-conv3x3(stride)-BN-ReLU-conv1x1-BN plus shortcut, then ReLU:
    (B, C_in, H, W) -> (B, 4 * width, H/stride, W/stride), ``width`` the 3x3 convolution's channels."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int, norm_layer: NormLayer = nn.BatchNorm2d):
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = norm_layer(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = norm_layer(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = norm_layer(out_channels)
        self.shortcut = shortcut(in_channels, out_channels, stride, norm_layer)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return F.relu(self.bn3(self.conv3(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR ResNet: images (B, 3, 32, 32) -> logits (B, num_classes).

    ``num_blocks``: blocks per stage, an int for three stages or one count per stage; stage ``s``
    has blocks of width ``width * 2**s`` and halves the map (but the first). ``block``: BasicBlock
    or Bottleneck. ``norm_layer(channels)`` makes every normalization layer (default BatchNorm2d).
    """

    def __init__(self, num_blocks: int | Sequence[int] = 3, width: int = 16, num_classes: int = 10,
                 norm_layer: NormLayer = nn.BatchNorm2d, block: type[BasicBlock] | type[Bottleneck] = BasicBlock):
        super().__init__()
        counts = (num_blocks,) * 3 if isinstance(num_blocks, int) else tuple(num_blocks)
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), norm_layer(width), nn.ReLU())
        stages, channels = [], width
        for stage, count in enumerate(counts):
            planes = width * 2**stage
            for i in range(count):
                stages.append(block(channels, planes, 2 if stage and i == 0 else 1, norm_layer))
                channels = planes * block.expansion
        self.layers = nn.Sequential(*stages)
        self.head = nn.Linear(channels, num_classes)
        self.layer_stacks = {"layers": 0}  # the blocks data parallelism groups (paratrain.models.transformer)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images):
        return self.head(self.layers(self.stem(images)).mean(dim=(2, 3)))


def resnet50(num_classes: int = 10, width: int = 64, norm_layer: NormLayer = nn.BatchNorm2d,
             num_blocks: Sequence[int] = (3, 4, 6, 3)) -> ResNet:
    """ResNet-50 for CIFAR-10: images (B, 3, 32, 32) -> logits (B, num_classes); four stages of (3, 4, 6, 3)
    bottlenecks of width ``width``..``8 * width`` (23.5M parameters at 64); ``num_blocks`` fewer for tests."""
    return ResNet(num_blocks, width, num_classes, norm_layer, Bottleneck)


def build_resnet(cfg: ModelConfig, num_classes: int = 10, norm_layer: NormLayer = nn.BatchNorm2d) -> ResNet:
    """ResNet from the model section: ``hidden_size`` = first-stage width, ``encoder_layers`` = blocks per stage."""
    return ResNet(cfg.encoder_layers, cfg.hidden_size, num_classes, norm_layer)
