"""The Transformer ("Attention Is All You Need"): token embedding, multi-head attention, position-wise
feed-forward, the layer they make and the stack of layers, as plain single-device modules with no collectives.

Shapes: B batch, Tq / Tk query / key lengths, H hidden size, F ffn hidden size, V vocab size, h heads of size d.
Every forward also runs on one tensor-parallel shard of its module, so no reshape names the number of heads or
ffn features: a column-sharded q/k/v simply holds fewer heads. A module's parts are named by its class
attribute ``names``, as parameter names are part of the checkpoint format (``paratrain.nn`` keeps MindSpore's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.modules.moe import MoE

CAUSAL = "causal"  # the mask of causal self-attention: SDPA's is_causal, no mask tensor (the flash kernel on GPU)


@dataclass(frozen=True)
class CausalPrefix:
    """A self-attention mask whose first ``rows`` query rows are causal in every sequence (causal x key padding
    of sequences padded at the end, none shorter than ``rows``): those rows attend the first ``rows`` keys with
    SDPA's ``is_causal`` (the flash kernel on GPU), the later rows add ``bias`` (B, 1, Tq - rows, Tk) to their
    scores. The result is the whole mask's."""

    rows: int
    bias: torch.Tensor


class DocumentMask:
    """The self-attention mask of packed documents, block-diagonal causal: query i attends key j where j <= i and
    both tokens are in the same document, given as each token's ``document_ids`` (B, T). ``mask``: that mask as a
    boolean (B, 1, T, T), True where a query may attend, made once at its first use (a sequence split over
    context-parallel ranks needs the ids alone)."""

    def __init__(self, document_ids: torch.Tensor):
        self.document_ids = document_ids
        self._mask: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor:
        # not functools.cached_property: its lock (Python 3.11) breaks a compiled layer's graph
        if self._mask is None:
            ids = self.document_ids
            causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).tril()
            self._mask = (ids[:, None, :, None] == ids[:, None, None, :]) & causal
        return self._mask


class VocabEmbedding(nn.Module):
    """Token lookup: ids (B, T) -> (embeddings (B, T, H), table (V, H)); the table's rows may split."""

    def __init__(self, vocab_size: int, embedding_size: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_size)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embedding(ids), self.embedding.weight

    def parallel_plan(self) -> dict:
        return {"embedding": "vocab_rows"}


class Attention(nn.Module):
    """Multi-head attention: query (B, Tq, H) over key and value (B, Tk, H) -> ``(output (B, Tq, H), (key,
    value))``, the projected keys and values (B, h, Tk, d) (MindSpore's ``layer_present``).

    Self-attention when ``key`` is None; ``value`` defaults to ``key``. ``attention_mask``: ``CAUSAL`` (SDPA's
    ``is_causal``), a ``CausalPrefix``, a ``DocumentMask``, a boolean (B, 1, Tq, Tk) mask (True where a query may
    attend), a float one added to the scores, or None. With a ``cache`` dict (self-attention while decoding, MindSpore's
    ``use_past``) the new keys and values are appended to the cached ones, so the query holds only the new
    positions.
    ``linear(in_features, out_features)`` builds the projections; ``dropout`` applies to the attention
    probabilities. q, k and v split colwise (whole heads per rank), the output projection rowwise.

    The Llama family's options: ``num_kv_heads`` key/value heads shared by groups of query heads (grouped-query
    attention; 1: multi-query; None: ``num_heads``), ``head_dim`` (None: hidden_size / num_heads), ``qkv_bias`` /
    ``out_bias`` (biases of q, k, v and of the output projection), ``qk_norm`` (makes a module of size d, e.g. an
    RMSNorm, one for the queries and one for the keys of every head, Qwen3) and ``rotary`` (a ``RotaryEmbedding``
    turning q and k by their positions, counted after the cached ones, or given as ``positions`` (B, Tq)).

    ``split_attention``: None (SDPA here), or what attends instead when the sequence is split over context-parallel
    ranks, set from outside (``paratrain.parallel.context``): ``(q, k, v, document_ids=None, dropout_p=0.0) ->
    context`` on this rank's tokens, (B, h, T_local, d) -> the same, where a ``DocumentMask``'s ids or None
    (``CAUSAL``) give the mask over the whole sequence.
    """

    split_attention: Callable | None = None

    names = ("q_proj", "k_proj", "v_proj", "out_proj")

    def __init__(self, hidden_size: int, num_heads: int, dropout: float, linear=nn.Linear,
                 num_kv_heads: int | None = None, head_dim: int | None = None, qkv_bias: bool = True,
                 out_bias: bool = True, qk_norm: Callable[[], nn.Module] | None = None,
                 rotary: nn.Module | None = None):
        super().__init__()
        self.head_dim = head_dim or hidden_size // num_heads
        self.attention_dropout = dropout
        q_width, kv_width = num_heads * self.head_dim, (num_kv_heads or num_heads) * self.head_dim
        shapes = [(hidden_size, q_width, qkv_bias), (hidden_size, kv_width, qkv_bias),
                  (hidden_size, kv_width, qkv_bias), (q_width, hidden_size, out_bias)]
        for name, (width_in, width_out, bias) in zip(self.names, shapes):
            self.add_module(name, linear(width_in, width_out) if bias else linear(width_in, width_out, bias=False))
        self.q_norm, self.k_norm = (None, None) if qk_norm is None else (qk_norm(), qk_norm())
        self.rotary = rotary

    def parallel_plan(self) -> dict:
        *qkv, out = self.names
        return {**dict.fromkeys(qkv, "colwise"), out: "rowwise"}

    def forward(self, query, key=None, value=None, attention_mask=None, cache: dict | None = None,
                positions: torch.Tensor | None = None) -> tuple:
        q, k, v = self.heads(query, key, value, cache, positions)
        return self.attend(q, k, v, attention_mask), (k, v)

    def heads(self, query, key=None, value=None, cache: dict | None = None, positions: torch.Tensor | None = None):
        """The projected query (B, h, Tq, d), key and value (B, h, Tk, d), h being this rank's heads; ``positions``
        (B, Tq) those the rotary embedding turns them by (None: counted from the cached ones)."""
        projected = self.projected_together(query) if key is None and value is None else None
        if projected is None:
            key = query if key is None else key
            value = key if value is None else value
            projected = (getattr(self, name)(x) for name, x in zip(self.names, (query, key, value)))
        q, k, v = (x.unflatten(-1, (-1, self.head_dim)) for x in projected)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        if self.rotary is not None:
            q, k = self.rotary(q, k, start=cache["k"].shape[2] if cache else 0, positions=positions)
        if cache is not None:
            if cache:
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            cache.update(k=k, v=v)
        return q, k, v

    def projected_together(self, x: torch.Tensor) -> tuple | None:
        """Under autocast, self-attention's q, k and v of ``x`` (..., H) by one matmul of their weights cast and
        joined: one read and cast of ``x`` and one matmul for its gradient instead of three and their sum. The
        joined weight is what backward keeps in place of the three casts it would keep anyway, so only weights
        that autocast casts are joined (parameters already in the compute dtype, as FSDP gathers them, or fp32
        training would keep a copy more). None then, and where a projection is more than a plain Linear (a
        tensor-parallel shard, fp8, a hook on it) or torch.export traces the module (a pipeline split, whose
        stages take their layers' parameters as they are)."""
        device = x.device.type
        if not torch.is_autocast_enabled(device) or torch.compiler.is_exporting():
            return None
        dtype = torch.get_autocast_dtype(device)
        linears = [getattr(self, name) for name in self.names[:3]]
        biases = [linear.bias for linear in linears]
        if len({bias is None for bias in biases}) > 1 or any(
                type(linear) is not nn.Linear or isinstance(linear.weight, DTensor) or linear.weight.dtype == dtype
                or linear._forward_hooks or linear._forward_pre_hooks for linear in linears):
            return None
        weight = torch.cat([linear.weight.to(dtype) for linear in linears])
        bias = None if biases[0] is None else torch.cat([bias.to(dtype) for bias in biases])
        return F.linear(x, weight, bias).split([linear.weight.shape[0] for linear in linears], dim=-1)

    def attend(self, q, k, v, mask=None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v of every head (a key/value head serving q.shape[1] / k.shape[1] query
        heads), then the output projection: -> (B, Tq, H)."""
        # grouped heads: SDPA reads each key/value head for its group of query heads, no copy repeats them
        dropout = self.attention_dropout if self.training else 0.0
        if self.split_attention is not None:
            if mask is not CAUSAL and not isinstance(mask, DocumentMask):
                raise ValueError(f"attention over a sequence split by context parallelism takes the causal or the "
                                 f"document mask, not {type(mask).__name__}")
            document_ids = mask.document_ids if isinstance(mask, DocumentMask) else None
            context = self.split_attention(q, k, v, document_ids=document_ids, dropout_p=dropout)
            return getattr(self, self.names[-1])(context.transpose(1, 2).flatten(2))
        options = {"dropout_p": dropout, "enable_gqa": k.shape[1] != q.shape[1]}
        if isinstance(mask, DocumentMask):
            mask = mask.mask
        if mask is CAUSAL:
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True, **options)
        elif isinstance(mask, CausalPrefix):
            n = mask.rows
            context = torch.cat([
                F.scaled_dot_product_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], is_causal=True, **options),
                F.scaled_dot_product_attention(q[:, :, n:], k, v, attn_mask=mask.bias, **options)], dim=2)
        else:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **options)
        return getattr(self, self.names[-1])(context.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    """Position-wise FFN: (..., H) -> first Linear (..., F) -> activation -> dropout -> second Linear (..., H).

    ``activation``: a module; ``linear`` as in ``Attention``. The first Linear splits colwise, the second
    rowwise (one all-reduce).
    """

    names = ("fc1", "fc2")

    def __init__(self, hidden_size: int, ffn_hidden_size: int, dropout: float, activation: nn.Module,
                 linear=nn.Linear):
        super().__init__()
        first, second = self.names
        self.add_module(first, linear(hidden_size, ffn_hidden_size))
        self.activation = activation
        self.hidden_dropout = nn.Dropout(dropout)
        self.add_module(second, linear(ffn_hidden_size, hidden_size))

    def parallel_plan(self) -> dict:
        first, second = self.names
        return {first: "colwise", second: "rowwise"}

    def forward(self, x):
        first, second = (getattr(self, name) for name in self.names)
        return second(self.hidden_dropout(self.activation(first(x))))


class GatedFeedForward(nn.Module):
    """The SwiGLU feed-forward of the Llama family: x (..., H) -> down(silu(gate(x)) * up(x)) (..., H), gate
    and up (H -> F) and down (F -> H) without biases. Gate and up split colwise, down rowwise."""

    names = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        gate, up, down = self.names
        self.add_module(gate, nn.Linear(hidden_size, ffn_hidden_size, bias=False))
        self.add_module(up, nn.Linear(hidden_size, ffn_hidden_size, bias=False))
        self.add_module(down, nn.Linear(ffn_hidden_size, hidden_size, bias=False))

    def parallel_plan(self) -> dict:
        gate, up, down = self.names
        return {gate: "colwise", up: "colwise", down: "rowwise"}

    def forward(self, x):
        gate, up, down = (getattr(self, name) for name in self.names)
        return down(F.silu(gate(x)) * up(x))


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer) in the rotate-half layout of Hugging Face's Llama, so its q/k weights
    need no permutation: q, k (B, h, T, d) -> the same turned by the angles of positions ``start`` .. ``start +
    T - 1``, or of each row's own ``positions`` (B, T) (packed documents, each counted from 0), frequency i of
    the pairs (j, j + d/2) being ``theta ** (-2i / d)``. ``scaling``: HF's ``rope_scaling``
    of ``rope_type`` "linear" (frequencies / ``factor``) or "llama3" (Llama 3.1's: low frequencies / ``factor``,
    high ones kept, those between blended). No parameters or buffers: the angles are computed in float32 on q's
    device at each call."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, dict(scaling or {})

    def frequencies(self, device) -> torch.Tensor:
        """(d/2,) float32 angles per position of each rotated pair."""
        d = self.head_dim
        inv_freq = self.theta ** -(torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
        kind = self.scaling.get("rope_type", self.scaling.get("type"))
        if kind == "linear":
            return inv_freq / self.scaling["factor"]
        if kind != "llama3":
            return inv_freq
        factor, low, high = (self.scaling[key] for key in ("factor", "low_freq_factor", "high_freq_factor"))
        context = self.scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv_freq
        blend = ((context / wavelength - low) / (high - low)).clamp(0, 1)  # 0 at long wavelengths, 1 at short
        return (1 - blend) * inv_freq / factor + blend * inv_freq

    def forward(self, q: torch.Tensor, k: torch.Tensor, start: int = 0,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is None:
            positions = torch.arange(start, start + q.shape[2], dtype=torch.float32, device=q.device)
        else:  # (B, T) -> (B, 1, T): one angle per row and position, the same for every head
            positions = positions.to(device=q.device, dtype=torch.float32)[:, None]
        angles = positions[..., None] * self.frequencies(q.device)
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        return tuple((x * cos + rotate_half(x) * sin).to(x.dtype) for x in (q, k))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., d) -> (-x[d/2:], x[:d/2]): the second half of each pair's rotation."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class TransformerLayer(nn.Module):
    """A pre-LayerNorm Transformer layer: self-attention, cross-attention over the encoder output ``memory``
    (given one), then the FFN or a mixture of experts, each as ``x + dropout(sublayer(norm(x)))`` (MindSpore's
    ``post_layernorm_residual``: ``norm(x) + ...``): x (B, T, H), mask, memory (B, S, H), memory_mask ->
    ``(output (B, T, H), presents, *aux_loss)``: the keys and values of its attentions where ``returns_presents``
    (MindSpore's layers; else ``()``: under recompute they would stay alive to the end of the stack, and FSDP
    hooks every tensor a unit returns) and, where the FFN is a mixture of experts, its load-balancing loss.
    ``cache``: the self-attention's while decoding; ``positions`` (B, T): the self-attention's rotary positions.

    Its owner builds the parts and names them in ``names``, as parameter names are part of the checkpoint
    format: the LayerNorm and sublayer of the self-attention, of the cross-attention (absent without one) and
    of the FFN. The attentions are called as ``Attention``, on (query,) and (query, memory) with the mask as
    ``attention_mask``: the inputs a tensor-parallel plan's ``("gather", n)`` gathers.
    """

    is_transformer_layer = True  # a unit of recompute and FSDP
    names = ("norm1", "self_attention", "norm2", "cross_attention", "norm3", "ffn")
    returns_presents = True

    def __init__(self, dropout: float, post_layernorm_residual: bool):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.post_layernorm_residual = post_layernorm_residual

    def forward(self, x, mask=None, memory=None, memory_mask=None, cache: dict | None = None,
                positions: torch.Tensor | None = None) -> tuple:
        part = self.get_submodule
        norm1, self_attention, norm2, cross_attention, norm3, ffn = self.names
        decoding = {} if cache is None else {"cache": cache}  # only the built-ins' attention keeps one
        if positions is not None:  # as the cache: only asked of the built-ins' attention
            decoding["positions"] = positions
        normed = part(norm1)(x)
        update, presents = part(self_attention)(normed, attention_mask=mask, **decoding)
        x = self.residual(x, normed, update)
        if memory is not None:
            normed = part(norm2)(x)
            update, cross_presents = part(cross_attention)(normed, memory, attention_mask=memory_mask)
            x = self.residual(x, normed, update)
            presents += cross_presents
        normed, ffn = part(norm3)(x), part(ffn)
        update, *aux_loss = ffn(normed) if isinstance(ffn, MoE) else (ffn(normed),)
        return (self.residual(x, normed, update), presents if self.returns_presents else (), *aux_loss)

    def residual(self, x: torch.Tensor, normed: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """``update`` after dropout onto the LayerNorm's input ``x``, or onto its output ``normed``."""
        return (normed if self.post_layernorm_residual else x) + self.dropout(update)


class TransformerStack(nn.Module):
    """Layers in turn, then the final LayerNorm where there is one: x (B, T, H) and what each layer takes after
    it -> ``(output (B, T, H), presents, *aux_loss)``: the presents of the layers that return any, and the
    layers' mixture-of-experts losses summed, if any. ``caches`` (decoding): layer name -> its
    self-attention's cache; ``positions`` (B, T): each token's rotary position (packed documents). The owner
    builds the layers (a ModuleList, or a ModuleDict where pipeline chunks remove some) and the norm (None: none) under its ``names``.
    """

    names = ("layers", "norm")

    def forward(self, x, *inputs, caches: dict[str, dict] | None = None,
                positions: torch.Tensor | None = None) -> tuple:
        layers, norm = (getattr(self, name) for name in self.names)
        presents, aux_losses = (), []
        for key, layer in layers.named_children():
            decoding = {} if caches is None else {"cache": caches.setdefault(key, {})}
            if positions is not None:
                decoding["positions"] = positions
            x, present, *aux_loss = layer(x, *inputs, **decoding)
            presents += (present,) if present else ()
            aux_losses += aux_loss
        return (x if norm is None else norm(x), presents, *summed(aux_losses))


def cached_length(caches: dict[str, dict] | None) -> int:
    """Positions the self-attention caches of a decoding model already hold (0: none, or not decoding)."""
    cache = next(iter(caches.values()), None) if caches else None
    return cache["k"].shape[2] if cache else 0


def decoder_mask(caches: dict[str, dict] | None, document_ids: torch.Tensor | None = None) -> str | DocumentMask | None:
    """The self-attention mask of a decoder-only model: ``CAUSAL``, but None once its ``caches`` hold earlier
    positions, where the one new token attends every key. With ``document_ids`` (B, S) (packed documents) the
    block-diagonal causal ``DocumentMask``."""
    if document_ids is not None:
        return DocumentMask(document_ids)
    return None if cached_length(caches) else CAUSAL


def summed(aux_losses: list[torch.Tensor]) -> tuple:
    """Mixture-of-experts losses as their sum, the last element of a return tuple (nothing without any)."""
    return (torch.stack(aux_losses).sum(),) if aux_losses else ()


def pipeline_blocks(model: nn.Module) -> list[tuple[str, int, int]]:
    """(name, layer_id, offset) of each layer the model holds, in execution order, from its ``layer_stacks``.

    ``offset`` counts the layers of the stacks before this one (the decoder's offset
    is the number of encoder layers), as in MindSpore's ``lambda_func(layer_id, offset)``.
    A pipeline chunk holds only some layers; the names stay those of the whole model.
    """
    return [(f"{stack}.{key}", int(key), offset) for stack, offset in model.layer_stacks.items()
            for key in model.get_submodule(stack)._modules]
