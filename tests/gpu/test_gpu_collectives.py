"""Every collective paratrain's parallel paths call, on CUDA tensors over two ranks, against the values they must
give: NCCL on two GPUs, or gloo when the ranks share one (conftest) -- gloo stages CUDA tensors through the host
in its collectives, and this test is where one it cannot carry shows. Its point-to-point ops take no CUDA tensors
(they hand the tensor's memory to the transport as host memory), so with shared GPUs they go through host copies
made by tests/gpu/spawn.py, as the pipeline's do. With ``PARATRAIN_GPU_REPORT=DIR`` the results are also written
to DIR/collectives.json (tools/gpu_check.sh)."""
import json
import os
from pathlib import Path

import pytest
import torch

from gpu.spawn import collective_backend, run_spawned
from paratrain.device import shares_gpus

pytestmark = pytest.mark.gpu(2)


def collectives_on_cuda() -> dict[str, str]:
    """Worker: each collective's outcome on this rank, "ok" or what went wrong (one line)."""
    import torch.distributed as dist

    from paratrain.device import backend, device
    from paratrain.distributed import init_from_env

    rank, world = init_from_env()
    cuda = device()
    results = {"backend": backend(), "device": str(cuda),
               "point-to-point": "staged through host copies" if shares_gpus() else "direct"}

    def mine(n=8, dtype=torch.float32):
        return (torch.arange(n, device=cuda) + 100 * rank).to(dtype)

    def every(n=8, dtype=torch.float32):
        return [(torch.arange(n, device=cuda) + 100 * r).to(dtype) for r in range(world)]

    def all_reduce(op, want):
        t = mine()
        dist.all_reduce(t, op=op)
        return t, want

    def reduce_scatter(dtype):
        out = torch.empty(4, device=cuda, dtype=dtype)
        dist.reduce_scatter_tensor(out, mine(4 * world, dtype))
        return out, sum(every(4 * world, dtype))[4 * rank:4 * rank + 4]

    def all_gather_into(dtype):
        out = torch.empty(8 * world, device=cuda, dtype=dtype)
        dist.all_gather_into_tensor(out, mine(8, dtype))
        return out, torch.cat(every(8, dtype))

    def all_gather_list():
        out = [torch.empty(8, device=cuda) for _ in range(world)]
        dist.all_gather(out, mine())
        return torch.cat(out), torch.cat(every())

    def broadcast():
        t = mine()
        dist.broadcast(t, 0)
        return t, every()[0]

    def all_to_all():
        out = torch.empty(2 * world, device=cuda)
        dist.all_to_all_single(out, mine(2 * world))
        return out, torch.cat([e[2 * rank:2 * rank + 2] for e in every(2 * world)])

    def send_recv():  # the pipeline's point-to-point
        t = mine()
        if rank == 0:
            dist.isend(t, 1).wait()
            return t, t
        dist.irecv(t, 0).wait()
        return t, every()[0]

    def batched_send_recv():  # torch.distributed.pipelining's schedules batch them
        t, peer = mine(), 1 - rank
        out = torch.empty_like(t)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, out, peer)]):
            work.wait()
        return out, every()[peer]

    checks = {"all_reduce sum": lambda: all_reduce(dist.ReduceOp.SUM, sum(every())),
              "all_reduce avg": lambda: all_reduce(dist.ReduceOp.AVG, sum(every()) / world),
              "all_reduce max": lambda: all_reduce(dist.ReduceOp.MAX, every()[-1]),
              "broadcast": broadcast, "all_gather": all_gather_list,
              "all_gather_into_tensor fp32": lambda: all_gather_into(torch.float32),
              "all_gather_into_tensor bf16": lambda: all_gather_into(torch.bfloat16),
              "reduce_scatter_tensor fp32": lambda: reduce_scatter(torch.float32),
              "reduce_scatter_tensor bf16": lambda: reduce_scatter(torch.bfloat16),
              "all_to_all_single": all_to_all, "isend/irecv": send_recv, "batch_isend_irecv": batched_send_recv}
    for name, check in checks.items():
        try:
            got, want = check()
            results[name] = "ok" if torch.equal(got.cpu(), want.cpu()) else f"wrong values: {got.tolist()}"
        except Exception as exc:  # noqa: BLE001 -- reported by name, the next collective still tried
            results[name] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        if results[name] != "ok":  # a failed collective may leave the group unusable: stop here
            break
    return results


@pytest.mark.timeout(200)
def test_every_collective_carries_cuda_tensors(tmp_path):
    ranks = run_spawned(collectives_on_cuda, 2, root=tmp_path, timeout=150)
    report = os.environ.get("PARATRAIN_GPU_REPORT")
    if report:
        Path(report, "collectives.json").write_text(json.dumps(ranks, indent=1))
    assert [r["backend"] for r in ranks] == [collective_backend()] * 2
    failed = {name: outcome for r in ranks for name, outcome in r.items()
              if name not in ("backend", "device", "point-to-point") and outcome != "ok"}
    assert not failed, failed
    assert len(ranks[0]) == 3 + 12  # every check ran
