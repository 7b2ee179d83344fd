"""Activation recompute: keep fewer activations, recompute them in backward.

``full`` wraps a whole layer (only its input is kept); ``selective`` wraps just the
attention core (the softmax and its (B, heads, T, T) scores, cheap to recompute and
large to keep). The mode of each layer comes from ``ParallelConfig.recompute_mode``.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from paratrain.config import ParallelConfig
from paratrain.models.transformer import ScaledDotProductAttention, pipeline_blocks


def apply_recompute(model: nn.Module, config: ParallelConfig) -> nn.Module:
    """Wrap each layer as its recompute mode says."""
    for name, layer_id, offset in pipeline_blocks(model):
        mode = config.recompute_mode(layer_id, offset)
        parent_name, _, child = name.rpartition(".")
        parent, layer = model.get_submodule(parent_name), model.get_submodule(name)
        if mode == "full":
            parent.register_module(child, checkpoint_wrapper(layer))
        elif mode == "selective":
            for core_parent in layer.modules():
                if isinstance(getattr(core_parent, "core", None), ScaledDotProductAttention):
                    core_parent.core = checkpoint_wrapper(core_parent.core)
    return model
