"""Parallelism applied from outside the model; one file per dimension."""
from paratrain.parallel.data import shard_optimizer_state
from paratrain.parallel.parallelize import parallelize

__all__ = ["parallelize", "shard_optimizer_state"]
