"""MindSpore's primitives (``mindspore.ops``) as torch modules with ``.shard(strategy)``, applied under
``semi_auto_parallel``/``auto_parallel`` (``paratrain.train.parallel_modes.semi_auto``; what a strategy means:
``paratrain.ops.strategy``); elsewhere the ops are the plain torch computation.
"""
from paratrain.ops.comm import AllReduce
from paratrain.ops.math import (Add, BatchMatMul, BiasAdd, Cast, Dropout, Exp, Gather, Log, MatMul, Mul, NotEqual,
                                OneHot, RealDiv, ReduceMax, ReduceMean, ReduceSum, ReLU, Reshape, Softmax, Sub,
                                Transpose, shape)
from paratrain.ops.primitive import Primitive
from paratrain.ops.strategy import StrategyError

__all__ = ["Add", "AllReduce", "BatchMatMul", "BiasAdd", "Cast", "Dropout", "Exp", "Gather", "Log", "MatMul", "Mul",
           "NotEqual", "OneHot", "Primitive", "RealDiv", "ReduceMax", "ReduceMean", "ReduceSum", "ReLU", "Reshape",
           "Softmax", "StrategyError", "Sub", "Transpose", "shape"]
