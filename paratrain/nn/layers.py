"""MindSpore's transformer sub-blocks: VocabEmbedding, AttentionMask, FeedForward, MoE, MultiHeadAttention.

VocabEmbedding, FeedForward and MultiHeadAttention are adapters over the modules of the built-in models
(``paratrain.modules``): MindSpore's names, initialisation, dtypes, shapes, return tuples and refusals around
the same forward and tensor-parallel plan. Shapes: B batch, T (Tq, Tk) sequence lengths, H hidden size,
F ffn hidden size, V vocab size, h heads of size d = H / heads.

Dense layers compute in ``param_init_type`` (inputs cast to it, outputs back; under autocast the outputs stay
in its compute dtype), LayerNorms in ``layernorm_compute_type``. ``compute_dtype`` and ``softmax_compute_type``
are accepted and recorded only: MindSpore's fp16 matmuls are the trainer's ``mixed_precision`` (autocast) here,
and the softmax runs inside ``scaled_dot_product_attention`` in the queries' dtype (the fused GPU kernels
accumulate in fp32).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.config_rules import head_problems
from paratrain.errors import UserError
from paratrain.modules import moe as shared_moe
from paratrain.modules import transformer as shared
from paratrain.nn.cell import EXPERT_BIAS, SAME, TRANSPOSED, Cell
from paratrain.nn.config import (MoEConfig, check_divisible, check_moe, check_rate, check_sizes,
                                 default_dpmp_config, default_embedding_parallel_config, default_moe_config, op_config,
                                 refuse_unsupported, to_dtype)

MASKED_SCORE = -10000.0  # added to the scores of keys a query may not attend (MindSpore's value)


class FastGelu(nn.Module):
    """MindSpore's fast_gelu: x * sigmoid(1.702 x), elementwise."""

    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


# MindSpore's activation names; its "gelu" is the tanh approximation
ACTIVATIONS = {
    "gelu": lambda: nn.GELU(approximate="tanh"), "fast_gelu": FastGelu, "relu": nn.ReLU, "relu6": nn.ReLU6,
    "tanh": nn.Tanh, "elu": nn.ELU, "sigmoid": nn.Sigmoid, "prelu": nn.PReLU, "leakyrelu": lambda: nn.LeakyReLU(0.2),
    "hswish": nn.Hardswish, "hsigmoid": nn.Hardsigmoid, "logsigmoid": nn.LogSigmoid,
}

# MindSpore's initializer names (Normal and TruncatedNormal: sigma 0.01, Uniform: scale 0.07)
INITIALIZERS = {
    "normal": lambda t: nn.init.normal_(t, std=0.01), "uniform": lambda t: nn.init.uniform_(t, -0.07, 0.07),
    "truncatednormal": lambda t: nn.init.trunc_normal_(t, std=0.01, a=-0.02, b=0.02),
    "xavier_uniform": nn.init.xavier_uniform_, "he_uniform": nn.init.kaiming_uniform_, "zeros": nn.init.zeros_,
    "ones": nn.init.ones_}


def activation(hidden_act, owner: str) -> nn.Module:
    """A MindSpore activation name (case-insensitive) or an ``nn.Module`` class as a module."""
    if isinstance(hidden_act, type) and issubclass(hidden_act, nn.Module):
        return hidden_act()
    if isinstance(hidden_act, str) and hidden_act.lower() in ACTIVATIONS:
        return ACTIVATIONS[hidden_act.lower()]()
    raise UserError(f"{owner}: hidden_act={hidden_act!r} is not one of {', '.join(ACTIVATIONS)} or an nn.Module class")


@torch.no_grad()
def initialize(tensor: torch.Tensor, param_init, owner: str) -> None:
    """Fill ``tensor`` as MindSpore's ``initializer(param_init, shape)``: a name, a number or a tensor of values."""
    if isinstance(param_init, torch.Tensor):
        if param_init.shape != tensor.shape:
            raise UserError(f"{owner}: param_init has shape {tuple(param_init.shape)}, the table needs "
                            f"{tuple(tensor.shape)}")
        tensor.copy_(param_init)
    elif isinstance(param_init, (int, float)) and not isinstance(param_init, bool):
        tensor.fill_(param_init)
    elif isinstance(param_init, str) and param_init.lower() in INITIALIZERS:
        INITIALIZERS[param_init.lower()](tensor)
    else:
        raise UserError(f"{owner}: param_init={param_init!r} is not one of {', '.join(INITIALIZERS)}, "
                        f"a number or a tensor")


def dense(in_features: int, out_features: int, dtype: torch.dtype) -> nn.Linear:
    """MindSpore's Dense defaults: weight normal(0, 0.01), bias zeros."""
    linear = nn.Linear(in_features, out_features, dtype=dtype)
    initialize(linear.weight, "normal", "Dense")
    initialize(linear.bias, "zeros", "Dense")
    return linear


def in_input_dtype(output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A block's output in its input's ``dtype``, as MindSpore casts it back; under autocast left in the
    compute dtype, which whatever takes it casts or promotes anyway (a residual add makes the same fp32 sum),
    instead of a round trip through memory."""
    return output if torch.is_autocast_enabled(output.device.type) else output.to(dtype)


class _LayerNorm(nn.LayerNorm):
    """LayerNorm over the last dim, computed in ``compute_type``: (..., H) -> (..., H) in the input's dtype. Its
    weight and bias carry MindSpore's names ``gamma`` and ``beta`` as their ``param_name`` from the start, so an
    ungrouped ``AdamWeightDecay`` given ``net.parameters()`` leaves them undecayed as MindSpore's default filter
    does (``Cell.trainable_params()`` names them by their paths in the net)."""

    def __init__(self, hidden_size: int, compute_type: torch.dtype, param_init_type: torch.dtype, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps, dtype=param_init_type)
        self.compute_type = compute_type
        self.weight.param_name, self.bias.param_name = "gamma", "beta"

    def forward(self, x):
        dtype = self.compute_type
        return F.layer_norm(x.to(dtype), self.normalized_shape, self.weight.to(dtype), self.bias.to(dtype),
                            self.eps).to(x.dtype)


class _SplitWhenParallel:
    """The shared module's tensor-parallel plan, declared only when ``model_parallel`` > 1."""

    def parallel_plan(self) -> dict[str, str]:
        return super().parallel_plan() if self.model_parallel > 1 else {}


class VocabEmbedding(_SplitWhenParallel, shared.VocabEmbedding, Cell):
    """Token lookup: input_ids (B, T) -> (embeddings (B, T, E), embedding table (V, E)). With
    ``parallel_config.vocab_emb_dp=False`` the table's rows are split over model_parallel and the lookups summed.
    ``param_init``: MindSpore's initializer name ("normal": normal(0, 0.01)), a number or a tensor."""

    def __init__(self, vocab_size: int, embedding_size: int, parallel_config=default_embedding_parallel_config,
                 param_init="normal"):
        check_sizes("VocabEmbedding", vocab_size=vocab_size, embedding_size=embedding_size)
        super().__init__(vocab_size, embedding_size)
        self.vocab_size, self.embedding_size = vocab_size, embedding_size
        config = op_config(parallel_config, "VocabEmbedding", embedding=True)
        self.model_parallel = 1 if config.vocab_emb_dp else config.model_parallel
        check_divisible("VocabEmbedding", self.model_parallel, vocab_size=vocab_size)
        initialize(self.embedding.weight, param_init, "VocabEmbedding")

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(input_ids)

    @property
    def embedding_table(self) -> nn.Parameter:
        """The (V, E) table under MindSpore's name."""
        return self.embedding.weight

    def mindspore_params(self) -> dict[str, tuple[str, str]]:
        return {"embedding.weight": ("embedding_table", SAME)}


class AttentionMask(Cell):
    """input_mask (B, T), nonzero for real tokens -> float (B, T, T): 1 where query i may attend key j,
    i.e. j <= i and both are real tokens (causal and padding, as MindSpore's AttentionMask)."""

    def __init__(self, seq_length: int, parallel_config=default_dpmp_config):
        super().__init__()
        check_sizes("AttentionMask", seq_length=seq_length)
        op_config(parallel_config, "AttentionMask")
        self.seq_length = seq_length

    def forward(self, input_mask: torch.Tensor) -> torch.Tensor:
        real = (input_mask != 0).float()
        length = input_mask.shape[1]
        causal = torch.ones(length, length, device=input_mask.device).tril()
        return real[:, :, None] * real[:, None, :] * causal


class FeedForward(_SplitWhenParallel, shared.FeedForward, Cell):
    """Position-wise FFN as MindSpore's: dropout(projection(act(mapping(x)))), (B, T, H) or (B*T, H) -> same shape;
    ``mapping`` (H -> F) is split colwise and ``projection`` (F -> H) rowwise over model_parallel."""

    names = ("mapping", "projection")

    def __init__(self, hidden_size: int, ffn_hidden_size: int, dropout_rate: float, hidden_act="gelu",
                 expert_num: int = 1, expert_group_size: int | None = None, param_init_type=torch.float32,
                 parallel_config=default_dpmp_config):
        owner = "FeedForward"
        if expert_num > 1:
            raise UserError(f"{owner}: expert_num={expert_num}: the experts of a mixture are built by MoE; give the "
                            f"layers moe_config=MoEConfig(expert_num={expert_num}) or use paratrain.nn.MoE")
        check_rate(owner, dropout_rate=dropout_rate)
        model_parallel = op_config(parallel_config, owner).model_parallel
        check_divisible(owner, model_parallel, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        dtype = to_dtype(param_init_type, "param_init_type", owner)
        # MindSpore drops the FFN's output, not its hidden features
        super().__init__(hidden_size, ffn_hidden_size, 0.0, activation(hidden_act, owner), partial(dense, dtype=dtype))
        self.model_parallel = model_parallel
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, x):
        return in_input_dtype(self.dropout(super().forward(x.to(self.mapping.weight.dtype))), x.dtype)

    def mindspore_params(self) -> dict[str, tuple[str, str]]:
        # MindSpore's _Linear(transpose_b=False) keeps both weights (in, out)
        return {name: (name, TRANSPOSED) for name in ("mapping.weight", "projection.weight")}


class MoE(shared_moe.MoE, Cell):
    """MindSpore's mixture-of-experts FFN: x (B, T, H) or (B*T, H) -> ``(output shaped like x, aux_loss ())``.
    ``moe_config`` as in ``paratrain.modules.moe.MoE``; without ``expert_group_size`` the tokens form
    ``parallel_config.data_parallel`` groups, as MindSpore's. Dropout applies to the output. The experts split
    over ``expert_parallel`` ranks when the net is placed (``paratrain.parallel.expert``)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, dropout_rate: float, hidden_act="gelu",
                 param_init_type=torch.float32, moe_config: MoEConfig = default_moe_config,
                 parallel_config=default_dpmp_config):
        owner = "MoE"
        check_rate(owner, dropout_rate=dropout_rate)
        check_moe(owner, moe_config, parallel_config)
        data_parallel = op_config(parallel_config, owner).data_parallel
        super().__init__(hidden_size, ffn_hidden_size, moe_config.expert_num, activation(hidden_act, owner),
                         moe_config.num_experts_chosen, moe_config.capacity_factor, moe_config.aux_loss_factor,
                         moe_config.expert_group_size, data_parallel,
                         dtype=to_dtype(param_init_type, "param_init_type", owner))
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, x):
        output, aux_loss = super().forward(x.to(self.router.weight.dtype))
        return in_input_dtype(self.dropout(output), x.dtype), aux_loss

    def mindspore_params(self) -> dict[str, tuple[str, str]]:
        # MindSpore's experts are one batched FFN, ``ffn``, weights (experts, in, out) as here
        return {"router.weight": ("router.dense.weight", SAME), "experts.w1": ("ffn.mapping.weight", SAME),
                "experts.b1": ("ffn.mapping.bias", EXPERT_BIAS), "experts.w2": ("ffn.projection.weight", SAME),
                "experts.b2": ("ffn.projection.bias", EXPERT_BIAS)}


class MultiHeadAttention(_SplitWhenParallel, shared.Attention, Cell):
    """Multi-head attention of query (B, Tq, H) over key and value (B, Tk, H) (or (B*T, H) each; the key
    defaults to the query, the value to the key) under attention_mask (B, Tq, Tk), 1 where a query may attend a
    key (None: everywhere).

    Returns ``(output shaped like the query, (key (B, h, d, Tk), value (B, h, Tk, d)))``. ``dense1``/``dense2``/
    ``dense3`` (query, key, value) are split colwise (whole heads per rank), ``projection`` rowwise over
    model_parallel. ``attention_dropout_rate`` drops attention probabilities, ``hidden_dropout_rate`` the output.
    ``key_past``, ``value_past`` and ``batch_valid_length`` (incremental decoding, refused) are ignored."""

    names = ("dense1", "dense2", "dense3", "projection")

    def __init__(self, batch_size: int, src_seq_length: int, tgt_seq_length: int, hidden_size: int, num_heads: int,
                 hidden_dropout_rate: float = 0.1, attention_dropout_rate: float = 0.1, compute_dtype=torch.float16,
                 softmax_compute_type=torch.float32, param_init_type=torch.float32, use_past: bool = False,
                 parallel_config=default_dpmp_config):
        owner = "MultiHeadAttention"
        refuse_unsupported(owner, use_past)
        check_rate(owner, hidden_dropout_rate=hidden_dropout_rate, attention_dropout_rate=attention_dropout_rate)
        check_sizes(owner, batch_size=batch_size, src_seq_length=src_seq_length, tgt_seq_length=tgt_seq_length,
                    hidden_size=hidden_size, num_heads=num_heads)
        for problem in head_problems(hidden_size, num_heads, where=""):
            raise UserError(f"{owner}: {problem}")
        model_parallel = op_config(parallel_config, owner).model_parallel
        check_divisible(owner, model_parallel, num_heads=num_heads)
        compute_dtype = to_dtype(compute_dtype, "compute_dtype", owner)
        softmax_dtype = to_dtype(softmax_compute_type, "softmax_compute_type", owner)
        dtype = to_dtype(param_init_type, "param_init_type", owner)
        super().__init__(hidden_size, num_heads, attention_dropout_rate, partial(dense, dtype=dtype))
        self.model_parallel, self.compute_dtype, self.softmax_dtype = model_parallel, compute_dtype, softmax_dtype
        self.batch_size, self.src_seq_length, self.tgt_seq_length = batch_size, src_seq_length, tgt_seq_length
        self.hidden_size, self.n_head, self.size_per_head = hidden_size, num_heads, hidden_size // num_heads
        self.dropout = nn.Dropout(hidden_dropout_rate)

    def forward(self, query_tensor, key_tensor=None, value_tensor=None, attention_mask=None, key_past=None,
                value_past=None, batch_valid_length=None):
        key_tensor = query_tensor if key_tensor is None else key_tensor
        value_tensor = key_tensor if value_tensor is None else value_tensor
        shape, dtype = query_tensor.shape, query_tensor.dtype
        batch = shape[0] if query_tensor.dim() == 3 else attention_mask.shape[0]
        inputs = (query_tensor,) if key_tensor is query_tensor and value_tensor is query_tensor else (
            query_tensor, key_tensor, value_tensor)  # self-attention: its projections may run as one
        q, k, v = self.heads(*(x.reshape(batch, -1, x.shape[-1]).to(self.dense1.weight.dtype) for x in inputs))
        output = self.dropout(self.attend(q, k, v, self._score_bias(attention_mask, q.dtype)))
        return in_input_dtype(output.reshape(shape), dtype), (k.transpose(-2, -1), v)

    def mindspore_params(self) -> dict[str, tuple[str, str]]:
        # MindSpore's output projection is a _Linear(transpose_b=False), (in, out); dense1-3 are (out, in) as here
        return {"projection.weight": ("projection.weight", TRANSPOSED)}

    @staticmethod
    def _score_bias(attention_mask, dtype) -> torch.Tensor | str | None:
        """(B, Tq, Tk) mask -> (B, 1, Tq, Tk) added to the scores: 0 where allowed, MASKED_SCORE elsewhere;
        ``CAUSAL`` for a stack's mask recognised as causal (``RecognisedMask``).

        A finite bias, as MindSpore's: a query row with no allowed key (a padded query) gets a
        uniform softmax instead of NaN, and exp(MASKED_SCORE) is exactly 0 next to any allowed key.
        """
        if attention_mask is None:
            return None
        if isinstance(attention_mask, RecognisedMask):
            return attention_mask.score_bias(dtype)
        return score_bias(attention_mask, dtype)


def score_bias(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 0/1 mask (B, Tq, Tk) or (B, 1, Tq, Tk) as the bias added to the scores, (B, 1, Tq, Tk) in ``dtype``."""
    mask = attention_mask.to(dtype)
    if mask.dim() == 3:
        mask = mask.unsqueeze(1)
    return (1.0 - mask) * MASKED_SCORE


class RecognisedMask:
    """A stack's self-attention mask (B, T, T) or (B, 1, T, T), looked at once per forward (``recognise_mask``)
    for all its layers. ``causal_rows``: how many first query rows allow exactly the keys j <= i in every
    sequence. All T (``causal``): the layers run SDPA's ``is_causal`` (the flash kernels, no mask read). Some
    (causal x key padding of sequences padded at the end: the shortest sequence's length): those rows run as
    ``is_causal`` and the rest with their score bias (``CausalPrefix``). None: the whole mask's score bias. A
    bias is made once per dtype rather than in every layer. ``shape`` is the mask's."""

    def __init__(self, mask: torch.Tensor, causal_rows: int):
        self.mask, self.causal_rows, self.shape = mask, causal_rows, mask.shape
        self._biases: dict[torch.dtype, torch.Tensor | shared.CausalPrefix] = {}

    @property
    def causal(self) -> bool:
        return self.causal_rows == self.shape[-1]

    def score_bias(self, dtype: torch.dtype) -> torch.Tensor | shared.CausalPrefix | str:
        if self.causal:
            return shared.CAUSAL
        if dtype not in self._biases:
            rows = self.causal_rows
            bias = score_bias(self.mask.reshape(-1, 1, *self.shape[-2:])[:, :, rows:], dtype)
            self._biases[dtype] = shared.CausalPrefix(rows, bias) if rows else bias
        return self._biases[dtype]


def recognise_mask(attention_mask):
    """A self-attention mask (B, T, T) or (B, 1, T, T), 0/1 float or bool, as a ``RecognisedMask`` that knows
    how many of its first query rows are causal in every sequence (one comparison on the device and one wait
    for its count). Anything else is given back as it is: None, a mask that is no plain tensor (a DTensor, a
    traced or fake tensor: a pipeline's trace, ``torch.compile``), not square or empty."""
    if (type(attention_mask) is not torch.Tensor or torch.compiler.is_compiling() or attention_mask.is_meta
            or attention_mask.dim() not in (3, 4) or (attention_mask.dim() == 4 and attention_mask.shape[1] != 1)
            or attention_mask.shape[-1] != attention_mask.shape[-2] or attention_mask.numel() == 0):
        return attention_mask
    length = attention_mask.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril_()
    causal_row = ((attention_mask.reshape(-1, length, length) != 0) == causal).all(-1)  # (B, T)
    return RecognisedMask(attention_mask, int(causal_row.cumprod(-1).sum(-1).min()))
