"""The one entry point: ``parallelize(model, config, layout)``.

Order (as torchtitan): pipeline split -> tensor parallel -> recompute -> data
parallel / ZeRO (the last three on each pipeline chunk). Each step is applied only
when its dimension is used, so one process gets the plain model.
"""
from __future__ import annotations

from torch import nn

from paratrain.config import ParallelConfig
from paratrain.mesh import Layout
from paratrain.parallel.data import apply_data_parallel
from paratrain.parallel.pipeline import Pipeline
from paratrain.parallel.recompute import apply_recompute
from paratrain.parallel.tensor import apply_tensor_parallel


def parallelize(model: nn.Module, config: ParallelConfig, layout: Layout,
                loss_fn=None) -> tuple[list[nn.Module], Pipeline | None]:
    """Split ``model`` (built identically on every rank) over ``layout``'s mesh.

    Returns ``(model_parts, pipeline)``: this rank's model chunks -- the model itself,
    sharded in place, when ``pipeline_stage`` is 1 -- and the ``Pipeline`` whose
    schedule runs a step over them (calling ``loss_fn(logits, labels, **loss_kwargs)``),
    or None without pipeline parallelism.
    """
    if config.pipeline_stage > 1:
        pipeline = Pipeline(model, config, layout, lambda chunk, stage: _parallelize_chunk(chunk, config, layout, stage),
                            loss_fn)
        return pipeline.parts, pipeline
    return [_parallelize_chunk(model, config, layout)], None


def _parallelize_chunk(model: nn.Module, config: ParallelConfig, layout: Layout, root: nn.Module | None = None):
    if config.model_parallel > 1:
        apply_tensor_parallel(model, config, layout.tp_mesh)
    apply_recompute(model, config)
    if config.data_parallel > 1:
        apply_data_parallel(model, config, layout, root=root)
    return model
