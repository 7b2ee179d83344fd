"""Configuration: one dataclass per TOML section, loading, overrides and validation.

The parallel knobs keep MindSpore's names (``data_parallel``, ``model_parallel``,
``pipeline_stage``, ``micro_batch_num``, ``optimizer_shard``,
``gradient_aggregation_group``, ``recompute``, ``vocab_emb_dp``) so a
``TransformerOpParallelConfig`` reads the same here.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterator, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib
import tomli_w

from paratrain.errors import UserError

MAX_COUNT = 10**12  # steps, batch sizes: more would not finish (10^12 steps of 1 ms are 31 years)
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble")
RECOMPUTE_MODES = ("none", "full", "selective")
MIXED_PRECISION = ("auto", "none", "bf16", "fp16")
MODEL_KINDS = ("transformer", "gpt", "resnet")
LR_SCHEDULES = ("cosine", "warmup_lr", "warmup_decay_lr", "warmup_cosine_lr")  # the last three: DeepSpeed's
WARMUP_TYPES = ("linear", "log")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
DTYPES = ("float32", "bfloat16", "float16")
ACTIVATIONS = ("gelu", "relu")
LOG_FORMATS = ("default", "mindspore")
DATA_KINDS = {"transformer": ("synthetic", "translation"), "gpt": ("synthetic", "text"), "resnet": ("cifar10",)}
SYNTHETIC_TASKS = {"transformer": ("reverse", "copy"), "gpt": ("markov",)}  # the first: data.task left out
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


class Section:
    """Base of the config sections: building from a dict with aliases and unknown-key checks."""

    ALIASES: dict[str, str] = {}
    SECTION = ""

    @classmethod
    def key_names(cls) -> list[str]:
        return [f.name for f in fields(cls)] + list(cls.ALIASES)

    @classmethod
    def canonical(cls, key: str, problems: list[str]) -> str | None:
        key = cls.ALIASES.get(key, key)
        if key in {f.name for f in fields(cls)}:
            return key
        problems.append(f"unknown key {cls.SECTION}.{key}{cls.hint(key)}")
        return None

    @classmethod
    def hint(cls, key: str) -> str:
        """What to write instead of the unknown ``key``: a MindSpore name's counterpart, the key (or an alias)
        in the section it belongs to, else the closest key here."""
        if key in MINDSPORE_HINTS:
            return f" ({MINDSPORE_HINTS[key]})"
        for name, section in Config.sections().items():
            if section is not cls and key in section.key_names():
                return f" (did you mean {name}.{section.ALIASES.get(key, key)}?)"
        close = difflib.get_close_matches(key, cls.key_names(), n=1)
        if close:
            return f" (did you mean {cls.SECTION}.{close[0]}?)"
        return f" (known: {', '.join(sorted(cls.key_names()))})"

    @classmethod
    def from_dict(cls, values: dict[str, Any], problems: list[str]):
        obj = cls()
        for key, value in values.items():
            name = cls.canonical(key, problems)
            if name is not None:
                obj.set(name, value, problems)
        return obj

    def set(self, name: str, value: Any, problems: list[str]) -> None:
        default = next(f for f in fields(self) if f.name == name)
        current = getattr(self, name)
        try:
            setattr(self, name, _coerce(value, current, default))
        except (TypeError, ValueError) as exc:
            problems.append(f"{self.SECTION}.{name}={value!r}: {exc}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if not callable(getattr(self, f.name))}

    def unusable(self) -> list[str]:
        """A problem for every number of this section that is NaN or infinite, and every string holding a NUL
        character (no path or name can)."""
        problems = []
        for name, value in self.to_dict().items():
            if isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{self.SECTION}.{name}={value} is not a finite number")
            elif isinstance(value, str) and "\0" in value:
                problems.append(f"{self.SECTION}.{name}={value!r} holds a NUL character, which no path or name "
                                f"can: remove it")
        return problems


def _coerce(value: Any, current: Any, f: dataclasses.Field) -> Any:
    """Convert ``value`` (from TOML or the command line) to the type of the field it sets."""
    kind = next((t for t in (bool, int, float, str) if isinstance(current, t)), None)
    if f.name == "layer_stages":
        if isinstance(value, str):  # from the command line: --parallel.layer_stages=[0,0,1,1]
            value = _parse_literal(value)
        if isinstance(value, list) or callable(value):
            return value
        raise TypeError("expected a list with the stage of each layer, or a function")
    if f.name == "recompute":
        if isinstance(value, str):
            value = _parse_literal(value)
        if isinstance(value, (bool, str, dict, list, TransformerRecomputeConfig)) or callable(value):
            return value
        raise TypeError("expected none/full/selective, true/false, a per-layer list, a function "
                        "or a TransformerRecomputeConfig")
    if isinstance(value, str) and kind in (int, float, bool):
        value = _parse_literal(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise TypeError(f"expected an integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"expected a number, got {value!r}")
        return float(value)
    if kind is str and not isinstance(value, str):
        if isinstance(value, (bool, list, dict)):  # str() would make a name or path of it
            raise TypeError(f"expected a string, got {value!r}")
        return str(value)
    return value


def dotted(tree: dict, sep: str = ".", prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(name, value) of every leaf of the nested dicts ``tree``, names joined by ``sep``: ``{"a": {"b": 1}}``
    gives ``("a.b", 1)`` (DeepSpeed's keys), ``("a/b", 1)`` with ``sep="/"`` (TensorBoard's tags)."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from dotted(value, sep, f"{prefix}{key}{sep}")
        else:
            yield f"{prefix}{key}", value


def parse_overrides(args: list[str]) -> list[str]:
    """Command-line overrides ``--section.key=value`` or ``--section.key value`` -> ``section.key=value``."""
    overrides, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ConfigError([f"unexpected argument {arg!r}: overrides look like --section.key=value"])
        if "=" in arg:
            overrides.append(arg[2:])
        elif i + 1 < len(args):
            overrides.append(f"{arg[2:]}={args[i + 1]}")
            i += 1
        else:
            raise ConfigError([f"override {arg} has no value: write {arg}=VALUE"])
        i += 1
    return overrides


def _parse_literal(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


@dataclass
class RunConfig(Section):
    """Where a run writes and how it is seeded."""

    SECTION = "run"
    name: str = "paratrain"
    dir: str = ""  # default: runs/<name>
    seed: int = 1234

    @property
    def path(self) -> Path:
        return Path(self.dir or f"runs/{self.name}")


@dataclass
class ModelConfig(Section):
    """Sizes of the encoder-decoder ``transformer`` or the decoder-only ``gpt``."""

    SECTION = "model"
    ALIASES = {"hidden_dropout_rate": "hidden_dropout", "attention_dropout_rate": "attention_dropout"}
    kind: str = "transformer"
    vocab_size: int = 64
    hidden_size: int = 64
    num_heads: int = 4
    ffn_hidden_size: int = 256
    encoder_layers: int = 2
    decoder_layers: int = 2
    src_seq_length: int = 32
    tgt_seq_length: int = 32
    seq_length: int = 64
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    hidden_act: str = "gelu"
    post_layernorm_residual: bool = False
    tie_embeddings: bool = False
    layernorm_eps: float = 1e-5
    dtype: str = "float32"
    pad_token_id: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_layers(self) -> int:
        return self.decoder_layers + (self.encoder_layers if self.kind == "transformer" else 0)

    @property
    def ignore_index(self) -> int:
        """Target value that does not count in the loss: padding, or none for image classes."""
        return -100 if self.kind == "resnet" else self.pad_token_id

    def sequence_lengths(self) -> dict[str, int]:
        if self.kind == "gpt":
            return {"seq_length": self.seq_length}
        return {"src_seq_length": self.src_seq_length, "tgt_seq_length": self.tgt_seq_length}


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

    ``data_parallel * model_parallel * pipeline_stage`` must equal the world size; ``data_parallel``
    not given is derived from it (``world_size // (model_parallel * pipeline_stage)``) by ``check``,
    ``Layout`` and the trainer, and is 1 until then.
    ``zero_stage`` (or ``optimizer_shard=True``, meaning stage 1) shards optimizer
    state (1), gradients (2) and parameters (3) over the data-parallel ranks.
    ``recompute`` is ``none``/``full``/``selective``, a bool, a list with one mode per
    layer, a function ``(layer_id, offset, config) -> mode`` like MindSpore's
    ``lambda_func``, or MindSpore's ``TransformerRecomputeConfig``. ``layer_stages`` places layers on pipeline stages: empty for an
    even split (embeddings and head counted as one layer each), a list with the
    stage of every layer, or a function ``(layer_id, offset, config) -> stage``; with
    ``virtual_pipeline_stage`` v > 1 the values are virtual stages 0..pp*v-1.
    """

    SECTION = "parallel"
    ALIASES = {"dp": "data_parallel", "mp": "model_parallel", "tp": "model_parallel", "pp": "pipeline_stage",
               "stage_num": "pipeline_stage", "pipeline_stages": "pipeline_stage",
               "enable_parallel_optimizer": "optimizer_shard"}
    data_parallel: int = DERIVED
    model_parallel: int = 1
    pipeline_stage: int = 1
    micro_batch_num: int = 1
    pipeline_schedule: str = "1f1b"
    virtual_pipeline_stage: int = 1
    optimizer_shard: bool = False
    zero_stage: int = 0
    gradient_aggregation_group: int = 0  # 0: each layer is its own group (one FSDP unit per block)
    recompute: RecomputeSpec = "none"
    vocab_emb_dp: bool = True
    sequence_parallel: bool = False
    layer_stages: StageSpec = field(default_factory=list)
    offload_optimizer: str = "none"  # "cpu": optimizer state and step on the host (ZeRO-Offload, stages 1-3)
    offload_param: str = "none"  # "cpu": parameters at rest on the host too (stage 3)
    auto: bool = False  # `paratrain train` picks the layout for its world size (paratrain.plan.resolve_auto)

    @property
    def data_parallel_given(self) -> bool:
        """False while ``data_parallel`` waits to be derived from the world size (see ``derive``)."""
        return type(self.data_parallel) is not _Derived

    def derive(self, world_size: int) -> "ParallelConfig":
        """Set ``data_parallel``, when not given, to ``world_size // (model_parallel * pipeline_stage)`` (as
        MindSpore's tutorial computes it); left as it is when that does not divide. Returns self."""
        split = self.model_parallel * self.pipeline_stage
        if not self.data_parallel_given and split > 0 and world_size % split == 0 and world_size >= split:
            self.data_parallel = world_size // split
        return self

    @property
    def dp(self) -> int:
        return self.data_parallel

    @property
    def mp(self) -> int:
        return self.model_parallel

    tp = mp

    @property
    def pp(self) -> int:
        return self.pipeline_stage

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.model_parallel * self.pipeline_stage

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


TransformerOpParallelConfig = ParallelConfig


@dataclass
class TrainConfig(Section):
    """Optimisation: batch, steps, AdamW, LR schedule, clipping, precision."""

    SECTION = "train"
    global_batch_size: int = 16
    steps: int = 100
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-8
    grad_clip: float = 1.0
    # LR schedule (paratrain.optim.lr_schedule): "cosine" (linear warmup, cosine to min_lr), or DeepSpeed's
    # "warmup_lr" / "warmup_decay_lr" / "warmup_cosine_lr" starting at warmup_min_lr with a linear or log warmup
    lr_schedule: str = "cosine"
    warmup_type: str = "linear"
    warmup_min_lr: float = 0.0
    lr_decay_steps: int = 0  # the step where the decay ends (DeepSpeed's total_num_steps); 0: train.steps
    mixed_precision: str = "auto"  # bf16 on a GPU, "none" (fp32) on the CPU (paratrain.precision)
    compile: bool = False  # torch.compile each layer (after tensor parallel and recompute, before FSDP)
    initial_loss_scale: float = 65536.0  # fp16 only
    min_loss_scale: float = 1.0  # fp16: an overflow at this scale stops training (DeepSpeed's min_loss_scale)
    max_skipped_steps: int = 100  # fp16: this many overflowed steps in a row stop training; 0 = no limit
    loss_scale_window: int = 1000  # fp16: the scale doubles after this many steps without overflow
    loss_scale_hysteresis: int = 1  # fp16: overflows tolerated before the scale halves (DeepSpeed's hysteresis)
    consecutive_hysteresis: bool = False  # fp16: every good step refills the hysteresis (else each doubling)
    eval_steps: int = 0  # BLEU on data.eval_path every this many steps (encoder-decoder, translation data); 0 = off


@dataclass
class DataConfig(Section):
    """Where batches come from; ``synthetic`` needs no files.

    ``translation``: ``path`` is a ``source<TAB>target`` file (``paratrain preprocess``),
    ``text``: a text file or ``.npy`` token stream, ``cifar10``: the ``cifar-10-batches-bin``
    directory. ``tokenizer`` is a ``tokenizer.json``, trained on ``path`` at first use if absent.
    """

    SECTION = "data"
    KINDS = ("synthetic", "translation", "text", "cifar10")
    kind: str = "synthetic"
    task: str = ""  # synthetic data: reverse | copy (encoder-decoder), markov (gpt); "": the first
    min_length: int = 4
    path: str = ""
    tokenizer: str = ""
    eval_path: str = ""  # held-out source<TAB>target pairs for BLEU
    eval_samples: int = 200  # how many of the held-out pairs (the first ones) BLEU decodes
    shuffle: bool = True
    bucket_size: int = 0  # length bucketing: sort windows of this many global batches by length; 0 = off
    dynamic_padding: bool = False  # pad each global batch to its longest example, not the model lengths
    too_long: str = "filter"  # translation pairs longer than the model lengths: filter | truncate

    def problems(self) -> list[str]:
        """Every rule these keys break (call from ``validate``)."""
        out = []
        if self.kind not in self.KINDS:
            out.append(f"data.kind={self.kind!r} is not one of {', '.join(self.KINDS)}")
        elif self.kind != "synthetic" and not self.path:
            out.append(f"data.kind={self.kind!r} needs data.path (for translation: run "
                       f"`paratrain preprocess sample --out data/sample` and use data/sample/train/sample.en_fr.txt)")
        if self.too_long not in ("filter", "truncate"):
            out.append(f"data.too_long={self.too_long!r} is not one of filter, truncate")
        if self.bucket_size < 0:
            out.append(f"data.bucket_size={self.bucket_size} must be 0 (off) or positive")
        for name in ("bucket_size", "dynamic_padding"):
            if getattr(self, name) and self.kind != "translation":
                out.append(f"data.{name}={getattr(self, name)} applies to translation data only, not "
                           f"data.kind={self.kind!r}: leave it out")
        if self.min_length < 0:
            out.append(f"data.min_length={self.min_length} must not be negative (the shortest synthetic string)")
        if self.eval_samples < 1:
            out.append(f"data.eval_samples={self.eval_samples} must be positive (the held-out pairs BLEU decodes)")
        return out

    def synthetic_task(self, model_kind: str) -> str:
        """``task``, or when not given the first synthetic task of ``model_kind``."""
        return self.task or SYNTHETIC_TASKS[model_kind][0]


@dataclass
class CheckpointConfig(Section):
    """When and where checkpoints are written and whether to resume."""

    SECTION = "checkpoint"
    ALIASES = {"save_checkpoint_steps": "save_steps", "keep_checkpoint_max": "keep_max", "directory": "dir"}
    dir: str = ""  # default: <run dir>/checkpoints
    save_steps: int = 0
    keep_max: int = 3  # newest checkpoints kept; 0: all
    integrated_save: bool = False
    resume: str = "auto"
    prefix: str = ""  # "": directories step_00000008; else MindSpore's <prefix>-<epoch>_<step> (one epoch here)


@dataclass
class MetricsConfig(Section):
    """Logging: how often, and which sinks."""

    SECTION = "metrics"
    log_steps: int = 10
    tensorboard: bool = False
    breakdown: bool = False  # forward / backward / optimizer / communication / pipeline idle per step
    log_format: str = "default"  # default | mindspore
    peak_tflops: float = 0.0  # per device, for mfu; 0: GPU table (bf16) or a CPU matmul measured at start
    progress: bool = True  # progress bar with ETA on rank 0 when stdout is a terminal


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

    @property
    def checkpoint_path(self) -> Path:
        """Where checkpoints go: ``checkpoint.dir``, default ``<run dir>/checkpoints``."""
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run.path / "checkpoints"

    @classmethod
    def sections(cls) -> dict[str, type[Section]]:
        return {f.name: f.default_factory for f in fields(cls)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], overrides: list[str] = ()) -> "Config":
        """Build from nested dicts plus ``section.key=value`` overrides; raise ConfigError on any bad key."""
        problems: list[str] = []
        data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
        for item in overrides:
            dotted, sep, value = item.partition("=")
            section, dot, key = dotted.partition(".")
            if not sep or not dot:
                problems.append(f"override {item!r} is not of the form section.key=value")
                continue
            data.setdefault(section, {})[key] = value
        built = {}
        for name, values in data.items():
            if name not in cls.sections():
                close = difflib.get_close_matches(name, list(cls.sections()), n=1)
                hint = (" (a DeepSpeed config is read by paratrain train/launch/plan, or "
                        "paratrain.deepspeed_config.load_config)" if name == "deepspeed" else
                        f" (did you mean [{close[0]}]?)" if close else "")
                problems.append(f"unknown section [{name}]{hint}")
            elif not isinstance(values, dict):
                problems.append(f"[{name}] must be a table of keys, got {values!r}")
            else:
                built[name] = cls.sections()[name].from_dict(values, problems)
        if problems:
            raise ConfigError(problems)
        return cls(**built)

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] = ()) -> "Config":
        """The config of TOML file ``path`` (none: the defaults) with ``overrides`` (``section.key=value``).
        A file naming a DeepSpeed config (``deepspeed = "ds.json"``) is read by
        ``paratrain.deepspeed_config.load_config``."""
        return cls.from_dict(cls.read_toml(path) if path is not None else {}, overrides)

    @staticmethod
    def read_toml(path: str | Path) -> dict[str, Any]:
        """The tables of TOML file ``path``; ConfigError naming the file when it cannot be read as TOML."""
        if Path(path).exists() and not Path(path).is_dir() and not Path(path).is_file():  # /dev/zero, a fifo
            raise ConfigError([f"config file {path} is not a regular file: give a .toml file"])
        try:
            data = tomllib.loads(Path(path).read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise ConfigError([f"config file {path} does not exist"]) from None
        except IsADirectoryError:
            raise ConfigError([f"config file {path} is a directory: give the .toml file in it"]) from None
        except OSError as exc:
            raise ConfigError([f"config file {path} cannot be read ({exc.strerror})"]) from None
        except UnicodeDecodeError as exc:
            raise ConfigError([f"config file {path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
                               f"offset {exc.start}): give a TOML file"]) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([f"config file {path} is not valid TOML: {exc}"]) from None
        return data

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: getattr(self, name).to_dict() for name in self.sections()}

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_toml())


# MindSpore names that are no key here, and what to do instead
MINDSPORE_HINTS = {
    "parallel_mode": "paratrain has no parallel mode: it follows from data_parallel, model_parallel and "
                     "pipeline_stage; a Python script may call paratrain.set_auto_parallel_context(parallel_mode=...)",
    "device_num": "the device count is the number of launched processes (paratrain launch --nproc-per-node); "
                  "parallel.data_parallel defaults to it divided by model_parallel x pipeline_stage",
    "full_batch": "always on: every rank reads the whole global batch and keeps its own rows",
    "gradients_mean": "always on: the gradients are those of one device on the whole global batch",
    "loss_repeated_mean": "always on: the loss is the mean over the global batch's tokens",
    "batch_size": "did you mean train.global_batch_size?",
    "learning_rate": "did you mean train.lr?",
    "epoch_size": "paratrain counts optimizer steps: did you mean train.steps?",
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(cfg: Config, world_size: int | None = None, resolved: bool = False) -> list[str]:
    """Every rule ``cfg`` breaks, each naming the fields, the numbers and a fix.

    With ``parallel.auto`` the parallel sizes need not match ``world_size`` yet, unless the layout
    is ``resolved`` (``paratrain.plan.resolve_auto``), as the trainer needs it.
    """
    if world_size is not None and (resolved or not cfg.parallel.auto):
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel).derive(world_size))
    m, p, t = cfg.model, cfg.parallel, cfg.train
    problems: list[str] = [q for name in cfg.sections() for q in getattr(cfg, name).unusable()]
    if problems:  # the rules below compare these numbers
        return problems

    def positive(section: Section, names: list[str]):
        for name in names:
            value = getattr(section, name)
            if value <= 0:
                problems.append(f"{section.SECTION}.{name}={value} must be positive")

    def choice(section: Section, name: str, allowed: tuple[str, ...]):
        value = getattr(section, name)
        if value not in allowed:
            problems.append(f"{section.SECTION}.{name}={value!r} is not one of {', '.join(allowed)}")

    positive(m, ["vocab_size", "hidden_size", "num_heads", "ffn_hidden_size", "decoder_layers",
                 *m.sequence_lengths()])
    if m.kind == "transformer":
        positive(m, ["encoder_layers"])
    positive(p, ["data_parallel", "model_parallel", "pipeline_stage", "micro_batch_num",
                 "virtual_pipeline_stage"])
    if p.gradient_aggregation_group < 0 or m.kind != "resnet" and p.gradient_aggregation_group > m.num_layers > 0:
        problems.append(f"parallel.gradient_aggregation_group={p.gradient_aggregation_group} must be 0 (one group "
                        f"per layer) or a number of groups of the model's {m.num_layers} layers, 1..{m.num_layers}")
    positive(t, ["global_batch_size", "steps", "lr", "eps", "initial_loss_scale", "min_loss_scale",
                 "loss_scale_window", "loss_scale_hysteresis"])
    positive(cfg.metrics, ["log_steps"])
    if t.warmup_steps < 0 or t.min_lr < 0 or t.weight_decay < 0 or t.grad_clip < 0:
        problems.append(f"train.warmup_steps={t.warmup_steps}, min_lr={t.min_lr}, weight_decay={t.weight_decay} "
                        f"and grad_clip={t.grad_clip} must not be negative")
    for section, name in ((t, "steps"), (t, "warmup_steps"), (t, "global_batch_size"), (t, "eval_steps"),
                          (cfg.checkpoint, "save_steps"), (cfg.metrics, "log_steps")):
        if getattr(section, name) > MAX_COUNT:
            problems.append(f"{section.SECTION}.{name}={getattr(section, name):.3g} is absurd (more than "
                            f"{MAX_COUNT:.0e}): give a count that can finish")
    for section, name in ((t, "eval_steps"), (t, "max_skipped_steps"), (t, "lr_decay_steps"), (t, "warmup_min_lr"),
                          (cfg.checkpoint, "save_steps"),
                          (cfg.metrics, "peak_tflops")):
        if getattr(section, name) < 0:
            problems.append(f"{section.SECTION}.{name}={getattr(section, name)} must be 0 (off) or positive")
    if cfg.checkpoint.keep_max < 0:
        problems.append(f"checkpoint.keep_max={cfg.checkpoint.keep_max} must be 0 (keep all) or the number of "
                        f"newest checkpoints kept")
    if not 0 <= cfg.launch.max_restarts <= MAX_COUNT:
        problems.append(f"launch.max_restarts={cfg.launch.max_restarts} must be 0 (no restart) or the number of "
                        f"times a failed job restarts")
    if 0 < t.initial_loss_scale < t.min_loss_scale:
        problems.append(f"train.min_loss_scale={t.min_loss_scale:g} is above train.initial_loss_scale="
                        f"{t.initial_loss_scale:g}: lower it (default 1)")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(t, name) < 1:
            problems.append(f"train.{name}={getattr(t, name)} is outside [0, 1): use e.g. 0.9 and 0.98")
    if not 0 <= cfg.run.seed < 2**63:
        problems.append(f"run.seed={cfg.run.seed} must be in [0, 2**63)")
    problems += _output_problems(cfg)
    if t.lr_schedule in ("cosine", "warmup_cosine_lr") and 0 < t.lr < t.min_lr:
        default = " (the default)" if t.min_lr == TrainConfig.min_lr else ""
        problems.append(f"train.min_lr={t.min_lr:g}{default} is above train.lr={t.lr:g}: the LR would climb to "
                        f"min_lr instead of decaying; set min_lr at most lr (e.g. lr / 10)")
    if m.vocab_size > 0 and not 0 <= m.pad_token_id < m.vocab_size:
        problems.append(f"model.pad_token_id={m.pad_token_id} is not a token id of model.vocab_size={m.vocab_size}")
    if m.layernorm_eps <= 0:
        problems.append(f"model.layernorm_eps={m.layernorm_eps} must be positive (e.g. 1e-5)")
    choice(m, "kind", MODEL_KINDS)
    choice(m, "dtype", DTYPES)
    choice(m, "hidden_act", ACTIVATIONS)
    choice(p, "pipeline_schedule", PIPELINE_SCHEDULES)
    choice(t, "mixed_precision", MIXED_PRECISION)
    choice(t, "lr_schedule", LR_SCHEDULES)
    choice(t, "warmup_type", WARMUP_TYPES)
    choice(cfg.metrics, "log_format", LOG_FORMATS)
    if t.lr_schedule == "warmup_cosine_lr" and (t.lr_decay_steps or t.steps) <= max(2, t.warmup_steps):
        problems.append(f"train.lr_schedule='warmup_cosine_lr' decays over train.lr_decay_steps (0: train.steps) "
                        f"= {t.lr_decay_steps or t.steps} steps, not more than its warmup of max(2, warmup_steps="
                        f"{t.warmup_steps}) steps: raise lr_decay_steps or lower warmup_steps")
    problems += _offload_problems(p)
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(m, name)
        if not 0 <= value < 1:
            problems.append(f"model.{name}={value} is outside [0, 1): use a probability such as 0.1, or 0 for none")
    if p.zero_stage not in (0, 1, 2, 3):
        problems.append(f"parallel.zero_stage={p.zero_stage} is not one of 0, 1, 2, 3")
    problems += _recompute_problems(p, m.num_layers)
    problems += _data_problems(cfg.data, m)
    if problems:  # the rules below divide by these sizes
        return problems

    if m.kind == "resnet" and (p.model_parallel > 1 or p.pipeline_stage > 1):
        problems.append(f"model.kind='resnet' trains with data parallelism only, got parallel.model_parallel="
                        f"{p.model_parallel} and pipeline_stage={p.pipeline_stage}: set both to 1")
    if m.hidden_size % m.num_heads:
        problems.append(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}: "
                        f"use num_heads in {_divisors(m.hidden_size)}")
    mp = p.model_parallel
    for name in ("num_heads", "hidden_size", "ffn_hidden_size"):
        value = getattr(m, name)
        if value % mp:
            problems.append(f"model.{name}={value} is not divisible by parallel.model_parallel={mp}: "
                            f"use model_parallel in {_divisors(value)}")
    if not p.vocab_emb_dp and m.vocab_size % mp:
        problems.append(f"model.vocab_size={m.vocab_size} is not divisible by parallel.model_parallel={mp} "
                        f"with parallel.vocab_emb_dp=false: pad vocab_size to {math.ceil(m.vocab_size / mp) * mp} "
                        f"or set vocab_emb_dp=true")
    if p.sequence_parallel:
        for name, value in m.sequence_lengths().items():
            if value % mp:
                problems.append(f"model.{name}={value} is not divisible by parallel.model_parallel={mp} "
                                f"with parallel.sequence_parallel=true: use a multiple of {mp}")
    chunks = p.pipeline_stage * p.virtual_pipeline_stage
    if m.num_layers < chunks:
        problems.append(f"model has {m.num_layers} layers, fewer than parallel.pipeline_stage={p.pipeline_stage}"
                        + (f" x virtual_pipeline_stage={p.virtual_pipeline_stage}" if p.virtual_pipeline_stage > 1 else "")
                        + f": use pipeline_stage <= {m.num_layers // p.virtual_pipeline_stage} or add layers")
    problems += _pipeline_problems(p, m.num_layers)
    if m.kind == "transformer" and p.pipeline_stage > 1 and "zero_bubble" in p.pipeline_schedule:
        problems.append(f"parallel.pipeline_schedule={p.pipeline_schedule!r} cannot run the encoder-decoder: "
                        f"PyTorch's split weight-gradient pass fails on the encoder output carried across "
                        f"stages; use 1f1b or interleaved_1f1b (zero-bubble schedules run with model.kind='gpt')")
    split = p.data_parallel * p.micro_batch_num
    if t.global_batch_size % split:
        problems.append(f"train.global_batch_size={t.global_batch_size} is not divisible by parallel.data_parallel="
                        f"{p.data_parallel} x parallel.micro_batch_num={p.micro_batch_num} = {split}: "
                        f"use a multiple of {split} such as {max(split, t.global_batch_size // split * split)}")
    if world_size is not None and not p.data_parallel_given and (resolved or not p.auto):
        problems.append(f"parallel.model_parallel={p.model_parallel} x pipeline_stage={p.pipeline_stage} = "
                        f"{p.model_parallel * p.pipeline_stage} does not divide the world size {world_size}, so "
                        f"data_parallel (not given) cannot be derived: launch a multiple of "
                        f"{p.model_parallel * p.pipeline_stage} processes or change the parallel sizes")
    elif world_size is not None and p.world_size != world_size and (resolved or not p.auto):
        problems.append(f"parallel.data_parallel={p.data_parallel} x model_parallel={p.model_parallel} x "
                        f"pipeline_stage={p.pipeline_stage} = {p.world_size} does not equal the world size "
                        f"{world_size}: launch {p.world_size} processes or change the parallel sizes")
    if m.tie_embeddings and mp > 1 and p.vocab_emb_dp:
        problems.append(f"model.tie_embeddings=true with parallel.model_parallel={mp} needs the embedding split like "
                        f"the vocab-sharded head: set parallel.vocab_emb_dp=false or tie_embeddings=false")
    return problems


def _output_problems(cfg: Config) -> list[str]:
    """What names the files a run writes: plain names (``is_plain_name``) and directories taken as written."""
    problems = []
    if not is_plain_name(cfg.run.name):
        problems.append(f"run.name={cfg.run.name!r} is not a plain name (the run directory is runs/<name>): "
                        f"{NAME_RULE}")
    if cfg.checkpoint.prefix and not is_plain_name(cfg.checkpoint.prefix):
        problems.append(f"checkpoint.prefix={cfg.checkpoint.prefix!r} is not a plain name (checkpoints are "
                        f"<prefix>-1_<step> in checkpoint.dir): {NAME_RULE}; or \"\" for step_<step>")
    for key, path in (("run.dir", cfg.run.dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if path.startswith("~"):
            problems.append(f"{key}={path!r}: '~' is not expanded here (a directory named '~' would be made): "
                            f"give the full path")
    return problems


def _data_problems(d: DataConfig, m: ModelConfig) -> list[str]:
    """What the data of ``d`` cannot give the model ``m``."""
    if d.kind not in DataConfig.KINDS or m.kind not in MODEL_KINDS:
        return []  # said by DataConfig.problems and validate
    if d.kind not in DATA_KINDS[m.kind]:
        return [f"data.kind={d.kind!r} has no batches for model.kind={m.kind!r}: use data.kind "
                f"{' or '.join(map(repr, DATA_KINDS[m.kind]))}"]
    if d.kind != "synthetic":
        return []
    problems = []
    tasks = SYNTHETIC_TASKS[m.kind]
    if d.task and d.task not in tasks:
        problems.append(f"data.task={d.task!r} is not a synthetic task of model.kind={m.kind!r}: use "
                        f"{' or '.join(map(repr, tasks))} (or leave it out: {tasks[0]!r})")
    if 0 < m.vocab_size <= SPECIAL_TOKENS:
        problems.append(f"model.vocab_size={m.vocab_size} leaves synthetic data no token: ids 0-{SPECIAL_TOKENS - 1} "
                        f"are pad, bos, eos and unk; use vocab_size >= {SPECIAL_TOKENS + 1}")
    if m.kind == "transformer" and m.tgt_seq_length == 1:
        problems.append("model.tgt_seq_length=1 leaves a synthetic target no token (it ends with eos): use "
                        "tgt_seq_length >= 2")
    return problems


def _recompute_problems(p: ParallelConfig, num_layers: int) -> list[str]:
    spec = p.recompute
    if callable(spec) or isinstance(spec, (bool, TransformerRecomputeConfig)):
        return []
    if isinstance(spec, str):
        return [] if spec in RECOMPUTE_MODES else [
            f"parallel.recompute={spec!r} is not one of {', '.join(RECOMPUTE_MODES)} (or true/false, a list, a function)"]
    if isinstance(spec, list):
        bad = [s for s in spec if s not in RECOMPUTE_MODES and not isinstance(s, bool)]
        if len(spec) != num_layers or bad:
            return [f"parallel.recompute list has {len(spec)} entries {spec}, needs one of "
                    f"{', '.join(RECOMPUTE_MODES)} for each of the {num_layers} layers"]
        return []
    return [f"parallel.recompute={spec!r} must be a mode name, a bool, a list or a function"]


def _offload_problems(p: ParallelConfig) -> list[str]:
    """ZeRO-Offload's rules (DeepSpeed's): optimizer offload with stages 1-3, parameter offload with stage 3,
    host memory only. That the device must be an accelerator is checked by ``paratrain.preflight``."""
    problems = []
    for name in ("offload_optimizer", "offload_param"):
        value = getattr(p, name)
        if value not in OFFLOAD_DEVICES:
            problems.append(f"parallel.{name}={value!r} is not one of {', '.join(OFFLOAD_DEVICES)}")
        elif value == "nvme":
            problems.append(f"parallel.{name}='nvme' is refused: paratrain has no NVMe offload (DeepSpeed's "
                            f"ZeRO-Infinity); FSDP2 offloads to host memory only: use 'cpu'")
    if p.offload_optimizer == "cpu" and p.effective_zero_stage == 0:
        problems.append("parallel.offload_optimizer='cpu' needs the optimizer state sharded: set "
                        "parallel.zero_stage to 1, 2 or 3")
    if p.offload_param == "cpu" and p.effective_zero_stage != 3:
        problems.append(f"parallel.offload_param='cpu' needs parameters sharded and freed after use: set "
                        f"parallel.zero_stage=3 (it is {p.effective_zero_stage})")
    return problems


def _pipeline_problems(p: ParallelConfig, num_layers: int) -> list[str]:
    problems = []
    chunks = p.pipeline_stage * p.virtual_pipeline_stage
    single = p.pipeline_schedule in ("gpipe", "1f1b")
    if p.pipeline_stage > 1 and single and p.virtual_pipeline_stage != 1:
        problems.append(f"parallel.pipeline_schedule={p.pipeline_schedule!r} runs one stage per rank, but "
                        f"virtual_pipeline_stage={p.virtual_pipeline_stage}: use interleaved_1f1b or set it to 1")
    if p.pipeline_schedule == "zbv_zero_bubble" and p.virtual_pipeline_stage != 2:
        problems.append(f"parallel.pipeline_schedule='zbv_zero_bubble' needs virtual_pipeline_stage=2, "
                        f"got {p.virtual_pipeline_stage}")
    if p.pipeline_stage > 1 and p.micro_batch_num < p.pipeline_stage:
        problems.append(f"parallel.micro_batch_num={p.micro_batch_num} is fewer than pipeline_stage="
                        f"{p.pipeline_stage}: stages would idle; use micro_batch_num >= {p.pipeline_stage}")
    if not single and p.pipeline_stage > 1 and p.micro_batch_num % p.pipeline_stage:
        problems.append(f"parallel.micro_batch_num={p.micro_batch_num} must be a multiple of pipeline_stage="
                        f"{p.pipeline_stage} for {p.pipeline_schedule}")
    stages = p.layer_stages
    if isinstance(stages, list) and stages:
        integers = all(isinstance(s, int) and not isinstance(s, bool) for s in stages)
        if not integers or len(stages) != num_layers or stages != sorted(stages) or set(stages) != set(range(chunks)):
            problems.append(f"parallel.layer_stages={stages} must give each of the {num_layers} layers a stage, "
                            f"in order, using every stage 0..{chunks - 1} (pipeline_stage x virtual_pipeline_stage)")
    return problems


def check(cfg: Config, world_size: int | None = None, resolved: bool = False) -> Config:
    """Raise ConfigError listing every violation (see ``validate``), or return ``cfg``, its ``data_parallel``
    derived from ``world_size`` when not given."""
    if world_size is not None and (resolved or not cfg.parallel.auto):
        cfg.parallel.derive(world_size)
    problems = validate(cfg, world_size, resolved)
    if problems:
        raise ConfigError(problems)
    return cfg
