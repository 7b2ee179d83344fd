"""Context parallelism on the CPU: tokens/s and memory per rank against sequence length, for cp = 1, 2, 4.

One run trains a tiny ``llama`` (default hidden 64, 2 layers, 4 heads and 4 key/value heads of 16, ffn 128,
vocab 256, one sequence a step, fp32, synthetic data) with ``parallel.context_parallel`` = each ``--cp`` at each
``--lengths`` (default 2k to 32k tokens), every job a torchrun job of cp ranks, 1 thread a rank over gloo, with the
allocator ``paratrain launch`` preloads. A rank runs ``--warmup`` steps, then ``--steps`` timed ones behind a
barrier each, then one more step in which it adds up the bytes of every tensor autograd saves for backward (each
storage once): the activation memory a rank holds at the end of its forward. It also records the growth of its
resident set over the timed steps (peak VmHWM after a reset, minus the resident set at the reset): activations
plus the transient buffers of attention and the collectives.

Reported per length and cp: the step time (median of the slowest rank's steps), tokens/s, the saved bytes per
rank, their ratio to cp = 1's (``saved_vs_cp1``: close to 1/cp is the goal), the resident growth per rank and the
first step's loss. The losses of each length agree across cp sizes (relative ``--tolerance``), else the script
reports it and exits 1.

    python bench/context_parallel.py [--quick] [--json PATH] [--lengths 2048,4096] [--cp 1,2,4] [--steps N]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from llama_hf import launch, work  # noqa: E402
from peers import status_kb, peak_rss_kb, reset_peak_rss  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--out", type=Path, default=ROOT / "runs/bench/context_parallel", help="work directory")
    p.add_argument("--lengths", default="2048,4096,8192,16384,32768", help="sequence lengths, comma-separated")
    p.add_argument("--cp", default="1,2,4", help="context-parallel sizes, comma-separated")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="timed steps of each job")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--timeout", type=float, default=1800, help="seconds a job may take")
    p.add_argument("--quick", action="store_true", help="lengths 2048 and 4096, 1 timed step")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.lengths, a.steps = "2048,4096", 1
    a.lengths = [int(n) for n in a.lengths.split(",")]
    a.cp = [int(n) for n in a.cp.split(",")]
    return a


def run_config(job: dict):
    """paratrain's Config of one job: the tiny llama at the job's length, split over its cp ranks."""
    from paratrain import config_file

    model = job["model"]
    return config_file.from_dict({
        "run": {"dir": job["run_dir"], "seed": 0},
        "model": {"kind": "llama", "vocab_size": model["vocab"], "hidden_size": model["hidden"],
                  "num_heads": model["heads"], "num_kv_heads": model["kv_heads"], "ffn_hidden_size": model["ffn"],
                  "decoder_layers": model["layers"], "seq_length": job["length"], "hidden_dropout": 0.0,
                  "attention_dropout": 0.0},
        "parallel": {"context_parallel": job["cp"]},
        "train": {"global_batch_size": 1, "steps": job["warmup"] + job["steps"] + 2, "lr": 1e-3,
                  "warmup_steps": 0, "grad_clip": 1.0},
        "checkpoint": {"resume": "none"},
        "metrics": {"log_steps": 10 ** 9, "progress": False, "peak_tflops": 1.0},  # no CPU peak measured at start
    })


def saved_bytes(step) -> tuple[int, float]:
    """Run ``step()`` adding up the bytes of the tensors autograd saves (each storage once); (bytes, its loss)."""
    import torch

    storages = {}

    def pack(tensor):
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = step()
    return sum(storages.values()), loss


def run_worker(job: dict) -> dict:
    """One rank of one job: warm-up steps, timed ones, then the counted one."""
    import torch
    import torch.distributed as dist

    from paratrain.trainer import Trainer

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    trainer = Trainer(run_config(job))

    def step() -> float:
        record = trainer.train_step()
        trainer.step += 1
        return float(record["loss"])

    losses, times, method, resident_kb = [], [], "", 0
    for s in range(job["warmup"] + job["steps"]):
        if s == job["warmup"]:
            gc.collect()
            method, resident_kb = reset_peak_rss(), status_kb("VmRSS")
        dist.barrier()
        begin = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - begin)
    growth_kb = peak_rss_kb(method) - resident_kb
    saved, _ = saved_bytes(step)
    return {"rank": dist.get_rank(), "losses": losses, "times": times[job["warmup"]:], "saved_bytes": saved,
            "resident_growth_kb": growth_kb, "memory_method": method}


def summary(ranks: list[dict], length: int) -> dict:
    step = max(statistics.median(rank["times"]) for rank in ranks)
    return {"step_s": step, "tokens_per_s": length / step, "first_loss": ranks[0]["losses"][0],
            "saved_mb_per_rank": max(rank["saved_bytes"] for rank in ranks) / 2 ** 20,
            "resident_growth_mb_per_rank": max(rank["resident_growth_kb"] for rank in ranks) / 1024}


def build_report(runs: dict, tolerance: float) -> dict:
    """Per length: each cp's summary, its saved bytes against cp = 1's, and whether the losses agree."""
    report = {}
    for length, by_cp in runs.items():
        got = {cp: summary(ranks, length) for cp, ranks in by_cp.items()}
        base = got[min(got)]
        for cp, entry in got.items():
            entry["saved_vs_cp1"] = entry["saved_mb_per_rank"] / base["saved_mb_per_rank"]
        losses = [entry["first_loss"] for entry in got.values()]
        difference = max(abs(loss - base["first_loss"]) / abs(base["first_loss"]) for loss in losses)
        report[str(length)] = {"by_cp": {str(cp): entry for cp, entry in got.items()},
                               "max_loss_rel_diff": difference, "losses_agree": difference <= tolerance}
    return report


def print_report(report: dict) -> None:
    print(f"\n{'length':>7} {'cp':>3} {'step s':>8} {'tok/s':>8} {'saved MB/rank':>14} {'vs cp1':>7} "
          f"{'RSS growth MB':>14}")
    for length, entry in report.items():
        for cp, got in entry["by_cp"].items():
            print(f"{length:>7} {cp:>3} {got['step_s']:8.2f} {got['tokens_per_s']:8.0f} "
                  f"{got['saved_mb_per_rank']:14.1f} {got['saved_vs_cp1']:7.2f} "
                  f"{got['resident_growth_mb_per_rank']:14.1f}")
        if not entry["losses_agree"]:
            print(f"{'':>7} losses differ across cp by {entry['max_loss_rel_diff']:.2e}")


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        return work(a.worker, run_worker)
    model = {"vocab": a.vocab, "hidden": a.hidden, "layers": a.layers, "heads": a.heads, "kv_heads": a.kv_heads,
             "ffn": a.ffn}
    runs = {length: {} for length in a.lengths}
    for length in a.lengths:
        for cp in a.cp:
            tag = f"len{length}_cp{cp}"
            print(f"length {length}, cp {cp}", flush=True)
            job = {"model": model, "length": length, "cp": cp, "warmup": a.warmup, "steps": a.steps,
                   "run_dir": str(a.out / "runs" / tag), "out_dir": str(a.out / tag)}
            runs[length][cp] = launch(job, cp, a.timeout, script=__file__)
    report = build_report(runs, a.tolerance)
    print_report(report)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(entry["losses_agree"] for entry in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
