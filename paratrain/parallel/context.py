"""Context parallelism: each sequence of a decoder split over the ``context_parallel`` ranks of its ``cp`` group.

The causal split is load-balanced: the sequence in 2N chunks, cp rank r keeps chunks r and 2N-1-r (a head chunk
and a tail chunk), so every rank's queries see about as many keys. ``split_sequence`` cuts a batch's (B, T) token
tensors so -- input ids, labels (already shifted), position ids (made explicit, so rotary and learned positions
stay those of the whole sequence) and the document ids of packed documents -- and every module outside attention
runs on its own tokens unchanged. ``apply_context_parallel`` gives each of the model's ``Attention`` modules the
attention over the whole sequence (``split_attention``), from outside: the model calls no collective.

Ulysses (DeepSpeed-Ulysses) attention: an all-to-all turns this rank's tokens of all its heads, (B, h, T/N, d),
into all tokens of 1/N of its heads, (B, h/N, T, d), put back in the sequence's order; causal SDPA (or the
block-diagonal causal mask of the whole sequence's documents) runs there, and a second all-to-all returns the
output to the local tokens. The all-to-alls have a backward (functional collectives'
``all_to_all_single_autograd``), so the gradients of the keys and values of other ranks' tokens flow back to them.
Where the heads do not divide by N, ring attention (``paratrain.parallel.ring_attention``) passes the keys and
values around the ranks instead.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from paratrain.mesh import Layout
from paratrain.modules.transformer import Attention, DocumentMask
from paratrain.parallel.ring_attention import ring_attention
from paratrain.parallel.vocab import ALL_GATHER

SPLIT_KEYS = ("input_ids", "labels", "position_ids", "document_ids")  # the (B, T) tensors of a decoder's batch


def local_positions(length: int, cp_size: int, cp_rank: int, device: torch.device) -> torch.Tensor:
    """The positions of a sequence of ``length`` that cp rank ``cp_rank`` of ``cp_size`` keeps, (length / N,):
    chunk r then chunk 2N-1-r of 2N equal chunks."""
    chunks = torch.arange(length, device=device).view(2 * cp_size, -1)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]])


def split_sequence(batch: dict, layout: Layout) -> dict:
    """This cp rank's tokens of a decoder's ``batch`` (``SPLIT_KEYS``, each (B, T) -> (B, T / N)), with explicit
    ``position_ids`` (0..T-1 where the batch has none); the batch itself without context parallelism."""
    if layout.cp_group is None:
        return batch
    ids = batch["input_ids"]
    rows, length = ids.shape
    batch = dict(batch)
    if "position_ids" not in batch:
        batch["position_ids"] = torch.arange(length, device=ids.device).expand(rows, length)
    keep = local_positions(length, layout.cp_size, layout.cp_rank, ids.device)
    return {k: v.index_select(1, keep) if k in SPLIT_KEYS else v for k, v in batch.items()}


def apply_context_parallel(model: nn.Module, layout: Layout, method: str) -> nn.Module:
    """Give every ``Attention`` of ``model`` the attention over its sequence split on ``layout``'s cp group, by
    ``method`` (``ParallelConfig.attention_split``: "ulysses" or "ring"); in place, returned."""
    attention = functools.partial(ATTENTIONS[method], group=layout.cp_group)
    for module in model.modules():
        if isinstance(module, Attention):
            module.split_attention = attention
    return model


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Exchange the N slices of ``x`` (N, ...) with the group's N ranks: slice i goes to rank i, the result's slice
    i comes from rank i. Gradients flow back the same way."""
    return wait_tensor(all_to_all_single_autograd(x.contiguous(), None, None, group))


def _whole_sequence(x: torch.Tensor, group: dist.ProcessGroup, order: torch.Tensor) -> torch.Tensor:
    """(B, h, T/N, d), this rank's tokens of its heads -> (B, h/N, T, d), every token of the group's rank-th
    slice of the heads, in the sequence's order."""
    n = dist.get_world_size(group)
    sliced = x.unflatten(1, (n, -1)).movedim(1, 0)  # (N, B, h/N, T/N, d): head slice i goes to rank i
    received = _all_to_all(sliced, group)  # (N, B, h/N, T/N, d): rank i's tokens of this rank's heads
    return received.movedim(0, 2).flatten(2, 3).index_select(2, order)


def _local_sequence(x: torch.Tensor, group: dist.ProcessGroup, order: torch.Tensor) -> torch.Tensor:
    """``_whole_sequence`` undone: (B, h/N, T, d) -> (B, h, T/N, d)."""
    n = dist.get_world_size(group)
    by_rank = torch.empty_like(x).index_copy(2, order, x)  # back in the ranks' order
    sliced = by_rank.unflatten(2, (n, -1)).movedim(2, 0)  # (N, B, h/N, T/N, d): rank i's tokens go to it
    return _all_to_all(sliced, group).movedim(0, 1).flatten(1, 2)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                      document_ids: torch.Tensor | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention over a sequence split on ``group``'s N ranks, each holding its head chunk then its tail
    chunk (``split_sequence``): q (B, h, T/N, d), k and v (B, hk, T/N, d) (grouped-query heads: hk divides h, and
    N divides both) -> (B, h, T/N, d), this rank's tokens' output. ``document_ids`` (B, T/N), in the same order:
    attention stays within each packed document (block-diagonal causal); None: causal over the whole sequence."""
    n = dist.get_world_size(group)
    length = q.shape[2] * n
    # order[i]: where the i-th token of the sequence lies in the ranks' tokens one after the other
    order = torch.cat([local_positions(length, n, rank, q.device) for rank in range(n)]).argsort()
    q, k, v = (_whole_sequence(x, group, order) for x in (q, k, v))
    options = {"dropout_p": dropout_p, "enable_gqa": k.shape[1] != q.shape[1]}
    if document_ids is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **options)
    else:
        gathered = document_ids.new_empty((n * document_ids.shape[0], document_ids.shape[1]))  # each rank's in turn
        ALL_GATHER(gathered, document_ids.contiguous(), group=group)
        whole_ids = gathered.unflatten(0, (n, -1)).movedim(0, 1).flatten(1).index_select(1, order)  # (B, T)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=DocumentMask(whole_ids).mask, **options)
    return _local_sequence(out, group, order)


# ``ParallelConfig.attention_split`` -> the attention it names
ATTENTIONS = {"ulysses": ulysses_attention, "ring": ring_attention}
