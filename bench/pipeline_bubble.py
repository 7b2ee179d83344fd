"""Pipeline bubble: measured idle fraction per rank of a pipeline step against the theory.

For each schedule (gpipe, 1f1b, interleaved_1f1b with 2 virtual stages per rank, and the
zero-bubble schedules interleaved_zero_bubble and zbv_zero_bubble, also with 2), each
number of stages p and of micro-batches m, ``paratrain.parallel.Pipeline`` runs real
forward+backward steps of a GPT (one process per stage, forked gloo workers,
``torch.set_num_threads(1)``). The model is chosen so that compute dominates
communication: a wide layer (hidden 512, FFN 2048) on few tokens (a micro-batch of
2 x 32), a 64-word vocabulary (embedding and head are negligible), 4 layers per rank
split evenly over its chunks (``layer_stages``), so the stages are balanced as the theory
assumes. The one-way send+recv time of one activation between two ranks is measured
too and reported against a chunk's forward time (``p2p/F``).

Busy time of a rank = the wall time spent in its stages' ``forward_one_chunk``,
``backward_one_chunk`` and ``backward_weight_one_chunk`` and in the loss (wrapped from
outside with timers; the schedule waits for received activations/gradients before
calling them, so waiting is not counted as busy). All ranks start a step together
(after a barrier); the step time T is last end - first start over the ranks (one
monotonic clock shared by the processes of this machine), and

    idle fraction of rank r = 1 - busy_r / T          (summed over the measured steps)

Theory, with equal stages and free communication: (p-1)/(m+p-1) for gpipe and 1f1b,
(p-1)/(v*m+p-1) for the interleaved schedules with v chunks per rank. For the
zero-bubble schedules the same interleaved value is given as the reference: they fill
part of that bubble with weight-gradient work, so a ratio below 1 is their point.

Honesty notes, written into the output and the JSON: the machine's CPU count and load
average are recorded; with p larger than the cores the processes contend, so the
compute of a rank runs slower while the others compute too (when they idle it speeds
up), which shrinks the measured idle fraction. ``cpu/wall`` (CPU time of the compute
thread / its wall time while busy) shows it: 1.0 means the compute never waited for a
core. Contention bends the idle fraction both ways (busy compute stretches; a rank
whose input has arrived may wait for a core), so quote these numbers as measured in
one run on this machine, next to its load.

    python bench/pipeline_bubble.py [--json PATH] [--schedules a,b] [--stages 2,4] [--micro 2,4,8]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tests/forked_ranks.py: forked gloo workers

from forked_ranks import run_distributed  # noqa: E402

# schedule: virtual stages per rank
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "interleaved_zero_bubble": 2, "zbv_zero_bubble": 2}
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv_zero_bubble")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated, of: " + ", ".join(SCHEDULES))
    p.add_argument("--stages", default="2,4", help="numbers of pipeline stages p (one process each)")
    p.add_argument("--micro", default="2,4,8", help="numbers of micro-batches m (m < p is skipped, and m not a "
                                                  "multiple of p for the interleaved schedules: paratrain refuses)")
    p.add_argument("--steps", type=int, default=3, help="measured steps after --warmup steps")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--layers-per-rank", type=int, default=4, help="split evenly over the rank's v chunks")
    p.add_argument("--length", type=int, default=32, help="sequence length")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per group of forked workers")
    p.add_argument("--collective-timeout", type=float, default=120.0,
                   help="seconds a send/recv may wait before it raises (a failed rank does not hang the others)")
    return p.parse_args(argv)


def cases(a: argparse.Namespace) -> list[dict]:
    """Every (schedule, p, m) to run, with the reason when paratrain's rules skip it."""
    out = []
    for schedule in a.schedules.split(","):
        if schedule not in SCHEDULES:
            raise SystemExit(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
        v = SCHEDULES[schedule]
        if a.layers_per_rank % v:
            raise SystemExit(f"--layers-per-rank={a.layers_per_rank} is not divisible by {v} chunks ({schedule})")
        for p in map(int, a.stages.split(",")):
            for m in map(int, a.micro.split(",")):
                case = {"schedule": schedule, "p": p, "m": m, "v": v, "theory": theory(p, m, v)}
                if m < p:
                    case["skipped"] = f"micro_batch_num={m} < pipeline_stage={p}"
                elif v > 1 and m % p:
                    case["skipped"] = f"micro_batch_num={m} not a multiple of pipeline_stage={p}"
                out.append(case)
    return out


def theory(p: int, m: int, v: int = 1) -> float:
    """Bubble fraction of a step with equal stages and free communication: (p-1)/(v*m+p-1)."""
    return (p - 1) / (v * m + p - 1)


def make_config(a: argparse.Namespace, case: dict):
    from paratrain import config_file

    p, v = case["p"], case["v"]
    chunks = p * v
    per_chunk = a.layers_per_rank // v
    return config_file.from_dict({
        "run": {"seed": 0},
        "model": {"kind": "gpt", "vocab_size": a.vocab, "hidden_size": a.hidden, "num_heads": a.heads,
                  "ffn_hidden_size": a.ffn, "decoder_layers": chunks * per_chunk, "seq_length": a.length,
                  "hidden_dropout": 0.0, "attention_dropout": 0.0, "tie_embeddings": False},
        "parallel": {"pp": p, "micro_batch_num": case["m"], "pipeline_schedule": case["schedule"],
                     "virtual_pipeline_stage": v,
                     "layer_stages": [c for c in range(chunks) for _ in range(per_chunk)]},
        "train": {"global_batch_size": case["m"] * a.micro_batch, "steps": 1},
    })


# --- the worker -------------------------------------------------------------------------------

def _timed(events: list, kind: str, fn, chunk_of=None):
    """``fn`` that appends (kind, chunk, start, end, thread CPU seconds) to ``events`` on every call."""
    def wrapper(*args, **kwargs):
        cpu, start = time.thread_time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            events.append((kind, chunk_of, start, time.perf_counter(), time.thread_time() - cpu))
    return wrapper


def _instrument(pipeline, events: list) -> None:
    schedule = pipeline.schedule
    for stage in pipeline.stages:
        for kind, attr in (("F", "forward_one_chunk"), ("B", "backward_one_chunk"),
                           ("W", "backward_weight_one_chunk")):
            setattr(stage, attr, _timed(events, kind, getattr(stage, attr), stage.stage_index))
    schedule._loss_fn = _timed(events, "loss", schedule._loss_fn)


def _p2p_latency(a: argparse.Namespace, rank: int, trips: int = 10) -> float | None:
    """One-way send+recv time of one activation (micro_batch, length, hidden) between ranks 0 and 1
    (median of ``trips`` ping-pongs): what a stage boundary costs next to the compute."""
    import torch
    import torch.distributed as dist

    x = torch.zeros(a.micro_batch, a.length, a.hidden)
    times = []
    for _ in range(trips + 1):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)
        times.append((time.perf_counter() - start) / 2)
    return sorted(times[1:])[trips // 2] if rank == 0 else None


def measure(a: argparse.Namespace, group: list[dict]) -> list[dict]:
    """On every rank: for each case of ``group`` (same p), warm-up steps then timed steps.

    A case that raises ends the group on this rank (its peers then fail on their collective
    timeout); the error is returned in place of the timings.
    """
    import torch
    import torch.distributed as dist

    from paratrain.config_rules import check
    from paratrain.distributed import init_from_env
    from paratrain.mesh import Layout
    from paratrain.models import build_model, token_loss_sum
    from paratrain.parallel import parallelize

    torch.set_num_threads(1)
    rank, world = init_from_env(timeout_s=a.collective_timeout)
    out = [{"p2p_s": _p2p_latency(a, rank)}]
    for case in group:
        try:
            cfg = check(make_config(a, case), world)
            layout = Layout(cfg.parallel, world)
            torch.manual_seed(0)
            pad = cfg.model.pad_token_id
            placed = parallelize(build_model(cfg.model), cfg.parallel, layout)
            parts, pipeline = placed.parts, placed.pipeline
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(1, cfg.model.vocab_size, (cfg.train.global_batch_size, a.length + 1), generator=g)
            batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
            num_tokens = torch.tensor(float(batch["labels"].numel()))

            def loss_fn(logits, labels):
                return token_loss_sum(logits.float(), labels, pad) / num_tokens

            events, steps = [], []
            for step in range(a.warmup + a.steps):
                if step == a.warmup:
                    _instrument(pipeline, events)
                dist.barrier()
                start = time.perf_counter()
                pipeline.step(batch, loss_fn)
                end = time.perf_counter()
                for module in parts:
                    module.zero_grad(set_to_none=True)
                if step >= a.warmup:
                    mine = [e for e in events if e[2] >= start]
                    steps.append({"start": start, "end": end, "events": mine})
                    events.clear()
            out.append({"ok": True, "rank": rank, "steps": steps, "chunks": pipeline.chunk_ids})
        except Exception as e:  # noqa: BLE001 -- reported per case, the rest of the group is not run
            out.append({"ok": False, "rank": rank, "error": f"{type(e).__name__}: {str(e).strip()[:600]}"})
            break
    return out


# --- summary ----------------------------------------------------------------------------------

def summarize(case: dict, ranks: list[dict]) -> dict:
    """Idle fraction per rank over the measured steps, from the ranks' own timings."""
    n_steps = len(ranks[0]["steps"])
    step_times, busy, busy_cpu, by_kind = [], [0.0] * len(ranks), [0.0] * len(ranks), [{} for _ in ranks]
    own_wall = [0.0] * len(ranks)
    for s in range(n_steps):
        starts = [r["steps"][s]["start"] for r in ranks]
        ends = [r["steps"][s]["end"] for r in ranks]
        step_times.append(max(ends) - min(starts))
        for i, r in enumerate(ranks):
            own_wall[i] += ends[i] - starts[i]
            for kind, _, t0, t1, cpu in r["steps"][s]["events"]:
                busy[i] += t1 - t0
                busy_cpu[i] += cpu
                count, total = by_kind[i].get(kind, (0, 0.0))
                by_kind[i][kind] = (count + 1, total + t1 - t0)
    total = sum(step_times)
    idle = [1 - b / total for b in busy]
    mean_idle = sum(idle) / len(idle)
    origin = min(r["steps"][-1]["start"] for r in ranks)
    return {**case, "ok": True, "steps": n_steps, "step_time_s": total / n_steps,
            "step_times_s": step_times, "idle_fraction": mean_idle, "idle_fraction_per_rank": idle,
            "idle_fraction_own_wall_per_rank": [1 - b / w for b, w in zip(busy, own_wall)],
            "ratio": mean_idle / case["theory"],
            "busy_s_per_rank": [b / n_steps for b in busy],
            "busy_cpu_over_wall_per_rank": [c / b if b else None for c, b in zip(busy_cpu, busy)],
            "cpu_over_wall": sum(busy_cpu) / sum(busy) if sum(busy) else None,
            "actions_per_rank": [{k: {"count": c // n_steps, "mean_s": t / c} for k, (c, t) in bk.items()}
                                 for bk in by_kind],
            "chunks_per_rank": [r["chunks"] for r in ranks],
            # the last measured step, for plotting: rank -> [kind, chunk, start, end] (s from the step's start)
            "timeline_last_step": [[[k, c, round(t0 - origin, 5), round(t1 - origin, 5)]
                                    for k, c, t0, t1, _ in r["steps"][-1]["events"]] for r in ranks]}


def run(a: argparse.Namespace) -> dict:
    all_cases = cases(a)
    rows = [dict(c, ok=False) for c in all_cases if "skipped" in c]
    groups: dict[tuple, list[dict]] = {}
    for c in all_cases:
        if "skipped" not in c:
            groups.setdefault((c["schedule"], c["p"]), []).append(c)
    for (schedule, p), group in groups.items():
        load = os.getloadavg()[0]
        print(f"running {schedule} p={p} m={','.join(str(c['m']) for c in group)} "
              f"(load average {load:.1f} on {os.cpu_count()} cores)", file=sys.stderr, flush=True)
        try:
            per_rank = run_distributed(measure, p, a, group, timeout=a.timeout)
        except Exception as e:  # noqa: BLE001 -- a crashed or hung rank: every case of the group fails
            rows += [dict(c, ok=False, error=f"{type(e).__name__}: {str(e).strip()[-600:]}") for c in group]
            continue
        p2p = per_rank[0][0]["p2p_s"]
        per_rank = [r[1:] for r in per_rank]
        for i, case in enumerate(group):
            results = [r[i] if i < len(r) else None for r in per_rank]
            errors = [r for r in results if r is None or not r["ok"]]
            if errors:
                first = next((r["error"] for r in errors if r is not None), "not run: an earlier case failed")
                rows.append(dict(case, ok=False, error=first,
                                 failed_ranks=[k for k, r in enumerate(results) if r is None or not r["ok"]]))
            else:
                row = summarize(case, results)
                forward = [a["F"]["mean_s"] for a in row["actions_per_rank"]]
                rows.append(dict(row, load_average=load, p2p_s=p2p,
                                 p2p_over_forward=p2p / (sum(forward) / len(forward))))
    order = {(c["schedule"], c["p"], c["m"]): k for k, c in enumerate(all_cases)}
    rows.sort(key=lambda r: order[(r["schedule"], r["p"], r["m"])])
    cores = os.cpu_count()
    return {"cores": cores, "max_processes": max(int(s) for s in a.stages.split(",")),
            "contention": [int(p) for p in a.stages.split(",") if int(p) > cores],
            "load_average": list(os.getloadavg()),
            "torch_threads_per_process": 1,
            "model": {"kind": "gpt", "hidden": a.hidden, "heads": a.heads, "ffn": a.ffn, "vocab": a.vocab,
                      "layers_per_rank": a.layers_per_rank, "seq_length": a.length,
                      "micro_batch": a.micro_batch},
            "steps": a.steps, "warmup": a.warmup,
            "idle_definition": "1 - busy_r / T, T = last end - first start of the step over ranks (after a barrier), "
                               "busy_r = wall time in forward/backward/weight-backward chunks and the loss",
            "theory": "(p-1)/(v*m+p-1); zero-bubble schedules: the interleaved value, as a reference",
            "rows": rows}


def print_table(result: dict) -> None:
    head = (f"{'schedule':24} {'p':>2} {'m':>2} {'v':>2} {'idle':>6} {'theory':>6} {'ratio':>6} "
            f"{'step s':>7} {'cpu/wall':>8} {'p2p/F':>6}  idle per rank")
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        prefix = f"{r['schedule']:24} {r['p']:2d} {r['m']:2d} {r['v']:2d}"
        if r.get("ok"):
            per_rank = " ".join(f"{x:.2f}" for x in r["idle_fraction_per_rank"])
            print(f"{prefix} {r['idle_fraction']:6.3f} {r['theory']:6.3f} {r['ratio']:6.2f} "
                  f"{r['step_time_s']:7.3f} {r['cpu_over_wall']:8.2f} {r['p2p_over_forward']:6.2f}  {per_rank}")
        elif "skipped" in r:
            print(f"{prefix} {'skipped':>6}  {r['skipped']}")
        else:
            print(f"{prefix} {'FAILED':>6}  {r['error'].splitlines()[-1][:150]}")
    cores, load = result["cores"], result["load_average"][0]
    print(f"\n{cores} cores, load average {load:.1f} at the end; one process per stage, 1 torch thread each.")
    if result["contention"]:
        print(f"p={','.join(map(str, result['contention']))} runs more processes than cores: stages contend for "
              f"the CPU. That bends the measurement both ways: compute slows while all ranks are busy (busy grows, "
              f"idle reads low) and a rank whose input has arrived may wait for a core (idle reads high); "
              f"cpu/wall < 1 shows it (so does load from other users of the machine).")
    print("p2p/F = one-way gloo send+recv of one activation / mean forward of a chunk: the theory counts "
          "communication as free, the measurement counts it (and the schedule's Python between actions) as idle.")
    print("idle = 1 - busy/T per rank, mean over ranks; theory = (p-1)/(v*m+p-1) "
          "(zero-bubble schedules: the interleaved value, which they aim to beat); ratio = idle/theory.")


def main(argv=None) -> int:
    a = parse_args(argv)
    result = run(a)
    print_table(result)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
