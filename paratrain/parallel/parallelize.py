"""The one entry point: ``parallelize(model, config, layout)``.

Order (as torchtitan): pipeline split -> fp8 Linears (``train.mixed_precision = "fp8"``) -> tensor
parallel -> expert parallel -> recompute -> compile (``train.compile``: each layer) -> data parallel /
ZeRO (all but the split on each pipeline chunk). Each step is applied only when its dimension is used,
so one process gets the plain model.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from paratrain.config import ParallelConfig, TrainConfig
from paratrain.mesh import Layout
from paratrain.modules.transformer import pipeline_blocks
from paratrain.parallel.data import apply_data_parallel
from paratrain.parallel.expert import apply_expert_parallel
from paratrain.parallel.pipeline import Pipeline
from paratrain.parallel.recompute import apply_recompute
from paratrain.parallel.tensor import apply_tensor_parallel
from paratrain.precision import compute_dtype, convert_to_fp8


def parallelize(model: nn.Module, config: ParallelConfig, layout: Layout, loss_fn=None,
                train: TrainConfig | None = None, layer_costs: list[int] | None = None,
                tokens_per_rank: int | None = None) -> tuple[list[nn.Module], Pipeline | None]:
    """Split ``model`` (built identically on every rank, or on the meta device) over ``layout``'s mesh.

    Returns ``(model_parts, pipeline)``: this rank's model chunks -- the model itself,
    sharded in place, when ``pipeline_stage`` is 1 -- and the ``Pipeline`` whose
    schedule runs a step over them (calling ``loss_fn(logits, labels, **loss_kwargs)``),
    or None without pipeline parallelism. ``train`` gives ``compile`` and ``mixed_precision``, resolved
    for the device, never "auto" (FSDP then gathers parameters in the compute dtype and reduces gradients in
    fp32; without ``train``: fp32). ``layer_costs``: each layer's work, which the pipeline split balances
    (``paratrain.parallel.pipeline.layer_chunks``; equal when not given). ``tokens_per_rank``: the tokens of a
    micro-batch when every data-parallel rank's have the same shape (``paratrain.parallel.vocab``).
    """
    train = train or TrainConfig(mixed_precision="none")
    precision = train.mixed_precision

    def parallelize_chunk(chunk: nn.Module, root: nn.Module | None = None) -> nn.Module:
        if precision == "fp8":
            convert_to_fp8(chunk)
        if config.model_parallel > 1:
            apply_tensor_parallel(chunk, config, layout.tp_mesh)
        apply_expert_parallel(chunk, config, layout)
        apply_recompute(chunk, config)
        if train.compile:
            for name, _, _ in pipeline_blocks(chunk):
                chunk.get_submodule(name).compile()
        if config.data_parallel > 1 or config.offloads:  # FSDP2 offloads, even over one rank
            policy = None
            if precision != "none":
                policy = MixedPrecisionPolicy(param_dtype=compute_dtype(precision), reduce_dtype=torch.float32)
            apply_data_parallel(chunk, config, layout, policy, root=root, tokens_per_rank=tokens_per_rank)
        return chunk

    if config.pipeline_stage > 1:
        pipeline = Pipeline(model, config, layout, parallelize_chunk, loss_fn, layer_costs)
        return pipeline.parts, pipeline
    return [parallelize_chunk(model)], None
