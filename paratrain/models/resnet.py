"""A small ResNet for CIFAR-10 (He et al. 2016, section 4.2), the data-parallel example model.

Three stages of ``num_blocks`` basic blocks with ``width``, ``2*width`` and
``4*width`` channels on 32x32, 16x16 and 8x8 maps, then global average pooling
and a linear classifier: depth ``6 * num_blocks + 2`` (3 blocks: ResNet-20).
Plain single-device module. Under data parallelism its batch-norm statistics
must be those of the global batch to match one process: on GPU convert the
layers with ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``; on CPU torch's
SyncBatchNorm refuses CPU tensors, so pass a ``norm_layer`` that all-reduces
the statistics over the data-parallel group (built by the parallel code).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from typing import Callable

from paratrain.config import ModelConfig

NormLayer = Callable[[int], nn.Module]


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus shortcut, then ReLU: (B, C_in, H, W) -> (B, C_out, H/stride, W/stride).

    The shortcut is a 1x1 convolution with normalization when the shape changes.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int, norm_layer: NormLayer = nn.BatchNorm2d):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = norm_layer(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = norm_layer(out_channels)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                                          norm_layer(out_channels))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR ResNet: images (B, 3, 32, 32) -> logits (B, num_classes).

    ``norm_layer(channels)`` makes every normalization layer (default BatchNorm2d).
    """

    def __init__(self, num_blocks: int = 3, width: int = 16, num_classes: int = 10,
                 norm_layer: NormLayer = nn.BatchNorm2d):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), norm_layer(width), nn.ReLU())
        stages, channels = [], width
        for stage in range(3):
            out = width * 2**stage
            stages += [BasicBlock(channels if i == 0 else out, out, 2 if stage and i == 0 else 1, norm_layer)
                       for i in range(num_blocks)]
            channels = out
        self.layers = nn.Sequential(*stages)
        self.head = nn.Linear(channels, num_classes)
        self.layer_stacks = {"layers": 0}  # the blocks data parallelism groups (paratrain.models.transformer)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images):
        return self.head(self.layers(self.stem(images)).mean(dim=(2, 3)))


def build_resnet(cfg: ModelConfig, num_classes: int = 10, norm_layer: NormLayer = nn.BatchNorm2d) -> ResNet:
    """ResNet from the model section: ``hidden_size`` = first-stage width, ``encoder_layers`` = blocks per stage."""
    return ResNet(cfg.encoder_layers, cfg.hidden_size, num_classes, norm_layer)
