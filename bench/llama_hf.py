"""The llama kind against a plain torch loop over ``transformers``' ``LlamaForCausalLM``, side by side in one run.

Both sides train the same model from one Hugging Face directory this script writes (a random Llama: default
hidden 512, 4 layers, 8 heads of which 4 key/value heads, ffn 1408, vocab 32000, seq 256), on the same token
batches (paratrain's synthetic Markov LM, saved once), fp32, with a fused AdamW (weight decay 0, constant LR) and
gradient clipping 1.0. The plain side is what a PyTorch user writes: ``from_pretrained(attn_implementation=
"sdpa")``, ``F.cross_entropy`` over the logits, ``torch.nn.parallel.DistributedDataParallel`` on 2 ranks. The
paratrain side is ``paratrain.trainer.Trainer`` with ``model.from_hf`` (data parallel on 2 ranks), stepped as
``paratrain train`` steps it.

Each side runs as its own torchrun job of 1 and of 2 ranks (``--ranks``), 1 thread a rank over gloo, every rank
with the allocator ``paratrain launch`` preloads, ``--repeats`` times in alternating order. A rank runs
``--warmup`` steps, then ``--steps`` timed ones behind a barrier each; it records its step times and the peak
resident set over the timed steps (VmHWM reset after warm-up). Reported per rank count: tokens/s (global batch
tokens over the median of the slowest rank's median step), peak RSS (max over ranks and repeats), and the ratios
paratrain / plain (tokens/s: higher is better for paratrain; memory: lower). The losses of the two sides are
compared first: a side further than ``--tolerance`` (relative, any step) is reported, gets no ratio and the
script exits 1.

    python bench/llama_hf.py [--quick] [--json PATH] [--ranks 1,2] [--repeats N] [--steps N] [--hidden H] ...
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from paratrain import host_memory  # noqa: E402
from peers import peak_rss_kb, reset_peak_rss  # noqa: E402

LR = 3e-4
SIDES = ("plain_hf", "paratrain")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--out", type=Path, default=ROOT / "runs/bench/llama_hf", help="work directory")
    p.add_argument("--ranks", default="1,2", help="rank counts to run, comma-separated")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps of each job")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--timeout", type=float, default=900, help="seconds a job may take")
    p.add_argument("--quick", action="store_true", help="1 repeat, 2 warm-up and 4 timed steps")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.repeats, a.warmup, a.steps = 1, 2, 4
    a.ranks = [int(r) for r in a.ranks.split(",")]
    return a


def run_config(model: dict, ranks: int, run_dir: str, steps: int, lora: dict | None = None):
    """paratrain's Config of the run: the HF directory's model, data parallel over ``ranks``; ``lora``: a [lora]
    section (adapters on the frozen base)."""
    from paratrain import config_file

    return config_file.from_dict({**({"lora": lora} if lora else {}),
        "run": {"dir": run_dir, "seed": 0},
        "model": {"from_hf": model["dir"], "seq_length": model["length"]},
        "parallel": {"data_parallel": ranks},
        "train": {"global_batch_size": model["batch"], "steps": steps, "lr": LR, "min_lr": LR, "warmup_steps": 0,
                  "weight_decay": 0.0, "grad_clip": 1.0},
        "checkpoint": {"resume": "none"},
        "metrics": {"log_steps": 10 ** 9, "progress": False, "peak_tflops": 1.0},  # no CPU peak measured at start
    })


def prepare(a: argparse.Namespace) -> dict:
    """Write the HF directory and the batches of every step; the model description the jobs share."""
    import torch
    import transformers

    from paratrain.data.loader import ShardedBatches, build_dataset

    a.out.mkdir(parents=True, exist_ok=True)
    model = {"dir": str(a.out / "hf"), "length": a.length, "batch": a.batch}
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_attention_heads=a.heads,
                                      num_key_value_heads=a.kv_heads, intermediate_size=a.ffn,
                                      num_hidden_layers=a.layers, max_position_embeddings=a.length)
    transformers.LlamaForCausalLM(config).save_pretrained(model["dir"])
    total = a.warmup + a.steps
    data = ShardedBatches(build_dataset(run_config(model, 1, str(a.out / "data"), total)), a.batch)
    rows = [data.host_rows(s) for s in range(total)]
    torch.save({k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels")}, a.out / "data.pt")
    params = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    return {"model": model, "warmup": a.warmup, "steps": a.steps, "data": str(a.out / "data.pt"), "params": params}


def plain_hf_side(job: dict):
    """The plain loop over LlamaForCausalLM (DDP on more than one rank)."""
    import torch
    import torch.nn.functional as F
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(job["model"]["dir"], attn_implementation="sdpa",
                                                          dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    if torch.distributed.get_world_size() > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)

    def step(step_index: int, ids, labels) -> float:
        loss = F.cross_entropy(model(ids).logits.flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def paratrain_side(job: dict):
    """paratrain's Trainer on the HF directory; its batches are checked equal to the saved ones first."""
    import torch

    from paratrain.trainer import Trainer

    ranks = torch.distributed.get_world_size()
    # one step more than it runs: none of the bench's steps is the run's last (which reads every metric)
    trainer = Trainer(run_config(job["model"], ranks, job["run_dir"], job["warmup"] + job["steps"] + 1,
                                 job.get("lora")))

    def step(step_index: int, ids, labels) -> float:
        if step_index == 0 and not torch.equal(trainer.data.batch(0)["input_ids"], ids):
            raise AssertionError("paratrain's first batch differs from the saved one")
        record = trainer.train_step()
        trainer.step += 1
        return float(record["loss"])  # read every step, as the plain side's loss.item()

    return step


def run_worker(job: dict) -> dict:
    """One rank of one job: warm-up steps, then timed ones. Returns what it measured."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.load(job["data"])
    rows = job["model"]["batch"] // world
    step = {"plain_hf": plain_hf_side, "paratrain": paratrain_side}[job["side"]](job)
    losses, times, method = [], [], ""
    for s in range(job["warmup"] + job["steps"]):
        if s == job["warmup"]:
            gc.collect()
            method = reset_peak_rss()
        ids, labels = (data[k][s, rank * rows:(rank + 1) * rows] for k in ("input_ids", "labels"))
        dist.barrier()  # a step's time on a rank runs from a common start to that rank's end
        begin = time.perf_counter()
        loss = step(s, ids, labels)
        times.append(time.perf_counter() - begin)
        mean = torch.tensor([loss / world], device="cpu")
        dist.all_reduce(mean)
        losses.append(mean.item())
    return {"rank": rank, "losses": losses, "times": times[job["warmup"]:], "peak_rss_kb": peak_rss_kb(method),
            "memory_method": method, "allocator": host_memory.loaded_allocator() or "glibc"}


def launch(job: dict, ranks: int, timeout: float, script: str = __file__) -> list[dict]:
    """``job`` as a torchrun job of ``ranks`` processes of ``script --worker JOB`` (each writes its rank{R}.json in
    ``job["out_dir"]``), each with the allocator ``paratrain launch`` preloads; the per-rank results."""
    out = Path(job["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    (out / "job.json").write_text(json.dumps(job))
    env = os.environ | host_memory.rank_env() | {"OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               script, "--worker", str(out / "job.json")]
    with (out / "log.txt").open("w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if done.returncode != 0:
        tail = (out / "log.txt").read_text().splitlines()[-15:]
        raise RuntimeError(f"exit code {done.returncode} (log {out / 'log.txt'}):\n" + "\n".join(tail))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def summary(runs: list[list[dict]], tokens: int) -> dict:
    """One side at one rank count over its repeats: tokens/s, peak RSS, mean losses of the first repeat."""
    step = statistics.median(max(statistics.median(rank["times"]) for rank in run) for run in runs)
    return {"step_s": step, "tokens_per_s": tokens / step,
            "peak_rss_mb": max(rank["peak_rss_kb"] for run in runs for rank in run) / 1024,
            "losses": runs[0][0]["losses"], "allocator": runs[0][0]["allocator"]}


def build_report(runs: dict, common: dict, tolerance: float) -> dict:
    """Per rank count: each side's summary, whether its losses agree with the plain side's, and the ratios."""
    tokens = common["model"]["batch"] * common["model"]["length"]
    report = {"params": common["params"], "tokens_per_step": tokens, "by_ranks": {}}
    for ranks, sides in runs.items():
        got = {side: summary(side_runs, tokens) for side, side_runs in sides.items()}
        plain, mine = got["plain_hf"], got["paratrain"]
        difference = max(abs(a - b) / abs(b) for a, b in zip(mine["losses"], plain["losses"]))
        entry = {"sides": got, "max_loss_rel_diff": difference, "losses_agree": difference <= tolerance}
        if entry["losses_agree"]:
            entry["ratios"] = {"tokens_per_s": mine["tokens_per_s"] / plain["tokens_per_s"],
                               "peak_rss": mine["peak_rss_mb"] / plain["peak_rss_mb"]}
        report["by_ranks"][str(ranks)] = entry
    return report


def print_report(report: dict) -> None:
    print(f"\nllama kind vs plain loop over LlamaForCausalLM ({report['params'] / 1e6:.1f} M parameters, "
          f"{report['tokens_per_step']} tokens a step)")
    print(f"{'ranks':>5} {'side':>10} {'step s':>8} {'tok/s':>9} {'peak MB':>8}")
    for ranks, entry in report["by_ranks"].items():
        for side, got in entry["sides"].items():
            print(f"{ranks:>5} {side:>10} {got['step_s']:8.3f} {got['tokens_per_s']:9.0f} {got['peak_rss_mb']:8.0f}")
        ratios = entry.get("ratios")
        verdict = (f"paratrain / plain: tokens/s x{ratios['tokens_per_s']:.2f}, peak memory x{ratios['peak_rss']:.2f}"
                   if ratios else f"losses differ by {entry['max_loss_rel_diff']:.2e}: no ratio")
        print(f"{'':>5} {verdict}")


def work(job_file: Path, run_worker) -> int:
    """A rank of a ``launch``ed job: ``run_worker(job)``'s result written as its rank{R}.json."""
    job = json.loads(job_file.read_text())
    result = run_worker(job)
    Path(job["out_dir"], f"rank{result['rank']}.json").write_text(json.dumps(result))
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        return work(a.worker, run_worker)
    common = prepare(a)
    runs = {ranks: {side: [] for side in SIDES} for ranks in a.ranks}
    for repeat in range(a.repeats):
        for ranks in a.ranks:
            for side in SIDES[::-1] if repeat % 2 else SIDES:
                tag = f"{side}_{ranks}r_{repeat}"
                print(f"[repeat {repeat + 1}/{a.repeats}] {side} on {ranks} rank(s)", flush=True)
                job = {**common, "side": side, "run_dir": str(a.out / "runs" / tag), "out_dir": str(a.out / tag)}
                runs[ranks][side].append(launch(job, ranks, a.timeout))
    report = build_report(runs, common, a.tolerance)
    print_report(report)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(entry["losses_agree"] for entry in report["by_ranks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
