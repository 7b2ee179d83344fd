"""Predicted vs measured step time of a few CPU layouts: does the planner rank them as the machine does?

Each layout trains a small GPT with ``paratrain.trainer.Trainer`` in forked gloo workers (one
thread each) for ``--steps`` steps after one warm-up step; the measured time is the fastest
``step_time_s`` of rank 0 (least disturbed on a shared machine). The prediction is ``paratrain.plan.search.evaluate`` with this
machine's numbers: the matmul rate of one thread measured here (efficiency 1) and the gloo
bandwidth (``--bw``, TORCH_CPU_NOTES: 0.6-0.9 GB/s for 2 processes) and the memory bandwidth
of one thread (``--mem-bw``). Prints both rankings and
their Spearman correlation; ``--json`` writes the rows.

    python bench/plan_check.py [--steps 4] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from forked_ranks import run_distributed  # noqa: E402

LAYOUTS = {  # name: parallel section
    "single": {},
    "single_full_recompute": {"recompute": "full"},
    "single_micro4": {"micro_batch_num": 4},
    "dp2": {"dp": 2},
    "dp2_zero3": {"dp": 2, "zero_stage": 3},
    "mp2": {"mp": 2},
    "mp2_sp": {"mp": 2, "sequence_parallel": True},
    "pp2_1f1b_m4": {"pp": 2, "micro_batch_num": 4, "pipeline_schedule": "1f1b"},
}


def make_config(a, parallel: dict, run_dir: str):
    from paratrain import config_file

    return config_file.from_dict({
        "run": {"dir": run_dir, "seed": 0},
        "model": {"kind": "gpt", "vocab_size": a.vocab, "hidden_size": a.hidden, "num_heads": 4,
                  "ffn_hidden_size": 4 * a.hidden, "decoder_layers": a.layers, "seq_length": a.length,
                  "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "parallel": parallel,
        "train": {"global_batch_size": a.batch, "steps": a.steps + 1, "warmup_steps": 1},
        "metrics": {"log_steps": 1000},
        "checkpoint": {"resume": "none"},
    })


def world(parallel: dict) -> int:
    return parallel.get("dp", 1) * parallel.get("mp", 1) * parallel.get("pp", 1)


def measure(cfg) -> float:
    from paratrain.trainer import Trainer

    trainer = Trainer(cfg)
    times = []
    for _ in range(cfg.train.steps):
        times.append(trainer.train_step()["step_time_s"])
        trainer.step += 1
    return min(times[1:])  # the least disturbed step: the machine is shared


def matmul_rate(n: int = 512, repeat: int = 20) -> float:
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def spearman(x: list[float], y: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0] * len(v)
        for k, i in enumerate(order):
            r[i] = k
        return r

    rx, ry = ranks(x), ranks(y)
    n = len(x)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--bw", type=float, default=0.7, help="gloo bus bandwidth, GB/s")
    p.add_argument("--mem-bw", type=float, default=4.0, help="memory bandwidth of one thread, GB/s")
    p.add_argument("--layer-overhead", type=float, default=1e-3, help="seconds per layer and micro-batch")
    p.add_argument("--latency", type=float, default=3e-3, help="seconds per gloo collective (1-7 ms measured)")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    from paratrain.plan.search import Hardware, evaluate

    peak = matmul_rate()
    names = a.layouts.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="plan_check_") as tmp:
        for name in names:
            cfg = make_config(a, LAYOUTS[name], f"{tmp}/{name}")
            n = world(LAYOUTS[name])
            measured = run_distributed(measure, n, cfg, timeout=900)[0]
            hw = Hardware(n, n, device_memory=math.inf, peak_flops=peak, intra_bw=a.bw * 1e9, inter_bw=a.bw * 1e9,
                          efficiency=1.0, mem_bw=a.mem_bw * 1e9, layer_overhead=a.layer_overhead, latency=a.latency)
            predicted = evaluate(cfg, cfg.parallel, hw)["step_time_s"]
            rows.append({"layout": name, "world_size": n, "measured_s": measured, "predicted_s": predicted})
            print(f"{name:24} world {n}  measured {measured:7.3f} s  predicted {predicted:7.3f} s  "
                  f"ratio {measured / predicted:5.2f}", flush=True)
    rho = spearman([r["measured_s"] for r in rows], [r["predicted_s"] for r in rows])
    print(f"\nmatmul rate of one thread: {peak / 1e9:.1f} GFLOP/s; gloo bandwidth assumed {a.bw} GB/s")
    print("measured ranking :", " < ".join(r["layout"] for r in sorted(rows, key=lambda r: r["measured_s"])))
    print("predicted ranking:", " < ".join(r["layout"] for r in sorted(rows, key=lambda r: r["predicted_s"])))
    print(f"Spearman rank correlation: {rho:.2f}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"rows": rows, "spearman": rho, "matmul_flops": peak}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
