"""The Llama family (Llama 3, Qwen2, Qwen3, Mistral) as a plain single-device decoder composed of the shared
``paratrain.modules`` parts: RMSNorm, rotary position embedding, grouped-query attention, SwiGLU feed-forward.

Shapes: B batch, S sequence length, H hidden size, V vocab size. Parameter names are those of Hugging Face's
``LlamaForCausalLM`` without its ``model.`` prefix, but ``lm_head`` (``head``) and ``o_proj`` (``out_proj``):
``paratrain.models.hf`` maps between the two.
"""
from __future__ import annotations

from functools import partial

from torch import nn

from paratrain.config import ModelConfig
from paratrain.models.transformer import EncoderLayer, init_weights
from paratrain.modules.linear_cross_entropy import OutputHead
from paratrain.modules.transformer import (Attention, GatedFeedForward, RotaryEmbedding, TransformerStack,
                                          decoder_mask)


class LlamaLayer(EncoderLayer):
    """A pre-RMSNorm decoder layer: x + attention(norm(x)), then + SwiGLU(norm(x)); x (B, S, H) -> ``(output
    (B, S, H), ())`` (``TransformerLayer``). The attention turns q and k by their positions (rotary), may share
    key/value heads between query heads, normalise q and k per head (``qk_norm``) and bias q, k, v
    (``qkv_bias``); nothing else has a bias."""

    names = ("input_layernorm", "self_attn", None, None, "post_attention_layernorm", "mlp")

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def make_attention(self, cfg: ModelConfig) -> Attention:
        return Attention(cfg.hidden_size, cfg.num_heads, cfg.attention_dropout, num_kv_heads=cfg.kv_heads,
                         head_dim=cfg.head_size, qkv_bias=cfg.qkv_bias, out_bias=False,
                         qk_norm=partial(nn.RMSNorm, cfg.head_size, eps=cfg.rms_norm_eps) if cfg.qk_norm else None,
                         rotary=RotaryEmbedding(cfg.head_size, cfg.rope_theta, cfg.rope_scaling))

    def make_feed_forward(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        return GatedFeedForward(cfg.hidden_size, cfg.ffn_hidden_size)


class LlamaModel(TransformerStack):
    """Decoder-only language model of the Llama family: input_ids (B, S) -> logits (B, S, V), or with ``labels``
    (B, S) their summed token loss computed without whole logits; token embedding, causal ``LlamaLayer``s and
    the final RMSNorm as a ``TransformerStack``, then the bias-free head (tied to the embedding or not).

    A pipeline chunk gets the hidden state (B, S, H) of the chunk before it as ``hidden`` and returns its own
    unless it holds the head. ``caches`` (decoding, ``paratrain.generation``): layer name -> its keys and values
    so far, filled by a prompt, then extended one new token at a time. Packed documents (``data.document_mask``):
    ``position_ids`` (B, S) each token's position in its document, ``document_ids`` (B, S) its document; attention
    then stays within each document (``decoder_mask``).
    """

    pipeline_parts = {"embed_tokens": "first", "norm": "last", "head": "last"}  # see Seq2SeqModel

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pad_token_id = cfg.pad_token_id
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): LlamaLayer(cfg, i) for i in range(cfg.decoder_layers)})
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.head = OutputHead(cfg.hidden_size, cfg.vocab_size, cfg.ignore_index)
        if cfg.tie_embeddings:
            self.head.weight = self.embed_tokens.weight
        self.layer_stacks = {"layers": 0}  # see Seq2SeqModel
        init_weights(self)

    def parallel_plan(self) -> dict:
        return {"embed_tokens": "vocab_rows", "norm": "norm", "head": "head"}

    def forward(self, input_ids, hidden: tuple = (), labels=None, caches: dict[str, dict] | None = None,
                position_ids=None, document_ids=None):
        x = hidden[0] if hidden else self.embed_tokens(input_ids)
        x = super().forward(x, decoder_mask(caches, document_ids), caches=caches, positions=position_ids)[0]
        return self.head(x, labels) if self.head is not None else x
