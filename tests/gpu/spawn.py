"""Run a function on N GPUs: one spawned process per rank (never forked: CUDA cannot be used in a forked
child), joined into one process group through the torchrun variables, results back by rank. With fewer GPUs
than ranks (``PARATRAIN_SHARED_GPU=1``, set by conftest) the ranks share them and their collectives go over gloo,
which stages CUDA tensors through host memory in its collectives but not in point-to-point ops: those are staged
here (``stage_point_to_point_through_host``)."""
from __future__ import annotations

import os
import pickle
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from forked_ranks import free_port
from paratrain.device import shares_gpus


def rank_devices(world_size: int) -> list[str]:
    """The device each rank trains on: its own GPU, or with shared GPUs ``cuda:rank % GPUs``."""
    count = torch.cuda.device_count() if shares_gpus() else world_size
    return [f"cuda:{rank % count}" for rank in range(world_size)]


def collective_backend() -> str:
    """The backend of the ranks' CUDA tensors: NCCL, or gloo when they share GPUs."""
    return "gloo" if shares_gpus() else "nccl"


STAGED_DEVICES = ("cuda",)  # the devices whose tensors point-to-point ops copy through host memory


class HostStagedWork:
    """Point-to-point works whose device tensors went through host copies: waiting for it waits for them all
    (once), then copies what was received into the device tensors."""

    def __init__(self, works: list, received: list[tuple]):
        self.works, self.received, self.done = works, received, False

    def wait(self, timeout=None) -> bool:
        if not self.done:
            for work in self.works:
                work.wait()
            with torch.no_grad():  # a received activation's buffer requires grad; the transport writes it as data
                for tensor, host in self.received:
                    tensor.copy_(host)
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


def stage_point_to_point_through_host() -> None:
    """Make ``isend``/``irecv``/``batch_isend_irecv`` carry ``STAGED_DEVICES`` tensors through host copies, in this
    process: gloo's send and recv hand a tensor's memory to its TCP transport as host memory (ProcessGroupGloo::send
    takes ``tensor.data_ptr()``), so a CUDA tensor cannot go as it is. Only for ranks sharing a GPU over gloo
    (the pipeline's activations and gradients between stages); every wait of a batch waits for all of it, as
    torch's pipeline schedules of some releases wait only for the last work of a batch."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    isend, irecv, batch_isend_irecv = c10d.isend, c10d.irecv, c10d.batch_isend_irecv

    def staged_isend(tensor, *args, **kwargs):
        return isend(tensor.cpu() if tensor.device.type in STAGED_DEVICES else tensor, *args, **kwargs)

    def staged_irecv(tensor, *args, **kwargs):
        if tensor.device.type not in STAGED_DEVICES:
            return irecv(tensor, *args, **kwargs)
        host = torch.empty_like(tensor, device="cpu")
        return HostStagedWork([irecv(host, *args, **kwargs)], [(tensor, host)])

    def staged_batch_isend_irecv(p2p_op_list):
        works = batch_isend_irecv(p2p_op_list)  # calls each op's isend/irecv: the staged ones above
        return [HostStagedWork(works, [])] * len(works)

    for module in (c10d, dist):  # P2POp checks its op against c10d's; the pipeline calls dist's
        module.isend, module.irecv, module.batch_isend_irecv = staged_isend, staged_irecv, staged_batch_isend_irecv


def gpu_env(root: Path) -> dict[str, str]:
    """The environment of a GPU worker: CUDA named explicitly (``auto`` would fall back to the CPU), temporary
    files, compile caches and job directories under ``root``, and collectives that fail instead of hanging."""
    return {"PARATRAIN_DEVICE": "cuda", "TMPDIR": str(root), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
            "PARATRAIN_HOME": str(root / "runs"), "PARATRAIN_COLLECTIVE_TIMEOUT": "120"}


def _rank_main(rank: int, world_size: int, port: int, env: dict, fn, args: tuple, result_dir: str) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    if shares_gpus():
        stage_point_to_point_through_host()
    try:
        result = fn(*args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(Path(result_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def run_spawned(fn, world_size: int, *args, root: Path, timeout: float = 300.0) -> list:
    """``fn(*args)`` on ranks 0..world_size-1 (on ``rank_devices``) in the ``gpu_env(root)`` environment;
    returns the results by rank.

    ``fn`` must be importable (a module-level function). A failed rank raises here with its traceback
    (the others are stopped); ranks still running after ``timeout`` seconds are killed and named.
    """
    root.mkdir(parents=True, exist_ok=True)
    result_dir = Path(tempfile.mkdtemp(prefix="results-", dir=root))
    context = mp.start_processes(_rank_main, args=(world_size, free_port(), gpu_env(root), fn, args, str(result_dir)),
                                 nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                alive = [r for r, p in enumerate(context.processes) if p.is_alive()]
                raise TimeoutError(f"ranks {alive} of {world_size} did not finish in {timeout:.0f} s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
    results = []
    for rank in range(world_size):
        with open(result_dir / f"rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results
