"""Run a function in N forked processes joined into one gloo process group (faster than torchrun)."""
from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        results.put((rank, True, fn(*args)))
        if dist.is_initialized():  # a rank that tore its group down early would reset a peer still connecting
            dist.barrier()
    except BaseException:  # report every failure to the parent, which names the rank
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0):
    """``fn(*args)`` on every rank; returns the list of results by rank, raises naming a failed rank."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + timeout
    try:
        while len(out) < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(out))} did not finish in {timeout} s")
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]


def loss_recorder():
    """A ``paratrain.train`` callback keeping each step's loss in its ``values``."""
    from paratrain.train import Callback

    class Losses(Callback):
        def __init__(self):
            self.values = []

        def on_train_step_end(self, run_context):
            self.values.append(float(run_context.original_args().net_outputs))

    return Losses()


def example_losses(script, argv: list[str]) -> list[float]:
    """Run an example script's ``main(argv, extra_callbacks)`` in this process (a rank of ``run_distributed``);
    the losses its ``Model.train`` computed, one per step. The script's folder is importable, as with
    ``python script.py``."""
    import importlib.util
    import sys

    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    losses = loss_recorder()
    module.main(argv, extra_callbacks=[losses])
    return losses.values
