"""The one entry point: ``parallelize(model, config, layout)``.

Order (as torchtitan): tensor parallel -> recompute -> data parallel / ZeRO. Each
step is applied only when its dimension is used, so one process gets the plain model.
"""
from __future__ import annotations

from torch import nn

from paratrain.config import ParallelConfig
from paratrain.mesh import Layout
from paratrain.parallel.data import apply_data_parallel
from paratrain.parallel.recompute import apply_recompute
from paratrain.parallel.tensor import apply_tensor_parallel


def parallelize(model: nn.Module, config: ParallelConfig, layout: Layout) -> nn.Module:
    """Split ``model`` (built identically on every rank) over ``layout``'s mesh, in place."""
    if config.model_parallel > 1:
        apply_tensor_parallel(model, config, layout.tp_mesh)
    apply_recompute(model, config)
    if config.data_parallel > 1:
        apply_data_parallel(model, config, layout)
    return model
