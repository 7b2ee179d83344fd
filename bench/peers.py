"""Peers: paratrain's ZeRO stages and pipeline against torch DDP, FSDP2 and DeepSpeed on one GPT (issue 16).

Every system trains the same GPT (paratrain's ``GPTModel``; default hidden 512, 6 layers, 8 heads,
ffn 2048, vocab 32000, seq 128: 51.7 M parameters) from one saved initial state, on the same saved
token batches (paratrain's synthetic Markov LM, global batch 8), fp32, with paratrain's fused AdamW
and decay groups (``paratrain.optim.build_optimizer``, constant LR) and gradient clipping 1.0, on
2 ranks x 1 thread over gloo. Each system runs as its own 2-process torchrun job; DeepSpeed's
ranks run with the interpreter of a separate virtual environment that this script makes on first
use (``--venv``: deepspeed 0.19.8 and torch 2.13.0, pinned by a constraints file so pip can never
pick another torch; its shared-memory op is JIT-built there once, before any job is timed).
paratrain runs through ``paratrain.trainer.Trainer``, which builds the model from the same seed
and makes the same batches itself: both are checked against the saved ones before any step.

Equal terms (issue 29): by default (``--terms equal,own``) every system runs twice. The headline
("equal") starts every system's ranks with the allocator ``paratrain launch`` preloads for CPU ranks
(tcmalloc when found, ``paratrain.host_memory.rank_env``), DeepSpeed's and torch's too; the second
table ("own") starts each as its own launcher does: paratrain with that allocator, the others with
glibc's. Their difference per peer is what the allocator alone is worth (``allocator_effect``).
Every rank records its allocator (``allocator``; the table's ``alloc`` column).

Each rank of each job runs ``--warmup`` steps, then ``--steps`` timed steps, then one more step
under two ``TorchDispatchMode``s, so counting slows no timed step: one counts the bytes every
collective sends (bench/parallel_cost.py's counter; ring formula, point-to-point sends count their
whole tensor), the other every op dispatched below autograd (``OpCounter``: a CPU proxy for GPU kernel
launches; ``kernels`` leaves out views and allocations) and the bytes written by copy-like ops
(``copy_``, ``_to_copy``, ``cat``, ``clone``, FSDP2's copy-in/out, ``*_copy``: a proxy for memory traffic
besides compute), by op name. DTensor ops are left to DTensor and counted as the local ops it runs,
so FSDP2's parameters count as DeepSpeed's plain ones do. Before each step the ranks meet at a barrier, so a step's time on a rank runs from a common
start to that rank's end. Per rank it records step times (wall clock, and the CPU time of all the
rank's threads, gloo's included: work done, little changed by other processes competing for the
cores, unlike waiting; split into user and system time, with the page faults taken), losses, and
the peak resident set over the timed steps: VmHWM from
/proc/self/status after resetting it (``echo 5 > /proc/self/clear_refs``) just before the first
timed step, or ru_maxrss (peak since the process started) where that reset is refused; the JSON
says which. After the timed steps it also reads how much freed memory glibc's heap keeps (mallinfo2):
resident memory that no tensor holds, which comes from a system's allocation pattern. With ``--profile``
one more step runs under ``torch.profiler`` and each system's ``profile`` holds that step's self CPU time
by op (rank 0): where the time goes, op by op, next to another system's.

Losses are checked first: every system's per-step loss (mean over ranks; all steps, all repeats)
is compared with ``torch_ddp``'s; one further than ``--tolerance`` (relative) is reported as a
mismatch and left out of the ratios. Systems run ``--repeats`` times, each repeat in an order
rotated by one. Reported: the median over repeats of the slowest rank's median timed step, the
peak RSS of each rank (max over repeats), bytes sent per step by collective, aten ops, kernels and
copy bytes of the counted step (max over ranks) and the load average at the start of each job. ``ratios``: paratrain / the best DeepSpeed variant of
each stage (time: the fastest, memory: the smallest) and paratrain zero 0 / torch DDP.

    python bench/peers.py [--quick] [--json PATH] [--systems a,b] [--terms equal,own] [--repeats N] [--steps N]
                          [--mmap-threshold B] [--profile]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # paratrain, also for DeepSpeed's interpreter, which does not install it
sys.path.insert(0, str(ROOT / "bench"))

from paratrain import host_memory  # noqa: E402  (no torch: also in DeepSpeed's interpreter)

TORCH = "torch==2.13.0"
DEEPSPEED = "deepspeed==0.19.8"
LR = 3e-4

# name -> how it runs. stage: the paratrain stage it is compared with; runner: torch, paratrain,
# deepspeed (ZeRO engine) or deepspeed_pipe (PipelineModule)
SYSTEMS = {
    "torch_ddp": {"runner": "torch", "stage": "zero0", "wrap": "ddp"},
    "torch_fsdp2": {"runner": "torch", "stage": "zero2", "wrap": "fsdp2", "reshard_after_forward": False},
    "torch_fsdp2_reshard": {"runner": "torch", "stage": "zero3", "wrap": "fsdp2", "reshard_after_forward": True},
    "paratrain_zero0": {"runner": "paratrain", "stage": "zero0", "parallel": {"data_parallel": 2, "zero_stage": 0}},
    "paratrain_zero1": {"runner": "paratrain", "stage": "zero1", "parallel": {"data_parallel": 2, "zero_stage": 1}},
    "paratrain_zero2": {"runner": "paratrain", "stage": "zero2", "parallel": {"data_parallel": 2, "zero_stage": 2}},
    "paratrain_zero3": {"runner": "paratrain", "stage": "zero3", "parallel": {"data_parallel": 2, "zero_stage": 3}},
    "paratrain_pp2": {"runner": "paratrain", "stage": "pipeline",
                      "parallel": {"pipeline_stage": 2, "micro_batch_num": 4}},
    "deepspeed_zero0": {"runner": "deepspeed", "stage": "zero0", "zero": {"stage": 0}},
    "deepspeed_zero1": {"runner": "deepspeed", "stage": "zero1", "zero": {"stage": 1}},
    # reduce_scatter=true (the default) still all-reduces each bucket while use_multi_rank_bucket_allreduce
    # is on (the default); off, each rank's partition is reduced to it: the bytes of a reduce-scatter
    "deepspeed_zero2": {"runner": "deepspeed", "stage": "zero2", "zero": {"stage": 2}},
    "deepspeed_zero2_reduce": {"runner": "deepspeed", "stage": "zero2",
                               "zero": {"stage": 2, "reduce_scatter": True, "use_multi_rank_bucket_allreduce": False}},
    "deepspeed_zero2_allreduce": {"runner": "deepspeed", "stage": "zero2",
                                  "zero": {"stage": 2, "reduce_scatter": False}},
    # DeepSpeed's default keeps gathered parameters it will reuse within 1e9 elements, and never releases
    # prefetched ones: for this model all stay gathered from forward to backward. "free" releases them
    # after use (no reuse distance, no prefetch) and shards small parameters too, so backward gathers
    # again, as FSDP2's reshard_after_forward=True does.
    "deepspeed_zero3": {"runner": "deepspeed", "stage": "zero3", "zero": {"stage": 3}},
    "deepspeed_zero3_free": {"runner": "deepspeed", "stage": "zero3",
                             "zero": {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0,
                                      "stage3_param_persistence_threshold": 0}},
    "deepspeed_pp2": {"runner": "deepspeed_pipe", "stage": "pipeline", "num_stages": 2, "micro_batch_num": 4},
}
REFERENCE = "torch_ddp"
# how the systems' ranks are started: the allocator each is given
TERMS = {"equal": "every system with the allocator `paratrain launch` preloads",
         "own": "each as its own launcher starts it: paratrain with that allocator, the others with glibc's"}
# ratio -> (paratrain system, the peers it is divided by: the best of them)
RATIOS = {
    "zero0": ("paratrain_zero0", ["deepspeed_zero0"]),
    "zero1": ("paratrain_zero1", ["deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero2_reduce",
                                  "deepspeed_zero2_allreduce"]),
    "zero2": ("paratrain_zero2", ["deepspeed_zero2", "deepspeed_zero2_reduce", "deepspeed_zero2_allreduce"]),
    "zero3": ("paratrain_zero3", ["deepspeed_zero3", "deepspeed_zero3_free"]),
    "pipeline": ("paratrain_pp2", ["deepspeed_pp2"]),
    "ddp": ("paratrain_zero0", ["torch_ddp"]),
    "fsdp2": ("paratrain_zero2", ["torch_fsdp2"]),
    "fsdp2_reshard": ("paratrain_zero3", ["torch_fsdp2_reshard"]),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--quick", action="store_true", help="short pass: 1 warm-up, 3 timed steps, 1 repeat")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated names of SYSTEMS")
    p.add_argument("--repeats", type=int, help="runs of every system, in rotated order (default 2, quick 1)")
    p.add_argument("--steps", type=int, help="timed steps per run (default 6, quick 3)")
    p.add_argument("--warmup", type=int, help="untimed steps before them (default 2, quick 1)")
    p.add_argument("--tolerance", type=float, default=1e-5, help="largest relative loss difference that agrees")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--length", type=int, default=128, help="sequence length")
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "peers", help="run folder")
    p.add_argument("--venv", type=Path, default=ROOT / "runs" / "bench" / "peers-venv",
                   help="DeepSpeed's virtual environment (made on first use)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    p.add_argument("--terms", default="equal,own",
                   help="comma-separated: 'equal' runs every system's ranks with the allocator `paratrain launch` "
                        "preloads (the headline), 'own' runs each as its own launcher starts it (paratrain with it, "
                        "the others with glibc's); both by default, the jobs of both in one rotated order")
    p.add_argument("--mmap-threshold", type=int,
                   help="run every rank with glibc's MALLOC_MMAP_THRESHOLD_ fixed at this many bytes: without it glibc "
                        "raises the threshold (up to 32 MB) as large blocks are freed and serves later ones from its "
                        "heap, whose free space it keeps, so peak RSS also measures each system's allocation pattern")
    p.add_argument("--profile", action="store_true",
                   help="one more step per rank under torch.profiler: self CPU time by op (``profile`` per system)")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # one rank of one job (under torchrun)
    a = p.parse_args(argv)
    for key, full, quick in (("repeats", 2, 1), ("steps", 6, 3), ("warmup", 2, 1)):
        if getattr(a, key) is None:
            setattr(a, key, quick if a.quick else full)
    a.terms = [t for t in a.terms.split(",") if t]
    if not a.terms or set(a.terms) - set(TERMS):
        p.error(f"--terms {','.join(a.terms)}: give one or both of {', '.join(TERMS)}")
    return a


def selected(a: argparse.Namespace) -> list[str]:
    names = a.systems.split(",")
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    return names


def make_config(model: dict, parallel: dict | None = None, run_dir: str = "", steps: int = 1):
    """The paratrain Config of every system: the GPT, no dropout, constant LR, clipping 1.0."""
    from paratrain import config_file

    return config_file.from_dict({
        "run": {"dir": run_dir, "seed": model["seed"]},
        "model": {"kind": "gpt", "vocab_size": model["vocab"], "hidden_size": model["hidden"],
                  "num_heads": model["heads"], "ffn_hidden_size": model["ffn"], "decoder_layers": model["layers"],
                  "seq_length": model["length"], "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "parallel": parallel or {},
        "train": {"global_batch_size": model["batch"], "steps": steps, "lr": LR, "min_lr": LR, "warmup_steps": 0,
                  "grad_clip": 1.0},
        "checkpoint": {"resume": "none"},
        "metrics": {"log_steps": 10 ** 9, "progress": False, "peak_tflops": 1.0},  # no CPU peak measured at start
    })


# --- set-up (the project's interpreter) ---------------------------------------------------------

def deepspeed_env(venv: Path) -> dict:
    """Environment of DeepSpeed's processes: CPU accelerator, JIT ops built inside the venv."""
    return {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(venv / "torch_extensions")}


def ensure_deepspeed(venv: Path) -> Path:
    """DeepSpeed's interpreter: makes the venv on first use, then (JIT-)builds its shared-memory op."""
    python = venv / "bin" / "python"
    ready = venv / ".installed"
    if not ready.exists():
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        constraints = venv / "constraints.txt"  # DeepSpeed asks only torch>=2.0: never another torch
        constraints.write_text(f"{TORCH}\n")
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(constraints), TORCH, DEEPSPEED,
                        "tomli-w"], check=True)  # tomli-w: paratrain.config, imported from the work tree
        ready.write_text(f"{TORCH} {DEEPSPEED}\n")
    # the first init_distributed of every process builds or loads this op: build it here, untimed
    subprocess.run([str(python), "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
                   env=os.environ | deepspeed_env(venv), check=True, stdout=subprocess.DEVNULL)
    return python


def prepare(a: argparse.Namespace) -> dict:
    """Saves the initial weights and the batches every system trains on; returns the job's common part."""
    import torch

    from paratrain.data.synthetic import PAD, SyntheticLM
    from paratrain.models import build_model

    model = {k: getattr(a, k) for k in ("vocab", "hidden", "heads", "ffn", "layers", "length", "batch", "seed")}
    cfg = make_config(model)
    steps = a.warmup + a.steps + 1 + a.profile
    a.out.mkdir(parents=True, exist_ok=True)
    tag = "_".join(str(v) for v in model.values())
    init, data = a.out / f"init_{tag}.pt", a.out / f"data_{tag}_{steps}.pt"
    # made anew each run: files left by another version of paratrain's model or data would fail the checks
    torch.manual_seed(cfg.run.seed)  # as paratrain's Trainer does
    torch.save(build_model(cfg.model).state_dict(), init)
    source = SyntheticLM(cfg.model, cfg.run.seed)
    batches = [source.batch_rows(s, 0, a.batch) for s in range(steps)]
    ids, labels = (torch.stack([b[k] for b in batches]) for k in ("input_ids", "labels"))
    if (ids == PAD).any() or (labels == PAD).any():  # DeepSpeed's pipeline blocks assume no padding
        raise ValueError("the synthetic batches hold padding: DeepSpeed's pipeline blocks would mask differently")
    torch.save({"input_ids": ids, "labels": labels}, data)
    params = sum(v.numel() for v in torch.load(init, mmap=True).values())
    return {"model": model, "init": str(init), "data": str(data), "warmup": a.warmup, "steps": a.steps,
            "profile": a.profile, "params": params}


# --- one rank of one job ------------------------------------------------------------------------

def status_kb(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def reset_peak_rss() -> str:
    """Restart the kernel's peak-RSS count of this process; returns how the peak will be read."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return "VmHWM reset before the timed steps"
    except OSError:
        return "ru_maxrss since process start"


def peak_rss_kb(method: str) -> int:
    import resource

    return status_kb("VmHWM") if method.startswith("VmHWM") else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def heap_free_kb() -> int | None:
    """Memory the program freed that glibc's heap keeps (mallinfo2's fordblks, all arenas), or None elsewhere
    (another allocator preloaded, or not glibc)."""
    import ctypes

    if host_memory.loaded_allocator():
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = MallInfo2
    return mallinfo2().fordblks // 1024


def _gpt_part(job: dict, *names: str):
    """Submodules of the GPT (e.g. "layers.3"), on CPU with their initial weights; one module per name."""
    import torch

    from paratrain.models import build_model

    with torch.device("meta"):
        model = build_model(make_config(job["model"]).model)
    state = torch.load(job["init"], mmap=True)
    parts = []
    for name in names:
        part = model.get_submodule(name).to_empty(device="cpu")
        prefix = f"{name}." if name else ""
        part.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        parts.append(part)
    return parts


def _loss(logits, labels):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def torch_system(job: dict):
    """DDP, or FSDP2 with each block and the root sharded (torchtitan's layout)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from paratrain.optim import build_optimizer

    system, cfg = job["system"], make_config(job["model"])
    (model,) = _gpt_part(job, "")
    if system["wrap"] == "ddp":
        optimizer = build_optimizer(model, cfg.train)
        model = DistributedDataParallel(model)
    else:
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh, reshard_after_forward=system["reshard_after_forward"])
        fully_shard(model, mesh=mesh, reshard_after_forward=system["reshard_after_forward"])
        optimizer = build_optimizer(model, cfg.train)

    def step(ids, labels) -> float:
        loss = _loss(model(ids), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def paratrain_system(job: dict, batches: list[tuple]):
    """paratrain's Trainer; its weights and its batches are checked equal to the saved ones first."""
    import torch
    from torch.distributed.tensor import DTensor

    from paratrain.trainer import Trainer

    # one step more than it runs: none of the bench's steps is the run's last, which brings every step's
    # deferred metrics to the host (the other systems read only their loss a step, as this does)
    cfg = make_config(job["model"], job["system"]["parallel"], job["run_dir"], len(batches) + 1)
    trainer = Trainer(cfg)
    init = torch.load(job["init"], mmap=True)
    for name, p in trainer.model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        key = name if name in init else name.split(".", 1)[1]  # a pipeline's chunks are numbered
        if not torch.equal(full.detach(), init[key]):
            raise AssertionError(f"paratrain's initial {name} differs from the saved initial weights")
    for s, (ids, labels) in enumerate(batches):
        mine = trainer.data.batch(s)
        if not (torch.equal(mine["input_ids"], ids) and torch.equal(mine["labels"], labels)):
            raise AssertionError(f"paratrain's batch of step {s} differs from the saved one")

    def step(ids, labels) -> float:  # the trainer makes this same batch itself (checked above)
        record = trainer.train_step()
        trainer.step += 1
        return float(record["loss"])  # read every step, as the other systems' loss.item()

    return step


def _deepspeed_config(job: dict, micro_batch: int, extra: dict) -> dict:
    batch = job["model"]["batch"]
    return {"train_batch_size": batch, "train_micro_batch_size_per_gpu": micro_batch, "gradient_clipping": 1.0,
            "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9, **extra}


def deepspeed_system(job: dict):
    """DeepSpeed's engine at a ZeRO stage, with paratrain's AdamW as its client optimizer."""
    import deepspeed
    import torch

    from paratrain.optim import build_optimizer

    (model,) = _gpt_part(job, "")
    optimizer = build_optimizer(model, make_config(job["model"]).train)
    micro = job["model"]["batch"] // torch.distributed.get_world_size()
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=_deepspeed_config(job, micro, {"zero_optimization": job["system"]["zero"]}))

    def step(ids, labels) -> float:
        loss = _loss(engine(ids), labels)
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step


def _pipe_classes():
    """DeepSpeed PipelineModule layers cut from the GPT: embeddings, one block, final norm + head."""
    from torch import nn

    from paratrain.models.transformer import attention_mask

    class Embed(nn.Module):
        def __init__(self, job):
            super().__init__()
            (self.embed,) = _gpt_part(job, "embed")

        def forward(self, ids):
            return self.embed(ids)

    class Block(nn.Module):
        def __init__(self, job, index):
            super().__init__()
            (self.layer,) = _gpt_part(job, f"layers.{index}")

        def forward(self, x):  # GPTModel's mask for ids without padding (prepare checks the data has none)
            no_pad = x.new_zeros(x.shape[:2], dtype=bool)
            return self.layer(x, attention_mask(no_pad, True, x.shape[1]))[0]  # the hidden states, not presents

    class Head(nn.Module):
        def __init__(self, job):
            super().__init__()
            self.norm, self.head = _gpt_part(job, "norm", "head")

        def forward(self, x):
            return self.head(self.norm(x))

    return Embed, Block, Head


def deepspeed_pipe_system(job: dict):
    """DeepSpeed's PipelineModule: [embeddings, blocks..., norm + head] split uniformly over the stages."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    from paratrain.optim import build_optimizer

    deepspeed.init_distributed(dist_backend="gloo")  # PipelineModule needs DeepSpeed's communication set up
    system, model = job["system"], job["model"]
    embed, block, head = _pipe_classes()
    layers = [LayerSpec(embed, job), *(LayerSpec(block, job, i) for i in range(model["layers"])), LayerSpec(head, job)]
    module = PipelineModule(layers=layers, num_stages=system["num_stages"], loss_fn=_loss, partition_method="uniform")
    # Its fp32 clip_grad_norm_ counts a parameter on a rank other than the first of its "model
    # parallel" group (which here is the pipeline) only when it is marked model-parallel: without
    # this the global norm leaves out every later stage's gradients and clips differently.
    for p in module.parameters():
        p.model_parallel = True
    optimizer = build_optimizer(module, make_config(model).train)
    micro = model["batch"] // system["micro_batch_num"]
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=_deepspeed_config(job, micro, {}))

    def step(ids, labels) -> float:
        micro_batches = zip(ids.split(micro), labels.split(micro))
        return engine.train_batch(iter(list(micro_batches))).item()

    return step


def count_bytes(events: list[dict]) -> dict:
    """Bytes sent and calls by collective kind, from parallel_cost's counter events."""
    out = defaultdict(lambda: {"bytes": 0.0, "calls": 0})
    for e in events:
        kind = e["kind"] if e["kind"] != "unknown" else e["op"]
        sent = {"send": e["full_bytes"], "recv": 0.0}.get(kind, e["bytes_sent"])  # point to point: all of it
        out[kind]["bytes"] += sent
        out[kind]["calls"] += 1
    return dict(out)


# aten ops that only move data: their written bytes are the step's copy traffic. FSDP2's own ops (namespace
# fsdp) copy too and are counted as one op each, as a dispatch mode does not see the aten ops inside them.
COPY_OPS = frozenset({"copy_", "_to_copy", "clone", "cat", "stack", "_chunk_cat", "chunk_cat", "_foreach_copy_",
                      "all_gather_copy_in", "split_with_sizes_copy", "contiguous", "repeat", "flatten_dense_tensors",
                      "unflatten_dense_tensors"})


# neither compute nor copies: allocations and aliases that are not marked as views
METADATA_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
                          "lift_fresh", "set_", "resize_", "record_stream"})


def is_copy(name: str) -> bool:
    """Whether the op named ``name`` (no namespace, no overload) is copy-like: see :data:`COPY_OPS`;
    also every ``*_copy`` / ``*_copy_`` variant (``slice_copy``, ``as_strided_copy``, ...)."""
    return name in COPY_OPS or name.endswith(("_copy", "_copy_"))


def _tensors(obj) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    return []


def written_bytes(func, args, kwargs, out) -> int:
    """Bytes an op writes: its mutated arguments (``copy_``, ``out=``, foreach in place) or else its outputs.
    ``all_gather_copy_in`` writes its first output only (the second is the all-gather's empty buffer)."""
    schema = func._schema
    name = schema.name.split("::")[-1]
    if name == "all_gather_copy_in":
        return out[0].nbytes
    mutated = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            mutated += _tensors(value)
    return sum(t.untyped_storage().nbytes() if t.is_sparse else t.nbytes for t in (mutated or _tensors(out)))


def _op_counter_class():
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        """Counts every op dispatched below autograd (a CPU proxy for GPU kernel launches) and the bytes
        written by copy-like ones (:func:`is_copy`, a proxy for memory traffic), by op name. A DTensor op is
        left to DTensor, whose local ops come back through this mode: what runs is counted, as for plain
        tensors (FSDP2's parameters are DTensors, DeepSpeed's are not)."""

        def __init__(self):
            super().__init__()
            self.ops: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # name -> [calls, bytes written]
            self.views: set[str] = set()  # the names of view and allocation ops among them

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            out = func(*args, **kwargs)
            if func.namespace == "profiler":  # record_function's markers: no work
                return out
            name = func._schema.name.split("::")[-1]
            key = f"{func.namespace}.{name}"
            if func.is_view or name in METADATA_OPS:
                self.views.add(key)
            entry = self.ops[key]
            entry[0] += 1
            if is_copy(name):
                entry[1] += written_bytes(func, args, kwargs, out)
            return out

        def summary(self) -> dict:
            """ops: all calls; kernels: those that compute or move data (no views, no allocations);
            copy_ops, copy_bytes: the copy-like ones and the bytes they write; by_op: name -> [calls, copy bytes]."""
            return {"ops": sum(c for c, _ in self.ops.values()),
                    "kernels": sum(c for k, (c, _) in self.ops.items() if k not in self.views),
                    "copy_ops": sum(c for k, (c, _) in self.ops.items() if is_copy(k.split(".", 1)[1])),
                    "copy_bytes": sum(b for _, b in self.ops.values()),
                    "by_op": {k: list(v) for k, v in sorted(self.ops.items())}}

    return OpCounter


def run_worker(job: dict) -> dict:
    """One rank of one system: warm-up steps, timed steps, one counted step. Returns what it measured."""
    import torch
    import torch.distributed as dist

    from parallel_cost import _counter_class

    torch.set_num_threads(1)
    load = os.getloadavg()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.load(job["data"])
    counted = job["warmup"] + job["steps"]
    total = counted + 1 + job["profile"]
    pipeline = job["system"]["stage"] == "pipeline"
    rows = job["model"]["batch"] // (1 if pipeline else world)
    start = 0 if pipeline else rank * rows
    batches = [(data["input_ids"][s, start:start + rows], data["labels"][s, start:start + rows]) for s in range(total)]
    runner = job["system"]["runner"]
    if runner == "paratrain":
        step = paratrain_system(job, batches)
    else:
        step = {"torch": torch_system, "deepspeed": deepspeed_system, "deepspeed_pipe": deepspeed_pipe_system}[runner](job)

    warmup, timed = job["warmup"], slice(job["warmup"], counted)
    counter, ops = _counter_class()(), _op_counter_class()()
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    losses, times, usage = [], [], []
    for s, (ids, labels) in enumerate(batches):
        if s == warmup:
            gc.collect()
            method = reset_peak_rss()
        if s == counted:  # the counted step, after the timed ones
            peak, heap_free = peak_rss_kb(method), heap_free_kb()
        dist.barrier()
        begin, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        with contextlib.ExitStack() as counting:
            if s == counted:
                counting.enter_context(counter)
                counting.enter_context(ops)
            if s == counted + 1:
                counting.enter_context(profiler)
            losses.append(step(ids, labels))
        times.append(time.perf_counter() - begin)
        after = resource.getrusage(resource.RUSAGE_SELF)  # all threads of this rank, gloo's included
        usage.append((after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime,
                      after.ru_minflt - before.ru_minflt))
    user, system, faults = (list(x) for x in zip(*usage[timed]))
    return {"rank": rank, "load": load, "losses": losses, "times": times[timed],
            "cpu_times": [u + s for u, s in zip(user, system)], "user_times": user, "sys_times": system,
            "page_faults": faults, "warmup_times": times[:warmup], "counted_step_time": times[counted],
            "peak_rss_kb": peak,
            "memory_method": method, "rss_kb": status_kb("VmRSS"), "heap_free_kb": heap_free,
            "allocator": host_memory.loaded_allocator() or "glibc",
            "comm": count_bytes(counter.events), "ops": ops.summary(),
            "profile": self_cpu_by_op(profiler) if job["profile"] else None}


def self_cpu_by_op(profiler, top: int = 40) -> dict:
    """The profiled step's self CPU time (ms) by op, the ``top`` largest, with the total and the step's
    operator calls."""
    events = sorted(profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return {"total_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
            "by_op": {e.key: [round(e.self_cpu_time_total / 1e3, 2), e.count] for e in events[:top]}}


def worker_main(job_path: Path) -> None:
    job = json.loads(job_path.read_text())
    result = run_worker(job)
    Path(job["out_dir"], f"rank{result['rank']}.json").write_text(json.dumps(result))


# --- the driver (the project's interpreter) -----------------------------------------------------

def rank_env(name: str, terms: str, env: dict, venv: Path | None = None) -> dict:
    """The environment of the ranks of system ``name`` under ``terms`` (:data:`TERMS`): ``env`` plus the
    allocator's preload (``paratrain.host_memory.rank_env``, as ``paratrain launch`` sets it) for every
    system under "equal", for paratrain's only under "own"; plus DeepSpeed's settings for its systems."""
    runner = SYSTEMS[name]["runner"]
    allocator = host_memory.rank_env(env) if terms == "equal" or runner == "paratrain" else {}
    return env | allocator | (deepspeed_env(venv) if runner.startswith("deepspeed") else {})


def torchrun_launch(job: dict, python: str, env: dict, log: Path, timeout: float) -> list[dict]:
    """Runs ``job`` as a 2-process torchrun job with ``python``; returns the per-rank results."""
    out_dir = Path(job["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("rank*.json"):
        old.unlink()
    job_path = out_dir / "job.json"
    job_path.write_text(json.dumps(job))
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--worker", str(job_path)]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun stops its ranks (each in a session of its own) on SIGTERM
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise RuntimeError(f"did not finish in {timeout:.0f} s (log {log})") from None
    if code != 0:
        tail = log.read_text().splitlines()[-15:]
        raise RuntimeError(f"exit code {code} (log {log}):\n" + "\n".join(tail))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


def run_all(a: argparse.Namespace, names: list[str], common: dict, launch) -> dict[str, dict[str, list]]:
    """Every system under every one of ``a.terms``, ``a.repeats`` times, the order of all these jobs
    rotated by one each repeat (a system's equal-terms and own-launcher jobs are neighbours).

    ``launch(name, job)`` returns the per-rank results of one job (``job["terms"]`` says which terms).
    Returns term -> name -> one entry per repeat: the per-rank results, or {"error": why}.
    """
    runs = {term: defaultdict(list) for term in a.terms}
    jobs = [(name, term) for name in names for term in a.terms]
    for repeat in range(a.repeats):
        k = repeat % len(jobs)
        for name, term in jobs[k:] + jobs[:k]:
            tag = f"{name}_{term}_r{repeat}"
            job = {**common, "system": SYSTEMS[name], "name": name, "terms": term,
                   "run_dir": str(a.out / "runs" / tag), "out_dir": str(a.out / "jobs" / f"{name}_{term}")}
            print(f"[repeat {repeat + 1}/{a.repeats}] {name}, {term} terms (load {os.getloadavg()[0]:.2f})", flush=True)
            started = time.perf_counter()
            try:
                runs[term][name].append(launch(name, job))
            except RuntimeError as exc:
                print(f"  failed: {exc}", flush=True)
                runs[term][name].append({"error": str(exc)})
            print(f"  {time.perf_counter() - started:.0f} s", flush=True)
    return runs


def _best(systems: dict, names: list[str], key: str) -> str | None:
    """The system among ``names`` with the smallest ``key`` whose losses agree, or None."""
    usable = [n for n in names if n in systems and systems[n]["losses_agree"] and systems[n].get(key) is not None]
    return min(usable, key=lambda n: systems[n][key]) if usable else None


def build_report(names: list[str], runs: dict[str, list], common: dict, tolerance: float) -> dict:
    """Loss agreement first, then times, memory, bytes, ratios and a diagnosis line per stage."""
    systems = {}
    reference = REFERENCE if REFERENCE in names else names[0]
    ok_runs = {n: [r for r in runs[n] if not isinstance(r, dict)] for n in names}
    ref_losses = [statistics.fmean(step) for step in zip(*(rank["losses"] for rank in ok_runs[reference][0]))] \
        if ok_runs[reference] else None
    for name in names:
        good = ok_runs[name]
        entry = {**SYSTEMS[name], "errors": [r["error"] for r in runs[name] if isinstance(r, dict)]}
        if not good or ref_losses is None:
            systems[name] = entry | {"losses_agree": False, "max_loss_rel_diff": None}
            continue
        losses = [[statistics.fmean(step) for step in zip(*(rank["losses"] for rank in ranks))] for ranks in good]
        diff = max(abs(x - y) / abs(y) for run in losses for x, y in zip(run, ref_losses))

        def per_repeat(key: str) -> list[float]:  # the slowest rank's median timed step, per repeat
            return [max(statistics.median(rank[key]) for rank in ranks) for ranks in good]

        comm = defaultdict(lambda: {"bytes": 0.0, "calls": 0})
        for rank in good[-1]:
            for kind, c in rank["comm"].items():
                comm[kind] = {"bytes": max(comm[kind]["bytes"], c["bytes"]), "calls": max(comm[kind]["calls"], c["calls"])}
        systems[name] = entry | {
            "losses_agree": diff <= tolerance, "max_loss_rel_diff": diff, "losses": losses[0],
            "step_time_s": statistics.median(per_repeat("times")), "repeat_step_time_s": per_repeat("times"),
            "cpu_time_s": statistics.median(per_repeat("cpu_times")), "repeat_cpu_time_s": per_repeat("cpu_times"),
            "user_time_s": statistics.median(per_repeat("user_times")),
            "sys_time_s": statistics.median(per_repeat("sys_times")),
            "page_faults": statistics.median(per_repeat("page_faults")),
            "step_times_s": [[rank["times"] for rank in ranks] for ranks in good],
            "peak_rss_mb": [max(ranks[r]["peak_rss_kb"] for ranks in good) / 1024 for r in range(len(good[0]))],
            "rss_end_mb": [good[-1][r]["rss_kb"] / 1024 for r in range(len(good[0]))],
            "heap_free_mb": max((rank["heap_free_kb"] or 0) / 1024 for ranks in good for rank in ranks),
            "max_peak_rss_mb": max(rank["peak_rss_kb"] for ranks in good for rank in ranks) / 1024,
            "bytes_per_step": dict(comm), "total_bytes_per_step": sum(c["bytes"] for c in comm.values()),
            "load": [ranks[0]["load"] for ranks in good], "memory_method": good[0][0]["memory_method"],
            "allocator": good[0][0]["allocator"], "profile": good[-1][0].get("profile"), **op_counts(good[-1])}
    ratios = {}
    for key, (ours, peers) in RATIOS.items():
        if ours not in systems or not systems[ours]["losses_agree"]:
            continue
        fast, small = _best(systems, peers, "step_time_s"), _best(systems, peers, "max_peak_rss_mb")
        if fast is None:
            continue
        me = systems[ours]
        ratios[key] = {"paratrain": ours, "time_peer": fast, "time": me["step_time_s"] / systems[fast]["step_time_s"],
                       "cpu_time": me["cpu_time_s"] / systems[fast]["cpu_time_s"],
                       "memory_peer": small, "memory": me["max_peak_rss_mb"] / systems[small]["max_peak_rss_mb"],
                       "bytes": me["total_bytes_per_step"] / max(systems[fast]["total_bytes_per_step"], 1.0),
                       **{key: me[key] / max(systems[fast][key], 1) for key in ("ops", "kernels", "copy_bytes")
                          if me.get(key) is not None and systems[fast].get(key) is not None}}
    diffs = [s["max_loss_rel_diff"] for s in systems.values() if s["max_loss_rel_diff"] is not None]
    return {"systems": systems, "ratios": ratios, "reference": reference, "tolerance": tolerance,
            "max_loss_rel_diff": max(diffs) if diffs else None, "params": common["params"],
            "model": common["model"], "warmup": common["warmup"], "steps": common["steps"],
            "diagnosis": diagnose(systems, ratios, common["params"] * 4)}


def op_counts(ranks: list[dict]) -> dict:
    """The counted step's aten ops, kernels (ops less views and allocations), copy-like ops and the bytes
    they write: the largest over ranks; with rank 0's ops by name. Empty for results without counts."""
    if any("ops" not in rank for rank in ranks):
        return {}
    out = {key: max(rank["ops"][key] for rank in ranks) for key in ("ops", "kernels", "copy_ops", "copy_bytes")}
    return out | {"ops_by_op": ranks[0]["ops"]["by_op"]}


def build_reports(names: list[str], runs: dict[str, dict[str, list]], common: dict, tolerance: float) -> dict:
    """The report of the headline terms (equal when run, else own) with the own-launcher one under
    ``own_launcher`` and, with both, what the allocator alone changes per peer (``allocator_effect``)."""
    reports = {term: build_report(names, runs[term], common, tolerance) for term in runs}
    head = "equal" if "equal" in reports else next(iter(reports))
    report = reports[head] | {"terms": head, "terms_meaning": TERMS[head], "own_launcher": None,
                              "allocator_effect": {}}
    if head == "equal" and "own" in reports:
        report["own_launcher"] = reports["own"]
        for name in names:
            eq, own = reports["equal"]["systems"][name], reports["own"]["systems"][name]
            if eq.get("step_time_s") is None or own.get("step_time_s") is None or eq["allocator"] == own["allocator"]:
                continue
            report["allocator_effect"][name] = {
                "from": own["allocator"], "to": eq["allocator"],
                **{key: eq[key] - own[key] for key in ("step_time_s", "user_time_s", "sys_time_s", "page_faults",
                                                       "max_peak_rss_mb")}}
    return report


def op_differences(mine: dict, theirs: dict, top: int = 6) -> str:
    """The ops whose counts (or copy bytes) differ most between two ``by_op`` histograms, e.g.
    "aten.slice +8, fsdp.all_gather_copy_in +1 (-33 MB)"."""
    rows = []
    for name in set(mine) | set(theirs):
        (c1, b1), (c2, b2) = mine.get(name, (0, 0)), theirs.get(name, (0, 0))
        if (c1, b1) != (c2, b2):
            rows.append((abs(c1 - c2) + abs(b1 - b2) / 1e6, name, c1 - c2, b1 - b2))
    rows.sort(reverse=True)
    return ", ".join(f"{name} {dc:+d}" + (f" ({db / 1e6:+.0f} MB)" if db else "") for _, name, dc, db in rows[:top]) or "none"


def _kinds(entry: dict) -> str:
    return ", ".join(f"{k} {c['bytes'] / 1e6:.1f} MB x{c['calls']}" for k, c in sorted(entry["bytes_per_step"].items())
                     if c["bytes"] > 0)


def diagnose(systems: dict, ratios: dict, param_bytes: int) -> dict[str, str]:
    """One line per ratio: where the measured difference lies -- bytes, overlap, copies, allocator.

    CPU time per step is work done: user time is computation and copies, system time is mostly
    page faults (memory the allocator gave back to the kernel and takes again, zeroed). The same
    CPU time with more wall time is waiting: communication not overlapped with compute, or other
    processes' load (given with each). Bytes and calls show what goes on the wire. Memory is given
    in units of P, the fp32 parameter bytes (extra copies of parameters or gradients come in P),
    with the freed memory glibc's heap keeps after the timed steps (allocation pattern, not tensors).
    """
    lines = {}
    for key, r in ratios.items():
        me, peer = systems[r["paratrain"]], systems[r["time_peer"]]
        dm = me["max_peak_rss_mb"] - systems[r["memory_peer"]]["max_peak_rss_mb"]
        db = me["total_bytes_per_step"] - peer["total_bytes_per_step"]
        calls = sum(c["calls"] for c in me["bytes_per_step"].values())
        peer_calls = sum(c["calls"] for c in peer["bytes_per_step"].values())
        if r["cpu_time"] > 1.03:
            why = "more work per step"
        elif r["time"] > 1.03:
            why = "the same work, so the wall time is waiting (communication not overlapped, or load)"
        else:
            why = "no slower"
        work = (f"user {me['user_time_s'] - peer['user_time_s']:+.2f} s (compute, copies), system "
                f"{me['sys_time_s'] - peer['sys_time_s']:+.2f} s ({me['page_faults'] / 1e3:.0f}k vs "
                f"{peer['page_faults'] / 1e3:.0f}k page faults/step)")
        if abs(db) > 0.02 * max(peer["total_bytes_per_step"], 1.0):
            wire = f"sends {db / 1e6:+.1f} MB/step ({_kinds(me)} vs {_kinds(peer)})"
        else:
            wire = f"same bytes ({me['total_bytes_per_step'] / 1e6:.1f} MB/step in {calls} vs {peer_calls} collectives)"
        if me.get("ops") is not None and peer.get("ops") is not None:
            work += (f"; aten ops {me['ops']} vs {peer['ops']} ({me['kernels']} vs {peer['kernels']} kernels), copies "
                     f"{me['copy_bytes'] / 1e6:.0f} vs {peer['copy_bytes'] / 1e6:.0f} MB/step in {me['copy_ops']} vs "
                     f"{peer['copy_ops']} ops; most different: {op_differences(me['ops_by_op'], peer['ops_by_op'])}")
        load = "/".join(f"{statistics.fmean(x[0] for x in s['load']):.1f}" for s in (me, peer))
        small = systems[r["memory_peer"]]
        if me["allocator"] == small["allocator"] == "glibc":
            kept = (f", of which freed memory glibc's heap keeps after the timed steps: "
                    f"{me['heap_free_mb'] - small['heap_free_mb']:+.0f} MB ({me['heap_free_mb']:.0f} vs "
                    f"{small['heap_free_mb']:.0f})")
        else:
            kept = f" (allocators: {me['allocator']} vs {small['allocator']})"
        lines[key] = (f"{r['paratrain']} vs {r['time_peer']}: wall {me['step_time_s'] - peer['step_time_s']:+.2f} "
                      f"s/step ({r['time']:.2f}x, load {load}), CPU {me['cpu_time_s'] - peer['cpu_time_s']:+.2f} s/step "
                      f"({r['cpu_time']:.2f}x): {why}; {work}; {wire}; peak RSS {dm:+.0f} MB vs {r['memory_peer']} "
                      f"({dm * 2 ** 20 / param_bytes:+.2f} P, P = {param_bytes / 2 ** 20:.0f} MB){kept}")
    return lines


def print_reports(report: dict) -> None:
    """The headline table (equal terms), the per-launcher one below it, and what the allocator alone changes."""
    print(f"\n=== {report['terms']} terms: {report['terms_meaning']} ===")
    print_report(report)
    own = report.get("own_launcher")
    if own:
        print(f"\n=== own terms: {TERMS['own']} ===")
        print_report(own)
    if report.get("allocator_effect"):
        print("\nthe allocator alone (equal terms - own launcher, per system):")
        for name, e in report["allocator_effect"].items():
            print(f"  {name:27} {e['from']} -> {e['to']}: wall {e['step_time_s']:+.3f} s/step, user "
                  f"{e['user_time_s']:+.3f} s, system {e['sys_time_s']:+.3f} s, {e['page_faults'] / 1e3:+.0f}k faults, "
                  f"peak RSS {e['max_peak_rss_mb']:+.0f} MB")


def print_report(report: dict) -> None:
    systems = report["systems"]
    print(f"\nGPT {report['params'] / 1e6:.1f} M parameters, {report['warmup']} warm-up + {report['steps']} timed "
          f"steps; losses compared with {report['reference']} (tolerance {report['tolerance']:g} relative)")
    head = (f"{'system':27} {'step s':>7} {'repeats s':>15} {'cpu s':>6} {'sys s':>5} {'faults':>6} {'peak RSS MB r0/r1':>18} "
            f"{'MB sent/step':>12} {'aten ops':>8} {'kernels':>7} {'copy MB':>7} {'loss diff':>9}  {'load':>9}  "
            f"{'alloc':8}  bytes by collective")
    print(head)
    print("-" * len(head))
    for name, s in systems.items():
        if s.get("step_time_s") is None:
            print(f"{name:27} failed: {s['errors'][0].splitlines()[0] if s['errors'] else 'no run'}")
            continue
        flag = "" if s["losses_agree"] else "  LOSSES DISAGREE: not comparable"
        repeats = ",".join(f"{t:.3f}" for t in s["repeat_step_time_s"])
        rss = "/".join(f"{m:.0f}" for m in s["peak_rss_mb"])
        load = ",".join(f"{x[0]:.1f}" for x in s["load"])
        print(f"{name:27} {s['step_time_s']:7.3f} {repeats:>15} {s['cpu_time_s']:6.2f} {s['sys_time_s']:5.2f} "
              f"{s['page_faults'] / 1e3:5.0f}k {rss:>18} "
              f"{s['total_bytes_per_step'] / 1e6:12.1f} {s.get('ops', 0):8} {s.get('kernels', 0):7} "
              f"{s.get('copy_bytes', 0) / 1e6:7.1f} {s['max_loss_rel_diff']:9.1e}  {load:>9}  "
              f"{s['allocator'].removeprefix('lib').split('.')[0]:8}  {_kinds(s)}{flag}")
    print("\nratios (paratrain / best peer; time: fastest peer, memory: smallest peak RSS):")
    for key, r in report["ratios"].items():
        print(f"  {key:14} time {r['time']:.3f} ({r['paratrain']} / {r['time_peer']}, cpu {r['cpu_time']:.3f})   "
              f"memory {r['memory']:.3f} (/ {r['memory_peer']})   bytes {r['bytes']:.3f}   "
              f"ops {r.get('ops', float('nan')):.3f}   copy bytes {r.get('copy_bytes', float('nan')):.3f}")
    print("\nwhere the difference comes from:")
    for key, line in report["diagnosis"].items():
        print(f"  {key}: {line}")
    if report["max_loss_rel_diff"] is not None:
        print(f"\nmax relative loss difference over all systems and steps: {report['max_loss_rel_diff']:.2e}")


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        worker_main(a.worker)
        return 0
    names = selected(a)
    a.out = a.out.resolve()
    tmp = a.out / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"OMP_NUM_THREADS": "1", "TMPDIR": str(tmp), "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
                        "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    if a.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)
    ds_python = None
    if any(SYSTEMS[n]["runner"].startswith("deepspeed") for n in names):
        ds_python = str(ensure_deepspeed(a.venv.resolve()))
    common = prepare(a)
    logs = a.out / "logs"
    logs.mkdir(exist_ok=True)
    count = defaultdict(int)

    def launch(name: str, job: dict) -> list[dict]:
        deepspeed = SYSTEMS[name]["runner"].startswith("deepspeed")
        tag = f"{name}_{job['terms']}"
        count[tag] += 1
        return torchrun_launch(job, ds_python if deepspeed else sys.executable,
                               rank_env(name, job["terms"], env, a.venv.resolve()),
                               logs / f"{tag}_r{count[tag] - 1}.log", a.timeout)

    runs = run_all(a, names, common, launch)
    report = build_reports(names, runs, common, a.tolerance)
    report.update(quick=a.quick, repeats=a.repeats, deepspeed=DEEPSPEED, torch=TORCH, mmap_threshold=a.mmap_threshold,
                  runs=runs)  # every rank's own measurements, for another look
    print_reports(report)
    if a.quick and a.repeats < 2:
        print("quick pass: 1 repeat, so times are single runs")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=1))
    failed = sorted({n for r in [report, report.get("own_launcher") or {"systems": {}}]
                     for n, s in r["systems"].items() if not s["losses_agree"]})
    if failed:
        print(f"\nsystems whose losses disagree or that failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
