"""Parallelism applied from outside the model; one file per dimension."""
from paratrain.parallel.parallelize import parallelize

__all__ = ["parallelize"]
