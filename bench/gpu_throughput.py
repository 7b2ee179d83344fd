"""One-GPU training throughput of every face of paratrain against plain PyTorch loops, in one run.

Sides (each trains the same sizes on the same synthetic batches, one after the other in this process, each
freeing its memory before the next):

- ``scratch``: the fastest GPT-2 loop written in plain PyTorch, no paratrain module (fused qkv Linear, SDPA
  ``is_causal``, bf16 autocast, fused AdamW, clipping at 1.0, the cross-entropy of the whole fp32 logits);
- ``torch``: a plain loop over paratrain's ``GPTModel`` with paratrain's optimizer and schedule;
- ``paratrain``: ``paratrain train`` (``Trainer(cfg).train()``) of that GPT, bf16; ``paratrain_fp8`` the same
  with ``train.mixed_precision = "fp8"``, where it is accepted (CUDA, Hopper, torchao), else reported skipped
  with the reason; ``paratrain_offload`` (``--offload``, CUDA) with ZeRO-Offload (zero 3, parameters and
  AdamW on the host);
- ``ms_model``: the MindSpore face, a user's LM of ``paratrain.nn`` blocks as the tutorial writes it
  (``VocabEmbedding`` for words and positions, ``TransformerEncoder`` given a (B, T, T) 0/1 mask built with
  ``expand``, a ``Linear`` head, ``CrossEntropyLoss`` with the pad mask, ``torch.optim.AdamW``) through
  ``Model(net, optimizer=opt, amp_level="O2").train``; ``ms_loop``: the same net, seed and AdamW in a plain
  torch loop (bf16 autocast, clipping at 1.0); ``ms_loop_padded`` that loop with the last 1/8 of every row
  padded, so that the mask is causal x key padding rather than causal (``is_causal``): its first 7/8 of the rows
  run as ``is_causal``, the rest with the mask's score bias;
- ``llama``: ``paratrain train`` of ``model.kind = "llama"`` from a Hugging Face directory this script writes (a
  random ``transformers`` Llama of the same sizes, a key/value head for every 4 query heads, a SwiGLU
  feed-forward as wide as the GPT's); ``llama_hf_loop``: a plain loop over that directory's ``LlamaForCausalLM``
  (SDPA) with the same optimizer, schedule and clipping. Their FLOPs are the Llama's.

Each side runs its warm-up steps, then its timed steps between two ``torch.cuda.synchronize`` calls; a
side's peak memory is ``torch.cuda.max_memory_allocated`` from its start, less what was allocated then.
MFU is the achieved model FLOP/s (``paratrain.metrics.flops.model_flops``: counted on the model, every matmul and
attention, the GPT's of these sizes for every side) over the device's bf16 peak as measured here (the
fastest of three runs of 20 back-to-back 8192^3 bf16 matmuls), or ``--peak-tflops``, and over the
datasheet's dense bf16 peak (``gpu_peak_tflops``). The ratios: CLI face / scratch loop, CLI face / loop over
GPTModel, MindSpore face / plain loop over the same net, MindSpore face / CLI face, fp8 / bf16, the llama kind /
the loop over LlamaForCausalLM, and the causal
mask (``is_causal``) / causal x key padding (7/8 of the rows ``is_causal``) in the plain loop over the LM. Sides that
train the same model must train alike: a step whose loss differs between ``paratrain`` and ``torch``,
``ms_model`` and ``ms_loop``, or ``llama`` and ``llama_hf_loop``, by more than ``--loss-rtol`` (2e-2 relative: bf16 rounding) makes it exit 3.

Model: 1.04 B parameters (hidden 2048, 18 layers, 16 heads, ffn 8192, vocab 32000, seq 2048), micro
batch 8 x 2048 tokens (about 4 minutes for every side, eager, on an H100/H200). ``--quick``: a
GPT-2-small-sized model (0.135 B, seq 1024, micro batch 16). ``--compile`` compiles every side.
``--device cpu --quick``: a tiny fp32 model on the CPU, MFU against a measured fp32 matmul peak -- a check
of this script, not a benchmark. Without CUDA (and without ``--device cpu``) it says why it did not run and
exits 1.

``--profile`` runs each side's last warm-up step under ``torch.profiler`` and prints, per side, the step's
wall time, the device's busy time and share of it (the rest is the device waiting for the host: Python,
launches, host syncs), the number of kernels and the time by kind of op (matmul, attention, optimizer,
collectives, other); then, for the two sides of each ratio, the ops whose time differs most. Every side is
profiled at the same point, so the profiler's own overhead weighs on all alike. ``--sides`` runs only the
sides it names.

    python bench/gpu_throughput.py [--quick] [--device cuda|cpu] [--json PATH] [--micro-batch B] [--offload]
                                   [--steps N] [--warmup N] [--compile] [--profile] [--sides A,B...]
                                   [--peak-tflops T] [--loss-rtol R]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paratrain import config_file  # noqa: E402
from paratrain.config import Config  # noqa: E402
from paratrain.errors import UserError  # noqa: E402
from paratrain.data.loader import build_dataset  # noqa: E402
from paratrain.metrics.flops import gpu_peak_tflops, measure_cpu_peak_tflops, model_flops  # noqa: E402
from paratrain.models import GPTModel  # noqa: E402
from paratrain.optim import build_optimizer, build_scheduler  # noqa: E402
from paratrain.trainer import Trainer  # noqa: E402

# the learning rate of the sides with their own optimizer (no warm-up: an 18-layer net without a final LayerNorm,
# the paratrain.nn LM, climbs at 3e-4)
PLAIN_LR = 1e-4
# name: (model section, micro batch)
MODELS = {
    "1b": ({"hidden_size": 2048, "num_heads": 16, "ffn_hidden_size": 8192, "decoder_layers": 18,
            "vocab_size": 32000, "seq_length": 2048}, 8),
    "quick": ({"hidden_size": 768, "num_heads": 12, "ffn_hidden_size": 3072, "decoder_layers": 12,
               "vocab_size": 32000, "seq_length": 1024}, 16),
    "tiny": ({"hidden_size": 64, "num_heads": 4, "ffn_hidden_size": 256, "decoder_layers": 2,
              "vocab_size": 256, "seq_length": 32}, 4),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (cuda:0, bf16) or cpu (with --quick only: a tiny fp32 model, to check this script)")
    p.add_argument("--quick", action="store_true", help="a smaller model: GPT-2 small on a GPU, tiny on the CPU")
    p.add_argument("--micro-batch", type=int, help="sequences per step (default 8 for the 1B model, 16 --quick)")
    p.add_argument("--steps", type=int, default=15, help="timed steps of each side")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each side before them")
    p.add_argument("--compile", action="store_true",
                   help="compile every side: train.compile = true, torch.compile(model) in the plain loops, "
                        "set_context(mode=GRAPH_MODE) for Model.train")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="the device's bf16 peak for MFU (default: measured with bf16 matmuls)")
    p.add_argument("--loss-rtol", type=float, default=2e-2,
                   help="the largest relative difference of a step's loss between the sides (default 2e-2)")
    p.add_argument("--offload", action="store_true",
                   help="on CUDA, also paratrain train with ZeRO-Offload (slow at 1B: the optimizer steps on the host)")
    p.add_argument("--profile", action="store_true",
                   help="profile each side's last warm-up step (torch.profiler): the device's busy share of the "
                        "step, its time by kind of op and the ops that differ most between sides")
    p.add_argument("--sides", help="the sides to run, comma-separated (default: all but paratrain_offload, which "
                                   "--offload adds); the sides: " + ", ".join(SIDES))
    p.add_argument("--json", type=Path, help="write the results here")
    a = p.parse_args(argv)
    if a.device == "cpu" and not a.quick:
        p.error("--device cpu runs only the tiny model: add --quick")
    default = [side for side in SIDES if side != "paratrain_offload" or a.offload]
    a.sides = default if a.sides is None else [side.strip() for side in a.sides.split(",") if side.strip()]
    unknown = [side for side in a.sides if side not in SIDES]
    if unknown or not a.sides:
        p.error(f"--sides: unknown {', '.join(map(repr, unknown))}" if unknown else "--sides names no side")
    a.sides = [side for side in SIDES if side in a.sides]  # in the table's order
    if a.device == "cpu" and "paratrain_offload" in a.sides:
        p.error("--offload runs on CUDA only: paratrain refuses ZeRO-Offload on the CPU")
    if a.steps < 1 or a.warmup < 1:
        p.error("--steps and --warmup must be at least 1")
    if a.profile and a.warmup < 2:
        p.error("--profile profiles the last warm-up step, which must not be the first (one-time costs): "
                "give --warmup 2 or more")
    return a


def bench_config(a: argparse.Namespace, run_dir: str, offload: bool = False, precision: str | None = None,
                 from_hf: str = "") -> Config:
    """The run every side trains: one device, one micro-batch a step, no checkpoints, one logged step;
    ``offload``: ZeRO-Offload of parameters, gradients and optimizer state (stage 3); ``precision``: the
    ``train.mixed_precision`` (default bf16 on CUDA, fp32 on the CPU); ``from_hf``: the llama kind of that Hugging
    Face directory instead of the GPT."""
    model, micro_batch = MODELS["tiny" if a.device == "cpu" else "quick" if a.quick else "1b"]
    steps = a.warmup + a.steps
    train = {"global_batch_size": a.micro_batch or micro_batch, "steps": steps,
             "mixed_precision": precision or ("bf16" if a.device == "cuda" else "none")}
    if a.compile:
        train["compile"] = True
    return config_file.from_dict({
        "run": {"dir": run_dir},
        "model": {"from_hf": from_hf, "seq_length": model["seq_length"]} if from_hf else
                 {"kind": "gpt", **model, "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "train": train,
        "parallel": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"} if offload else {},
        "metrics": {"log_steps": steps, "progress": False},  # the host waits for the device only at the end
        "checkpoint": {"save_steps": 0, "resume": "none"},
    })


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> float:
    """Start measuring a side's peak memory; returns the bytes already allocated (normally none)."""
    if device.type != "cuda":
        return 0.0
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_memory_mb(device: torch.device, start: float) -> float:
    """CUDA max allocated since ``reset_peak_memory`` above what was there then; on the CPU the process's
    peak resident set so far."""
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated(device) - start) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Clock:
    """A side's clock: ``before(number)`` is called before each step (0-based). The clock starts once the
    ``warmup`` steps are done (the host waits for the device there); with ``profile`` the last warm-up step
    runs under ``torch.profiler`` (``step_profile``), so every side is profiled at the same point."""

    def __init__(self, device: torch.device, warmup: int, profile: bool):
        self.device, self.warmup, self.profile = device, warmup, profile
        self.profiler, self.profiled, self.start = None, None, None

    def before(self, number: int) -> None:
        if self.profile and number == self.warmup - 1:
            synchronize(self.device)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
            self.start = time.perf_counter()
        if number == self.warmup:
            synchronize(self.device)
            if self.profiler is not None:
                wall = time.perf_counter() - self.start
                self.profiler.stop()
                self.profiled = step_profile(self.profiler, self.device, wall)
                self.profiler = None
            self.start = time.perf_counter()

    def seconds(self) -> float:
        """Seconds from the end of the warm-up to now, once the device is done."""
        synchronize(self.device)
        return time.perf_counter() - self.start

    def measured(self, memory_start: float, model: torch.nn.Module, losses: list) -> dict:
        """What a side reports: its timed seconds, peak memory, parameter count, every step's loss (``losses``:
        floats or the steps' loss tensors, () or MindSpore's (1,)) and, if profiled, where its profiled step's time
        went."""
        seconds = self.seconds()
        params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        losses = torch.stack([torch.as_tensor(loss).reshape(()) for loss in losses]).tolist()  # one device wait
        return {"seconds": seconds, "peak_memory_mb": peak_memory_mb(self.device, memory_start), "params": params,
                "losses": losses, "loss_first": losses[0], "loss_last": losses[-1],
                **({"profile": self.profiled} if self.profiled else {})}


# what an op's name says it is, in this order (the first pattern it contains); "optimizer" holds the gradient
# clipping's foreach ops too; "other" is the rest: elementwise ops, norms, copies and casts, the loss
OP_KINDS = (("attention", ("attention", "flash", "cudnn", "efficient")),
            ("collectives", ("nccl", "c10d", "all_reduce", "allreduce", "all_gather", "reduce_scatter", "gloo")),
            ("optimizer", ("adam", "_foreach")),
            ("matmul", ("mm", "gemm", "linear", "matmul")))
TOP_OPS = 12


def op_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, parts in OP_KINDS if any(part in lowered for part in parts)), "other")


def step_profile(profiler, device: torch.device, wall: float) -> dict:
    """One profiled step: its wall time, the time the device spent in kernels (on the CPU: in ops) and its share
    of the wall time (the rest: the device waiting for the host), the number of kernels, the time of each
    kind of op (``OP_KINDS``) and the ops that took the most. Kernel time is counted at the op that launched
    it (its self device time), so every kernel is counted once."""
    on_cuda = device.type == "cuda"
    ops = {}
    for op in profiler.key_averages():
        if "::" not in op.key or "#" in op.key:  # annotations (optimizer steps, profiler steps), not ops
            continue
        us = op.self_device_time_total if on_cuda else op.self_cpu_time_total
        if us > 0:
            ops[op.key] = (op.count, us / 1e3)
    busy = sum(ms for _, ms in ops.values())
    kinds = dict.fromkeys([kind for kind, _ in OP_KINDS] + ["other"], 0.0)
    for name, (_, ms) in ops.items():
        kinds[op_kind(name)] += ms
    top = sorted(ops.items(), key=lambda item: -item[1][1])[:TOP_OPS]
    return {"wall_ms": wall * 1e3, "busy_ms": busy, "busy_share": busy / (wall * 1e3),
            "kernels": sum(len(event.kernels) for event in profiler.events()) if on_cuda else None,
            "kinds_ms": kinds, "ops_ms": {name: ms for name, (_, ms) in ops.items()},
            "top": [{"op": name, "calls": calls, "ms": ms} for name, (calls, ms) in top]}


def run_llama(cfg: Config, device: torch.device, clock: Clock) -> dict:
    """``run_paratrain`` of the llama kind from ``cfg.model.from_hf``, its FLOPs counted as the Llama's."""
    return {**run_paratrain(cfg, device, clock), "flops_per_step": model_flops(cfg.model, cfg.train.global_batch_size)}


def write_llama(cfg: Config, directory: Path) -> str:
    """A random ``transformers`` Llama of the GPT's sizes in ``directory`` (grouped-query attention with a key/value
    head for every 4 query heads, a SwiGLU feed-forward as wide as the GPT's), saved as a Hugging Face directory."""
    import transformers

    m = cfg.model
    torch.manual_seed(cfg.run.seed)
    config = transformers.LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                                      num_attention_heads=m.num_heads, num_key_value_heads=max(1, m.num_heads // 4),
                                      intermediate_size=m.ffn_hidden_size, num_hidden_layers=m.decoder_layers,
                                      max_position_embeddings=m.seq_length)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


def run_paratrain(cfg: Config, device: torch.device, clock: Clock) -> dict:
    """``Trainer(cfg).train()``; the clock runs from the end of the warm-up steps to the end of the last."""
    memory_start = reset_peak_memory(device)
    trainer = Trainer(cfg)
    train_step = trainer.train_step

    def timed_step():
        clock.before(trainer.step)
        return train_step()

    trainer.train_step = timed_step
    history = trainer.train()
    return clock.measured(memory_start, trainer.model, [record["loss"] for record in history])


def run_torch(cfg: Config, device: torch.device, clock: Clock, compile: bool) -> dict:
    """The plain PyTorch loop over paratrain's GPTModel with the same batches, optimizer and clipping, timed the
    same way."""
    memory_start = reset_peak_memory(device)
    torch.manual_seed(cfg.run.seed)
    with device:
        model = GPTModel(cfg.model)
    return plain_loop(model, model, cfg, device, clock, compile, memory_start)


def run_llama_hf_loop(cfg: Config, device: torch.device, clock: Clock, compile: bool) -> dict:
    """The plain PyTorch loop over ``transformers``' LlamaForCausalLM (SDPA) of ``cfg.model.from_hf``, as
    ``run_torch`` loops over the GPT."""
    import transformers

    memory_start = reset_peak_memory(device)
    model = transformers.LlamaForCausalLM.from_pretrained(cfg.model.from_hf, attn_implementation="sdpa",
                                                          dtype=torch.float32).to(device)
    result = plain_loop(model, lambda ids: model(ids).logits, cfg, device, clock, compile, memory_start)
    return {**result, "flops_per_step": model_flops(cfg.model, cfg.train.global_batch_size)}


def plain_loop(model: torch.nn.Module, logits_of, cfg: Config, device: torch.device, clock: Clock, compile: bool,
               memory_start: float) -> dict:
    """``model`` trained by a plain loop: ``logits_of(input_ids)`` (B, T, V) under bf16 autocast on CUDA, the
    cross-entropy of the fp32 logits, clipping, paratrain's optimizer and schedule of ``cfg``; timed by ``clock``."""
    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_scheduler(optimizer, cfg.train)
    forward = torch.compile(logits_of) if compile else logits_of

    def step(batch: dict) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = forward(batch["input_ids"])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                               ignore_index=cfg.model.ignore_index)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return timed_loop(step, model, cfg, device, clock, memory_start)


def timed_loop(step, model: torch.nn.Module, cfg: Config, device: torch.device, clock: Clock,
               memory_start: float) -> dict:
    """``step(batch)`` (-> its loss, a device tensor) on each of the run's batches, timed by ``clock``; the
    losses come to the host once, at the end."""
    data = build_dataset(cfg)
    losses = []
    for number in range(cfg.train.steps):
        clock.before(number)
        batch = {k: v.to(device, non_blocking=True)
                 for k, v in data.batch_rows(number, 0, cfg.train.global_batch_size).items()}
        losses.append(step(batch).detach())
    return clock.measured(memory_start, model, losses)


class ScratchBlock(torch.nn.Module):
    """A GPT-2 block: LayerNorm, fused qkv Linear, SDPA ``is_causal``, projection; LayerNorm, 4x GELU MLP."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.c_attn, self.c_proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, ffn), torch.nn.GELU(approximate="tanh"),
                                       torch.nn.Linear(ffn, hidden))

    def forward(self, x):
        batch, seq, hidden = x.shape
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2)
                   for t in self.c_attn(self.ln_1(x)).split(hidden, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.mlp(self.ln_2(x))


class ScratchGPT(torch.nn.Module):
    """A GPT-2 written from scratch (no paratrain module): token and position embeddings, the blocks, a final
    LayerNorm and a head tied to the token embedding; ids (B, T) -> logits (B, T, V)."""

    def __init__(self, model: dict):
        super().__init__()
        hidden = model["hidden_size"]
        self.wte = torch.nn.Embedding(model["vocab_size"], hidden)
        self.wpe = torch.nn.Embedding(model["seq_length"], hidden)
        self.h = torch.nn.ModuleList(ScratchBlock(hidden, model["num_heads"], model["ffn_hidden_size"])
                                     for _ in range(model["decoder_layers"]))
        self.ln_f = torch.nn.LayerNorm(hidden)
        self.lm_head = torch.nn.Linear(hidden, model["vocab_size"], bias=False)
        self.lm_head.weight = self.wte.weight
        for name, param in self.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                torch.nn.init.normal_(param, std=0.02)
            elif name.endswith("bias"):
                torch.nn.init.zeros_(param)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def adamw(params, lr: float, device: torch.device) -> torch.optim.AdamW:
    """The fastest plain AdamW: fused on CUDA."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, fused=device.type == "cuda")


def run_scratch(cfg: Config, device: torch.device, clock: Clock, compile: bool) -> dict:
    """The fastest plain GPT-2 loop of the same sizes, written from scratch: bf16 autocast on CUDA, fused AdamW,
    clipping at 1.0, the cross-entropy of the whole fp32 logits."""
    memory_start = reset_peak_memory(device)
    torch.manual_seed(cfg.run.seed)
    with device:
        model = ScratchGPT({k: getattr(cfg.model, k) for k in MODELS["1b"][0]})
    optimizer = adamw(model.parameters(), PLAIN_LR, device)
    forward = torch.compile(model) if compile else model

    def step(batch: dict) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = forward(batch["input_ids"])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return timed_loop(step, model, cfg, device, clock, memory_start)


def mindspore_lm(cfg: Config, device: torch.device):
    """On ``device``, the tutorial's LM of ``paratrain.nn`` blocks as a MindSpore user writes it: ``VocabEmbedding``
    for words and positions, a ``TransformerEncoder`` given a (B, T, T) 0/1 mask (causal x key padding, built
    with ``expand``), a ``Linear`` head and ``CrossEntropyLoss`` with the pad mask: forward(ids, input_mask,
    labels) -> loss."""
    from paratrain import nn as msnn

    m, batch = cfg.model, cfg.train.global_batch_size

    class LanguageModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.word_embedding = msnn.VocabEmbedding(m.vocab_size, m.hidden_size)
            self.position_embedding = msnn.VocabEmbedding(m.seq_length, m.hidden_size)
            self.encoder = msnn.TransformerEncoder(batch_size=batch, num_layers=m.decoder_layers,
                                                   hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
                                                   seq_length=m.seq_length, num_heads=m.num_heads,
                                                   attention_dropout_rate=0.0, hidden_dropout_rate=0.0)
            self.head = torch.nn.Linear(m.hidden_size, m.vocab_size)
            self.loss = msnn.CrossEntropyLoss()
            self.register_buffer("causal", torch.ones(m.seq_length, m.seq_length).tril(), persistent=False)
            self.register_buffer("positions", torch.arange(m.seq_length), persistent=False)

        def forward(self, input_ids, input_mask, labels):
            rows, length = input_ids.shape
            words, _ = self.word_embedding(input_ids)
            positions, _ = self.position_embedding(self.positions[None, :length].expand(rows, length))
            mask = self.causal[:length, :length].expand(rows, length, length) * input_mask[:, None, :]
            hidden, _ = self.encoder(words + positions, mask)
            return self.loss(self.head(hidden), labels, input_mask)

    torch.manual_seed(cfg.run.seed)
    with device:
        return LanguageModel()


def mindspore_batches(cfg: Config, padded: int = 0):
    """The LM's batches (ids, input_mask, labels) on the host, the same as the other sides'; ``padded``: the
    last tokens of every row are padding (input_mask 0: the mask is causal x key padding, no longer causal)."""
    data = build_dataset(cfg)
    for number in range(cfg.train.steps):
        batch = data.batch_rows(number, 0, cfg.train.global_batch_size)
        input_mask = (batch["labels"] != cfg.model.pad_token_id).float()
        if padded:
            input_mask[:, -padded:] = 0
        yield batch["input_ids"], input_mask, batch["labels"]


def run_mindspore_model(cfg: Config, device: torch.device, clock: Clock, compile: bool) -> dict:
    """The LM through ``Model(net, optimizer=AdamW, amp_level="O2").train`` (O0 on the CPU: fp32);
    ``--compile``: ``set_context(mode=GRAPH_MODE)``."""
    from paratrain.context import GRAPH_MODE, PYNATIVE_MODE, set_context
    from paratrain.train import Callback, Model

    memory_start = reset_peak_memory(device)
    net = mindspore_lm(cfg, device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=PLAIN_LR)
    model = Model(net, optimizer=optimizer, amp_level="O2" if device.type == "cuda" else "O0")
    losses = []

    class Timed(Callback):
        def on_train_step_begin(self, run_context):
            clock.before(run_context.original_args().cur_step_num)

        def on_train_step_end(self, run_context):
            losses.append(run_context.original_args().net_outputs)

    set_context(mode=GRAPH_MODE if compile else PYNATIVE_MODE)
    try:
        model.train(1, list(mindspore_batches(cfg)), callbacks=[Timed()])
    finally:
        set_context(mode=PYNATIVE_MODE)
    return clock.measured(memory_start, net, losses)


def run_mindspore_loop(cfg: Config, device: torch.device, clock: Clock, compile: bool, padded: int = 0) -> dict:
    """The same LM, seed and AdamW in a plain torch loop: bf16 autocast on CUDA, clipping at 1.0; ``padded``
    tokens of padding at the end of every row (``mindspore_batches``)."""
    memory_start = reset_peak_memory(device)
    net = mindspore_lm(cfg, device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=PLAIN_LR)
    forward = torch.compile(net) if compile else net
    losses = []
    for number, batch in enumerate(mindspore_batches(cfg, padded)):
        clock.before(number)
        batch = [t.to(device, non_blocking=True) for t in batch]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = forward(*batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return clock.measured(memory_start, net, losses)


def fp8_refusal(device: torch.device) -> str | None:
    """Why ``train.mixed_precision = "fp8"`` cannot run here (None: it may: CUDA, Hopper or later, torchao)."""
    if device.type != "cuda":
        return "fp8 needs a CUDA GPU"
    capability = torch.cuda.get_device_capability(device)
    if capability < (9, 0):
        return f"fp8 needs a Hopper GPU or later (compute capability 9.0), this one is {capability[0]}.{capability[1]}"
    try:
        import torchao.float8  # noqa: F401
    except Exception as exc:  # an import error, or compiled ops that do not load on this torch
        return f"torchao.float8 does not import: {type(exc).__name__}: {exc}"
    return None


def measure_gpu_peak_tflops(device: torch.device, size: int = 8192, iters: int = 20, trials: int = 3) -> float:
    """The best bf16 matmul rate of ``device`` (TFLOP/s): ``iters`` back-to-back (size x size) matmuls timed
    with CUDA events, the fastest of ``trials`` runs."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    out = torch.mm(a, b)  # warm-up (and cuBLAS's choice of kernel)
    best = 0.0
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            torch.mm(a, b, out=out)
        end.record()
        end.synchronize()
        best = max(best, 2 * size ** 3 * iters / (start.elapsed_time(end) / 1e3) / 1e12)
    return best


def device_peak(device: torch.device, override: float) -> tuple[float, str]:
    """(peak TFLOP/s of the device for MFU, where it came from)."""
    if override > 0:
        return override, "--peak-tflops"
    if device.type == "cuda":
        return measure_gpu_peak_tflops(device), "fastest of 3 x 20 8192^3 bf16 matmuls"
    return measure_cpu_peak_tflops(), f"fastest 512x512 fp32 CPU matmul, {torch.get_num_threads()} threads"


# the sides that train the GPT of the table's header (the others train the paratrain.nn LM of its sizes)
GPT_SIDES = ("paratrain", "torch", "scratch")
# each side whose losses must follow another's step by step (the same model, seed and batches): its reference
SAME_TRAINING = {"paratrain": "torch", "paratrain_offload": "torch", "ms_model": "ms_loop", "llama": "llama_hf_loop"}
# (name, numerator side, denominator side) of the ratios of tokens/s
RATIOS = (("cli_vs_scratch", "paratrain", "scratch"), ("cli_vs_gptmodel_loop", "paratrain", "torch"),
          ("ms_vs_plain_loop", "ms_model", "ms_loop"), ("ms_vs_cli", "ms_model", "paratrain"),
          ("fp8_vs_bf16", "paratrain_fp8", "paratrain"), ("causal_mask_vs_padded", "ms_loop", "ms_loop_padded"),
          ("llama_vs_hf_loop", "llama", "llama_hf_loop"))
SIDES = {
    "scratch": "a GPT-2 loop from scratch (fused qkv, SDPA is_causal, fused AdamW)",
    "torch": "a plain loop over paratrain's GPTModel",
    "paratrain": "paratrain train (Trainer)",
    "paratrain_fp8": "paratrain train --train.mixed_precision=fp8",
    "paratrain_offload": "paratrain train, ZeRO-Offload (zero 3, optimizer and parameters on the host)",
    "ms_model": "Model(net, AdamW, amp_level=O2).train of a paratrain.nn LM",
    "ms_loop": "the same paratrain.nn LM and AdamW in a plain loop",
    "ms_loop_padded": "ms_loop with the last 1/8 of every row padded: the mask causal x key padding",
    "llama": "paratrain train of model.kind llama from an HF directory (a Llama of these sizes, kv heads / 4)",
    "llama_hf_loop": "a plain loop over transformers' LlamaForCausalLM (SDPA) of that directory",
}


def loss_agreement(result: dict, rtol: float) -> dict:
    """The worst relative difference of a step's loss between each side and the side it must train like
    (``SAME_TRAINING``), and whether every one is within ``rtol``."""
    worst = {side: max(abs(a - b) / abs(b) for a, b in zip(result[side]["losses"], result[reference]["losses"],
                                                           strict=True))
             for side, reference in SAME_TRAINING.items() if "losses" in result.get(side, {})
             and "losses" in result.get(reference, {})}
    return {"rtol": rtol, "worst": worst, "agree": all(w <= rtol for w in worst.values())}


def rates(run: dict, cfg: Config, steps: int, peak: float, datasheet: float | None) -> dict:
    """tokens/s, TFLOP/s and MFU (against the measured peak and the datasheet's) of a side's timed steps."""
    batch, seq = cfg.train.global_batch_size, cfg.model.seq_length
    tflops = run.get("flops_per_step", model_flops(cfg.model, batch, (seq, seq))) * steps / run["seconds"] / 1e12
    return {**run, "step_time_s": run["seconds"] / steps, "tokens_per_s": batch * seq * steps / run["seconds"],
            "tflops": tflops, "mfu": tflops / peak if peak else None,
            "mfu_datasheet": tflops / datasheet if datasheet else None}


def print_table(r: dict) -> None:
    m = r["model"]
    print(f"GPT {r['params'] / 1e9:.3g} B params (hidden {m['hidden_size']}, {m['decoder_layers']} layers, "
          f"{m['num_heads']} heads, ffn {m['ffn_hidden_size']}, vocab {m['vocab_size']}), "
          f"{r['micro_batch']} x {r['seq_length']} tokens/step, {r['precision']}, "
          f"{r['steps']} timed steps after {r['warmup']}{', compiled' if r['compile'] else ''}")
    datasheet = f"; datasheet {r['datasheet_tflops']:.4g}" if r.get("datasheet_tflops") else ""
    print(f"{r['device']}: peak {r['peak_tflops']:.4g} TFLOP/s ({r['peak_source']}{datasheet}), "
          f"torch {r['torch_version']}")
    print(f"{'side':<18} {'tokens/s':>12} {'TFLOP/s':>9} {'MFU':>7} {'MFU(ds)':>7} {'step (s)':>9} "
          f"{'peak mem (MiB)':>15} {'loss first -> last':>19}")
    for side in SIDES:
        s = r.get(side)
        if s is None:
            continue
        if "skipped" in s:
            print(f"{side:<18} skipped: {s['skipped']}")
            continue
        mfu, ds = (f"{100 * s[k]:.1f}%" if s[k] is not None else "-" for k in ("mfu", "mfu_datasheet"))
        print(f"{side:<18} {s['tokens_per_s']:>12,.0f} {s['tflops']:>9.4g} {mfu:>7} {ds:>7} {s['step_time_s']:>9.4f} "
              f"{s['peak_memory_mb']:>15,.0f} {s['loss_first']:>9.3f} -> {s['loss_last']:.3f}")
    for side, what in SIDES.items():
        if side in r:
            print(f"  {side}: {what}")
    for name, value in r["ratios"].items():
        print(f"ratio {name} ({' / '.join(next((a, b) for n, a, b in RATIOS if n == name))}) tokens/s: "
              + (f"{value:.3f}" if value is not None else "- (a side did not run)"))
    losses = r["losses"]
    print("losses: every step within " + ", ".join(f"{w:.2g} ({side} vs {SAME_TRAINING[side]})"
                                                    for side, w in losses["worst"].items())
          + f" (tolerance {losses['rtol']:g}): {'agree' if losses['agree'] else 'DISAGREE'}")
    if r.get("profile_differences") is not None:
        print_profiles(r)
    if "offload" in r:
        o = r["offload"]
        print(f"offload (zero stage 3, parameters and optimizer on the host): {o['tokens_per_s_ratio']:.3f} x the "
              f"tokens/s, {o['device_memory_saved_mb']:,.0f} MiB less device memory at peak")


def profile_differences(result: dict, shown: int = 6) -> dict:
    """For each ratio's two sides when both were profiled: the ops whose time in the profiled step differs most,
    name -> milliseconds of the first side minus the second's, largest first."""
    differences = {}
    for name, top, bottom in RATIOS:
        if "profile" in result.get(top, {}) and "profile" in result.get(bottom, {}):
            mine, theirs = result[top]["profile"]["ops_ms"], result[bottom]["profile"]["ops_ms"]
            delta = {op: mine.get(op, 0.0) - theirs.get(op, 0.0) for op in mine.keys() | theirs.keys()}
            differences[name] = dict(sorted(delta.items(), key=lambda item: -abs(item[1]))[:shown])
    return differences


def print_profiles(r: dict) -> None:
    kinds = [kind for kind, _ in OP_KINDS] + ["other"]
    unit = "device" if r["device"] != "cpu" else "CPU op"
    print(f"one step profiled (each side's last warm-up step, torch.profiler; {unit} time counted at the op that "
          f"ran it; busy: the share of the step's wall time the device worked; ms):")
    print(f"{'side':<18} {'wall':>8} {'busy':>8} {'busy %':>7} {'kernels':>8} "
          + " ".join(f"{kind:>11}" for kind in kinds))
    for side in SIDES:
        prof = r.get(side, {}).get("profile")
        if prof:
            kernels = f"{prof['kernels']:,}" if prof["kernels"] is not None else "-"
            print(f"{side:<18} {prof['wall_ms']:>8.1f} {prof['busy_ms']:>8.1f} {100 * prof['busy_share']:>6.1f}% "
                  f"{kernels:>8} " + " ".join(f"{prof['kinds_ms'][kind]:>11.1f}" for kind in kinds))
    for name, delta in r["profile_differences"].items():
        top, bottom = next((a, b) for n, a, b in RATIOS if n == name)
        print(f"ops that differ most, {top} - {bottom} (ms): "
              + ", ".join(f"{op} {ms:+.2f}" for op, ms in delta.items()))


def write_json(path: Path | None, result: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")


def run_sides(a: argparse.Namespace, cfg: Config, device: torch.device, run_dir: str):
    """Each side of ``a.sides`` in turn, as (side, what it measured), each freeing its memory before the next;
    a side that cannot run here measures ``{"skipped": why}``."""

    def clock() -> Clock:
        return Clock(device, a.warmup, a.profile)

    runs = {
        "scratch": lambda: run_scratch(cfg, device, clock(), a.compile),
        "torch": lambda: run_torch(cfg, device, clock(), a.compile),
        "paratrain": lambda: run_paratrain(cfg, device, clock()),
        "paratrain_fp8": lambda: run_paratrain_fp8(bench_config(a, str(Path(run_dir) / "fp8"), precision="fp8"),
                                                   device, clock()),
        "paratrain_offload": lambda: run_paratrain(bench_config(a, str(Path(run_dir) / "offload"), offload=True),
                                                   device, clock()),
        "ms_model": lambda: run_mindspore_model(cfg, device, clock(), a.compile),
        "ms_loop": lambda: run_mindspore_loop(cfg, device, clock(), a.compile),
        "ms_loop_padded": lambda: run_mindspore_loop(cfg, device, clock(), a.compile, cfg.model.seq_length // 8),
        "llama": lambda: run_llama(llama(), device, clock()),
        "llama_hf_loop": lambda: run_llama_hf_loop(llama(), device, clock(), a.compile),
    }

    def llama() -> Config:  # the Llama's directory, written once for both of its sides
        directory = Path(run_dir) / "llama-hf"
        if not directory.exists():
            write_llama(cfg, directory)
        return bench_config(a, str(Path(run_dir) / "llama"), from_hf=str(directory))

    for side in a.sides:
        yield side, runs[side]()


def run_paratrain_fp8(cfg: Config, device: torch.device, clock: Clock) -> dict:
    """``run_paratrain`` of an fp8 config where fp8 is accepted, else ``{"skipped": why}``: the other sides are
    still measured when torchao's kernels fail on this torch."""
    refusal = fp8_refusal(device)
    if refusal is not None:
        return {"skipped": refusal}
    try:
        return run_paratrain(cfg, device, clock)
    except UserError as exc:  # the config's or the Trainer's refusal
        return {"skipped": str(exc)}
    except Exception as exc:
        return {"skipped": f"failed: {type(exc).__name__}: "
                           f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"}


def main(argv=None) -> int:
    """Run every side, print the table and the ratios, write the JSON. Exit 1 without CUDA, 3 when the losses
    of sides that train alike disagree."""
    a = parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        reason = f"CUDA is not available (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})"
        print(f"gpu_throughput: not run: {reason}; it measures one GPU (--device cpu --quick checks the script)",
              file=sys.stderr)
        write_json(a.json, {"ran": False, "reason": reason, "torch_version": torch.__version__})
        return 1
    os.environ["PARATRAIN_DEVICE"] = a.device  # the Trainer's device: cuda:0 (LOCAL_RANK unset) or the CPU
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    peak = device_peak(device, a.peak_tflops)
    with tempfile.TemporaryDirectory(prefix="gpu_throughput-") as run_dir:
        cfg, sides = bench_config(a, run_dir), {}
        for side, run in run_sides(a, cfg, device, run_dir):
            sides[side] = run
            print(f"gpu_throughput: {side} done ({len(sides)} of {len(a.sides)} sides)", flush=True)
            if len(sides) < len(a.sides):  # what a run stopped by a time limit leaves
                write_json(a.json, summary(a, cfg, sides, device, peak) | {"ran": "partial"})
    result = summary(a, cfg, sides, device, peak)
    print_table(result)
    write_json(a.json, result)
    return 0 if result["losses"]["agree"] else 3


def timed(result: dict, *sides: str) -> bool:
    """Whether every one of ``sides`` ran and was timed (not skipped, not left out by ``--sides``)."""
    return all("tokens_per_s" in result.get(side, {}) for side in sides)


def summary(a: argparse.Namespace, cfg: Config, sides: dict, device: torch.device, measured_peak: tuple) -> dict:
    """The result of the sides measured so far: the run's settings, each side's rates, the ratios whose two sides
    ran, the losses' agreement and, with ``--profile``, the ops that differ most. ``measured_peak``: what
    ``device_peak`` gave."""
    peak, peak_source = measured_peak
    datasheet = gpu_peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    result = {
        "ran": True, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_version": torch.__version__, "peak_tflops": peak, "peak_source": peak_source,
        "datasheet_tflops": datasheet, "model": {k: getattr(cfg.model, k) for k in MODELS["1b"][0]},
        "params": next((sides[side]["params"] for side in (*GPT_SIDES, *sides) if "params" in sides.get(side, {})),
                       None),
        "micro_batch": cfg.train.global_batch_size,
        "seq_length": cfg.model.seq_length,
        "precision": cfg.train.mixed_precision if cfg.train.mixed_precision != "none" else "fp32",
        "compile": a.compile, "steps": a.steps, "warmup": a.warmup,
        "memory": "torch.cuda.max_memory_allocated of each side" if device.type == "cuda"
                  else "process peak resident set so far (CPU: not reset between sides)",
        "flops": "every side's model FLOPs are the GPT's of these sizes (paratrain.metrics.flops.model_flops), the "
                 "llama sides' the Llama's (model_flops)",
        **{side: run if "skipped" in run else rates(run, cfg, a.steps, peak, datasheet)
           for side, run in sides.items()},
    }
    result["ratios"] = {name: result[top]["tokens_per_s"] / result[bottom]["tokens_per_s"]
                        if timed(result, top, bottom) else None for name, top, bottom in RATIOS}
    if timed(result, "paratrain_offload", "paratrain"):
        offload, plain = result["paratrain_offload"], result["paratrain"]
        result["offload"] = {"tokens_per_s_ratio": offload["tokens_per_s"] / plain["tokens_per_s"],
                             "device_memory_saved_mb": plain["peak_memory_mb"] - offload["peak_memory_mb"]}
    result["losses"] = loss_agreement(result, a.loss_rtol)
    if a.profile:
        result["profile_differences"] = profile_differences(result)
    return result


if __name__ == "__main__":
    sys.exit(main())
