"""Plain single-device Transformer models ("Attention Is All You Need"), no collectives, composed of the
modules in ``paratrain.modules``.

Shapes: B batch, S source length, T target length, H hidden size, V vocab size.
Parallelism is applied from outside by ``paratrain.parallel.parallelize`` using what the models declare:
each module's ``parallel_plan()`` (the kinds: ``paratrain.parallel.tensor``), and each model's
``layer_stacks`` and ``pipeline_parts`` (how its layers and other parts split into pipeline chunks, read
by ``paratrain.modules.transformer.pipeline_blocks`` and ``paratrain.parallel.pipeline``).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from paratrain.config import ModelConfig
from paratrain.modules.linear_cross_entropy import OutputHead, token_loss_sum
from paratrain.modules.moe import MoE
from paratrain.modules.transformer import (CAUSAL, Attention, FeedForward, TransformerLayer, TransformerStack,
                                          VocabEmbedding, cached_length, decoder_mask)


class Embeddings(nn.Module):
    """Word + learned position embedding, then dropout: ids (B, S) -> (B, S, H)."""

    def __init__(self, word: VocabEmbedding, max_length: int, hidden_size: int, dropout: float):
        super().__init__()
        self.word = word
        self.position = nn.Embedding(max_length, hidden_size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: (B, S) each token's own (packed documents), else ``start`` on (tokens already decoded)."""
        if positions is None:
            positions = torch.arange(start, start + ids.shape[1], device=ids.device)
        return self.dropout(self.word(ids)[0] + self.position(positions))

    def parallel_plan(self) -> dict:
        return {"position": "position"}


def attention_mask(key_pad: torch.Tensor | None, causal: bool, query_length: int) -> torch.Tensor | str | None:
    """What a query may attend: ``CAUSAL`` for causal self-attention, else a boolean key-padding mask
    (B, 1, Tq, Tk), True where a query may attend, or None without padding.

    Causal self-attention needs no padding mask: sequences are padded at the end (the data
    loader checks it), so a real token's query never reaches a padded key; the outputs at pad
    positions are never used (the loss ignores pad targets). Query rows at pad positions of a
    padding mask still see the valid keys, so no row is empty.
    """
    if causal:
        return CAUSAL
    if key_pad is None:
        return None
    allowed = torch.ones(query_length, key_pad.shape[1], dtype=torch.bool, device=key_pad.device)
    return allowed[None, None] & ~key_pad[:, None, None, :]


# ``model.hidden_act`` -> its module; MindSpore's "gelu" (``paratrain.nn``) is the tanh form, "gelu_tanh" here
ACTIVATION_MODULES = {"gelu": nn.GELU, "gelu_tanh": functools.partial(nn.GELU, approximate="tanh"), "relu": nn.ReLU}


def feed_forward(cfg: ModelConfig, layer_id: int) -> FeedForward | MoE:
    """Layer ``layer_id``'s FFN, with its ``hidden_act``: a mixture of experts where ``cfg.moe`` puts one."""
    activation = ACTIVATION_MODULES[cfg.hidden_act]()
    moe = cfg.moe_config
    if moe.used_in(layer_id):
        return MoE(cfg.hidden_size, cfg.ffn_hidden_size, moe.expert_num, activation, moe.num_experts_chosen,
                   moe.capacity_factor, moe.aux_loss_factor, moe.expert_group_size, dropout=cfg.hidden_dropout)
    return FeedForward(cfg.hidden_size, cfg.ffn_hidden_size, cfg.hidden_dropout, activation)


class EncoderLayer(TransformerLayer):
    """Self-attention + FFN, x (B, S, H) -> ``(output (B, S, H), (), *aux_loss)`` (``TransformerLayer``);
    causal as a decoder-only (GPT) block. A mixture of experts' aux loss joins backward through its output (the
    placement's ``paratrain.modules.moe.AuxLossInBackward``): the models use the output alone.
    """

    # each LayerNorm inside a module of its own, as saved checkpoints name it
    names = ("attn_branch.norm", "attn", None, None, "ffn_branch.norm", "ffn")
    returns_presents = False

    def __init__(self, cfg: ModelConfig, layer_id: int = 0):
        super().__init__(cfg.hidden_dropout, cfg.post_layernorm_residual)
        norm1, attention, norm2, cross_attention, norm3, ffn = self.names
        for name in filter(None, (norm1, norm2, norm3)):
            holder, _, norm = name.rpartition(".")
            if holder:
                self.add_module(holder, nn.ModuleDict({norm: self.make_norm(cfg)}))
            else:
                self.add_module(norm, self.make_norm(cfg))
        for name in filter(None, (attention, cross_attention)):
            self.add_module(name, self.make_attention(cfg))
        self.add_module(ffn, self.make_feed_forward(cfg, layer_id))

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        """Each sublayer's norm (subclasses of other families build theirs)."""
        return nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_eps)

    def make_attention(self, cfg: ModelConfig) -> nn.Module:
        return Attention(cfg.hidden_size, cfg.num_heads, cfg.attention_dropout)

    def make_feed_forward(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        return feed_forward(cfg, layer_id)

    def parallel_plan(self) -> dict:
        """The LayerNorms on sequence shards; the inputs of the sublayers, (query,) or (query, memory), gathered
        for their tensor-parallel split, but a mixture of experts' (not split over model_parallel: each tp rank
        runs the whole of its experts on the plain replicated input)."""
        norm1, attention, norm2, cross_attention, norm3, ffn = self.names
        plan = {name: "norm" for name in (norm1, norm2, norm3) if name} | {attention: ("gather", 1)}
        if cross_attention:
            plan[cross_attention] = ("gather", 2)
        if not isinstance(self.get_submodule(ffn), MoE):
            plan[ffn] = ("gather", 1)
        return plan


class DecoderLayer(EncoderLayer):
    """Masked self-attention, cross-attention over the encoder output, FFN: x (B, T, H), mask, memory (B, S, H),
    memory_mask -> ``(output (B, T, H), (), *aux_loss)`` (``TransformerLayer``).
    """

    names = ("self_attn_branch.norm", "self_attn", "cross_attn_branch.norm", "cross_attn", "ffn_branch.norm", "ffn")


class TransformerEncoder(TransformerStack):
    """A stack of encoder layers and a final LayerNorm (``TransformerStack``): (B, S, H), mask -> ``(output
    (B, S, H), ())`` (and the aux loss of mixtures of experts).

    In a pipeline chunk the stack holds some layers only, and the norm only where the decoder starts.
    """

    layer = EncoderLayer

    def __init__(self, cfg: ModelConfig, num_layers: int, offset: int = 0):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): self.layer(cfg, offset + i) for i in range(num_layers)})
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_eps)

    def parallel_plan(self) -> dict:
        return {"norm": "norm"}


class TransformerDecoder(TransformerEncoder):
    """The encoder's stack and norm of decoder layers: (B, T, H), mask, memory (B, S, H), memory_mask -> as the
    encoder's.

    In a pipeline chunk the stack holds some layers only, and the norm only in the last chunk.
    """

    layer = DecoderLayer


class Transformer(nn.Module):
    """The encoder and decoder stacks; ``Seq2SeqModel`` runs them (see its ``forward``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.encoder = TransformerEncoder(cfg, cfg.encoder_layers)
        self.decoder = TransformerDecoder(cfg, cfg.decoder_layers, offset=cfg.encoder_layers)


class Seq2SeqModel(nn.Module):
    """The tutorial's translation network: shared word table, Transformer, output head.

    src_ids (B, S), tgt_in_ids (B, T) -> logits (B, T, V). Pass logits and labels
    to ``token_loss_sum`` for the loss over non-pad target tokens, or pass ``labels`` (B, T)
    to get that loss computed without whole logits (``linear_cross_entropy``).

    A pipeline chunk is this model with the layers and parts of other chunks removed
    (``None``); it gets what the chunk before it computed as ``hidden`` -- (encoder
    state,) inside the encoder, (memory, decoder state) inside the decoder -- and
    returns its own ``hidden`` unless it holds the head.
    """

    # where the parts other than layers go when the layers are split into pipeline chunks:
    # with the first layer, the last, or a named one
    pipeline_parts = {"src_embed": "first", "transformer.encoder.norm": "transformer.decoder.layers.0",
                      "tgt_embed": "transformer.decoder.layers.0", "transformer.decoder.norm": "last", "head": "last"}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pad_token_id = cfg.pad_token_id
        word = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.src_embed = Embeddings(word, cfg.src_seq_length, cfg.hidden_size, cfg.hidden_dropout)
        self.tgt_embed = Embeddings(word, cfg.tgt_seq_length, cfg.hidden_size, cfg.hidden_dropout)
        self.transformer = Transformer(cfg)
        self.head = OutputHead(cfg.hidden_size, cfg.vocab_size, cfg.ignore_index)
        if cfg.tie_embeddings:
            self.head.weight = word.embedding.weight
        # the layer stacks, with the number of layers before each (MindSpore's lambda_func offset)
        self.layer_stacks = {"transformer.encoder.layers": 0, "transformer.decoder.layers": cfg.encoder_layers}
        init_weights(self)

    def parallel_plan(self) -> dict:
        return {"head": "head"}

    def forward(self, src_ids, tgt_in_ids, hidden: tuple = (), labels=None):
        src_pad = src_ids == self.pad_token_id
        if len(hidden) < 2:  # the encoder has not finished
            memory = self.encode(src_ids, *hidden)
            if self.tgt_embed is None:  # it goes on in the next chunk
                return (memory,)
            hidden = (memory, None)
        memory, x = hidden
        out = self.decode(tgt_in_ids, memory, src_pad, x, labels=labels)
        return out if self.head is not None else (memory, out)

    def encode(self, src_ids, hidden=None):
        """src_ids (B, S) -> memory (B, S, H); ``hidden``: the encoder state an earlier chunk reached."""
        x = self.src_embed(src_ids) if hidden is None else hidden
        pad = src_ids == self.pad_token_id
        return self.transformer.encoder(x, attention_mask(pad, False, pad.shape[1]))[0]

    def decode(self, tgt_ids, memory, src_pad, hidden=None, caches: dict | None = None, start: int = 0,
               labels=None):
        """tgt_ids (B, T) over memory (B, S, H) -> logits (B, T, V) (with ``labels``: their summed token
        loss), or the decoder state without the head.

        ``hidden``: the decoder state an earlier chunk reached. With ``caches`` (greedy decoding,
        MindSpore's ``use_past``) ``tgt_ids`` are the new positions from ``start`` on, and the
        keys/values of the earlier ones come from the caches, so no causal mask is needed.
        """
        t = self.transformer
        x = self.tgt_embed(tgt_ids, start) if hidden is None else hidden
        # lengths come from the (B, S) / (B, T) ids: embedded inputs may be sequence-sharded
        length = tgt_ids.shape[1]
        self_mask = decoder_mask(caches)
        x = t.decoder(x, self_mask, memory, attention_mask(src_pad, False, length), caches=caches)[0]
        return self.head(x, labels) if self.head is not None else x


class GPTModel(TransformerStack):
    """Decoder-only language model: input_ids (B, S) -> logits (B, S, V), or with ``labels`` (B, S) their
    summed token loss computed without whole logits (see Seq2SeqModel). Its causal layers and final norm run
    as a ``TransformerStack`` between the embedding and the head.

    A pipeline chunk gets the hidden state (B, S, H) of the chunk before it as ``hidden``
    and returns its own unless it holds the head. ``caches``, ``position_ids`` and ``document_ids``: as
    ``LlamaModel``'s (the learned positions restart at each document).
    """

    pipeline_parts = {"embed": "first", "norm": "last", "head": "last"}  # see Seq2SeqModel

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pad_token_id = cfg.pad_token_id
        self.embed = Embeddings(VocabEmbedding(cfg.vocab_size, cfg.hidden_size), cfg.seq_length,
                                cfg.hidden_size, cfg.hidden_dropout)
        self.layers = nn.ModuleDict({str(i): EncoderLayer(cfg, i) for i in range(cfg.decoder_layers)})
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_eps)
        self.head = OutputHead(cfg.hidden_size, cfg.vocab_size, cfg.ignore_index)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.word.embedding.weight
        self.layer_stacks = {"layers": 0}  # see Seq2SeqModel
        init_weights(self)

    def parallel_plan(self) -> dict:
        return {"norm": "norm", "head": "head"}

    def forward(self, input_ids, hidden: tuple = (), labels=None, caches: dict[str, dict] | None = None,
                position_ids=None, document_ids=None):
        x = hidden[0] if hidden else self.embed(input_ids, start=cached_length(caches), positions=position_ids)
        x = super().forward(x, decoder_mask(caches, document_ids), caches=caches)[0]
        return self.head(x, labels) if self.head is not None else x


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """GPT-2 style init: normal(0, std) weights, zero biases, unit LayerNorm (experts: ``Experts``' own)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

