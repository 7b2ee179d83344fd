"""The vocabulary over the data-parallel ranks at ZeRO 2 and 3: the tokens travel, the word table and the head do not.

FSDP2 all-gathers each unit's parameters before use and reduce-scatters their gradients: for a (V, H) word
table or output head that is V*H*(dp-1)/dp elements each way a step (and the gather again in backward at
stage 3), while the tokens that use it are only dp*N rows of H (N: the tokens of a rank's micro-batch). When
dp*N <= V each rank keeps its V/dp rows of the table -- the DTensor ``Shard(0)`` FSDP2 would keep -- and:

- the embedding all-gathers the ids (dp*N), looks up the ones among its rows (zero elsewhere) and
  reduce-scatters the (dp*N, H) result: each rank gets its own tokens' embeddings. Backward all-gathers
  their gradient and adds it into this rank's rows.
- the head with labels all-gathers the hidden states and labels, computes the logits of its V/dp rows for
  all dp*N tokens, and combines each row's log-sum-exp over the ranks
  (``paratrain.modules.linear_cross_entropy``); the hidden states' gradient is reduce-scattered. Each rank's loss
  is that of the targets among its rows: summed over the ranks (as the step's loss is), that of all tokens.

No parameter is gathered and no parameter gradient reduced: each rank's rows already saw every rank's tokens.
It needs every data-parallel rank's micro-batches to have the same shape, as the built-in models' batches
have (the global batch is padded as one): ``parallelize`` applies it when given ``tokens_per_rank``.
Without gradients (evaluation, decoding) the table is gathered whole, as FSDP2 would.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from paratrain.mesh import Layout
from paratrain.modules.linear_cross_entropy import OutputHead, linear_token_loss_sum
from paratrain.modules.transformer import VocabEmbedding

# torch 2.13 renamed these two (its old names warn)
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def shard_vocabulary(model: nn.Module, layout: Layout, tokens_per_rank: int | None,
                     param_dtype: torch.dtype | None = None) -> set[nn.Parameter]:
    """Row-shard ``model``'s word tables (``VocabEmbedding``) and heads (``OutputHead``) over the data-parallel
    ranks when the tokens travel (``ParallelConfig.moves_tokens``), and make them look up and compute the loss by
    moving tokens; returns their parameters, for FSDP2 to leave alone (none when it does not apply).
    ``param_dtype``: the dtype FSDP2 would gather them in (mixed precision), which the lookups use."""
    tables = [m.embedding for m in model.modules() if isinstance(m, VocabEmbedding)]
    heads = [m for m in model.modules() if isinstance(m, OutputHead)]
    modules = tables + heads
    if not modules or not layout.config.moves_tokens(tokens_per_rank, modules[0].weight.shape[0]):
        return set()
    sharded: dict[int, nn.Parameter] = {}  # a tied table and head share one
    for module in modules:
        weight = module.weight
        if id(weight) not in sharded:
            sharded[id(weight)] = nn.Parameter(distribute_tensor(weight.detach(), layout.dp_mesh, [Shard(0)],
                                                                 src_data_rank=None),
                                               requires_grad=weight.requires_grad)
        module.weight = sharded[id(weight)]
        mixin = ShardedVocabRows if isinstance(module, nn.Embedding) else ShardedVocabHead
        module.__class__ = type(f"{mixin.__name__}{type(module).__name__}", (mixin, type(module)), {})
        module.param_dtype = param_dtype
    return set(sharded.values())


class RowsOfRanks:
    """The collectives of a table row-sharded over a group's ranks (``weight``: a ``Shard(0)`` DTensor on a 1-D
    mesh), for the fused head (``linear_token_loss_sum``) and the lookup: rows (N, ...) of every rank gathered,
    log-sum-exps combined, and each rank's own rows summed over the ranks."""

    def __init__(self, weight):
        mesh = weight.device_mesh
        self.group, self.ranks = mesh.get_group(), mesh.size()
        # Shard(0) chunks: ceil(V / ranks) rows
        self.vocab_start = -(-weight.shape[0] // self.ranks) * mesh.get_local_rank()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (N, ...) of every rank, in rank order: (ranks * N, ...)."""
        out = tensor.new_empty(self.ranks * tensor.shape[0], *tensor.shape[1:])
        ALL_GATHER(out, tensor.contiguous(), group=self.group)
        return out

    def whole_vocabulary(self, lse: torch.Tensor) -> torch.Tensor:
        """Each row's log-sum-exp over the whole vocabulary (N, 1), from those over each rank's rows (N, 1)."""
        return torch.logsumexp(self.gather(lse).view(self.ranks, *lse.shape), 0)

    def summed_own(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``tensor`` (ranks * N, ...) summed over the ranks -> (N, ...)."""
        out = tensor.new_empty(tensor.shape[0] // self.ranks, *tensor.shape[1:])
        REDUCE_SCATTER(out, tensor.contiguous(), group=self.group)
        return out


class ShardedVocabRows:
    """An ``nn.Embedding`` whose (V, H) table is row-sharded over the data-parallel ranks: ids (...) -> (..., H),
    each rank's own tokens, looked up where the rows are (see the module docstring)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        dtype = self.param_dtype or self.weight.dtype
        if not torch.is_grad_enabled():
            return F.embedding(ids, self.weight.full_tensor()).to(dtype)
        return _TokenLookup.apply(ids, self.weight.to_local(), RowsOfRanks(self.weight), dtype)


class ShardedVocabHead:
    """An ``OutputHead`` whose (V, H) weight is row-sharded over the data-parallel ranks: hidden (..., H) and
    labels (...) -> the summed token loss of every rank's targets among this rank's vocabulary rows (the ranks'
    sum: all their tokens' loss), the logits of each rank's rows computed for every rank's tokens; without
    labels -> logits (..., V), only without gradients (the weight gathered whole)."""

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if not torch.is_grad_enabled():
            weight = self.weight.full_tensor()
            return hidden @ weight.T if labels is None else linear_token_loss_sum(hidden, weight, labels,
                                                                                  self.ignore_index)
        if labels is None:
            raise RuntimeError("a head sharded over the data-parallel ranks computes logits only without gradients: "
                               "train it with labels (its loss)")
        return linear_token_loss_sum(hidden, self.weight.to_local(), labels, self.ignore_index,
                                     RowsOfRanks(self.weight))


class _TokenLookup(torch.autograd.Function):
    """ids (...) and this rank's rows (V/dp, H) of a row-sharded table -> this rank's embeddings (..., H) in
    ``dtype``; the table's gradient in its own dtype."""

    @staticmethod
    def forward(ctx, ids, weight, rows_of_ranks: RowsOfRanks, dtype: torch.dtype):
        local = rows_of_ranks.gather(ids) - rows_of_ranks.vocab_start  # (dp * B, ...): every rank's ids
        clamped = local.clamp(0, weight.shape[0] - 1)
        mine = (clamped == local).unsqueeze(-1)  # the row is one of this rank's
        rows = F.embedding(clamped, weight).to(dtype) * mine  # (dp * B, ..., H): zero where another rank's row
        # each rank's loss counts the data-parallel average (StepLoss): FSDP2 divides by the ranks, so here too
        ctx.save_for_backward(clamped, mine / rows_of_ranks.ranks)
        ctx.rows_of_ranks, ctx.table_rows, ctx.table_dtype = rows_of_ranks, weight.shape[0], weight.dtype
        return rows_of_ranks.summed_own(rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        local, share = ctx.saved_tensors  # the clamped rows; 1 / ranks where the row is this rank's, else 0
        grad_rows = ctx.rows_of_ranks.gather(grad_out).float().mul_(share)  # a buffer of its own: in place
        grad_weight = torch.ops.aten.embedding_dense_backward(grad_rows, local, ctx.table_rows, -1, False)
        return None, grad_weight.to(ctx.table_dtype), None, None
