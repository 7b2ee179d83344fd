"""Activation recompute: keep fewer activations, recompute them in backward.

Both modes checkpoint a whole layer (``torch.utils.checkpoint``, non-reentrant, random state preserved so dropout
recomputes the same masks). ``full`` keeps only the layer input and runs the whole layer again in backward.
``selective`` works op by op, as torchtitan does: it keeps the outputs of the expensive ops (matmuls, the fused
attention kernels, the tensor-parallel all-reduce or reduce-scatter; ``SAVED_OPS``) and recomputes the cheap ones
between them (LayerNorm, GELU, dropout, adds). The mode of each layer comes from ``ParallelConfig.recompute_mode``.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from paratrain.config import ParallelConfig
from paratrain.modules.transformer import pipeline_blocks

aten = torch.ops.aten

# ops as they reach the dispatcher: nn.Linear becomes addmm (mm without bias); SDPA becomes one
# fused kernel (flash, memory-efficient, cuDNN; flash_attention_for_cpu on CPU) or, on its math
# path (CPU with attention dropout), bmm, softmax and dropout. Of the tensor-parallel collectives
# the all-reduce (sequence parallel: reduce-scatter) of a sublayer's output is kept; the
# sequence-parallel all-gather of its input is redone, as its output is what SP avoids keeping.
SAVED_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default, torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default})


def _applies_dropout(func, args: tuple, kwargs: dict) -> bool:
    """Whether an op call has a ``dropout_p`` argument above 0 (an attention kernel drawing random numbers)."""
    names = [a.name for a in func._schema.arguments]
    if "dropout_p" not in names:
        return False
    i = names.index("dropout_p")
    return (args[i] if i < len(args) else kwargs.get("dropout_p", 0.0)) > 0


def keeps(func, args: tuple, kwargs: dict) -> bool:
    """Whether selective recompute keeps the output of this op call: one of ``SAVED_OPS``, but an attention kernel
    with dropout, which is recomputed too: the recompute restores the random state of the layer's start and replays
    its random ops in order, so an op that drew random numbers in forward but is skipped in the recompute would shift
    the dropout masks after it."""
    return func in SAVED_OPS and not _applies_dropout(func, args, kwargs)


def selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """The ``selective`` policy of ``create_selective_checkpoint_contexts``: save what ``keeps`` says, recompute
    everything else."""
    return CheckpointPolicy.MUST_SAVE if keeps(func, args, kwargs) else CheckpointPolicy.PREFER_RECOMPUTE


def apply_recompute(model: nn.Module, config: ParallelConfig) -> nn.Module:
    """Wrap each layer in a checkpoint as its recompute mode says (``none``: left as it is)."""
    for name, layer_id, offset in pipeline_blocks(model):
        mode = config.recompute_mode(layer_id, offset)
        if mode == "none":
            continue
        kwargs = {} if mode == "full" else {
            "context_fn": functools.partial(create_selective_checkpoint_contexts, selective_policy)}
        parent_name, _, child = name.rpartition(".")
        model.get_submodule(parent_name).register_module(child, checkpoint_wrapper(model.get_submodule(name), **kwargs))
    return model
