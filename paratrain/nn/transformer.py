"""MindSpore's transformer layers and stacks: TransformerEncoderLayer, TransformerDecoderLayer, TransformerEncoder,
TransformerDecoder, Transformer. The layers and stacks are the built-in models' (``TransformerLayer`` and
``TransformerStack`` of ``paratrain.modules.transformer``) under MindSpore's names, arguments and checks.

Shapes: B batch, S source length, T target length, H hidden size; masks are float or bool (B, Tq, Tk) with 1
where a query may attend a key. Every layer returns ``(output, layer_present)``, the projected keys and values of
its attentions. With ``moe_config.expert_num > 1`` the FFNs are ``MoE``s and, as in MindSpore, every layer and
stack also returns its (summed) load-balancing loss last, for the net to add to its loss. ``init_reset`` and
``batch_valid_length`` (incremental decoding, ``use_past``, refused) are ignored. The stacks keep their layers,
the units the parallel runtime wraps, in ``blocks`` and call ``lambda_func`` on each as it is built.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from paratrain.errors import UserError
from paratrain.modules import transformer as shared
from paratrain.nn.cell import Cell
from paratrain.nn.config import (EmbeddingOpParallelConfig, MoEConfig, OpParallelConfig, ParallelConfig,
                                 TransformerOpParallelConfig, TransformerRecomputeConfig, check_divisible, check_moe,
                                 check_sizes, default_dpmp_config, default_moe_config, default_transformer_config,
                                 op_config, refuse_unsupported, to_dtype)
from paratrain.nn.layers import (AttentionMask, FeedForward, MoE, MultiHeadAttention, VocabEmbedding, _LayerNorm,
                                 recognise_mask)
from paratrain.nn.loss import CrossEntropyLoss

# the names of MindSpore's transformer package (mindspore.nn.transformer in 1.x), so a script's import of it
# changes its package name only
__all__ = ["AttentionMask", "VocabEmbedding", "MultiHeadAttention", "FeedForward", "MoE", "CrossEntropyLoss",
           "TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder", "TransformerDecoder",
           "Transformer", "TransformerOpParallelConfig", "EmbeddingOpParallelConfig", "OpParallelConfig",
           "TransformerRecomputeConfig", "MoEConfig"]


def _get_lambda_func(total_layer: int | None = None):
    """MindSpore's default ``lambda_func(network, layer_id, offset, parallel_config, layers)``: layer
    ``layer_id + offset`` of ``total_layer or layers`` goes to its share of the pipeline stages and of the
    ``gradient_aggregation_group`` communication groups, recomputed as ``parallel_config.recompute`` says."""

    def set_parallel_configure_for_layer(network: Cell, layer_id: int, offset: int, parallel_config, layers: int):
        layers = total_layer or layers
        stages = parallel_config.pipeline_stage
        if layers < stages:
            raise UserError(f"{layers} layers cannot fill pipeline_stage={stages} stages: use pipeline_stage <= "
                            f"{layers}")
        index = layer_id + offset
        network.pipeline_stage = min(index // max(layers // stages, 1), stages - 1)
        network.set_comm_fusion(index // max(layers // parallel_config.aggregation_groups(layers), 1) + 1)
        mode = parallel_config.recompute_mode(layer_id, offset)
        if mode != "none":
            network.recompute(mode)

    return set_parallel_configure_for_layer


class _Layer(shared.TransformerLayer, Cell):
    """What both layers share (``paratrain.modules.transformer.TransformerLayer`` under MindSpore's names): their
    checks, LayerNorms and last sublayer, the FFN or (``moe_config.expert_num`` > 1) the mixture of experts."""

    names = ("layernorm1", "attention", "cross_attention_layernorm", "cross_attention", "layernorm2", "output")

    def __init__(self, hidden_size, ffn_hidden_size, num_heads, post_layernorm_residual, layernorm_compute_type,
                 param_init_type, use_past, moe_config, parallel_config):
        """Refuse what the layer cannot build; set the dtypes its sublayers take."""
        super().__init__(0.0, post_layernorm_residual)  # MindSpore's sublayers drop their own outputs
        owner = type(self).__name__
        refuse_unsupported(owner, use_past)
        check_moe(owner, moe_config, parallel_config)
        check_divisible(owner, op_config(parallel_config, owner).model_parallel, num_heads=num_heads,
                        hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        self._norm_dtype = to_dtype(layernorm_compute_type, "layernorm_compute_type", owner)
        self._param_dtype = to_dtype(param_init_type, "param_init_type", owner)

    def _norm(self, hidden_size: int) -> _LayerNorm:
        return _LayerNorm(hidden_size, self._norm_dtype, self._param_dtype)

    def _build_ffn(self, hidden_size, ffn_hidden_size, dropout_rate, hidden_act, moe_config, parallel_config) -> None:
        self.layernorm2 = self._norm(hidden_size)
        if moe_config.expert_num > 1:
            self.output = MoE(hidden_size, ffn_hidden_size, dropout_rate, hidden_act, self._param_dtype, moe_config,
                              parallel_config)
        else:
            self.output = FeedForward(hidden_size, ffn_hidden_size, dropout_rate, hidden_act,
                                      param_init_type=self._param_dtype, parallel_config=parallel_config)


class TransformerEncoderLayer(_Layer):
    """Self-attention then FFN, each behind a LayerNorm with a residual add:
    x (B, S, H) or (B*S, H), input_mask (B, S, S) -> ``(output shaped like x, (key, value))``.
    ``post_layernorm_residual=True``: ``y = layernorm2(x + attention(x))``, output ``layernorm1(y + output(y))``."""

    def __init__(self, batch_size: int, hidden_size: int, ffn_hidden_size: int, num_heads: int, seq_length: int,
                 attention_dropout_rate: float = 0.1, hidden_dropout_rate: float = 0.1,
                 post_layernorm_residual: bool = False, layernorm_compute_type=torch.float32,
                 softmax_compute_type=torch.float32, param_init_type=torch.float32, hidden_act="gelu",
                 use_past: bool = False, moe_config=default_moe_config, parallel_config=default_dpmp_config):
        super().__init__(hidden_size, ffn_hidden_size, num_heads, post_layernorm_residual, layernorm_compute_type,
                         param_init_type, use_past, moe_config, parallel_config)
        self.layernorm1 = self._norm(hidden_size)
        self.attention = MultiHeadAttention(batch_size, seq_length, seq_length, hidden_size, num_heads,
                                            hidden_dropout_rate, attention_dropout_rate,
                                            softmax_compute_type=softmax_compute_type,
                                            param_init_type=self._param_dtype, parallel_config=parallel_config)
        self._build_ffn(hidden_size, ffn_hidden_size, hidden_dropout_rate, hidden_act, moe_config, parallel_config)

    def forward(self, x, input_mask=None, init_reset=True, batch_valid_length=None):
        if not self.post_layernorm_residual:
            return super().forward(x, input_mask)
        # MindSpore's encoder post-LN differs from its decoder's: the input is added unnormalised, and layernorm1
        # normalises the layer's output
        update, presents = self.attention(x, attention_mask=input_mask)
        x = self.layernorm2(x + update)
        update, *aux_loss = self.output(x) if isinstance(self.output, MoE) else (self.output(x),)
        return (self.layernorm1(x + update), presents, *aux_loss)


class TransformerDecoderLayer(_Layer):
    """Masked self-attention, cross-attention over the encoder output, then FFN, each behind a LayerNorm
    with a residual add: hidden_stats (B, T, H), decoder_mask (B, T, T), encoder_output (B, S, H),
    memory_mask (B, T, S) -> ``(output (B, T, H), (self key, self value, cross key, cross value))``.
    Without ``encoder_output`` the cross-attention is skipped (and its key and value left out), as in MindSpore.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_heads: int, batch_size: int, src_seq_length: int,
                 tgt_seq_length: int, attention_dropout_rate: float = 0.1, hidden_dropout_rate: float = 0.1,
                 post_layernorm_residual: bool = False, use_past: bool = False, layernorm_compute_type=torch.float32,
                 softmax_compute_type=torch.float32, param_init_type=torch.float32, hidden_act="gelu",
                 moe_config=default_moe_config, parallel_config=default_dpmp_config):
        super().__init__(hidden_size, ffn_hidden_size, num_heads, post_layernorm_residual, layernorm_compute_type,
                         param_init_type, use_past, moe_config, parallel_config)
        attention = dict(hidden_size=hidden_size, num_heads=num_heads, batch_size=batch_size,
                         hidden_dropout_rate=hidden_dropout_rate, attention_dropout_rate=attention_dropout_rate,
                         softmax_compute_type=softmax_compute_type, param_init_type=self._param_dtype,
                         parallel_config=parallel_config)
        self.layernorm1 = self._norm(hidden_size)
        self.attention = MultiHeadAttention(src_seq_length=tgt_seq_length, tgt_seq_length=tgt_seq_length, **attention)
        self.cross_attention_layernorm = self._norm(hidden_size)
        self.cross_attention = MultiHeadAttention(src_seq_length=tgt_seq_length, tgt_seq_length=src_seq_length,
                                                  **attention)
        self._build_ffn(hidden_size, ffn_hidden_size, hidden_dropout_rate, hidden_act, moe_config, parallel_config)

    def forward(self, hidden_stats, decoder_mask=None, encoder_output=None, memory_mask=None, init_reset=True,
                batch_valid_length=None):
        return super().forward(hidden_stats, decoder_mask, encoder_output, memory_mask)


class _Stack(shared.TransformerStack, Cell):
    """What both stacks share (``paratrain.modules.transformer.TransformerStack``, with no final LayerNorm, as
    MindSpore's): ``num_layers`` layers in ``blocks``, each passed to ``lambda_func`` as it is built. Their
    self-attention mask is recognised once for all of them (``recognise_mask``: a causal one runs as
    ``is_causal``)."""

    names = ("blocks", "norm")
    norm = None

    def _build(self, layer_class: type, args: dict) -> None:
        """The layers, built from the stack's arguments ``args`` that ``layer_class`` takes."""
        owner = type(self).__name__
        check_sizes(owner, num_layers=args["num_layers"])
        self.num_layers = args["num_layers"]
        config = args["parallel_config"]
        if not isinstance(config, ParallelConfig):  # the stack needs the whole model's: stages, recompute, groups
            raise UserError(f"{owner}: parallel_config must be a TransformerOpParallelConfig, "
                            f"got {type(config).__name__}")
        self.parallel_config = config  # the layout paratrain.train.Model reads
        check_moe(owner, args["moe_config"], config)
        lambda_func = args["lambda_func"] or _get_lambda_func()
        layer_args = {name: args[name] for name in inspect.signature(layer_class).parameters
                      if name != "parallel_config"}
        self.blocks = nn.ModuleList()
        for i in range(self.num_layers):
            block = layer_class(**layer_args, parallel_config=config.dp_mp_config)
            lambda_func(block, layer_id=i, offset=args["offset"], parallel_config=config, layers=self.num_layers)
            self.blocks.append(block)


class TransformerEncoder(_Stack):
    """``num_layers`` TransformerEncoderLayers in ``blocks``: hidden_states (B, S, H), attention_mask (B, S, S)
    -> ``(output (B, S, H), one (key, value) per layer)``. ``lambda_func(network, layer_id, offset,
    parallel_config, layers)`` is called on each layer as it is built; ``offset`` counts the layers before it."""

    def __init__(self, batch_size: int, num_layers: int, hidden_size: int, ffn_hidden_size: int, seq_length: int,
                 num_heads: int, attention_dropout_rate: float = 0.1, hidden_dropout_rate: float = 0.1,
                 hidden_act="gelu", post_layernorm_residual: bool = False, layernorm_compute_type=torch.float32,
                 softmax_compute_type=torch.float32, param_init_type=torch.float32, lambda_func=None, offset: int = 0,
                 use_past: bool = False, moe_config=default_moe_config, parallel_config=default_transformer_config):
        super().__init__()
        self._build(TransformerEncoderLayer, locals())

    def forward(self, hidden_states, attention_mask=None, init_reset=True, batch_valid_length=None):
        return super().forward(hidden_states, recognise_mask(attention_mask))


class TransformerDecoder(_Stack):
    """``num_layers`` TransformerDecoderLayers in ``blocks``: hidden_states (B, T, H), attention_mask (B, T, T),
    encoder_output (B, S, H), memory_mask (B, T, S) -> ``(output (B, T, H), one present tuple per layer)``.
    ``lambda_func`` and ``offset`` as in ``TransformerEncoder`` (in a Transformer: after the encoder's layers)."""

    def __init__(self, num_layers: int, batch_size: int, hidden_size: int, ffn_hidden_size: int, src_seq_length: int,
                 tgt_seq_length: int, num_heads: int, attention_dropout_rate: float = 0.1,
                 hidden_dropout_rate: float = 0.1, post_layernorm_residual: bool = False,
                 layernorm_compute_type=torch.float32, softmax_compute_type=torch.float32,
                 param_init_type=torch.float32, hidden_act="gelu", lambda_func=None, use_past: bool = False,
                 offset: int = 0, moe_config=default_moe_config, parallel_config=default_transformer_config):
        super().__init__()
        self._build(TransformerDecoderLayer, locals())

    def forward(self, hidden_states, attention_mask=None, encoder_output=None, memory_mask=None, init_reset=True,
                batch_valid_length=None):
        return super().forward(hidden_states, recognise_mask(attention_mask), encoder_output, memory_mask)


class Transformer(Cell):
    """Encoder-decoder Transformer (pre-LayerNorm by default, no final LayerNorm, as MindSpore's):
    encoder_inputs (B, S, H), encoder_masks (B, S, S), decoder_inputs (B, T, H), decoder_masks (B, T, T),
    memory_mask (B, T, S) -> ``(output, encoder_layer_present, decoder_layer_present)``; ``output`` is the
    decoder's (B, T, H), or the encoder's (B, S, H) when ``decoder_layers=0`` (then ``decoder_layer_present``
    is None). ``encoder_layers`` must be positive, as MindSpore's. The default ``lambda_func`` spreads both stacks'
    layers together evenly over the pipeline stages."""

    def __init__(self, hidden_size: int, batch_size: int, ffn_hidden_size: int, src_seq_length: int,
                 tgt_seq_length: int, encoder_layers: int = 3, decoder_layers: int = 3, num_heads: int = 2,
                 attention_dropout_rate: float = 0.1, hidden_dropout_rate: float = 0.1, hidden_act="gelu",
                 post_layernorm_residual: bool = False, layernorm_compute_type=torch.float32,
                 softmax_compute_type=torch.float32, param_init_type=torch.float32, lambda_func=None,
                 use_past: bool = False, moe_config=default_moe_config, parallel_config=default_transformer_config):
        super().__init__()
        check_sizes("Transformer", least=0, encoder_layers=encoder_layers, decoder_layers=decoder_layers)
        if encoder_layers < 1 or decoder_layers < 0:
            raise UserError(f"Transformer: encoder_layers={encoder_layers} must be positive and decoder_layers="
                            f"{decoder_layers} not negative (as MindSpore's; one stack without cross-attention: "
                            f"encoder_layers={max(encoder_layers, decoder_layers, 1)}, decoder_layers=0)")
        refuse_unsupported("Transformer", use_past)
        lambda_func = lambda_func or _get_lambda_func(total_layer=encoder_layers + decoder_layers)
        common = dict(batch_size=batch_size, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                      num_heads=num_heads, attention_dropout_rate=attention_dropout_rate,
                      hidden_dropout_rate=hidden_dropout_rate, hidden_act=hidden_act,
                      post_layernorm_residual=post_layernorm_residual, layernorm_compute_type=layernorm_compute_type,
                      softmax_compute_type=softmax_compute_type, param_init_type=param_init_type,
                      lambda_func=lambda_func, moe_config=moe_config, parallel_config=parallel_config)
        self.encoder = TransformerEncoder(num_layers=encoder_layers, seq_length=src_seq_length, **common)
        self.decoder = None
        if decoder_layers > 0:
            self.decoder = TransformerDecoder(num_layers=decoder_layers, src_seq_length=src_seq_length,
                                              tgt_seq_length=tgt_seq_length, offset=encoder_layers, **common)

    def forward(self, encoder_inputs, encoder_masks, decoder_inputs=None, decoder_masks=None, memory_mask=None,
                init_reset=True, batch_valid_length=None):
        decoder_layer_present = None
        output, encoder_layer_present, *aux_losses = self.encoder(encoder_inputs, encoder_masks, init_reset,
                                                                  batch_valid_length)
        if self.decoder is not None:
            output, decoder_layer_present, *aux = self.decoder(decoder_inputs, decoder_masks, output, memory_mask,
                                                               init_reset, batch_valid_length)
            aux_losses += aux
        return (output, encoder_layer_present, decoder_layer_present, *shared.summed(aux_losses))
