"""Tensor (model) parallelism: the model's TP_PLAN turned into DTensor styles over the "tp" mesh dim.

Column-sharded q/k/v and fc1, row-sharded out_proj and fc2 (Megatron's split: one
all-reduce per attention and per FFN in forward). The output head is column-sharded
and its logits stay vocab-sharded for the vocab-parallel loss (``loss.py``). With
``vocab_emb_dp=false`` the embedding table's vocab rows are sharded too.

Attention and FFN inputs are marked replicated once per module, so backward sums
their gradients over the tp ranks once. With ``sequence_parallel`` the residual
stream between sublayers is sharded along
the sequence: LayerNorms and dropout run on 1/mp of the tokens, attention and FFN
inputs are all-gathered, and their outputs reduce-scattered instead of all-reduced.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from paratrain.config import ParallelConfig
from paratrain.models.transformer import TP_PLAN


def _plan_kind(name: str):
    for suffix, kind in TP_PLAN.items():
        if name == suffix or name.endswith("." + suffix):
            return kind
    return None


def tensor_parallel_plan(model: nn.Module, config: ParallelConfig) -> dict:
    """Module name -> DTensor ParallelStyle for every module the plan names."""
    sp = config.sequence_parallel
    stream = Shard(1) if sp else Replicate()  # layout of the residual stream between sublayers
    plan = {}
    for name, _ in model.named_modules():
        kind = _plan_kind(name)
        if kind == "colwise":
            plan[name] = ColwiseParallel()
        elif kind == "rowwise":
            plan[name] = RowwiseParallel(output_layouts=stream)
        elif kind == "vocab" and not config.vocab_emb_dp:  # with SP the partial rows are reduce-scattered
            plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
        elif sp and kind == "vocab":
            plan[name] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        elif kind == "head":
            plan[name] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
        elif sp and kind == "norm":
            plan[name] = SequenceParallel(use_local_output=True)
        elif sp and kind == "position":  # (S, H) table output: keep this rank's sequence rows
            plan[name] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
        elif isinstance(kind, tuple) and kind[0] == "gather":
            # also without sequence parallel: q, k and v then share one input DTensor, so backward
            # all-reduces the input gradient once instead of once per projection
            inputs = kind[1]
            plan[name] = PrepareModuleInput(input_layouts=(stream,) * inputs,
                                            desired_input_layouts=(Replicate(),) * inputs)
    return plan


def apply_tensor_parallel(model: nn.Module, config: ParallelConfig, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh``; keeps a tied head tied to the (sharded) table."""
    head, word = getattr(model, "head", None), _word_embedding(model)
    tied = head is not None and word is not None and head.weight is word.weight
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model, config))
    if tied:
        head.weight = word.weight
    if word is not None and not config.vocab_emb_dp:
        word.weight.register_post_accumulate_grad_hook(_gradient_like_parameter)
    return model


def _gradient_like_parameter(param) -> None:
    """The sharded embedding's backward leaves a replicated (V, H) gradient: keep only this rank's rows."""
    if param.grad.placements != param.placements:
        param.grad = param.grad.redistribute(param.device_mesh, param.placements)


def _word_embedding(model: nn.Module) -> nn.Embedding | None:
    return next((m for name, m in model.named_modules() if _plan_kind(name) == "vocab"), None)
