"""ResNet on batches from a CIFAR-10 binary file: shapes, learning, SyncBatchNorm conversion."""
import numpy as np
import torch
from torch import nn

from paratrain.config import Config
from paratrain.data.loader import ShardedBatches, build_dataset
from paratrain.data.cifar import write_cifar_bin
from paratrain.models.resnet import ResNet, build_resnet


def test_resnet_learns_cifar_batches(tmp_path):
    rng = np.random.default_rng(0)
    labels = np.arange(16) % 10
    noise = rng.integers(0, 40, (16, 3, 32, 32))
    images = (labels[:, None, None, None] * 20 + noise).astype(np.uint8)  # brightness tells the label
    write_cifar_bin(tmp_path / "data_batch_1.bin", images, labels)
    cfg = Config.from_dict({"data": {"kind": "cifar10", "path": str(tmp_path)},
                            "model": {"hidden_size": 8, "encoder_layers": 1}})
    batches = ShardedBatches(build_dataset(cfg), 16)
    torch.manual_seed(0)
    model = build_resnet(cfg.model)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 9
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(10):
        batch = batches.batch(step)
        logits = model(batch["images"])
        assert logits.shape == (16, 10)
        loss = nn.functional.cross_entropy(logits, batch["labels"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_normalization_can_be_replaced_from_outside():
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(ResNet(num_blocks=1, width=4))  # the GPU route
    assert not any(type(m) is nn.BatchNorm2d for m in synced.modules())
    assert sum(isinstance(m, nn.SyncBatchNorm) for m in synced.modules()) == 9
    grouped = ResNet(num_blocks=1, width=4, norm_layer=lambda c: nn.GroupNorm(2, c))  # e.g. a CPU-synced norm
    assert sum(isinstance(m, nn.GroupNorm) for m in grouped.modules()) == 9
    assert not any(isinstance(m, nn.BatchNorm2d) for m in grouped.modules())
    assert grouped(torch.randn(2, 3, 32, 32)).shape == (2, 10)
