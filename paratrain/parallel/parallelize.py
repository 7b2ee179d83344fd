"""The built-in models' entry point, ``parallelize(model, config, layout)``, and the one function that applies every
parallel dimension but the pipeline split to a chunk of any model, ``parallelize_chunk``.

Order (as torchtitan, but for fp8 Linears, which ``paratrain.parallel.place`` makes before): pipeline split -> tensor
parallel -> context parallel (the attention over a split sequence) -> expert parallel -> recompute -> compile
(``train.compile``: each layer) -> data parallel / ZeRO (all but the split on each pipeline chunk). Each step is
applied only when its dimension is used, so one process gets the plain model.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from paratrain.config import ModelConfig, ParallelConfig
from paratrain.mesh import Layout
from paratrain.modules.transformer import pipeline_blocks
from paratrain.parallel.context import apply_context_parallel
from paratrain.parallel.data import apply_data_parallel, fusion_groups
from paratrain.parallel.expert import apply_expert_parallel
from paratrain.parallel.model_loss import TokenSumLoss
from paratrain.parallel.pipeline import Pipeline
from paratrain.parallel.placed import PlacedModel
from paratrain.parallel.recompute import apply_recompute
from paratrain.parallel.tensor import apply_tensor_parallel, has_submodule
from paratrain.precision import compute_dtype


def parallelize(model: nn.Module, config: ParallelConfig, layout: Layout, *, precision: str = "none",
                model_config: ModelConfig | None = None, compile_layers: bool = False,
                layer_costs: list[int] | None = None, tokens_per_rank: int | None = None) -> PlacedModel:
    """Split a built-in ``model`` (built identically on every rank, or on the meta device) over ``layout``'s mesh;
    returns it placed (``PlacedModel``, its loss a ``TokenSumLoss``): this rank's chunks -- the model itself,
    sharded in place, when ``pipeline_stage`` is 1 -- and the ``Pipeline`` whose schedule runs a step over them.
    ``precision``: ``train.mixed_precision`` resolved for the device, never "auto" (FSDP then gathers parameters in
    the compute dtype and reduces gradients in fp32); ``compile_layers``: ``train.compile``. ``model_config``
    gives the loss (``ignore_index``, ``loss_in_head``) and whether there are experts (without it: none).
    ``layer_costs``: each layer's work, which the pipeline split balances
    (``paratrain.parallel.pipeline.layer_chunks``; equal when not given). ``tokens_per_rank``: the tokens of a
    micro-batch when every data-parallel rank's have the same shape (``paratrain.parallel.vocab``). Through
    ``paratrain.parallel.place`` the model is made fp8 and materialised too.
    """
    known = model_config is not None
    split = config.attention_split(model_config.num_heads, model_config.kv_heads) if known else None
    place = functools.partial(parallelize_chunk, config=config, layout=layout, precision=precision,
                              compile_layers=compile_layers, tokens_per_rank=tokens_per_rank, attention_split=split)
    pipeline = Pipeline(model, config, layout, place, layer_costs) if config.pipeline_stage > 1 else None
    experts = known and model_config.moe_config.expert_num > 1
    # the head computes the loss a few rows at a time, with no whole logits, unless the logits are vocab-sharded
    # (the loss is then loss_parallel's)
    loss = TokenSumLoss(ignore_index=model_config.ignore_index if known else -100, experts=experts,
                        loss_in_head=known and config.model_parallel == 1 and model_config.spec.loss_in_head)
    return PlacedModel(pipeline.parts if pipeline else [place(model)], config, layout, precision, loss=loss,
                       pipeline=pipeline, experts=experts)


def parallelize_chunk(chunk: nn.Module, config: ParallelConfig, layout: Layout, *, root: nn.Module | None = None,
                      net: nn.Module | None = None, precision: str = "none", compile_layers: bool = False,
                      tokens_per_rank: int | None = None, attention_split: str | None = None) -> nn.Module:
    """Every parallel dimension but the pipeline split on ``chunk`` (in place; returned): a built-in model or its
    pipeline chunk, a user's net or a traced pipeline stage of it. ``root``: the module whose forward runs the
    chunk (its pipeline stage's). ``net``: the user's net that ``chunk`` is or was cut from, whose modules declare
    what is split (``parallel_plan``: only the splits they want), its layers (``is_transformer_layer``, each with
    its own ``recompute_mode`` or the config's) and its data-parallel buckets (``comm_fusion``); only its
    SyncBatchNorm layers take global statistics (as MindSpore's). Without it the chunk's ``layer_stacks`` give the
    layers and every BatchNorm2d takes global statistics. ``precision``: the dtype FSDP gathers parameters in
    (fp8 Linears are made before, by ``paratrain.parallel.place``). ``compile_layers``: each layer, or the chunk
    when it has none, compiled after recompute. ``tokens_per_rank``: as ``parallelize``'s. ``attention_split``: how a
    built-in model's attention runs over a sequence split by ``context_parallel``
    (``ParallelConfig.attention_split``)."""
    if config.model_parallel > 1:
        apply_tensor_parallel(chunk, config, layout.tp_mesh, declared_by=net)
    if config.context_parallel > 1:
        apply_context_parallel(chunk, layout, attention_split)
    apply_expert_parallel(chunk, config, layout)
    if net is not None:
        chunk.layer_stacks = {s: o for s, o in _layer_stacks(net).items() if has_submodule(chunk, s)}
        config = _with_layer_recompute(config, net)
    apply_recompute(chunk, config)
    if compile_layers:
        for layer in [chunk.get_submodule(name) for name, _, _ in pipeline_blocks(chunk)] or [chunk]:
            layer.compile()
    # context-parallel ranks hold gradients of their own tokens: reduced with the data-parallel ones'
    if config.data_parallel * config.context_parallel > 1 or config.offloads:  # FSDP2 offloads, even over one rank
        policy = None
        if precision != "none":
            policy = MixedPrecisionPolicy(param_dtype=compute_dtype(precision), reduce_dtype=torch.float32)
        held = set(chunk.modules())
        groups = [[m for m in group if m in held] for group in fusion_groups(net if net is not None else chunk)]
        apply_data_parallel(chunk, config, layout, policy, root=root, every_batch_norm=net is None,
                            groups=[group for group in groups if group] or None, tokens_per_rank=tokens_per_rank)
    return chunk


def _layer_stacks(net: nn.Module) -> dict[str, int]:
    """The containers of the net's layers with the layers before each (MindSpore's offset)."""
    stacks, count = {}, 0
    for name, module in net.named_modules():
        if getattr(module, "is_transformer_layer", False):
            parent = name.rpartition(".")[0]
            if parent not in stacks:
                stacks[parent] = count
            count += 1
    return stacks


def _with_layer_recompute(config: ParallelConfig, net: nn.Module) -> ParallelConfig:
    """``config`` with one recompute mode per layer of ``net`` when any sets its own (``recompute_mode``, set by
    ``recompute()`` or MindSpore's ``lambda_func``): the layer's own where set, else the config's."""
    modes = [getattr(m, "recompute_mode", "none") for m in net.modules() if getattr(m, "is_transformer_layer", 0)]
    if all(mode == "none" for mode in modes):
        return config
    return dataclasses.replace(config, recompute=[m if m != "none" else config.recompute_mode(i)
                                                  for i, m in enumerate(modes)])
