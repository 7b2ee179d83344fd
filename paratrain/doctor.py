"""``paratrain doctor``: is this machine (or this set of machines) ready to train?

It reports the environment, then across the ranks of a launched job checks the rendezvous and that all-reduce is
exact, and measures all-reduce bus bandwidth as nccl-tests do (back-to-back, one synchronisation, algorithm bandwidth
x 2(n-1)/n) from 1 KB up to ``--size-mb`` (default 1 GiB on GPUs, where NVLink needs large messages; 16 MB over gloo).
``--duration`` keeps measuring (a network soak test). Without a launch, ``--nproc-per-node``/``--hostfile`` start one.
"""
from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time

SIZES_MB = (1 / 1024, 1.0, 16.0, 256.0)  # 1 KB (latency), ... up to --size-mb, which is measured last
DEFAULT_SIZE_MB = {"cuda": 1024.0, "cpu": 16.0}


def environment() -> list[tuple[str, str]]:
    """(key, value) rows describing this process's software and devices."""
    import torch
    import torch.distributed as dist

    from paratrain.device import backend
    from paratrain.host_memory import describe

    rows = [("host", socket.gethostname()), ("python", platform.python_version()),
            ("platform", platform.platform()), ("torch", torch.__version__),
            ("cpu cores", str(os.cpu_count())), ("torch threads", str(torch.get_num_threads()))]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        rows += [("cuda", str(torch.version.cuda)), ("devices", f"{len(names)}: {', '.join(names)}"),
                 ("nccl", ".".join(map(str, torch.cuda.nccl.version())))]
    else:
        rows += [("cuda", "not available"), ("devices", "cpu")]
    return rows + [("backend", backend()), ("host allocator", describe()),
                   ("gloo", "available" if dist.is_gloo_available() else "MISSING")]


def check_all_reduce(world: int, rank: int, device="cpu") -> list[str]:
    """Problems found when all-reducing known values on ``device`` (sum and average, fp32 and int64); [] if exact."""
    import torch
    import torch.distributed as dist

    problems = []
    base = torch.arange(1024, dtype=torch.float32, device=device)
    for dtype, op, expected in ((torch.float32, dist.ReduceOp.SUM, base * world * (world + 1) / 2),
                                (torch.int64, dist.ReduceOp.SUM, (base * world * (world + 1) / 2).long()),
                                (torch.float32, dist.ReduceOp.AVG, base * (world + 1) / 2)):
        tensor = (base * (rank + 1)).to(dtype)
        dist.all_reduce(tensor, op=op)
        if not torch.equal(tensor, expected.to(dtype)):
            worst = (tensor.double() - expected.double()).abs().max().item()
            problems.append(f"all_reduce {op} {dtype}: max error {worst:g} on rank {rank}")
    return problems


def from_rank0(value: int, device) -> int:
    """Rank 0's ``value`` on every rank, so that all ranks run the same collectives."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([int(value)], device=device)
    dist.broadcast(tensor, 0)
    return int(tensor.item())


def timed_all_reduces(tensor, iters: int) -> float:
    """Seconds per all-reduce of ``tensor`` over ``iters`` back-to-back ones, the device waited for once at
    the end (NCCL queues them on its stream; gloo's return when done)."""
    import torch.distributed as dist

    from paratrain.metrics.timer import synchronize

    synchronize(tensor.device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    synchronize(tensor.device)
    return (time.perf_counter() - start) / iters


def bus_bandwidth(size_mb: float, device, min_time_s: float = 0.5, max_iters: int = 1000) -> tuple[float, float]:
    """(seconds per all-reduce, bus bandwidth in GB/s) for a float32 tensor of ``size_mb``: two warm-up
    all-reduces, one timed to size the run, then as many as fill ``min_time_s`` (at most ``max_iters``),
    the count taken from rank 0 so that every rank runs the same collectives."""
    import torch
    import torch.distributed as dist

    tensor = torch.ones(max(1, int(size_mb * 2**20 / 4)), device=device)
    timed_all_reduces(tensor, 2)
    once = max(timed_all_reduces(tensor, 1), 1e-6)
    seconds = timed_all_reduces(tensor, from_rank0(min(max_iters, max(1, int(min_time_s / once))), device))
    world = dist.get_world_size()
    return seconds, tensor.numel() * 4 / seconds * 2 * (world - 1) / world / 1e9


def worker(args) -> int:
    """The check run by every rank of a launched job; rank 0 prints the report."""
    import torch.distributed as dist

    from paratrain import progress
    from paratrain.device import device as run_device
    from paratrain.distributed import init_from_env

    rank, world = init_from_env()
    progress.start(rank)
    device = run_device()
    say = print if rank == 0 else (lambda *a, **k: None)
    for key, value in environment():
        say(f"{key:>14}: {value}")
    if world == 1:
        say("single process: no collectives to check (use --nproc-per-node N or --hostfile F)")
        return 0
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    say(f"{'rendezvous':>14}: ok, {world} ranks on {len(set(hosts))} host(s): "
        + ", ".join(f"{r}@{h}" for r, h in enumerate(hosts)))
    problems = check_all_reduce(world, rank, device)
    everyone = [None] * world
    dist.all_gather_object(everyone, problems)
    problems = [p for ps in everyone for p in ps]
    say(f"{'all_reduce':>14}: " + ("ok (sum, avg; float32, int64; exact)" if not problems else "FAILED"))
    for problem in problems:
        say(f"{'':>14}  {problem}")
    largest = args.size_mb or DEFAULT_SIZE_MB.get(device.type, DEFAULT_SIZE_MB["cpu"])
    for size in (*(s for s in SIZES_MB if s < largest), largest):
        seconds, busbw = bus_bandwidth(size, device)
        say(f"{'bandwidth':>14}: {size * 2**20:>12,.0f} bytes  {seconds * 1e3:8.2f} ms  bus {busbw:6.2f} GB/s",
            flush=True)
    end, step = time.monotonic() + args.duration, 0
    while from_rank0(time.monotonic() < end, device):
        seconds, busbw = bus_bandwidth(largest, device, min_time_s=1.0)
        step += 1
        progress.step_done(step)  # one soak measurement is a step
        say(f"{'soak':>14}: {largest:g} MB all_reduce {seconds * 1e3:8.2f} ms  bus {busbw:6.2f} GB/s", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if problems else 0


def cmd_doctor(args) -> int:
    if "WORLD_SIZE" in os.environ or not (args.hostfile or (args.nproc_per_node or 1) > 1):
        return worker(args)
    launch = [sys.executable, "-m", "paratrain", "launch", "--name",
              args.name or f"doctor-{time.strftime('%Y%m%d-%H%M%S')}"]
    launch += ["--hostfile", args.hostfile] if args.hostfile else ["--nproc-per-node", str(args.nproc_per_node)]
    sizes = [f"--size-mb={args.size_mb:g}"] if args.size_mb else []
    return subprocess.call([*launch, "--", "doctor", *sizes, f"--duration={args.duration:g}"])


def register(sub) -> None:
    """Add ``doctor`` to the ``paratrain`` subcommand parser."""
    p = sub.add_parser("doctor", help="environment report, rendezvous + all-reduce check, all-reduce bandwidth")
    p.add_argument("--nproc-per-node", type=int, help="check this many ranks on this machine")
    p.add_argument("--hostfile", help="check the hosts of this DeepSpeed hostfile (over ssh)")
    p.add_argument("--name", help="job name of the check (default doctor-<time>)")
    p.add_argument("--size-mb", type=float, default=0.0,
                   help="largest all-reduce measured (default 1024 MB on GPUs, 16 MB on the CPU)")
    p.add_argument("--duration", type=float, default=0.0,
                   help="then keep measuring for this many seconds (network soak test)")
    p.set_defaults(func=cmd_doctor)
