"""Parallelism applied from outside the model; one file per dimension."""
from paratrain.parallel.data import shard_optimizer_state
from paratrain.parallel.parallelize import parallelize
from paratrain.parallel.place import place

__all__ = ["parallelize", "place", "shard_optimizer_state"]
