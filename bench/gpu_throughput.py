"""One-GPU training throughput: paratrain's Trainer against a plain PyTorch loop of the same GPT, in one run.

Both sides train ``paratrain.models.GPTModel`` built from the same ModelConfig and seed on the same
synthetic batches, in bf16 mixed precision (fp32 master weights, bf16 compute), with the same fused
AdamW and LR schedule (``paratrain.optim``) and global-norm clipping at ``train.grad_clip``. The
paratrain side is ``Trainer(cfg).train()``; the plain side is the loop a PyTorch user writes
(``torch.autocast``, ``F.cross_entropy``, ``clip_grad_norm_``). Each side runs its warm-up steps, then
its timed steps between two ``torch.cuda.synchronize`` calls. The sides run one after the other in
this process (never both in memory); a side's peak memory is ``torch.cuda.max_memory_allocated``
from its start, less what was allocated then. MFU is the achieved model FLOP/s
(``paratrain.metrics.flops.gpt_flops``: 6 x weights x tokens plus attention) over the device's bf16
peak as measured here (the fastest of three runs of 20 back-to-back 8192^3 bf16 matmuls, as the CPU's
is measured), or ``--peak-tflops``; the datasheet's dense bf16 peak (``gpu_peak_tflops``) is printed
beside it. The sides must train alike: a step whose loss differs between paratrain (either row) and
the plain loop by more than ``--loss-rtol`` (2e-2 relative: bf16 rounding) makes it exit 3.

Model: 1.04 B parameters (hidden 2048, 18 layers, 16 heads, ffn 8192, vocab 32000, seq 2048), micro
batch 8 x 2048 tokens: ``paratrain plan`` predicts 37 GiB on one device (26 GiB at micro batch 4,
58 GiB at 16), which leaves an 80 GB GPU room for the fp32 logits of the loss, the allocator and
kernel workspaces. ``--quick``: a GPT-2-small-sized model (0.135 B, seq 1024, micro batch 16:
10 GiB predicted). On CUDA a third row trains paratrain's side again with ZeRO-Offload (zero stage 3,
``offload_optimizer`` and ``offload_param`` = "cpu": FSDP2's CPUOffloadPolicy, parameters, gradients and
AdamW state in pinned host memory, the optimizer step on the CPU) and reports its tokens/s and how much
less device memory it peaks at; it is left out on the CPU, where offload is refused.
``--device cpu --quick``: a tiny fp32 model on the CPU, MFU against a measured
fp32 matmul peak -- a check of this script, not a benchmark. Without CUDA (and without
``--device cpu``) it says why it did not run and exits 1.

    python bench/gpu_throughput.py [--quick] [--device cuda|cpu] [--json PATH] [--micro-batch B]
                                   [--steps N] [--warmup N] [--compile] [--peak-tflops T] [--loss-rtol R]
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
from paratrain.data.loader import build_dataset  # noqa: E402
from paratrain.metrics.flops import gpt_flops, gpu_peak_tflops, measure_cpu_peak_tflops  # noqa: E402
from paratrain.models import GPTModel  # noqa: E402
from paratrain.optim import build_optimizer, build_scheduler  # noqa: E402
from paratrain.trainer import Trainer  # noqa: E402

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
    p.add_argument("--steps", type=int, default=20, help="timed steps of each side")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each side before them")
    p.add_argument("--compile", action="store_true",
                   help="compile both sides: train.compile = true, torch.compile(model) in the plain loop")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="the device's bf16 peak for MFU (default: measured with bf16 matmuls)")
    p.add_argument("--loss-rtol", type=float, default=2e-2,
                   help="the largest relative difference of a step's loss between the sides (default 2e-2)")
    p.add_argument("--json", type=Path, help="write the results here")
    a = p.parse_args(argv)
    if a.device == "cpu" and not a.quick:
        p.error("--device cpu runs only the tiny model: add --quick")
    if a.steps < 1 or a.warmup < 1:
        p.error("--steps and --warmup must be at least 1")
    return a


def bench_config(a: argparse.Namespace, run_dir: str, offload: bool = False) -> Config:
    """The run both sides train: one device, one micro-batch a step, no checkpoints, one logged step;
    ``offload``: ZeRO-Offload of parameters, gradients and optimizer state (stage 3)."""
    model, micro_batch = MODELS["tiny" if a.device == "cpu" else "quick" if a.quick else "1b"]
    steps = a.warmup + a.steps
    train = {"global_batch_size": a.micro_batch or micro_batch, "steps": steps,
             "mixed_precision": "bf16" if a.device == "cuda" else "none"}
    if a.compile:
        train["compile"] = True
    return config_file.from_dict({
        "run": {"dir": run_dir},
        "model": {"kind": "gpt", **model, "hidden_dropout": 0.0, "attention_dropout": 0.0},
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


def measured(seconds: float, device: torch.device, memory_start: float, model: torch.nn.Module,
             losses: list) -> dict:
    """What a side reports: its timed seconds, peak memory, parameter count and every step's loss."""
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    losses = [float(loss) for loss in losses]
    return {"seconds": seconds, "peak_memory_mb": peak_memory_mb(device, memory_start), "params": params,
            "losses": losses, "loss_first": losses[0], "loss_last": losses[-1]}


def run_paratrain(cfg: Config, device: torch.device, warmup: int) -> dict:
    """``Trainer(cfg).train()``; the clock runs from the end of the warm-up steps to the end of the last."""
    memory_start = reset_peak_memory(device)
    trainer = Trainer(cfg)
    train_step, clock = trainer.train_step, {}

    def timed_step():
        if trainer.step == warmup:  # the warm-up steps are queued: wait for them, then start the clock
            synchronize(device)
            clock["start"] = time.perf_counter()
        return train_step()

    trainer.train_step = timed_step
    history = trainer.train()
    synchronize(device)
    return measured(time.perf_counter() - clock["start"], device, memory_start, trainer.model,
                    [record["loss"] for record in history])


def run_torch(cfg: Config, device: torch.device, warmup: int, compile: bool) -> dict:
    """The plain PyTorch loop over the same model, batches, optimizer and clipping, timed the same way."""
    memory_start = reset_peak_memory(device)
    torch.manual_seed(cfg.run.seed)
    with device:
        model = GPTModel(cfg.model)
    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_scheduler(optimizer, cfg.train)
    forward = torch.compile(model) if compile else model
    data = build_dataset(cfg)
    batch_size, bf16 = cfg.train.global_batch_size, cfg.train.mixed_precision == "bf16"
    losses = []
    for step in range(cfg.train.steps):
        if step == warmup:
            synchronize(device)
            start = time.perf_counter()
        batch = {k: v.to(device, non_blocking=True) for k, v in data.batch_rows(step, 0, batch_size).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = forward(batch["input_ids"])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                               ignore_index=cfg.model.pad_token_id)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    synchronize(device)
    return measured(time.perf_counter() - start, device, memory_start, model, torch.stack(losses).tolist())


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


def loss_agreement(result: dict, rtol: float) -> dict:
    """The worst relative difference of a step's loss between each paratrain row and the plain loop, and
    whether every one is within ``rtol``."""
    want = result["torch"]["losses"]
    worst = {side: max(abs(a - b) / abs(b) for a, b in zip(result[side]["losses"], want, strict=True))
             for side in ("paratrain", "paratrain_offload") if side in result}
    return {"rtol": rtol, "worst": worst, "agree": all(w <= rtol for w in worst.values())}


def rates(run: dict, cfg: Config, steps: int, peak: float | None) -> dict:
    """tokens/s, TFLOP/s and MFU of a side's timed steps."""
    batch, seq = cfg.train.global_batch_size, cfg.model.seq_length
    tflops = gpt_flops(cfg.model, batch, seq) * steps / run["seconds"] / 1e12
    return {**run, "step_time_s": run["seconds"] / steps, "tokens_per_s": batch * seq * steps / run["seconds"],
            "tflops": tflops, "mfu": tflops / peak if peak else None}


def print_table(r: dict) -> None:
    m = r["model"]
    print(f"GPT {r['params'] / 1e9:.3g} B params (hidden {m['hidden_size']}, {m['decoder_layers']} layers, "
          f"{m['num_heads']} heads, ffn {m['ffn_hidden_size']}, vocab {m['vocab_size']}), "
          f"{r['micro_batch']} x {r['seq_length']} tokens/step, {r['precision']}, "
          f"{r['steps']} timed steps after {r['warmup']}{', compiled' if r['compile'] else ''}")
    datasheet = f"; datasheet {r['datasheet_tflops']:.4g}" if r.get("datasheet_tflops") else ""
    print(f"{r['device']}: peak {r['peak_tflops']:.4g} TFLOP/s ({r['peak_source']}{datasheet}), "
          f"torch {r['torch_version']}")
    print(f"{'side':<17} {'tokens/s':>12} {'TFLOP/s':>9} {'MFU':>7} {'step (s)':>9} {'peak mem (MiB)':>15} "
          f"{'loss first -> last':>19}")
    for side in ("paratrain", "paratrain_offload", "torch"):
        if side not in r:
            continue
        s = r[side]
        mfu = f"{100 * s['mfu']:.1f}%" if s["mfu"] is not None else "-"
        print(f"{side:<17} {s['tokens_per_s']:>12,.0f} {s['tflops']:>9.4g} {mfu:>7} {s['step_time_s']:>9.4f} "
              f"{s['peak_memory_mb']:>15,.0f} {s['loss_first']:>9.3f} -> {s['loss_last']:.3f}")
    print(f"ratio paratrain/torch tokens/s: {r['ratio']:.3f}")
    if r.get("datasheet_tflops"):
        paratrain, plain = (r[side]["tflops"] / r["datasheet_tflops"] for side in ("paratrain", "torch"))
        print(f"MFU against the datasheet's {r['datasheet_tflops']:.4g} TFLOP/s: paratrain {paratrain:.1%}, "
              f"torch {plain:.1%}")
    losses = r["losses"]
    print(f"losses: every step within {', '.join(f'{w:.2g}' for w in losses['worst'].values())} of the plain "
          f"loop's (tolerance {losses['rtol']:g}): {'agree' if losses['agree'] else 'DISAGREE'}")
    if "offload" in r:
        o = r["offload"]
        print(f"offload (zero stage 3, parameters and optimizer on the host): {o['tokens_per_s_ratio']:.3f} x the "
              f"tokens/s, {o['device_memory_saved_mb']:,.0f} MiB less device memory at peak")


def write_json(path: Path | None, result: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")


def main(argv=None) -> int:
    """Run both sides, print the table and the ratio, write the JSON. Exit 1 without CUDA, 3 when the losses
    of the sides disagree."""
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
    peak, peak_source = device_peak(device, a.peak_tflops)
    with tempfile.TemporaryDirectory(prefix="gpu_throughput-") as run_dir:
        cfg = bench_config(a, run_dir)
        sides = {"paratrain": run_paratrain(cfg, device, a.warmup)}
        if device.type == "cuda":
            offload = bench_config(a, str(Path(run_dir) / "offload"), offload=True)
            sides["paratrain_offload"] = run_paratrain(offload, device, a.warmup)
        sides["torch"] = run_torch(cfg, device, a.warmup, a.compile)
    result = {
        "ran": True, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_version": torch.__version__, "peak_tflops": peak, "peak_source": peak_source,
        "datasheet_tflops": gpu_peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None,
        "model": {k: getattr(cfg.model, k) for k in MODELS["1b"][0]}, "params": sides["paratrain"]["params"],
        "micro_batch": cfg.train.global_batch_size, "seq_length": cfg.model.seq_length,
        "precision": cfg.train.mixed_precision if cfg.train.mixed_precision != "none" else "fp32",
        "compile": a.compile, "steps": a.steps, "warmup": a.warmup,
        "memory": "torch.cuda.max_memory_allocated of each side" if device.type == "cuda"
                  else "process peak resident set so far (CPU: not reset between sides)",
        **{side: rates(run, cfg, a.steps, peak) for side, run in sides.items()},
    }
    result["ratio"] = result["paratrain"]["tokens_per_s"] / result["torch"]["tokens_per_s"]
    if "paratrain_offload" in result:
        offload, plain = result["paratrain_offload"], result["paratrain"]
        result["offload"] = {"tokens_per_s_ratio": offload["tokens_per_s"] / plain["tokens_per_s"],
                             "device_memory_saved_mb": plain["peak_memory_mb"] - offload["peak_memory_mb"]}
    result["losses"] = loss_agreement(result, a.loss_rtol)
    print_table(result)
    write_json(a.json, result)
    return 0 if result["losses"]["agree"] else 3


if __name__ == "__main__":
    sys.exit(main())
