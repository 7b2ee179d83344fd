"""MindSpore's Cifar10Dataset: the generated sample is CIFAR-10's binary format, each shard is its share of the
records, and the shards' batches together are one process's global batches."""
import numpy as np
import pytest
import torch

from paratrain.data.cifar import RECORD, CifarDataset
from paratrain.data.cifar_dataset import Cifar10Dataset, write_cifar10_sample
from paratrain.errors import UserError


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    return write_cifar10_sample(tmp_path_factory.mktemp("cifar"), num_images=21)


def test_the_sample_is_in_the_binary_format_with_a_colour_per_class(sample):
    raw = np.fromfile(sample / "data_batch_1.bin", dtype=np.uint8)
    assert raw.size == 21 * RECORD and (raw.reshape(21, RECORD)[:, 0] < 10).all()
    assert (sample / "test_batch.bin").stat().st_size == 5 * RECORD
    rows = CifarDataset(sample).rows(np.arange(21))
    assert rows["images"].shape == (21, 3, 32, 32) and rows["labels"].dtype == torch.int64
    means = rows["images"].mean((2, 3))
    same = rows["labels"][:, None] == rows["labels"][None, :]
    distance = torch.cdist(means, means)
    assert distance[same].max() < distance[~same].min()  # a class is told by its colour


def test_shards_deal_the_records_round_robin_padded_to_equal_counts(sample):
    shards = [Cifar10Dataset(sample, num_shards=4, shard_id=r) for r in range(4)]
    assert [len(s) for s in shards] == [6, 6, 6, 6]  # ceil(21 / 4), the last three padded
    assert shards[1].indices.tolist() == [1, 5, 9, 13, 17, 0]
    assert sorted(np.concatenate([s.indices for s in shards]).tolist()) == sorted([*range(21), 0, 1, 2])
    assert len(Cifar10Dataset(sample, num_samples=5)) == 5
    assert len(Cifar10Dataset(sample, usage="test")) == 5


def test_the_shards_batches_together_are_one_process_global_batches(sample):
    whole = list(Cifar10Dataset(sample).batch(8, drop_remainder=True))
    parts = [list(Cifar10Dataset(sample, num_shards=2, shard_id=r).batch(4, drop_remainder=True)) for r in range(2)]
    assert len(whole) == len(parts[0]) == len(parts[1]) == 2
    for k, (images, labels) in enumerate(whole):
        got_images = torch.cat([parts[r][k][0] for r in range(2)])
        got_labels = torch.cat([parts[r][k][1] for r in range(2)])
        order = [0, 2, 4, 6, 1, 3, 5, 7]  # rank 0 holds the even rows of the global batch
        assert torch.equal(got_images, images[order]) and torch.equal(got_labels, labels[order])
    rows = list(Cifar10Dataset(sample, num_shards=2, shard_id=1))
    assert len(rows) == 11 and torch.equal(rows[0][0], whole[0][0][1]) and rows[0][1] == whole[0][1][1]
    batches = Cifar10Dataset(sample, num_shards=2, shard_id=0).batch(4)
    assert batches.num_shards == 2 and batches.get_dataset_size() == 3  # 11 rows: the last batch short


def test_shuffle_gives_each_epoch_another_order_the_same_on_every_run(sample):
    first, second = Cifar10Dataset(sample, shuffle=True, seed=3), Cifar10Dataset(sample, shuffle=True, seed=3)
    epoch1, epoch2 = first.order(), first.order()
    assert sorted(epoch1.tolist()) == list(range(21)) and epoch1.tolist() != epoch2.tolist()
    assert second.order().tolist() == epoch1.tolist()


@pytest.mark.parametrize("kwargs, match", [
    ({"usage": "eval"}, "usage='eval'"),
    ({"num_shards": 2}, "together"),
    ({"num_shards": 2, "shard_id": 2}, "shard_id=2"),
    ({"num_shards": 0, "shard_id": 0}, "num_shards=0"),
    ({"num_samples": 0}, "num_samples=0"),
])
def test_bad_arguments_are_refused_naming_the_value(sample, kwargs, match):
    with pytest.raises(UserError, match=match):
        Cifar10Dataset(sample, **kwargs)


def test_a_directory_without_batches_is_refused_with_the_fix(tmp_path):
    with pytest.raises(UserError, match="write_cifar10_sample"):
        Cifar10Dataset(tmp_path)
    with pytest.raises(UserError, match="batch_size=0"):
        Cifar10Dataset(write_cifar10_sample(tmp_path, 4)).batch(0)
