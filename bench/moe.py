"""Mixture of experts against a dense GPT of the same FLOPs, on 2 CPU ranks (forked gloo workers).

Three runs of ``paratrain train``'s Trainer, the same global batch and sequence length:

- ``dense_dp2``: a GPT with FFN size F, data parallel over the 2 ranks;
- ``moe_dp2``: the same GPT with every FFN a mixture of E experts of size F, one expert chosen per token
  (``num_experts_chosen = 1``): the FLOPs of the dense model plus the router's, E times the FFN parameters;
  every rank holds every expert;
- ``moe_ep2``: the same, the experts split over the 2 ranks (``expert_parallel = 2``): half the experts a
  rank, the tokens dispatched and combined with all-to-all.

Reported per run: tokens/s (median step after the warm-up steps), peak memory (the trainer's ``memory_mb``:
the process's peak resident set on the CPU), and for ``moe_ep2`` the dispatch overhead share: the wall time
spent in the all-to-all exchanges (``paratrain.parallel.expert``, timed from outside) over the step time.
Capacity slots beyond the routed tokens run through the experts too (capacity_factor 1.25), so the MoE's
measured work is above the dense model's by up to that factor. Numbers are of one run on this machine,
next to its load average: the 2 processes share its cores with whatever else runs.

    python bench/moe.py [--json PATH] [--steps 8] [--hidden 256] [--experts 4]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tests/forked_ranks.py: forked gloo workers

from forked_ranks import run_distributed  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    return p.parse_args(argv)


def config(args, directory: str, parallel: dict, moe: dict):
    from paratrain import config_file

    return config_file.from_dict({
        "run": {"dir": directory},
        "model": {"kind": "gpt", "vocab_size": 256, "hidden_size": args.hidden, "num_heads": 4,
                  "ffn_hidden_size": 4 * args.hidden, "decoder_layers": 2, "seq_length": args.seq,
                  "hidden_dropout": 0.0, "attention_dropout": 0.0, "moe": moe},
        "parallel": parallel,
        "train": {"global_batch_size": args.batch, "steps": args.steps, "lr": 1e-3, "warmup_steps": 1},
        "metrics": {"log_steps": 1},
        "checkpoint": {"save_steps": 0},
    })


def measure(args, root: str, name: str, parallel: dict, moe: dict) -> dict:
    """One run on this rank (fresh processes: the peak resident set is the run's): tokens/s, peak memory and
    the time in the all-to-all exchanges."""
    import torch

    from paratrain.parallel import expert
    from paratrain.trainer import Trainer

    torch.set_num_threads(1)
    exchange, spent = expert._exchange, [0.0]

    def timed(x, group):
        start = time.perf_counter()
        out = exchange(x, group)
        spent[0] += time.perf_counter() - start
        return out

    expert._exchange = timed
    records = Trainer(config(args, f"{root}/{name}", parallel, moe)).train()
    measured = records[args.warmup:]
    step = sum(r["step_time_s"] for r in measured)
    share_steps = spent[0] * len(measured) / len(records)  # the exchanges of the measured steps, about
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in measured),
            "peak_memory_mb": max(r.get("memory_mb", 0.0) for r in records),
            "dispatch_share": share_steps / step if step else 0.0, "final_loss": records[-1]["loss"]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    moe = {"expert_num": args.experts, "num_experts_chosen": 1, "capacity_factor": 1.25}
    runs = {"dense_dp2": ({"dp": 2}, {}), "moe_dp2": ({"dp": 2}, moe), "moe_ep2": ({"dp": 2, "ep": 2}, moe)}
    root = f"/tmp/paratrain-bench-moe-{os.getpid()}"
    results = {name: run_distributed(measure, 2, args, root, name, parallel, moe, timeout=3600)[0]
               for name, (parallel, moe) in runs.items()}
    load = os.getloadavg()[0]
    print(f"mixture of experts vs dense, same FLOPs, 2 CPU ranks ({os.cpu_count()} cores, load {load:.2f}); "
          f"hidden {args.hidden}, batch {args.batch} x {args.seq}, {args.experts} experts, top-1")
    print(f"{'run':<10} {'tokens/s':>10} {'peak MB':>9} {'all-to-all':>11} {'loss':>8}")
    for name, r in results.items():
        share = f"{100 * r['dispatch_share']:.1f}%" if name == "moe_ep2" else "-"
        print(f"{name:<10} {r['tokens_per_s']:>10,.0f} {r['peak_memory_mb']:>9,.0f} {share:>11} "
              f"{r['final_loss']:>8.4f}")
    report = {"args": vars(args), "cpu_count": os.cpu_count(), "load_average": load, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
