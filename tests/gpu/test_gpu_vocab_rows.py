"""One GPU: the vocabulary rows' path (``paratrain.parallel.vocab``: the tokens travel to a row-sharded word
table and head, ZeRO 2 and 3) runs its collectives, lookup, fused head and their gradients on CUDA, in fp32
and under bf16 autocast, and gives the plain lookup's and head's loss and gradients.

With one rank every row is this rank's: the 2-GPU tests (tests/gpu/test_gpu_parallel.py) split them.
"""
import pytest
import torch
import torch.nn.functional as F

from gpu.spawn import run_spawned

IGNORE = -100


def vocab_rows(device_type: str, backend: str) -> dict:
    """Worker (one rank): for fp32 and bf16 autocast, the largest differences between the vocabulary-rows path and
    the plain one in the loss and in the table's and head's gradients, with the scale of each, and their devices."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from paratrain.modules.linear_cross_entropy import linear_token_loss_sum
    from paratrain.parallel.vocab import RowsOfRanks, _TokenLookup

    dist.init_process_group(backend)
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device_type, (1,))
    gen = torch.Generator(device="cpu").manual_seed(0)
    vocab, hidden = 512, 64
    table = torch.randn(vocab, hidden, generator=gen, device="cpu").to(device, non_blocking=True)
    head = (torch.randn(vocab, hidden, generator=gen, device="cpu") / 8).to(device, non_blocking=True)
    ids = torch.randint(0, vocab, (4, 16), generator=gen, device="cpu").to(device, non_blocking=True)
    labels = torch.randint(0, vocab, (4, 16), generator=gen, device="cpu")
    labels[0, :3] = IGNORE  # pads
    labels = labels.to(device, non_blocking=True)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        rows_table = torch.nn.Parameter(distribute_tensor(table, mesh, [Shard(0)]))
        rows_head = torch.nn.Parameter(distribute_tensor(head, mesh, [Shard(0)]))
        plain_table, plain_head = (t.clone().requires_grad_() for t in (table, head))
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            embedded = _TokenLookup.apply(ids, rows_table.to_local(), RowsOfRanks(rows_table), dtype)
            loss = linear_token_loss_sum(embedded, rows_head.to_local(), labels, IGNORE, RowsOfRanks(rows_head))
            plain_loss = linear_token_loss_sum(F.embedding(ids, plain_table).to(dtype), plain_head, labels, IGNORE)
        (loss + plain_loss).backward()
        table_grad, head_grad = rows_table.grad.to_local(), rows_head.grad.to_local()
        out[name] = {"loss": (abs(loss - plain_loss).item(), abs(plain_loss).item()),
                     "table": ((table_grad - plain_table.grad).abs().max().item(), plain_table.grad.abs().max().item()),
                     "head": ((head_grad - plain_head.grad).abs().max().item(), plain_head.grad.abs().max().item()),
                     "devices": sorted({str(t.device) for t in (embedded, loss, table_grad, head_grad)}),
                     "dtypes": (str(embedded.dtype), str(table_grad.dtype), str(head_grad.dtype))}
    return out


@pytest.mark.timeout(200)
def test_vocab_rows_lookup_and_head_on_one_gpu(tmp_path):
    (r,) = run_spawned(vocab_rows, 1, "cuda", "nccl", root=tmp_path, timeout=150)
    for name, tolerance in (("fp32", 1e-5), ("bf16", 2e-2)):
        got = r[name]
        assert got["devices"] == ["cuda:0"], got
        assert got["dtypes"] == (f"torch.{'float32' if name == 'fp32' else 'bfloat16'}", "torch.float32",
                                 "torch.float32"), got
        for part in ("loss", "table", "head"):
            difference, scale = got[part]
            assert scale > 0 and difference <= tolerance * scale, (name, part, got[part])
