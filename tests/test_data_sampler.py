"""The distributed sampler: shards partition each batch, epochs cover the data, restore is exact."""
import numpy as np
import pytest

from paratrain.data.loader import ShardedBatches
from paratrain.data.sampler import DistributedSampler


class Rows:
    """A dataset whose rows are the example indices themselves."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def rows(self, indices, batch_indices):
        import torch
        return {"index": torch.as_tensor(indices)}


@pytest.mark.parametrize("num_examples, batch, dp", [(48, 8, 2), (50, 12, 4), (7, 4, 1)])
def test_union_of_shards_is_the_epoch_without_overlap(num_examples, batch, dp):
    samplers = [DistributedSampler(num_examples, batch, r, dp, seed=5) for r in range(dp)]
    steps = num_examples * 3 // batch  # three epochs' worth, batches straddling epoch ends included
    for step in range(steps):
        shards = [s.indices(step) for s in samplers]
        assert all(len(x) == batch // dp for x in shards)
        assert np.array_equal(np.concatenate(shards), samplers[0].global_indices(step))
    stream = np.concatenate([samplers[0].global_indices(s) for s in range(steps)])
    for epoch in range(len(stream) // num_examples):
        assert sorted(stream[epoch * num_examples : (epoch + 1) * num_examples]) == list(range(num_examples))
    assert not np.array_equal(samplers[0].epoch_order(0), samplers[0].epoch_order(1))


def test_deterministic_by_seed_and_epoch():
    a, b, c = (DistributedSampler(40, 8, seed=s) for s in (1, 1, 2))
    assert np.array_equal(a.epoch_order(3), b.epoch_order(3))
    assert not np.array_equal(a.epoch_order(3), c.epoch_order(3))
    assert np.array_equal(DistributedSampler(40, 8, shuffle=False).global_indices(6), np.arange(8, 16))


def test_restored_state_gives_exactly_the_next_batches():
    sampler = DistributedSampler(30, 6, 1, 3, seed=9)
    for _ in range(7):
        next(sampler)
    state = sampler.state_dict()
    expected = [next(sampler) for _ in range(10)]
    resumed = DistributedSampler(30, 6, 1, 3, seed=9)
    resumed.load_state_dict(state)
    assert all(np.array_equal(x, y) for x, y in zip(expected, [next(resumed) for _ in range(10)]))
    with pytest.raises(ValueError, match="seed: saved 9, now 10"):
        DistributedSampler(30, 6, 1, 3, seed=10).load_state_dict(state)


def test_sharded_batches_resume_and_change_of_dp():
    source = Rows(26)
    source.seed = 4
    one = ShardedBatches(source, 8)
    for step in range(5):
        one.batch(step)
    state = one.state_dict()
    two = [ShardedBatches(source, 8, r, 2) for r in range(2)]
    for part in two:
        part.load_state_dict(state)
    step = state["step"]
    assert step == 5
    merged = np.concatenate([part.batch(step)["index"].numpy() for part in two])
    assert np.array_equal(merged, one.batch(step)["index"].numpy())


def test_length_bucketing_lowers_padding():
    lengths = np.random.default_rng(0).integers(1, 60, size=512)
    plain = DistributedSampler(512, 16, seed=1, lengths=lengths)
    bucketed = DistributedSampler(512, 16, seed=1, lengths=lengths, bucket_size=8)
    assert sorted(np.concatenate([bucketed.global_indices(s) for s in range(32)])) == list(range(512))
    assert bucketed.padding_fraction(32) < 0.5 * plain.padding_fraction(32)
