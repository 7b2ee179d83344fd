"""Ring attention against full causal SDPA on one process: outputs and q/k/v gradients, on 1, 2 and 4 ranks."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from forked_ranks import run_distributed

HEADS = 4
# (key heads, documents, dtype): multi-head, grouped-query and multi-query attention, with and without packed
# documents, in float64 (tight) and float32
CASES = [(key_heads, documents, torch.float64) for key_heads, documents in itertools.product((4, 2, 1), (False, True))]
CASES += [(2, True, torch.float32)]


def _random_documents(generator: torch.Generator, batch: int, length: int) -> torch.Tensor:
    """(batch, length) document ids: documents of fewer than length/3 tokens (at least 1)."""
    rows = []
    for _ in range(batch):
        lengths = torch.randint(1, max(2, length // 3), (length,), generator=generator, device="cpu")
        rows.append(torch.repeat_interleave(torch.arange(length, device="cpu"), lengths)[:length])
    return torch.stack(rows)


def _full_attention(q, k, v, document_ids):
    """Full causal (block-diagonal causal with documents) SDPA over the whole sequence."""
    if document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    length = q.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    mask = (document_ids[:, None, :, None] == document_ids[:, None, None, :]) & causal
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _ring_errors(rings: list[list[int]]) -> dict:
    """On this rank, for each ring of ``rings`` (the ranks of a group) it belongs to and each case: the largest
    relative difference of the ring's output and q, k, v gradients from full SDPA's rows of this rank's tokens.
    The ring runs with the meta device as the default, so any tensor it makes without naming a device fails."""
    import torch.distributed as dist

    from paratrain.parallel.ring_attention import ring_attention

    dist.init_process_group("gloo")
    batch, chunk, head_dim = 2, 3, 8
    errors = {}
    for ranks in rings:
        group = dist.new_group(ranks)
        if dist.get_rank() not in ranks:
            continue
        rank, size = dist.get_rank(group), len(ranks)
        local_tokens = torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk, device="cpu"),
                                  torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device="cpu")])
        length = 2 * size * chunk
        for key_heads, documents, dtype in CASES:
            generator = torch.Generator(device="cpu").manual_seed(size * 100 + key_heads * 10 + documents)
            q, k, v, grad_out = (torch.randn(batch, heads, length, head_dim, generator=generator, dtype=dtype,
                                             device="cpu") for heads in (HEADS, key_heads, key_heads, HEADS))
            document_ids = _random_documents(generator, batch, length) if documents else None
            if documents and size > 1:
                assert (document_ids[:, chunk::chunk] == document_ids[:, chunk - 1:-1:chunk]).any(), \
                    "the case needs a document crossing a chunk border"
            full_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            full = _full_attention(*full_leaves, document_ids)
            (full * grad_out).sum().backward()

            local = [t[:, :, local_tokens].requires_grad_() for t in (q, k, v)]
            with torch.device("meta"):
                out = ring_attention(*local, group, None if document_ids is None else document_ids[:, local_tokens])
                (out * grad_out[:, :, local_tokens]).sum().backward()
            pairs = [(out.detach(), full.detach())] + [(mine.grad, whole.grad)
                                                       for mine, whole in zip(local, full_leaves)]
            errors[(str(ranks), key_heads, documents, str(dtype))] = [
                float((mine - whole[:, :, local_tokens]).abs().max() / whole.abs().max()) for mine, whole in pairs]
    return errors


@pytest.mark.timeout(120)
# rings of 1 and 2 ranks in a world of 2; of 4, and of 2 whose group ranks are not their global ranks, in a world of 4
@pytest.mark.parametrize("world_size, rings", [(2, [[0], [0, 1]]), (4, [[0, 1, 2, 3], [1, 3]])])
def test_ring_attention_matches_full_causal_attention(world_size, rings):
    for rank, errors in enumerate(run_distributed(_ring_errors, world_size, rings, timeout=100)):
        assert len(errors) == len(CASES) * sum(rank in ranks for ranks in rings)
        for (ranks, key_heads, documents, dtype), relative in errors.items():
            tolerance = 1e-12 if dtype == "torch.float64" else 1e-5
            assert max(relative) < tolerance, (f"rank {rank} in ring {ranks}, {key_heads} key heads, documents "
                                               f"{documents}, {dtype}: out, dq, dk, dv differ by {relative}")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("key_heads", [4, 1])
@pytest.mark.parametrize("masking", ["causal", "documents"])
def test_matmul_block_attention_matches_the_fused_kernel(key_heads, masking):
    """The plain-matmul block attention (the ring's kernel off the CPU) against the CPU's fused flash kernel:
    output and log-sum-exp (also of queries the mask leaves no key), and the gradients given another attention's
    output and log-sum-exp, as the ring's backward passes them."""
    from paratrain.parallel import ring_attention as ring

    generator = torch.Generator(device="cpu").manual_seed(key_heads)
    q, grad_out, out = (torch.randn(2, HEADS, 6, 8, generator=generator, dtype=torch.float64, device="cpu")
                        for _ in range(3))
    k, v = (torch.randn(2, key_heads, 5, 8, generator=generator, dtype=torch.float64, device="cpu") for _ in range(2))
    bias = None
    if masking == "documents":
        query_documents, key_documents = (_random_documents(generator, 2, 6), _random_documents(generator, 2, 5) + 2)
        same = query_documents[:, None, :, None] == key_documents[:, None, None, :]
        bias = torch.zeros(same.shape, dtype=torch.float64, device="cpu").masked_fill(~same, float("-inf"))
        assert (~same).all(-1).any() and same.any(), "the case needs queries without keys and with keys"
    causal = masking == "causal"
    fused = ring._flash_cpu_forward(q, k, v, bias, causal)
    matmul = ring._matmul_forward(q, k, v, bias, causal)
    for mine, reference in zip(matmul, fused):
        torch.testing.assert_close(mine, reference, rtol=1e-12, atol=1e-12)
    lse = fused[1].logaddexp(torch.randn(fused[1].shape, generator=generator, dtype=torch.float64, device="cpu"))
    gradients = (grad_out, q, k, v, out, lse, bias, causal)
    for mine, reference in zip(ring._matmul_backward(*gradients), ring._flash_cpu_backward(*gradients)):
        torch.testing.assert_close(mine, reference, rtol=1e-12, atol=1e-12)
