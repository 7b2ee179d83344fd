"""Tensor (model) parallelism: the splits a model's modules declare, as DTensor styles over the "tp" mesh dim.

Every module may declare how its direct children split with ``parallel_plan()``: child name -> kind. ``colwise``: a
Linear's output features sharded; ``rowwise``: its input features sharded, outputs summed; ``vocab_rows``: an
Embedding's rows sharded, lookups summed (built-in models: only with ``vocab_emb_dp=false``); ``head``:
column-sharded, the logits kept vocab-sharded for the vocab-parallel loss (``loss.py``); ``replicate``: a module kept
whole on every rank, its replicated input taken as this rank's plain tensor (backward sums nothing: the gradient
reaching its output is already whole); ``("gather", n)``: the
module's n inputs made replicated first, so q, k and v share one input and backward sums their gradients over the tp
ranks once; with ``sequence_parallel`` only, ``norm`` (a LayerNorm on sequence shards), ``tokens`` (a module whole on every
rank, run on this rank's tokens flattened into dim 0: its gradient summed over the ranks) and ``position`` (a
position table, this rank's sequence rows kept). With ``sequence_parallel`` the residual stream between sublayers is sharded
along the sequence: LayerNorms and dropout run on 1/mp of the tokens, attention and FFN inputs are all-gathered, and
their outputs reduce-scattered instead of all-reduced.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)
from torch.distributed.tensor.parallel.style import ParallelStyle

from paratrain.config import ParallelConfig
from paratrain.errors import UserError


def declared_plan(model: nn.Module) -> dict[str, str | tuple]:
    """Module name -> split kind, from every ``parallel_plan()`` the model's modules declare; children a
    pipeline chunk does not hold are left out. A module declared with a kind that has ``split_as(kind)`` (a LoRA
    adapter around its Linear, ``paratrain.lora``) is split as that says its children split."""
    plan, modules = {}, dict(model.named_modules())
    for name, module in modules.items():
        for child, kind in (module.parallel_plan() if hasattr(module, "parallel_plan") else {}).items():
            target = f"{name}.{child}" if name else child
            if target in modules and hasattr(modules[target], "split_as"):  # it splits by splitting its children
                plan.update({f"{target}.{inner}": how for inner, how in modules[target].split_as(kind).items()})
            elif target in modules:
                plan[target] = kind
    return plan


def parallel_style(kind, sequence_parallel: bool = False, vocab_emb_dp: bool = False) -> ParallelStyle | None:
    """The DTensor style of a split kind; None when the kind changes nothing in this configuration."""
    stream = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream between sublayers
    if kind == "colwise":
        return ColwiseParallel()
    if kind == "rowwise":
        return RowwiseParallel(output_layouts=stream)
    if kind == "vocab_rows" and not vocab_emb_dp:  # with SP the partial rows are reduce-scattered
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if kind == "head":
        return ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
    if kind == "replicate":
        return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                  use_local_output=True)
    if isinstance(kind, tuple) and kind[0] == "gather":
        inputs = kind[1]
        return PrepareModuleInput(input_layouts=(stream,) * inputs, desired_input_layouts=(Replicate(),) * inputs)
    if sequence_parallel and kind == "norm":
        return SequenceParallel(use_local_output=True)
    if sequence_parallel and kind == "tokens":
        return SequenceParallel(sequence_dim=0, use_local_output=True)
    if sequence_parallel and kind == "vocab_rows":  # a whole table's output (B, S, H): keep this rank's sequence
        return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    if sequence_parallel and kind == "position":  # (S, H) table output: keep this rank's sequence rows
        return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    if kind in ("vocab_rows", "norm", "tokens", "position"):
        return None
    raise UserError(f"unknown tensor-parallel kind {kind!r} in a parallel_plan: use colwise, rowwise, vocab_rows, "
                    f"head, replicate, norm, tokens, position or ('gather', inputs)")


def apply_tensor_parallel(model: nn.Module, config: ParallelConfig, tp_mesh: DeviceMesh,
                          declared_by: nn.Module | None = None) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh`` as its modules declare; keeps a tied head tied to the (sharded)
    table. ``declared_by``: a user's net, which ``model`` is or was traced from: its modules declare only the
    splits they want (``vocab_emb_dp`` is theirs), and those ``model`` holds as traced leaves are replaced by the
    net's own modules, which are then sharded."""
    vocab_emb_dp = config.vocab_emb_dp and declared_by is None
    plan = declared_plan(declared_by or model)
    styles = {name: parallel_style(kind, config.sequence_parallel, vocab_emb_dp) for name, kind in plan.items()}
    styles = {name: style for name, style in styles.items() if style is not None and has_submodule(model, name)}
    for name in styles if declared_by is not None else ():
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).register_module(child, declared_by.get_submodule(name))
    tables = [model.get_submodule(name) for name in styles if plan[name] == "vocab_rows"]
    head, word = getattr(model, "head", None), next(iter(tables), None)
    tied = head is not None and word is not None and head.weight is word.weight
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    parallelize_module(model, tp_mesh, styles)
    for name, param in model.named_parameters():  # SequenceParallel's replicated parameters all require grad
        param.requires_grad_(name not in frozen)
    if tied:
        head.weight = word.weight
    if not vocab_emb_dp:  # each table once (the source and target embeddings may share one)
        for weight in {id(table.weight): table.weight for table in tables}.values():
            weight.register_post_accumulate_grad_hook(gradient_like_parameter)
    return model


def gradient_like_parameter(param) -> None:
    """The sharded embedding's backward leaves a replicated (V, H) gradient: keep only this rank's rows."""
    if param.grad.placements != param.placements:
        param.grad = param.grad.redistribute(param.device_mesh, param.placements)


def has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True
