"""The settings vocabulary every layer may use: one dataclass per section of a run's settings, their allowed values,
``ConfigError`` and the plain-name rule.

The parallel knobs keep MindSpore's names (``data_parallel``, ``model_parallel``, ``pipeline_stage``,
``micro_batch_num``, ``optimizer_shard``, ``gradient_aggregation_group``, ``recompute``, ``vocab_emb_dp``) so a
``TransformerOpParallelConfig`` reads the same here.

The faces build these objects their own way: the TOML face (files, ``--section.key=value`` overrides, hints for
misnamed keys) is :mod:`paratrain.config_file`, a DeepSpeed JSON config :mod:`paratrain.deepspeed_config`, the
MindSpore face its own arguments (:mod:`paratrain.context`, :mod:`paratrain.train`). The rules a whole config must
meet are :mod:`paratrain.config_rules`.
"""
from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterator, Union

from paratrain.errors import UserError

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble")
RECOMPUTE_MODES = ("none", "full", "selective")
MIXED_PRECISION = ("auto", "none", "bf16", "fp16", "fp8")
LR_SCHEDULES = ("cosine", "warmup_lr", "warmup_decay_lr", "warmup_cosine_lr")  # the last three: DeepSpeed's
WARMUP_TYPES = ("linear", "log")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# how attention runs over a sequence split by context parallelism (``paratrain.parallel.context``)
CP_METHODS = ("auto", "ulysses", "ring")
DTYPES = ("float32", "bfloat16", "float16")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu")  # exact GELU, its tanh approximation (paratrain.nn's "gelu"), ReLU
LOG_FORMATS = ("default", "mindspore")
# the llama kind's Linears that may get LoRA adapters, by their Hugging Face (peft) names; ours call o_proj out_proj
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RENAMED = {"out_proj": "o_proj"}
SPECIAL_TOKENS = 4  # ids 0-3 are pad, bos, eos and unk; synthetic data draws its tokens from the ids above
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
NAME_RULE = "use letters, digits, '.', '_' and '-', starting with a letter or digit (at most 128 characters)"


def is_plain_name(name: Any) -> bool:
    """Whether ``name`` can name a job (``paratrain launch --name``), a run (``run.name``: its directory under
    ``runs/``) or a checkpoint (``checkpoint.prefix``): one plain file name that stays in the directory it is
    put in (``NAME_RULE``)."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


class ConfigError(UserError, ValueError):
    """Every rule a configuration breaks, each with the numbers and a fix (one problem: one line)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        if len(self.problems) == 1:
            super().__init__(f"invalid configuration: {self.problems[0]}")
        else:
            super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))

    @classmethod
    def raise_any(cls, problems: list[str]) -> None:
        if problems:
            raise cls(problems)


class Section:
    """Base of the config sections: the section's name (``SECTION``) and the other names its keys go by
    (``ALIASES``: MindSpore's and the short ones)."""

    ALIASES: dict[str, str] = {}
    SECTION = ""

    @classmethod
    def key_names(cls) -> list[str]:
        return [f.name for f in fields(cls)] + list(cls.ALIASES)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if not callable(getattr(self, f.name))}


@dataclass
class RunConfig(Section):
    """Where a run writes and how it is seeded."""

    SECTION = "run"
    name: str = "paratrain"  # names the run; its directory is runs/<name> unless dir is given
    dir: str = ""  # the run directory (config, metrics, logs, checkpoints); "": runs/<name>
    seed: int = 1234  # seeds the initial weights, dropout and synthetic data

    @property
    def path(self) -> Path:
        return Path(self.dir or f"runs/{self.name}")


@dataclass(frozen=True)
class ModelKind:
    """What paratrain knows of one built-in ``model.kind`` without building it (the registry: ``MODEL_KINDS``):
    its builder, the data it trains on, its layer stacks and sequence lengths, how its loss is computed."""

    builder: str  # "module:name" of the class or function that builds it from a ModelConfig
    data_kinds: tuple[str, ...]
    synthetic_tasks: tuple[str, ...] = ()  # the first: data.task left out
    # the Transformer layer stacks in execution order (``layer_stacks``): one, or an encoder's and a decoder's
    # whose layers attend to the encoder output; none: not built of Transformer layers (data parallel only)
    stacks: tuple[str, ...] = ()
    length_keys: tuple[str, ...] = ()  # the ModelConfig keys of its (source, target) sequence lengths
    loss_in_head: bool = False  # its head computes the token loss from ``labels`` without whole logits
    ffn_matrices: int = 2  # weight matrices of each feed-forward block (a gated one: 3)

    @property
    def encoder_decoder(self) -> bool:
        return len(self.stacks) == 2

    def build_function(self):
        """The class or function ``builder`` names (imported now: it needs torch)."""
        module, _, name = self.builder.partition(":")
        return getattr(importlib.import_module(module), name)


MODEL_KINDS = {
    "transformer": ModelKind("paratrain.models.transformer:Seq2SeqModel", ("synthetic", "translation"),
                             ("reverse", "copy"), ("transformer.encoder.layers", "transformer.decoder.layers"),
                             ("src_seq_length", "tgt_seq_length"), loss_in_head=True),
    "gpt": ModelKind("paratrain.models.transformer:GPTModel", ("synthetic", "text", "documents", "chat"), ("markov",),
                     ("layers",), ("seq_length", "seq_length"), loss_in_head=True),
    "llama": ModelKind("paratrain.models.llama:LlamaModel", ("synthetic", "text", "documents", "chat"), ("markov",),
                       ("layers",), ("seq_length", "seq_length"), loss_in_head=True, ffn_matrices=3),
    "resnet": ModelKind("paratrain.models.resnet:build_resnet", ("cifar10",)),
}
USER_MODEL_KIND = "user"  # model.kind a user's own net is recorded as (MindSpore face): none of the built-in ones


HF_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
# the llama kind's [model] key -> its name in a Hugging Face config.json
HF_NAMES = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "ffn_hidden_size": "intermediate_size",
            "decoder_layers": "num_hidden_layers", "tie_embeddings": "tie_word_embeddings",
            "rms_norm_eps": "rms_norm_eps", "attention_dropout": "attention_dropout"}


def read_hf_config(directory: str | Path) -> dict:
    """The ``config.json`` of a Hugging Face model directory; a missing or unreadable one refused naming it."""
    path = Path(directory) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError([f"model.from_hf={str(directory)!r}: cannot read {path}: {err}"]) from err


def hf_model_settings(hf: dict) -> dict:
    """The llama kind's ``[model]`` keys an HF ``config.json`` (``hf``) sets; an architecture or option paratrain
    does not implement refused naming it."""
    architectures = hf.get("architectures") or [None]
    if len(architectures) != 1 or architectures[0] not in HF_ARCHITECTURES:
        raise ConfigError([f"config.json's architectures={architectures} is not supported: use one of "
                           f"{', '.join(HF_ARCHITECTURES)}"])
    architecture = architectures[0]
    unsupported = []
    if hf.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={hf['hidden_act']!r} (only 'silu')")
    if hf.get("attention_bias") and architecture != "Qwen2ForCausalLM":
        unsupported.append("attention_bias=true (a bias on the output projection as well)")
    if hf.get("mlp_bias"):
        unsupported.append("mlp_bias=true")
    if hf.get("use_sliding_window") or (architecture == "MistralForCausalLM" and hf.get("sliding_window")):
        unsupported.append(f"sliding_window={hf.get('sliding_window')} (attention over a window)")
    ConfigError.raise_any([f"config.json of {architecture}: {item} is not supported by model.kind='llama'"
                           for item in unsupported])
    settings = {key: hf[name] for key, name in HF_NAMES.items() if hf.get(name) is not None}
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})  # transformers 5's, or 4's
    settings["rope_theta"] = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    settings["rope_scaling"] = {} if rope_type == "default" else {"rope_type": rope_type, **rope}
    settings["qkv_bias"] = architecture == "Qwen2ForCausalLM"
    settings["qk_norm"] = architecture == "Qwen3ForCausalLM"
    return settings


def hf_config_json(m: ModelConfig) -> dict:
    """The Hugging Face ``config.json`` of a llama-kind model ``m`` (``hf_model_settings`` read back gives its keys):
    Qwen3 with q/k norms, Qwen2 with q/k/v biases, else Llama (Mistral's architecture without a sliding window)."""
    architecture, model_type = (("Qwen3ForCausalLM", "qwen3") if m.qk_norm else ("Qwen2ForCausalLM", "qwen2")
                                if m.qkv_bias else ("LlamaForCausalLM", "llama"))
    scaling = dict(m.rope_scaling) or {"rope_type": "default"}
    return {"architectures": [architecture], "model_type": model_type, "hidden_act": "silu",
            **{name: getattr(m, key) for key, name in HF_NAMES.items()}, "head_dim": m.head_size,
            "num_key_value_heads": m.kv_heads, "rope_parameters": {"rope_theta": m.rope_theta, **scaling},
            "max_position_embeddings": m.seq_length, "attention_bias": False, "dtype": m.dtype}


@dataclass
class MoEConfig:
    """MindSpore's mixture-of-experts settings (``paratrain.modules.moe.MoE``): ``expert_num`` expert FFNs
    instead of one (1: a plain FFN), each token sent to ``num_experts_chosen`` of them, each expert taking at
    most ``ceil(capacity_factor * tokens * num_experts_chosen / expert_num)`` tokens of a group of
    ``expert_group_size`` tokens (None: the tokens of one rank's micro-batch), the load-balancing loss
    weighted by ``aux_loss_factor``. ``every`` (paratrain's, the TOML face): every layer (1) or the second
    of every ``every`` layers (2: every other layer, as GShard) is a mixture of experts."""

    expert_num: int = 1  # expert feed-forward blocks per mixture-of-experts layer; 1 = a plain feed-forward
    capacity_factor: float = 1.1  # room per expert, as a multiple of an even share of the tokens
    aux_loss_factor: float = 0.05  # weight of the load-balancing loss
    num_experts_chosen: int = 1  # experts each token is sent to
    expert_group_size: int | None = None  # tokens per routing group; None: the tokens of one rank's micro-batch
    every: int = 1  # 1: every layer is a mixture of experts; 2: every other layer (as GShard)

    def used_in(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` (counted over the whole model) is a mixture of experts."""
        return self.expert_num > 1 and layer_id % self.every == self.every - 1

    def layers_in(self, start: int, count: int) -> int:
        """How many of the layers ``start`` .. ``start + count - 1`` are mixtures of experts (``used_in``)."""
        return (start + count) // self.every - start // self.every if self.expert_num > 1 else 0


@dataclass
class ModelConfig(Section):
    """Sizes of the encoder-decoder ``transformer``, the decoder-only ``gpt`` or ``llama`` (the Llama family:
    Llama 3, Qwen2/3, Mistral). The llama kind's keys by their Hugging Face ``config.json`` names: vocab_size,
    hidden_size, num_heads (num_attention_heads), ffn_hidden_size (intermediate_size), decoder_layers
    (num_hidden_layers), seq_length (at most max_position_embeddings), attention_dropout, tie_embeddings
    (tie_word_embeddings) and the keys below marked llama; hidden_dropout has no HF counterpart (set it to 0)."""

    SECTION = "model"
    ALIASES = {"hidden_dropout_rate": "hidden_dropout", "attention_dropout_rate": "attention_dropout",
               "attention_bias": "qkv_bias"}
    kind: str = "transformer"  # transformer (encoder-decoder) | gpt (decoder-only) | llama | resnet (CIFAR-10 images)
    vocab_size: int = 64  # tokens in the vocabulary (ids 0-3: pad, bos, eos, unk)
    hidden_size: int = 64  # width of the embeddings and of every layer
    num_heads: int = 4  # attention heads per layer (divides hidden_size; model_parallel divides it)
    ffn_hidden_size: int = 256  # inner width of each feed-forward block
    encoder_layers: int = 2  # layers of the encoder (transformer only)
    decoder_layers: int = 2  # layers of the decoder (gpt: all its layers)
    src_seq_length: int = 32  # source (encoder) tokens per example (transformer)
    tgt_seq_length: int = 32  # target (decoder) tokens per example (transformer)
    seq_length: int = 64  # tokens per example (gpt)
    hidden_dropout: float = 0.1  # dropout probability on the hidden states
    attention_dropout: float = 0.1  # dropout probability on the attention weights
    hidden_act: str = "gelu"  # feed-forward activation: gelu (exact) | gelu_tanh (the tanh approximation) | relu
    post_layernorm_residual: bool = False  # MindSpore's option: the residual adds to the normalised input
    tie_embeddings: bool = False  # the output head shares the word embedding's weights
    layernorm_eps: float = 1e-5  # epsilon of every LayerNorm
    dtype: str = "float32"  # dtype of the parameters: float32 | bfloat16 | float16 (see train.mixed_precision)
    pad_token_id: int = 0  # id of the padding token, which does not count in the loss
    moe: dict = field(default_factory=dict)  # MoEConfig's fields, e.g. {expert_num = 8, num_experts_chosen = 2}
    # llama: key/value heads, each shared by num_heads / num_kv_heads query heads (grouped-query attention);
    # 1: multi-query; 0: num_heads (HF: num_key_value_heads)
    num_kv_heads: int = 0
    head_dim: int = 0  # llama: width of each attention head; 0: hidden_size / num_heads (HF: head_dim)
    rms_norm_eps: float = 1e-6  # llama: epsilon of every RMSNorm (HF: rms_norm_eps)
    rope_theta: float = 10000.0  # llama: base of the rotary position embedding's frequencies (HF: rope_theta)
    # llama: rotary frequencies rescaled, {rope_type = "linear", factor = F} or {rope_type = "llama3", factor,
    # low_freq_factor, high_freq_factor, original_max_position_embeddings}; empty: not rescaled (HF: rope_scaling)
    rope_scaling: dict = field(default_factory=dict)
    qk_norm: bool = False  # llama: an RMSNorm over each head's queries and keys, as Qwen3 (HF: q_norm, k_norm)
    qkv_bias: bool = False  # llama: biases on the query, key and value projections, as Qwen2 (HF: attention_bias)
    # llama: a Hugging Face model directory (config.json, safetensors, tokenizer.json) whose architecture the
    # model takes and whose weights it starts from; "": none
    from_hf: str = ""

    @property
    def moe_config(self) -> MoEConfig:
        """``moe`` as a MoEConfig (expert_num 1 when empty: no mixture of experts)."""
        return MoEConfig(**self.moe)

    def layer_counts(self) -> dict[tuple[bool, bool], int]:
        """How many layers of each kind the model has: (a decoder layer of an encoder-decoder, a mixture of
        experts) -> count; as fast for 10^12 layers as for 2."""
        counts, start = {}, 0
        for stack, count in enumerate(self.stack_layers.values()):  # stack 1: the decoder's
            experts = self.moe_config.layers_in(start, count)
            counts.update({kind: n for kind, n in (((stack > 0, False), count - experts),
                                                   ((stack > 0, True), experts)) if n})
            start += count
        return counts

    def take_hf(self, given: set[str]) -> list[str]:
        """Set the keys ``from_hf``'s config.json decides (kind llama; hidden_dropout 0 unless ``given``); a
        problem for each of the ``given`` keys (set by the user) that contradicts it, showing both values."""
        settings = {"kind": "llama", **hf_model_settings(read_hf_config(self.from_hf))}
        names = {**HF_NAMES, "kind": "architectures", "rope_theta": "rope_parameters", "rope_scaling":
                 "rope_parameters", "qkv_bias": "architectures", "qk_norm": "architectures"}
        problems = [f"model.{key}={getattr(self, key)!r} contradicts {self.from_hf}/config.json ({names[key]}): "
                    f"{value!r}; remove model.{key} or set it to {value!r}"
                    for key, value in settings.items() if key in given and getattr(self, key) != value]
        for key, value in settings.items():
            setattr(self, key, value)
        if "hidden_dropout" not in given:
            self.hidden_dropout = 0.0  # HF's Llama family has no dropout on the hidden states
        return problems

    @property
    def head_size(self) -> int:
        """Width of each attention head: ``head_dim``, or hidden_size / num_heads."""
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads of each attention: ``num_kv_heads``, or num_heads."""
        return self.num_kv_heads or self.num_heads

    @property
    def spec(self) -> ModelKind:
        """This kind's entry of the registry ``MODEL_KINDS`` (``validate`` rejects a kind not in it)."""
        return MODEL_KINDS[self.kind]

    @property
    def stack_layers(self) -> dict[str, int]:
        """The number of layers of each of the kind's layer stacks, in execution order."""
        return dict(zip(self.spec.stacks, (self.encoder_layers, self.decoder_layers)[-len(self.spec.stacks):]))

    @property
    def num_layers(self) -> int:
        return self.decoder_layers + (self.encoder_layers if self.spec.encoder_decoder else 0)

    @property
    def ignore_index(self) -> int:
        """Target value that does not count in the loss: the encoder-decoder's padding; none (-100) for a
        decoder-only model, whose windows of text are never padded and whose every id may be a real token (id 0
        of a Hugging Face tokenizer), and for image classes."""
        return self.pad_token_id if self.spec.encoder_decoder else -100

    @property
    def lengths(self) -> tuple[int, int]:
        """(source, target) sequence lengths: the encoder's and the decoder's, or the one of a decoder-only model."""
        return tuple(getattr(self, key) for key in self.spec.length_keys)

    def sequence_lengths(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in dict.fromkeys(self.spec.length_keys)}


@dataclass
class OpParallelConfig:
    """MindSpore's per-operator view: how the batch and the weights of one op are split."""

    data_parallel: int = 1
    model_parallel: int = 1


@dataclass
class EmbeddingOpParallelConfig(OpParallelConfig):
    """MindSpore's embedding view: ``vocab_emb_dp=False`` shards vocab rows over model_parallel."""

    vocab_emb_dp: bool = True


class _Derived(int):
    """The value of ``data_parallel`` when not given: 1 until ``ParallelConfig.derive`` knows the world size."""


DERIVED = _Derived(1)


@dataclass
class TransformerRecomputeConfig:
    """MindSpore's recompute switch for the transformer blocks: ``recompute=True`` means full recompute.

    The three communication options are accepted for compatibility: under full recompute a block's
    tensor-parallel collectives run again in backward (``mp_comm_recompute=True``); the others have
    no effect here.
    """

    recompute: bool = False
    parallel_optimizer_comm_recompute: bool = False
    mp_comm_recompute: bool = True
    recompute_slice_activation: bool = False

    @property
    def mode(self) -> str:
        return "full" if self.recompute else "none"


RecomputeSpec = Union[str, bool, list, TransformerRecomputeConfig, Callable[[int, int, "ParallelConfig"], str]]
StageSpec = Union[list, Callable[[int, int, "ParallelConfig"], int]]


@dataclass
class ParallelConfig(Section):
    """How the work is split; also importable as ``TransformerOpParallelConfig``.

    ``data_parallel * context_parallel * model_parallel * pipeline_stage`` must equal the world size;
    ``data_parallel`` not given is derived from it (``world_size // (context_parallel * model_parallel *
    pipeline_stage)``) by ``paratrain.config_rules.check``,
    ``Layout`` and the trainer, and is 1 until then. ``zero_stage`` (or ``optimizer_shard=True``, meaning stage 1)
    shards optimizer state (1), gradients (2) and parameters (3) over the data-parallel ranks. ``recompute`` is
    ``none``/``full``/``selective``, a bool, a list with one mode per layer, a function ``(layer_id, offset,
    config) -> mode`` like MindSpore's ``lambda_func``, or MindSpore's ``TransformerRecomputeConfig``.
    ``layer_stages`` places layers on pipeline stages: empty for the split that balances the layers' FLOPs (the
    output head's counted with the last layer: ``paratrain.parallel.pipeline.layer_chunks``), a list with the stage
    of every layer, or a function ``(layer_id, offset, config) -> stage``; with ``virtual_pipeline_stage`` v > 1
    the values are virtual stages 0..pp*v-1.
    """

    SECTION = "parallel"
    ALIASES = {"dp": "data_parallel", "mp": "model_parallel", "tp": "model_parallel", "pp": "pipeline_stage",
               "stage_num": "pipeline_stage", "pipeline_stages": "pipeline_stage",
               "enable_parallel_optimizer": "optimizer_shard", "ep": "expert_parallel", "cp": "context_parallel"}
    # more gradient_aggregation_group groups than layers: refused here; one group per layer in MindSpore's
    # TransformerOpParallelConfig, whose default is 4 groups whatever the layer count
    GROUPS_MAY_EXCEED_LAYERS = False
    data_parallel: int = DERIVED  # replicas the batch is split over; not given: world size / (cp x mp x pp)
    model_parallel: int = 1  # tensor-parallel degree inside each layer
    pipeline_stage: int = 1  # number of pipeline stages
    micro_batch_num: int = 1  # micro-batches per step (pipeline, gradient accumulation)
    # gpipe | 1f1b | interleaved_1f1b | looped_bfs | interleaved_zero_bubble | zbv_zero_bubble
    pipeline_schedule: str = "1f1b"
    virtual_pipeline_stage: int = 1  # model chunks per pipeline rank (2 or more: an interleaved schedule)
    optimizer_shard: bool = False  # MindSpore's switch: true means zero_stage 1
    zero_stage: int = 0  # ZeRO over the data-parallel ranks: 0 off, 1 optimizer state, 2 + gradients, 3 + parameters
    # groups of consecutive layers gathered and reduced together; 0: each layer is its own group (one FSDP unit
    # per block)
    gradient_aggregation_group: int = 0
    recompute: RecomputeSpec = "none"  # activation recompute: none | full | selective, a bool, or one mode per layer
    vocab_emb_dp: bool = True  # true: the embedding replicated; false: its vocabulary rows sharded over model_parallel
    sequence_parallel: bool = False  # shard the norms' and dropouts' activations along the sequence over model_parallel
    # the pipeline stage of each layer; empty: the split that balances the layers' FLOPs
    layer_stages: StageSpec = field(default_factory=list)
    offload_optimizer: str = "none"  # "cpu": optimizer state and step on the host (ZeRO-Offload, stages 1-3)
    offload_param: str = "none"  # "cpu": parameters at rest on the host too (stage 3)
    expert_parallel: int = 1  # ranks among the data-parallel ones over which the experts are split
    context_parallel: int = 1  # ranks each sequence is split over (decoders: gpt, llama)
    # attention over the split sequence: ulysses (all-to-all of heads) | ring | auto (ulysses where this rank's
    # heads and key/value heads divide by context_parallel, else ring)
    cp_method: str = "auto"
    auto: bool = False  # `paratrain train` picks the layout for its world size (paratrain.plan.resolve_auto)

    @property
    def data_parallel_given(self) -> bool:
        """False while ``data_parallel`` waits to be derived from the world size (see ``derive``)."""
        return type(self.data_parallel) is not _Derived

    def derive(self, world_size: int) -> "ParallelConfig":
        """Set ``data_parallel``, when not given, to ``world_size // (context_parallel * model_parallel *
        pipeline_stage)`` (as MindSpore's tutorial computes it); left as it is when that does not divide. Returns
        self."""
        split = self.context_parallel * self.model_parallel * self.pipeline_stage
        if (not self.data_parallel_given and isinstance(split, int) and split > 0 and world_size % split == 0
                and world_size >= split):  # sizes of the wrong type or range are refused by the rules
            self.data_parallel = world_size // split
        return self

    # the short names of the sizes, read-only (``ALIASES`` takes them as keys)
    dp = property(lambda self: self.data_parallel)
    mp = tp = property(lambda self: self.model_parallel)
    pp = property(lambda self: self.pipeline_stage)
    ep = property(lambda self: self.expert_parallel)
    cp = property(lambda self: self.context_parallel)

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.context_parallel * self.model_parallel * self.pipeline_stage

    def attention_split(self, num_heads: int, kv_heads: int) -> str:
        """How attention runs over a sequence split by ``context_parallel``, for a model of ``num_heads`` query and
        ``kv_heads`` key/value heads: "ulysses" or "ring" (``cp_method``; "auto": ulysses where this rank's heads
        and key/value heads after the tensor-parallel split divide by ``context_parallel``, else ring)."""
        if self.cp_method != "auto":
            return self.cp_method
        heads = (num_heads // self.model_parallel, kv_heads // self.model_parallel)
        return "ulysses" if all(h % self.context_parallel == 0 for h in heads) else "ring"

    @property
    def effective_zero_stage(self) -> int:
        return max(self.zero_stage, 1 if self.optimizer_shard else 0)

    @property
    def shards_parameters(self) -> bool:
        """Whether FSDP2 shards parameters and gradients at rest over the data-parallel ranks (zero stages
        2 and 3, and stage 1 when it offloads); stage 1 otherwise keeps replicas and shards only the
        optimizer state (``paratrain.parallel.data.shard_optimizer_state``)."""
        stage = self.effective_zero_stage
        return stage >= 2 or stage == 1 and self.offloads

    def moves_tokens(self, tokens_per_rank: int | None, vocab_size: int) -> bool:
        """Whether the word tables and heads stay row-sharded over the data-parallel ranks and the tokens travel to
        them (``paratrain.parallel.vocab``): zero stage 2 or 3 over dp > 1 ranks without tensor, pipeline or
        context parallelism or offload, micro-batches of ``tokens_per_rank`` tokens of one shape on every rank
        (None: not known), and fewer tokens on all ranks together than ``vocab_size`` rows."""
        return (self.shards_parameters and not self.offloads and self.data_parallel > 1 and self.model_parallel == 1
                and self.pipeline_stage == 1 and self.context_parallel == 1 and tokens_per_rank is not None
                and self.data_parallel * tokens_per_rank <= vocab_size)

    @property
    def shards_only_optimizer_state(self) -> bool:
        """Zero stage 1 on replicas: each data-parallel rank keeps and steps the optimizer state of the
        parameters it owns; parameters and gradients stay whole."""
        return self.effective_zero_stage == 1 and not self.shards_parameters

    @property
    def offloads(self) -> bool:
        """Whether FSDP2 keeps this run's parameters, gradients and optimizer state on the host
        (``offload_optimizer`` or ``offload_param`` = "cpu"; ``paratrain.parallel.data``)."""
        return "cpu" in (self.offload_optimizer, self.offload_param)

    @property
    def dp_mp_config(self) -> OpParallelConfig:
        return OpParallelConfig(self.data_parallel, self.model_parallel)

    @property
    def embedding_dp_mp_config(self) -> EmbeddingOpParallelConfig:
        return EmbeddingOpParallelConfig(self.data_parallel, self.model_parallel, self.vocab_emb_dp)

    def aggregation_groups(self, num_layers: int) -> int:
        """Groups of consecutive layers gathered and reduced together among ``num_layers`` (at least 1)."""
        return max(1, min(self.gradient_aggregation_group or num_layers, num_layers))

    def recompute_mode(self, layer_id: int, offset: int = 0) -> str:
        """The recompute mode of one layer (``offset``: layers before this stack)."""
        spec = self.recompute
        if callable(spec):
            spec = spec(layer_id, offset, self)
        elif isinstance(spec, list):
            spec = spec[offset + layer_id]
        if isinstance(spec, TransformerRecomputeConfig):
            return spec.mode
        if isinstance(spec, bool):
            return "full" if spec else "none"
        return spec

    def to_dict(self) -> dict[str, Any]:
        values = super().to_dict()
        if isinstance(self.recompute, TransformerRecomputeConfig):  # TOML has no objects: its mode says the same
            values["recompute"] = self.recompute.mode
        return values


@dataclass
class TrainConfig(Section):
    """Optimisation: batch, steps, AdamW, LR schedule, clipping, precision."""

    SECTION = "train"
    global_batch_size: int = 16  # examples per step, over all data-parallel ranks and micro-batches
    steps: int = 100  # optimizer steps to train
    lr: float = 1e-3  # peak learning rate, reached at the end of the warmup
    min_lr: float = 1e-4  # learning rate at the end of the decay
    warmup_steps: int = 10  # steps of the warmup to lr
    weight_decay: float = 0.01  # AdamW's decoupled weight decay (on matrices, not on biases and LayerNorms)
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.98  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's epsilon
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 = off
    # LR schedule (paratrain.optim.lr_at): "cosine" (linear warmup, cosine to min_lr), or DeepSpeed's
    # "warmup_lr" / "warmup_decay_lr" / "warmup_cosine_lr" starting at warmup_min_lr with a linear or log warmup
    lr_schedule: str = "cosine"
    warmup_type: str = "linear"  # warmup of the DeepSpeed schedules: linear | log
    warmup_min_lr: float = 0.0  # learning rate the DeepSpeed schedules' warmup starts at
    lr_decay_steps: int = 0  # the step where the decay ends (DeepSpeed's total_num_steps); 0: train.steps
    mixed_precision: str = "auto"  # bf16 on a GPU, "none" (fp32) on the CPU; fp8: Linears in fp8 (paratrain.precision)
    compile: bool = False  # torch.compile each layer (after tensor parallel and recompute, before FSDP)
    initial_loss_scale: float = 65536.0  # fp16 only
    min_loss_scale: float = 1.0  # fp16: an overflow at this scale stops training (DeepSpeed's min_loss_scale)
    max_skipped_steps: int = 100  # fp16: this many overflowed steps in a row stop training; 0 = no limit
    loss_scale_window: int = 1000  # fp16: the scale doubles after this many steps without overflow
    loss_scale_hysteresis: int = 1  # fp16: overflows tolerated before the scale halves (DeepSpeed's hysteresis)
    consecutive_hysteresis: bool = False  # fp16: every good step refills the hysteresis (else each doubling)
    # evaluate every this many steps (0 = off): gpt / llama measure the held-out loss and perplexity on
    # data.eval_path (synthetic data: on windows never trained on), the encoder-decoder BLEU on held-out pairs
    eval_steps: int = 0


@dataclass
class DataConfig(Section):
    """Where batches come from; ``synthetic`` needs no files.

    ``translation``: ``path`` is a ``source<TAB>target`` file (``paratrain preprocess``),
    ``text``: a text file or ``.npy`` token stream, ``documents``: a folder or file of ``.jsonl`` /
    ``.parquet`` / ``.txt`` documents packed with EOS between them, ``chat``: a folder or file of ``.jsonl`` /
    ``.parquet`` conversations rendered with a chat template, ``cifar10``: the ``cifar-10-batches-bin``
    directory. ``tokenizer`` is a ``tokenizer.json``, trained on ``path`` at first use if absent.
    """

    SECTION = "data"
    KINDS = ("synthetic", "translation", "text", "documents", "chat", "cifar10")
    TOO_LONG = ("filter", "drop", "truncate")
    TRAIN_ON = ("assistant", "all")
    kind: str = "synthetic"  # synthetic | translation | text | documents | chat | cifar10
    task: str = ""  # synthetic data: reverse | copy (encoder-decoder), markov (gpt); "": the first
    min_length: int = 4  # synthetic data: the length of the shortest string
    path: str = ""  # the data file or directory of kind (see above)
    tokenizer: str = ""  # a tokenizer.json; trained on path at first use if absent
    # held-out data of the kind of path, read with its tokenizer: gpt / llama a text file (or .npy) or documents,
    # the encoder-decoder source<TAB>target pairs for BLEU
    eval_path: str = ""
    eval_samples: int = 200  # how many of the held-out pairs (the first ones) BLEU decodes
    eval_batches: int = 8  # gpt / llama: the held-out loss is measured on this many global batches of eval_path
    shuffle: bool = True  # shuffle the examples each epoch (seeded by run.seed)
    bucket_size: int = 0  # length bucketing: sort windows of this many global batches by length; 0 = off
    dynamic_padding: bool = False  # pad each global batch to its longest example, not the model lengths
    # translation pairs / chat conversations longer than the model lengths: filter (or drop) | truncate
    too_long: str = "filter"
    text_field: str = "text"  # documents: the field (jsonl) or column (parquet) holding each document's text
    # documents, packed chat: attention stays within each document of a packed row and positions restart at each one
    document_mask: bool = False
    train_on: str = "assistant"  # chat: the tokens counted in the loss: assistant (the assistant's turns) | all
    packing: bool = False  # chat: as many conversations a row as fit (else one, padded)
    chat_template: str = ""  # chat: a jinja file of the chat template; "": the model.from_hf tokenizer's

    def problems(self) -> list[str]:
        """Every rule these keys break on their own (the data loader and ``paratrain.preflight`` ask)."""
        out = []
        if self.kind not in self.KINDS:
            out.append(f"data.kind={self.kind!r} is not one of {', '.join(self.KINDS)}")
        elif self.kind != "synthetic" and not self.path:
            out.append(f"data.kind={self.kind!r} needs data.path (for translation: run "
                       f"`paratrain preprocess sample --out data/sample` and use data/sample/train/sample.en_fr.txt)")
        for name, values in (("too_long", self.TOO_LONG), ("train_on", self.TRAIN_ON)):
            if getattr(self, name) not in values:
                out.append(f"data.{name}={getattr(self, name)!r} is not one of {', '.join(values)}")
        if self.bucket_size < 0:
            out.append(f"data.bucket_size={self.bucket_size} must be 0 (off) or positive")
        for name in ("bucket_size", "dynamic_padding"):
            if getattr(self, name) and self.kind != "translation":
                out.append(f"data.{name}={getattr(self, name)} applies to translation data only, not "
                           f"data.kind={self.kind!r}: leave it out")
        if self.document_mask and self.kind not in ("documents", "chat"):
            out.append(f"data.document_mask=true needs the document boundaries of data.kind='documents' or 'chat', "
                       f"not data.kind={self.kind!r}: set data.kind='documents' or leave document_mask out")
        elif self.document_mask and self.kind == "chat" and not self.packing:
            out.append("data.document_mask=true with data.kind='chat' needs data.packing=true: one conversation a "
                       "row has no other to mask; set packing=true or leave document_mask out")
        for name in ("packing", "chat_template"):
            if getattr(self, name) and self.kind != "chat":
                out.append(f"data.{name}={getattr(self, name)!r} applies to data.kind='chat' only, not "
                           f"data.kind={self.kind!r}: leave it out")
        if not self.text_field:
            out.append('data.text_field="" names no field: give the jsonl field / parquet column of the text')
        if self.min_length < 0:
            out.append(f"data.min_length={self.min_length} must not be negative (the shortest synthetic string)")
        if self.eval_samples < 1:
            out.append(f"data.eval_samples={self.eval_samples} must be positive (the held-out pairs BLEU decodes)")
        if self.eval_batches < 1:
            out.append(f"data.eval_batches={self.eval_batches} must be positive (the held-out global batches a "
                       f"decoder's loss is measured on)")
        return out

    def synthetic_task(self, model_kind: str) -> str:
        """``task``, or when not given the first synthetic task of ``model_kind``."""
        return self.task or MODEL_KINDS[model_kind].synthetic_tasks[0]


@dataclass
class CheckpointConfig(Section):
    """When and where checkpoints are written and whether to resume."""

    SECTION = "checkpoint"
    ALIASES = {"save_checkpoint_steps": "save_steps", "keep_checkpoint_max": "keep_max", "directory": "dir"}
    dir: str = ""  # where checkpoints go; "": <run dir>/checkpoints
    save_steps: int = 0  # save every this many steps, and after the last one; 0 = no checkpoints
    keep_max: int = 3  # newest checkpoints kept; 0: all
    integrated_save: bool = False  # also write the whole model as one model.safetensors (plain parameter names)
    resume: str = "auto"  # auto (the newest intact checkpoint, if any) | a checkpoint path | none
    prefix: str = ""  # "": directories step_00000008; else MindSpore's <prefix>-<epoch>_<step> (one epoch here)
    trust_unverified: bool = False  # load checkpoints of format 1, which record no checksums (only ones you trust)


@dataclass
class MetricsConfig(Section):
    """Logging: how often, and which sinks."""

    SECTION = "metrics"
    log_steps: int = 10  # log a step's metrics every this many steps
    tensorboard: bool = False  # also write TensorBoard event files into the run directory
    breakdown: bool = False  # forward / backward / optimizer / communication / pipeline idle per step
    log_format: str = "default"  # default | mindspore
    peak_tflops: float = 0.0  # per device, for mfu; 0: GPU table (bf16) or a CPU matmul measured at start
    progress: bool = True  # progress bar with ETA on rank 0 when stdout is a terminal


@dataclass
class LoraConfig(Section):
    """LoRA: low-rank adapters trained on a frozen base (fine-tuning.md); without it every parameter trains."""

    SECTION = "lora"
    ALIASES = {"r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout"}  # peft's LoraConfig names
    rank: int = 0  # inner width r of each adapter (peft: r); 0: no adapters, full fine-tuning
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank (peft: lora_alpha)
    dropout: float = 0.0  # dropout on each adapter's input (peft: lora_dropout)
    # Linears that get adapters, by their Hugging Face names (o_proj is paratrain's out_proj); every projection
    # of attention and the feed-forward by default (peft: target_modules)
    target_modules: list = field(default_factory=lambda: list(LORA_TARGETS))
    base_dtype: str = "float32"  # dtype of the frozen base's parameters: float32 | bfloat16

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """What each adapter's output is multiplied by: alpha / rank."""
        return self.alpha / self.rank

    @property
    def targets(self) -> set[str]:
        """``target_modules`` by their Hugging Face names."""
        return {LORA_RENAMED.get(name, name) for name in self.target_modules}

    def problems(self) -> list[str]:
        """Every rule these keys break on their own (``paratrain.config_rules.validate`` asks)."""
        if self.rank == 0:
            return []
        out = []
        if self.rank < 0:
            out.append(f"lora.rank={self.rank} must be at least 1 (e.g. 8), or 0 for no adapters")
        if self.alpha <= 0:
            out.append(f"lora.alpha={self.alpha} must be positive (the adapters' output is scaled by alpha / rank; "
                       f"e.g. 16)")
        if not 0 <= self.dropout < 1:
            out.append(f"lora.dropout={self.dropout} is outside [0, 1): use a probability such as 0.05, or 0")
        unknown = [name for name in self.target_modules if name not in LORA_TARGETS and name not in LORA_RENAMED]
        if unknown:
            out.append(f"lora.target_modules names {', '.join(map(repr, unknown))}, not a Linear of the llama kind: "
                       f"use some of {', '.join(LORA_TARGETS)} (out_proj is o_proj)")
        if not self.target_modules:
            out.append(f"lora.target_modules=[] adds no adapters: name some of {', '.join(LORA_TARGETS)}, or set "
                       f"lora.rank=0 for full fine-tuning")
        if self.base_dtype not in ("float32", "bfloat16"):
            out.append(f"lora.base_dtype={self.base_dtype!r} is not one of float32, bfloat16")
        return out


@dataclass
class LaunchConfig(Section):
    """How ``paratrain launch`` runs the job's ranks (``paratrain train`` alone ignores it)."""

    SECTION = "launch"
    max_restarts: int = 0  # times a failed job is restarted from its newest checkpoint (--max-restarts wins)


@dataclass
class Config:
    """A whole run: one attribute per TOML section."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    @property
    def checkpoint_path(self) -> Path:
        """Where checkpoints go: ``checkpoint.dir``, default ``<run dir>/checkpoints``."""
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run.path / "checkpoints"

    @classmethod
    def sections(cls) -> dict[str, type[Section]]:
        return {f.name: f.default_factory for f in fields(cls)}

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: getattr(self, name).to_dict() for name in self.sections()}


def dotted(tree: dict, sep: str = ".", prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(name, value) of every leaf of the nested dicts ``tree``, names joined by ``sep``: ``{"a": {"b": 1}}``
    gives ``("a.b", 1)`` (DeepSpeed's keys), ``("a/b", 1)`` with ``sep="/"`` (TensorBoard's tags)."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from dotted(value, sep, f"{prefix}{key}{sep}")
        else:
            yield f"{prefix}{key}", value
