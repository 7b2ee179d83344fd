"""Ring attention: causal self-attention over a sequence split across the N ranks of a group (context parallelism).

Layout. The whole sequence of T = N * T_local tokens is cut into 2N chunks of C = T_local / 2 tokens; rank r holds
chunk r followed by chunk 2N-1-r (a head and a tail, so that every rank does the same causal work). Each rank
keeps its queries; keys and values travel around the ring: at step s (0 <= s < N) rank r holds those of rank
j = (r - s) mod N, and while it computes with them it already sends them on to rank r+1. Against rank j's keys
[chunk j, chunk 2N-1-j], rank r's queries [chunk r, chunk 2N-1-r] need one block:

- j == r (step 0): causal attention among the local tokens (they are in sequence order);
- j < r: all queries, against chunk j only (chunk 2N-1-j comes after both query chunks);
- j > r: the tail queries only (chunk 2N-1-r), against both chunks (both come after chunk r).

Each block is (2C x C) or (C x 2C), the same work as the causal (2C x 2C) one; the other pairs are skipped.

Merge. A block's attention returns its output o_b and the log-sum-exp l_b of each query's scores over the block's
keys. Blocks over disjoint keys combine exactly: l = log(exp(l_1) + exp(l_2)), o = exp(l_1 - l) o_1 + exp(l_2 - l)
o_2 (written with sigmoids below, which stay finite). A query with no key in a block has l_b = -inf and adds nothing.

Backward (recomputed from the saved output and log-sum-exp, not by autograd through the loop). Each block's
gradients are those of flash attention given the final o and l: its probabilities exp(s - l) are its slice of the
whole softmax. dq adds up on the rank; the dk, dv of rank j's keys add up in a buffer that travels around the ring
with those keys and arrives back at rank j after N steps.

Documents. With ``document_ids`` (B, T_local) a query sees only the keys of its own document as well: every
rank's ids are gathered once and each block gets the mask "same document" (and causal at step 0).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.modules.transformer import decoder_mask
from paratrain.parallel.vocab import ALL_GATHER


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
                   document_ids: torch.Tensor | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal self-attention (block-diagonal causal with ``document_ids``) of this rank's tokens over the whole
    sequence split over ``group`` in the head-tail layout above. q (B, h, T_local, d); k, v (B, hk, T_local, d)
    with hk dividing h (query head i uses key head i // (h / hk)); ``document_ids`` (B, T_local) integers, each
    token's document. Returns (B, h, T_local, d), what full causal SDPA over the gathered sequence gives for
    these tokens, differentiable in q, k and v. A group of one rank is plain SDPA (with ``dropout_p``); the ring
    has no attention dropout."""
    if dist.get_world_size(group) == 1:
        mask = None if document_ids is None else decoder_mask(None, document_ids).mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout_p,
                                              enable_gqa=k.shape[1] != q.shape[1])
    if dropout_p:
        raise ValueError(f"ring attention has no attention dropout (dropout_p={dropout_p}): set the attention "
                         "dropout to 0 or use Ulysses context parallelism")
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs an even number of local tokens (a head and a tail chunk), "
                         f"got {q.shape[2]}")
    return _RingAttention.apply(q, k, v, group, document_ids)


class _RingAttention(torch.autograd.Function):
    """The ring's forward and backward (see the module docstring); tensors as in ``ring_attention``."""

    @staticmethod
    def forward(ctx, q, k, v, group, document_ids):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        all_document_ids = None if document_ids is None else _gather_document_ids(document_ids, group)
        accumulate = torch.promote_types(q.dtype, torch.float32)
        out = torch.empty(q.shape, dtype=accumulate, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=accumulate, device=q.device)
        keys_values = torch.stack([k, v])
        for step in range(size):
            if step < size - 1:
                incoming, pending = _ring_shift(keys_values, group)
            rows, cols, bias, causal = _block(rank, (rank - step) % size, q.shape[2], document_ids,
                                              all_document_ids, q.dtype)
            block_out, block_lse = _attention_forward(q[:, :, rows], *keys_values[:, :, :, cols], bias, causal)
            if step == 0:
                out.copy_(block_out)
                lse.copy_(block_lse)
            else:
                _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if step < size - 1:
                _wait(pending)
                keys_values = incoming
        out = out.to(q.dtype)
        ctx.group = group
        ctx.save_for_backward(q, k, v, out, lse, document_ids, all_document_ids)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, document_ids, all_document_ids = ctx.saved_tensors
        group = ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        accumulate = torch.promote_types(q.dtype, torch.float32)
        grad_q = torch.zeros(q.shape, dtype=accumulate, device=q.device)
        keys_values = torch.stack([k, v])
        grad_keys_values = torch.zeros(keys_values.shape, dtype=accumulate, device=q.device)
        for step in range(size):
            if step < size - 1:
                incoming, pending = _ring_shift(keys_values, group)
            rows, cols, bias, causal = _block(rank, (rank - step) % size, q.shape[2], document_ids,
                                              all_document_ids, q.dtype)
            dq, dk, dv = _attention_backward(grad_out[:, :, rows], q[:, :, rows], *keys_values[:, :, :, cols],
                                             out[:, :, rows], lse[:, :, rows], bias, causal)
            grad_q[:, :, rows] += dq
            grad_keys_values[:, :, :, cols] += torch.stack([dk, dv])
            if step < size - 1:
                _wait(pending)
                keys_values = incoming
            # the keys now held are the previous rank's: take over its gradient buffer, hand ours to the next
            received, pending = _ring_shift(grad_keys_values, group)
            _wait(pending)
            grad_keys_values = received
        grad_k, grad_v = grad_keys_values.to(k.dtype)
        return grad_q.to(q.dtype), grad_k, grad_v, None, None


def _block(rank: int, source: int, local_length: int, document_ids: torch.Tensor | None,
           all_document_ids: torch.Tensor | None, dtype: torch.dtype) -> tuple[slice, slice, torch.Tensor | None, bool]:
    """The block of this rank's queries against ``source``'s keys: the query rows and key columns (slices of the
    local T_local), the additive ``dtype`` mask (B, 1, rows, cols) of its documents (None without), and whether it
    is causal."""
    chunk, everything = local_length // 2, slice(0, local_length)
    if source == rank:
        rows, cols = everything, everything
    elif source < rank:
        rows, cols = everything, slice(0, chunk)
    else:
        rows, cols = slice(chunk, local_length), everything
    if document_ids is None:
        return rows, cols, None, source == rank
    same_document = document_ids[:, None, rows, None] == all_document_ids[source][:, None, None, cols]
    if source == rank:
        same_document &= torch.ones(local_length, local_length, dtype=torch.bool, device=same_document.device).tril()
    bias = torch.zeros(same_document.shape, dtype=dtype, device=same_document.device)
    return rows, cols, bias.masked_fill(~same_document, -math.inf), False


def _gather_document_ids(document_ids: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's ``document_ids`` (B, T_local) as one (N, B, T_local), indexed by rank."""
    size = dist.get_world_size(group)
    gathered = torch.empty((size * document_ids.shape[0], *document_ids.shape[1:]), dtype=document_ids.dtype,
                           device=document_ids.device)
    ALL_GATHER(gathered, document_ids.contiguous(), group=group)
    return gathered.unflatten(0, (size, document_ids.shape[0]))


def _ring_shift(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, list]:
    """Start sending ``tensor`` to the next rank of the ring and receiving the previous rank's into a new tensor;
    returns that tensor and the pending requests (``_wait`` them before reading it or changing ``tensor``)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return received, dist.batch_isend_irecv([
        dist.P2POp(dist.isend, tensor, group=group, group_peer=(rank + 1) % size),
        dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - 1) % size)])


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's output (B, h, t, d) and log-sum-exp (B, h, t) into the running ``out`` and ``lse`` (views,
    changed in place); ``lse`` is finite, ``block_lse`` may be -inf."""
    out.sub_(torch.sigmoid(block_lse - lse).unsqueeze(-1) * (out - block_out))
    lse.sub_(F.logsigmoid(lse - block_lse))


def _attention_forward(q, k, v, bias: torch.Tensor | None, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention: q (B, h, t, d) against k, v (B, hk, u, d), with an additive mask ``bias``
    (B, 1, t, u) or ``causal`` (top-left aligned). Returns the output (B, h, t, d) and the log-sum-exp of the scores
    (B, h, t): -inf, with a zero output, for a query the mask leaves no key. On the CPU the fused flash kernel,
    elsewhere plain matmuls."""
    return (_flash_cpu_forward if q.device.type == "cpu" else _matmul_forward)(q, k, v, bias, causal)


def _attention_backward(grad_out, q, k, v, out, lse, bias: torch.Tensor | None, causal: bool):
    """The gradients (dq, dk, dv) of one block (``_attention_forward``'s arguments) given the whole attention's
    ``out`` (B, h, t, d) and finite ``lse`` (B, h, t), whose softmax this block's probabilities are a slice of."""
    backward = _flash_cpu_backward if q.device.type == "cpu" else _matmul_backward
    return backward(grad_out, q, k, v, out, lse, bias, causal)


def _flash_cpu_forward(q, k, v, bias, causal):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias)
    if bias is not None:  # the kernel gives a query without keys a log-sum-exp of 0
        lse = lse.masked_fill(torch.isinf(bias).all(-1), -math.inf)
    return out, lse


def _flash_cpu_backward(grad_out, q, k, v, out, lse, bias, causal):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=bias)


def _matmul_forward(q, k, v, bias, causal):
    scores = _scores(q, k, bias, causal)
    lse = torch.logsumexp(scores, -1)
    probabilities = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # -inf - -inf: a query without keys
    return probabilities @ _repeat_heads(v, q.shape[1]), lse


def _matmul_backward(grad_out, q, k, v, out, lse, bias, causal):
    heads, key_heads, scale = q.shape[1], k.shape[1], q.shape[-1] ** -0.5
    probabilities = torch.exp(_scores(q, k, bias, causal) - lse.unsqueeze(-1)).to(q.dtype)
    grad_scores = probabilities * (grad_out @ _repeat_heads(v, heads).transpose(-1, -2)
                                   - (grad_out * out).sum(-1, keepdim=True))
    grad_q = grad_scores @ _repeat_heads(k, heads) * scale
    grad_k = grad_scores.transpose(-1, -2) @ q * scale
    grad_v = probabilities.transpose(-1, -2) @ grad_out
    return grad_q, *(g.unflatten(1, (key_heads, heads // key_heads)).sum(2) for g in (grad_k, grad_v))


def _scores(q, k, bias: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """A block's attention scores (B, h, t, u), masked."""
    scores = q @ _repeat_heads(k, q.shape[1]).transpose(-1, -2) * q.shape[-1] ** -0.5
    if bias is not None:
        scores = scores + bias
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1),
                                    -math.inf)
    return scores


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key or value heads (B, hk, u, d) repeated for ``heads`` query heads (B, heads, u, d), as SDPA's GQA."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)
