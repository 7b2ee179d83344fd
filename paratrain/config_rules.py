"""The rules a whole :class:`paratrain.config.Config` must meet: ``validate`` lists every rule it breaks, each with the
numbers and a fix, and ``check`` raises them as one ConfigError.

One validator for the settings, whichever way they came: a TOML file or the command line (``paratrain train`` and
``paratrain launch`` check before any process starts, :mod:`paratrain.preflight`), a DeepSpeed JSON config, or the
layouts the planner weighs (:mod:`paratrain.plan.search`). It is its own module, not part of the TOML face
(:mod:`paratrain.config_file`), because the planner, below the faces, uses it too; it reads only the settings
vocabulary (:mod:`paratrain.config`). The MindSpore face calls the same rules on its own objects: ``value_problem``
(the type of every setting), ``parallel_problems`` (``TransformerOpParallelConfig``, ``parallel_config_for``),
``moe_problems`` and ``expert_split_problems`` (``MoEConfig`` and the blocks holding one).
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

from paratrain.config import (ACTIVATIONS, CP_METHODS, DTYPES, LOG_FORMATS, LR_SCHEDULES, MIXED_PRECISION,
                              MODEL_KINDS, NAME_RULE, OFFLOAD_DEVICES, PIPELINE_SCHEDULES, RECOMPUTE_MODES,
                              SPECIAL_TOKENS, WARMUP_TYPES, Config, ConfigError, DataConfig,
                              MoEConfig, ModelConfig, ParallelConfig, Section, TrainConfig, TransformerRecomputeConfig,
                              is_plain_name)

MAX_COUNT = 10**12  # steps, batch sizes: more would not finish (10^12 steps of 1 ms are 31 years)


def validate(cfg: Config, world_size: int | None = None, resolved: bool = False) -> list[str]:
    """Every rule ``cfg`` breaks, each naming the fields, the numbers and a fix.

    With ``parallel.auto`` the parallel sizes need not match ``world_size`` yet, unless the layout
    is ``resolved`` (``paratrain.plan.resolve_auto``), as the trainer needs it.
    """
    if world_size is not None and (resolved or not cfg.parallel.auto):
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel).derive(world_size))
    m, p, t = cfg.model, cfg.parallel, cfg.train
    problems: list[str] = [q for name in cfg.sections() if name != "parallel"  # parallel_problems: below
                           for q in type_problems(getattr(cfg, name), f"{name}.")]
    if m.kind not in MODEL_KINDS:
        problems.append(f"model.kind={m.kind!r} is not one of {', '.join(MODEL_KINDS)}")
    if problems:  # the rules below compare these numbers and depend on the kind
        return problems

    def positive(section: Section, names: list[str]):
        for name in names:
            value = getattr(section, name)
            if value <= 0:
                problems.append(f"{section.SECTION}.{name}={value} must be positive")

    positive(m, ["vocab_size", "hidden_size", "num_heads", "ffn_hidden_size", "decoder_layers",
                 *m.sequence_lengths()])
    if m.spec.encoder_decoder:
        positive(m, ["encoder_layers"])
    parallel = parallel_problems(p, num_layers=m.num_layers)
    problems += parallel
    if (not parallel and m.spec.stacks and p.gradient_aggregation_group > m.num_layers > 0
            and not p.GROUPS_MAY_EXCEED_LAYERS):
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
    choices = ((m, "dtype", DTYPES), (m, "hidden_act", ACTIVATIONS), (t, "mixed_precision", MIXED_PRECISION),
               (t, "lr_schedule", LR_SCHEDULES), (t, "warmup_type", WARMUP_TYPES),
               (cfg.metrics, "log_format", LOG_FORMATS))
    for section, name, allowed in choices:
        value = getattr(section, name)
        if value not in allowed:
            problems.append(f"{section.SECTION}.{name}={value!r} is not one of {', '.join(map(str, allowed))}")
    if t.lr_schedule == "warmup_cosine_lr" and (t.lr_decay_steps or t.steps) <= max(2, t.warmup_steps):
        problems.append(f"train.lr_schedule='warmup_cosine_lr' decays over train.lr_decay_steps (0: train.steps) "
                        f"= {t.lr_decay_steps or t.steps} steps, not more than its warmup of max(2, warmup_steps="
                        f"{t.warmup_steps}) steps: raise lr_decay_steps or lower warmup_steps")
    problems += fp8_tensor_parallel_problems(t.mixed_precision, p.model_parallel, "train.mixed_precision='fp8'",
                                             "parallel.model_parallel", "mixed_precision='bf16'")
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(m, name)
        if not 0 <= value < 1:
            problems.append(f"model.{name}={value} is outside [0, 1): use a probability such as 0.1, or 0 for none")
    problems += _data_problems(cfg.data, m) + _eval_problems(cfg.data, m, t.eval_steps) + _lora_problems(cfg)
    if cfg.data.document_mask and m.kind == "gpt" and p.sequence_parallel:
        problems.append("data.document_mask=true with model.kind='gpt' and parallel.sequence_parallel=true: the "
                        "learned positions of packed documents are not split along the sequence yet: set "
                        "sequence_parallel=false or use model.kind='llama'")
    if problems:  # the rules below divide by these sizes
        return problems

    if not m.spec.stacks and (p.model_parallel > 1 or p.pipeline_stage > 1 or p.auto):
        problems.append(f"model.kind={m.kind!r} trains with data parallelism only (the planner knows Transformer "
                        f"layers), got parallel.model_parallel={p.model_parallel}, pipeline_stage={p.pipeline_stage} "
                        f"and auto={str(p.auto).lower()}: set both to 1, auto to false")
    if not m.head_dim:
        problems += head_problems(m.hidden_size, m.num_heads)
    mp = p.model_parallel
    problems += _llama_problems(m) + divisible_problems(model_parallel_sizes(m), mp)
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
        virtual = f" x virtual_pipeline_stage={p.virtual_pipeline_stage}" if p.virtual_pipeline_stage > 1 else ""
        problems.append(f"model has {m.num_layers} layers, fewer than parallel.pipeline_stage={p.pipeline_stage}"
                        f"{virtual}: use pipeline_stage <= {m.num_layers // p.virtual_pipeline_stage} or add layers")
    problems += _pipeline_problems(p, m.num_layers)
    if m.spec.encoder_decoder and p.pipeline_stage > 1 and "zero_bubble" in p.pipeline_schedule:
        problems.append(f"parallel.pipeline_schedule={p.pipeline_schedule!r} cannot run the encoder-decoder: "
                        f"PyTorch's split weight-gradient pass fails on the encoder output carried across "
                        f"stages; use 1f1b or interleaved_1f1b (zero-bubble schedules run with model.kind='gpt')")
    split = p.data_parallel * p.micro_batch_num
    if t.global_batch_size % split:
        problems.append(f"train.global_batch_size={t.global_batch_size} is not divisible by parallel.data_parallel="
                        f"{p.data_parallel} x parallel.micro_batch_num={p.micro_batch_num} = {split}: "
                        f"use a multiple of {split} such as {max(split, t.global_batch_size // split * split)}")
    if world_size is not None and (resolved or not p.auto):
        problems += world_size_problems(p, world_size)
    if m.tie_embeddings and mp > 1 and p.vocab_emb_dp:
        problems.append(f"model.tie_embeddings=true with parallel.model_parallel={mp} needs the embedding split like "
                        f"the vocab-sharded head: set parallel.vocab_emb_dp=false or tie_embeddings=false")
    problems += _moe_problems(cfg) + _context_parallel_problems(cfg)
    return problems


def _context_parallel_problems(cfg: Config) -> list[str]:
    """``parallel.context_parallel`` N > 1: each sequence of a decoder split over N ranks, each keeping a head and a
    tail chunk of 2N (``paratrain.parallel.context``), with Ulysses attention (this rank's heads split over N) or
    ring attention (``ParallelConfig.attention_split``)."""
    m, p = cfg.model, cfg.parallel
    cp, mp = p.context_parallel, p.model_parallel
    if cp == 1:
        return []
    where = f"parallel.context_parallel={cp}"
    if m.spec.encoder_decoder:
        return [f"{where} with model.kind={m.kind!r}: the encoder-decoder is not split along the sequence (its "
                f"cross-attention lets every target position attend the whole source, and its decoding runs one "
                f"new token at a time); use model.kind='gpt' or 'llama', or context_parallel=1"]
    if not m.spec.stacks:
        return [f"{where} with model.kind={m.kind!r}: only the decoders 'gpt' and 'llama' have sequences to split; "
                f"set context_parallel=1"]
    problems = []
    fits = [n for n in divisors(m.seq_length // 2) if n > 1] if m.seq_length % 2 == 0 else []
    if m.seq_length % (2 * cp):
        problems.append(f"model.seq_length={m.seq_length} is not divisible by 2 x {where} = {2 * cp} (each rank keeps "
                        f"a head and a tail chunk of the sequence, which balances the causal attention's work): use "
                        f"seq_length={-(-m.seq_length // (2 * cp)) * 2 * cp}"
                        + (f", or context_parallel in {fits}" if fits else ""))
    heads, kv_heads = m.num_heads // mp, m.kv_heads // mp
    method = p.attention_split(m.num_heads, m.kv_heads)
    if method == "ulysses" and (heads % cp or kv_heads % cp):
        fits = [n for n in divisors(math.gcd(heads, kv_heads)) if n > 1]
        problems.append(f"parallel.cp_method='ulysses' splits this rank's attention heads over {where}: "
                        f"num_heads={m.num_heads} and {m.kv_heads} key/value heads over model_parallel={mp} leave "
                        f"{heads} and {kv_heads} a rank, not both divisible by {cp}: use context_parallel in "
                        f"{fits or 'none (no common divisor above 1)'}, or cp_method='ring'")
    if method == "ring" and m.attention_dropout > 0:
        fits = [n for n in divisors(math.gcd(heads, kv_heads)) if n > 1]
        chosen = ("parallel.cp_method='ring'" if p.cp_method == "ring" else
                  f"parallel.cp_method='auto' picks ring attention here ({heads} query and {kv_heads} key/value heads "
                  f"a rank are not both divisible by {where})")
        ulysses = f" or cp_method='ulysses' with context_parallel in {fits}" if fits else ""
        problems.append(f"{chosen}: ring attention has no attention dropout, but model.attention_dropout="
                        f"{m.attention_dropout}: set attention_dropout=0{ulysses}")
    if p.sequence_parallel and (m.seq_length // cp) % mp:
        problems.append(f"model.seq_length={m.seq_length} over {where} leaves {m.seq_length // cp} tokens a rank, "
                        f"not divisible by parallel.model_parallel={mp} with sequence_parallel=true: use a "
                        f"seq_length multiple of {math.lcm(2 * cp, cp * mp)}")
    if p.sequence_parallel and m.kind == "gpt":
        problems.append(f"{where} with parallel.sequence_parallel=true and model.kind='gpt': the learned positions "
                        f"of a split sequence are not split along it by sequence parallelism yet: set "
                        f"sequence_parallel=false or use model.kind='llama'")
    if m.moe_config.expert_num > 1:
        problems.append(f"{where} with model.moe (expert_num={m.moe_config.expert_num}) is not supported yet: the "
                        f"experts' load-balancing statistics are not summed over the sequence's ranks; remove "
                        f"model.moe or set context_parallel=1")
    return problems


def world_size_problems(p: ParallelConfig, world_size: int, where: str = "parallel.") -> list[str]:
    """The rule ``data_parallel x context_parallel x model_parallel x pipeline_stage = world_size``
    (``data_parallel`` not given: derived, ``ParallelConfig.derive``), for sizes ``parallel_problems`` accepts."""
    split = p.context_parallel * p.model_parallel * p.pipeline_stage
    context = f"context_parallel={p.context_parallel} x " if p.context_parallel > 1 else ""
    if not p.data_parallel_given:
        return [f"{where}{context}model_parallel={p.model_parallel} x pipeline_stage={p.pipeline_stage} = {split} "
                f"does not divide the world size {world_size}, so data_parallel (not given) cannot be derived: "
                f"launch a multiple of {split} processes or change the parallel sizes"]
    if p.world_size != world_size:
        return [f"{where}data_parallel={p.data_parallel} x {context}model_parallel={p.model_parallel} x "
                f"pipeline_stage={p.pipeline_stage} = {p.world_size} does not equal the world size {world_size}: "
                f"launch {p.world_size} process{'es' if p.world_size > 1 else ''} or change the parallel sizes"]
    return []


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
    if d.kind not in DataConfig.KINDS:
        return []  # said by DataConfig.problems
    if d.document_mask and m.spec.encoder_decoder:
        return [f"data.document_mask=true needs a decoder-only model, not model.kind={m.kind!r} (an encoder-decoder "
                f"takes source/target pairs): use model.kind='llama' or 'gpt', or leave document_mask out"]
    if d.kind not in m.spec.data_kinds:
        return [f"data.kind={d.kind!r} has no batches for model.kind={m.kind!r}: use data.kind "
                f"{' or '.join(map(repr, m.spec.data_kinds))}"]
    if d.kind == "chat" and not m.from_hf and not (d.tokenizer and d.chat_template):
        return ["data.kind='chat' needs a tokenizer and its chat template: set model.from_hf to a Hugging Face "
                "directory (its tokenizer.json, and the chat template of its tokenizer_config.json), or both "
                f"data.tokenizer and data.chat_template (a jinja file; given: data.tokenizer={d.tokenizer!r}, "
                f"data.chat_template={d.chat_template!r})"]
    if d.kind != "synthetic":
        return []
    problems = []
    tasks = m.spec.synthetic_tasks
    if d.task and d.task not in tasks:
        problems.append(f"data.task={d.task!r} is not a synthetic task of model.kind={m.kind!r}: use "
                        f"{' or '.join(map(repr, tasks))} (or leave it out: {tasks[0]!r})")
    if 0 < m.vocab_size <= SPECIAL_TOKENS:
        problems.append(f"model.vocab_size={m.vocab_size} leaves synthetic data no token: ids 0-{SPECIAL_TOKENS - 1} "
                        f"are pad, bos, eos and unk; use vocab_size >= {SPECIAL_TOKENS + 1}")
    if m.spec.encoder_decoder and m.tgt_seq_length == 1:
        problems.append("model.tgt_seq_length=1 leaves a synthetic target no token (it ends with eos): use "
                        "tgt_seq_length >= 2")
    return problems


def _eval_problems(d: DataConfig, m: ModelConfig, eval_steps: int) -> list[str]:
    """What ``train.eval_steps`` and ``data.eval_path`` cannot do for the model ``m`` on the data of ``d`` (the
    encoder-decoder's BLEU warns at start instead where it cannot apply)."""
    if eval_steps <= 0 or m.spec.encoder_decoder or d.kind not in m.spec.data_kinds:
        return []
    if not m.spec.stacks:
        return [f"train.eval_steps={eval_steps}: model.kind={m.kind!r} has no held-out evaluation (a decoder's "
                f"loss: gpt, llama; BLEU: transformer): set eval_steps=0"]
    if d.kind == "synthetic" and d.eval_path:
        return [f"data.eval_path={d.eval_path!r} with data.kind='synthetic': synthetic data holds out windows it "
                f"never trains on by itself; leave eval_path out"]
    if d.kind != "synthetic" and not d.eval_path:
        what = {"documents": "a folder or file of documents", "chat": "a folder or file of conversations"}.get(
            d.kind, "a text file")
        return [f"train.eval_steps={eval_steps} with data.kind={d.kind!r} needs held-out data: set data.eval_path "
                f"to {what} like data.path (read with the same tokenizer), or set eval_steps=0"]
    return []


def _recompute_problems(spec: Any, num_layers: int | None, where: str) -> list[str]:
    """What is wrong with a ``recompute`` setting (a list's length only when ``num_layers`` is known)."""
    if callable(spec) or isinstance(spec, (bool, TransformerRecomputeConfig)):
        return []
    if isinstance(spec, str):
        return [] if spec in RECOMPUTE_MODES else [f"{where}recompute={spec!r} is not one of "
                                                   f"{', '.join(RECOMPUTE_MODES)} (or true/false, a list, a function)"]
    if isinstance(spec, list):
        bad = [s for s in spec if s not in RECOMPUTE_MODES and not isinstance(s, bool)]
        if bad or num_layers is not None and len(spec) != num_layers:
            layers = "each layer" if num_layers is None else f"each of the {num_layers} layers"
            return [f"{where}recompute list has {len(spec)} entries {spec}, needs one of "
                    f"{', '.join(RECOMPUTE_MODES)} for {layers}"]
        return []
    return [f"{where}recompute={spec!r} must be a mode name, a bool, a list or a function"]


def _offload_problems(p: ParallelConfig, where: str) -> list[str]:
    """ZeRO-Offload's rules (DeepSpeed's): optimizer offload with stages 1-3, parameter offload with stage 3,
    host memory only. That the device must be an accelerator is checked by ``paratrain.preflight``."""
    problems = []
    for name in ("offload_optimizer", "offload_param"):
        if getattr(p, name) == "nvme":
            problems.append(f"{where}{name}='nvme' is refused: paratrain has no NVMe offload (DeepSpeed's "
                            f"ZeRO-Infinity); FSDP2 offloads to host memory only: use 'cpu'")
    if p.offload_optimizer == "cpu" and p.effective_zero_stage == 0:
        problems.append(f"{where}offload_optimizer='cpu' needs the optimizer state sharded: set "
                        f"{where}zero_stage to 1, 2 or 3")
    if p.offload_param == "cpu" and p.effective_zero_stage != 3:
        problems.append(f"{where}offload_param='cpu' needs parameters sharded and freed after use: set "
                        f"{where}zero_stage=3 (it is {p.effective_zero_stage})")
    return problems


PARALLEL_SIZES = ("data_parallel", "model_parallel", "pipeline_stage", "micro_batch_num", "virtual_pipeline_stage",
                  "expert_parallel", "context_parallel")
PARALLEL_CHOICES = {"zero_stage": (0, 1, 2, 3), "pipeline_schedule": PIPELINE_SCHEDULES, "cp_method": CP_METHODS,
                    "offload_optimizer": OFFLOAD_DEVICES, "offload_param": OFFLOAD_DEVICES}


def parallel_field_problem(name: str, value: Any, where: str = "parallel.", num_layers: int | None = None) -> str | None:
    """What is wrong with ``value`` for the parallel setting ``name`` on its own (its type, range or choices), named
    ``<where><name>``; None when nothing is."""
    if name == "recompute":
        return next(iter(_recompute_problems(value, num_layers, where)), None)
    if name == "layer_stages":
        return None if isinstance(value, list) or callable(value) else (
            f"{where}layer_stages={value!r} must be a list with the stage of each layer, or a function")
    problem = value_problem(where + name, value, ParallelConfig.__dataclass_fields__[name].default)
    if problem:
        return problem
    if name in PARALLEL_SIZES and value < 1:
        return f"{where}{name}={value} must be positive (1: not split)"
    if name in PARALLEL_CHOICES and value not in PARALLEL_CHOICES[name]:
        return f"{where}{name}={value!r} is not one of {', '.join(map(str, PARALLEL_CHOICES[name]))}"
    if name == "gradient_aggregation_group" and value < 0:
        return f"{where}{name}={value} must be 0 (one group per layer) or a positive number of groups of layers"
    return None


def parallel_problems(p: ParallelConfig, where: str = "parallel.", num_layers: int | None = None) -> list[str]:
    """Every rule the parallel settings ``p`` break on their own, without the model (``validate`` adds the model's
    rules; ``where`` names the settings: ``parallel.`` in a TOML file, ``TransformerOpParallelConfig.`` in a
    script); the rules comparing two settings only once each setting is right."""
    problems = [q for f in dataclasses.fields(p)
                if (q := parallel_field_problem(f.name, getattr(p, f.name), where, num_layers))]
    return problems or _offload_problems(p, where)


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
    ConfigError.raise_any(validate(cfg, world_size, resolved))
    return cfg


def value_problem(name: str, value: Any, default: Any) -> str | None:
    """What is wrong with ``value`` for the setting ``name`` whose default is ``default``, whatever the setting: it
    must be of the default's type (True or False, not a string, for a bool; an integer, not a bool or a string, for
    an int; a finite number for a float; a string or path without NUL for a string); None when it is."""
    if isinstance(default, bool):
        wrong = None if isinstance(value, bool) else "must be True or False"
    elif isinstance(default, (int, float)) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        wrong = "must be an integer" if isinstance(default, int) else "must be a number"
    elif isinstance(default, float) and not math.isfinite(value):
        wrong = "is not a finite number"
    elif isinstance(default, int) and not isinstance(value, int):
        wrong = "must be an integer" + (f": use {int(value)}" if math.isfinite(value) and value == int(value) else "")
    elif isinstance(default, str) and not isinstance(value, (str, os.PathLike)):
        wrong = "must be a string"
    elif isinstance(default, str) and "\0" in str(value):
        wrong = "holds a NUL character, which no path or name can: remove it"
    else:
        wrong = None
    if wrong is None:
        return None
    return f"{name}={value!r} {wrong}" if not isinstance(value, float) else f"{name}={value} {wrong}"


def type_problems(settings: Any, where: str) -> list[str]:
    """A problem for every field of the dataclass ``settings`` of the wrong type (``value_problem``), each named
    ``<where><field>``."""
    return [q for f in dataclasses.fields(settings)
            if (q := value_problem(where + f.name, getattr(settings, f.name), f.default))]


MOE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MoEConfig)}


def moe_problems(values: Mapping[str, Any], where: str = "model.moe.") -> list[str]:
    """Every rule the mixture-of-experts settings ``values`` (``MoEConfig``'s fields; the others at their
    defaults, any other key left to its owner) break on their own, each named ``<where><field>``."""
    moe = {**MOE_DEFAULTS, **{name: value for name, value in values.items() if name in MOE_DEFAULTS}}
    problems = [q for name, value in moe.items() if name != "expert_group_size"
                and (q := value_problem(where + name, value, MOE_DEFAULTS[name]))]
    group = moe["expert_group_size"]
    if group is not None and (q := value_problem(where + "expert_group_size", group, 1)):
        problems.append(q + " (or None: the tokens of one rank's micro-batch)")
    if problems:
        return problems
    if moe["expert_num"] < 1:
        problems.append(f"{where}expert_num={moe['expert_num']} must be positive (1: a plain feed-forward)")
    elif not 1 <= moe["num_experts_chosen"] <= moe["expert_num"]:
        problems.append(f"{where}num_experts_chosen={moe['num_experts_chosen']} must be in 1..expert_num="
                        f"{moe['expert_num']}")
    if moe["capacity_factor"] <= 0:
        problems.append(f"{where}capacity_factor={moe['capacity_factor']} gives each expert a capacity of 0 tokens: "
                        f"use a positive factor such as 1.25")
    if moe["aux_loss_factor"] < 0:
        problems.append(f"{where}aux_loss_factor={moe['aux_loss_factor']} must not be negative (0: no "
                        f"load-balancing loss)")
    if group is not None and group < 1:
        problems.append(f"{where}expert_group_size={group} must be positive (or None: the tokens of one rank's "
                        f"micro-batch)")
    if moe["every"] < 1:
        problems.append(f"{where}every={moe['every']} must be positive (1: every layer, 2: every other)")
    return problems


def expert_split_problems(expert_num: int | None, ep: int, dp: int | None, where_moe: str = "model.moe.",
                          where_parallel: str = "parallel.") -> list[str]:
    """The rules splitting ``expert_num`` experts over ``ep`` of the ``dp`` data-parallel ranks (either None: not
    known here)."""
    problems = []
    if dp is not None and dp % ep:
        problems.append(f"{where_parallel}expert_parallel={ep} does not divide {where_parallel}data_parallel={dp}: "
                        f"the experts are split over data-parallel ranks; use expert_parallel in {divisors(dp)}")
    if expert_num is None:
        return problems
    if expert_num % ep:
        fit = [d for d in divisors(expert_num) if dp is None or dp % d == 0]
        problems.append(f"{where_moe}expert_num={expert_num} is not divisible by {where_parallel}expert_parallel={ep}: "
                        f"use expert_parallel in {fit}")
    if ep > 1 and expert_num == 1:
        problems.append(f"{where_parallel}expert_parallel={ep} needs experts to split: set {where_moe}expert_num "
                        f"to a multiple of {ep}, or expert_parallel=1")
    return problems


def _moe_problems(cfg: Config) -> list[str]:
    """The mixture-of-experts settings (``model.moe``) and ``parallel.expert_parallel``, which splits the
    experts over ranks among the data-parallel ones."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    ep, dp = p.expert_parallel, p.data_parallel
    known = [f.name for f in dataclasses.fields(MoEConfig)]
    if not isinstance(m.moe, dict) or set(m.moe) - set(known):
        return [f"model.moe={m.moe!r} must be a table of {', '.join(known)}, e.g. "
                f"moe = {{expert_num = 8, num_experts_chosen = 2}}"]
    problems = moe_problems(m.moe)
    if problems:
        return problems
    moe = m.moe_config
    problems = expert_split_problems(moe.expert_num, ep, dp)
    if moe.expert_num > 1 and moe.every > m.num_layers:
        problems.append(f"model.moe.every={moe.every} must be in 1..{m.num_layers} (1: every layer, 2: every other)")
    if moe.expert_num == 1:
        return problems
    length = min(m.lengths)
    tokens = t.global_batch_size // max(dp * p.micro_batch_num, 1) * length  # one rank's micro-batch
    group = moe.expert_group_size
    if group is not None and tokens % group:
        problems.append(f"model.moe.expert_group_size={group} does not divide the {tokens} tokens of a rank's "
                        f"micro-batch: use a divisor such as {math.gcd(tokens, group)}")
    if p.sequence_parallel:
        problems.append("model.moe with parallel.sequence_parallel=true is not supported yet (the experts take "
                        "whole sequences): set sequence_parallel=false")
    return problems


def _lora_problems(cfg: Config) -> list[str]:
    """``[lora]``'s keys, and the model they adapt: the llama kind's Linears."""
    lora = cfg.lora
    if not lora.enabled:
        return lora.problems()
    problems = lora.problems()
    if cfg.model.kind != "llama":
        problems.append(f"lora.rank={lora.rank} adds adapters to the llama kind's Linears, not to model.kind="
                        f"{cfg.model.kind!r}: set model.kind='llama' (or model.from_hf) or remove [lora]")
    if cfg.train.mixed_precision == "fp8":
        problems.append(f"lora.rank={lora.rank} with train.mixed_precision='fp8': adapters around fp8 Linears are "
                        f"not supported yet; use mixed_precision='bf16'")
    return problems


def _llama_problems(m: ModelConfig) -> list[str]:
    """The llama kind's own keys: grouped heads and rotary settings; the other kinds must leave those keys alone."""
    keys = {"num_kv_heads": 0, "head_dim": 0, "qk_norm": False, "qkv_bias": False, "rope_scaling": {}, "from_hf": ""}
    if m.kind != "llama":
        return [f"model.{key}={getattr(m, key)!r} is a key of model.kind='llama', not of {m.kind!r}: remove it"
                for key, default in keys.items() if getattr(m, key) != default]
    problems = []
    for name in ("num_kv_heads", "head_dim"):
        if getattr(m, name) < 0:
            problems.append(f"model.{name}={getattr(m, name)} is negative: use a positive size, or 0 for the default")
    for name in ("rms_norm_eps", "rope_theta"):
        if getattr(m, name) <= 0:
            problems.append(f"model.{name}={getattr(m, name)} must be positive (e.g. 1e-6 and 10000.0)")
    if problems:
        return problems
    if m.num_heads % m.kv_heads:
        problems.append(f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.kv_heads}: "
                        f"use num_kv_heads in {divisors(m.num_heads)}")
    scaling = dict(m.rope_scaling)
    kind = scaling.pop("rope_type", scaling.pop("type", None))
    needed = {"linear": {"factor"}, "llama3": {"factor", "low_freq_factor", "high_freq_factor",
                                               "original_max_position_embeddings"}, None: set()}
    if kind not in needed or (kind is None and scaling):
        problems.append(f"model.rope_scaling={m.rope_scaling!r} has rope_type {kind!r}: use 'linear' or 'llama3' "
                        f"(or an empty rope_scaling for none)")
    elif needed[kind] - set(scaling):
        missing = ", ".join(sorted(needed[kind] - set(scaling)))
        problems.append(f"model.rope_scaling of rope_type {kind!r} lacks {missing}: give "
                        f"{', '.join(sorted(needed[kind]))}")
    if m.moe_config.expert_num > 1:
        problems.append(f"model.moe.expert_num={m.moe_config.expert_num} with model.kind='llama': the llama kind has "
                        f"no mixture of experts yet; remove model.moe")
    return problems


def head_problems(hidden_size: int, num_heads: int, where: str = "model.") -> list[str]:
    """Heads of hidden_size / num_heads each: ``num_heads`` must divide ``hidden_size``."""
    if hidden_size % num_heads == 0:
        return []
    return [f"{where}hidden_size={hidden_size} is not divisible by {where}num_heads={num_heads}: use num_heads in "
            f"{divisors(hidden_size)}"]


def model_parallel_sizes(m: ModelConfig) -> dict[str, int]:
    """The sizes of ``m`` that tensor parallelism splits, each rank taking whole heads (and whole key/value heads
    of the llama kind), by their ``model.`` key."""
    sizes = {name: getattr(m, name) for name in ("num_heads", "hidden_size", "ffn_hidden_size")}
    return sizes | ({"num_kv_heads": m.kv_heads} if m.kind == "llama" else {})


def divisible_problems(sizes: Mapping[str, int], model_parallel: int, where: str = "model.",
                       where_parallel: str = "parallel.") -> list[str]:
    """A problem for each of ``sizes`` (name -> size) that ``model_parallel`` tensor-parallel ranks cannot split
    evenly."""
    return [f"{where}{name}={value} is not divisible by {where_parallel}model_parallel={model_parallel}: use "
            f"model_parallel in {divisors(value)}" for name, value in sizes.items() if value % model_parallel]


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, found in O(sqrt n) (the plan search asks for a 128k vocabulary's
    for every layout it considers)."""
    small = [d for d in range(1, math.isqrt(max(n, 0)) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def fp8_tensor_parallel_problems(precision: str, model_parallel: int, fp8: str, model_parallel_key: str,
                                 bf16: str) -> list[str]:
    """fp8 beside tensor parallelism, refused on both faces (each names its own settings: ``fp8``, the key of
    ``model_parallel`` and the ``bf16`` to use instead): torchao's fp8 Linears are not split by tensor parallel."""
    if precision != "fp8" or model_parallel == 1:
        return []
    return [f"{fp8} with {model_parallel_key}={model_parallel}: fp8 Linears are not split by tensor parallel: use "
            f"model_parallel=1 (data parallel, ZeRO and pipeline stages take fp8), or {bf16}"]
