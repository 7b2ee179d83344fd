"""The Transformer's parts ("Attention Is All You Need"): token embedding, multi-head attention, position-wise
feed-forward and the residual add, as plain single-device modules with no collectives.

Shapes: B batch, Tq / Tk query / key lengths, H hidden size, F ffn hidden size, V vocab size, h heads of size d.
Every forward also runs on one tensor-parallel shard of its module, so no reshape names the number of heads or
ffn features: a column-sharded q/k/v simply holds fewer heads. A module's Linears are named by its class
attribute ``names``, as parameter names are part of the checkpoint format (``paratrain.nn`` keeps MindSpore's).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CAUSAL = "causal"  # the mask of causal self-attention: SDPA's is_causal, no mask tensor (the flash kernel on GPU)


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
    """Multi-head attention: query (B, Tq, H) over key and value (B, Tk, H) -> (B, Tq, H).

    Self-attention when ``key`` is None; ``value`` defaults to ``key``. ``mask``: ``CAUSAL`` (SDPA's
    ``is_causal``), a boolean (B, 1, Tq, Tk) mask (True where a query may attend), a float one added to the
    scores, or None. With a ``cache`` dict (self-attention while decoding, MindSpore's ``use_past``) the new
    keys and values are appended to the cached ones, so the query holds only the new positions.
    ``linear(in_features, out_features)`` builds the projections; ``dropout`` applies to the attention
    probabilities. q, k and v split colwise (whole heads per rank), the output projection rowwise.
    """

    names = ("q_proj", "k_proj", "v_proj", "out_proj")

    def __init__(self, hidden_size: int, num_heads: int, dropout: float, linear=nn.Linear):
        super().__init__()
        self.head_dim = hidden_size // num_heads
        self.attention_dropout = dropout
        for name in self.names:
            self.add_module(name, linear(hidden_size, hidden_size))

    def parallel_plan(self) -> dict:
        *qkv, out = self.names
        return {**dict.fromkeys(qkv, "colwise"), out: "rowwise"}

    def forward(self, query, key=None, value=None, mask=None, cache: dict | None = None) -> torch.Tensor:
        return self.attend(*self.heads(query, key, value, cache), mask)

    def heads(self, query, key=None, value=None, cache: dict | None = None):
        """The projected query (B, h, Tq, d), key and value (B, h, Tk, d), h being this rank's heads."""
        key = query if key is None else key
        value = key if value is None else value
        q, k, v = (getattr(self, name)(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
                   for name, x in zip(self.names, (query, key, value)))
        if cache is not None:
            if cache:
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            cache.update(k=k, v=v)
        return q, k, v

    def attend(self, q, k, v, mask=None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v of every head, then the output projection: -> (B, Tq, H)."""
        dropout = self.attention_dropout if self.training else 0.0
        if mask is CAUSAL:
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
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


def residual(x: torch.Tensor, normed: torch.Tensor, update: torch.Tensor, post_layernorm_residual: bool):
    """The residual add around a pre-LayerNorm sublayer: ``update`` onto the LayerNorm's input ``x``, or with
    MindSpore's ``post_layernorm_residual`` onto its output ``normed``."""
    return (normed if post_layernorm_residual else x) + update


def pipeline_blocks(model: nn.Module) -> list[tuple[str, int, int]]:
    """(name, layer_id, offset) of each layer the model holds, in execution order, from its ``layer_stacks``.

    ``offset`` counts the layers of the stacks before this one (the decoder's offset
    is the number of encoder layers), as in MindSpore's ``lambda_func(layer_id, offset)``.
    A pipeline chunk holds only some layers; the names stay those of the whole model.
    """
    return [(f"{stack}.{key}", int(key), offset) for stack, offset in model.layer_stacks.items()
            for key in model.get_submodule(stack)._modules]
