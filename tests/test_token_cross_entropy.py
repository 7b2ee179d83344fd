"""token_cross_entropy of bf16/fp16 logits (paratrain.nn.CrossEntropyLoss's under autocast) without an fp32 copy
of them: each token's loss and the logits' gradient are F.cross_entropy's of the logits made fp32, labels of
-100 ignored, in chunks of rows too."""
import pytest
import torch
import torch.nn.functional as F

from paratrain.modules import linear_cross_entropy
from paratrain.modules.linear_cross_entropy import token_cross_entropy
from paratrain.nn import CrossEntropyLoss


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows_per_chunk", [None, 7], ids=["one_chunk", "chunks_of_7"])
def test_low_precision_logits_give_the_fp32_loss_and_gradient(monkeypatch, dtype, rows_per_chunk):
    if rows_per_chunk:
        monkeypatch.setattr(linear_cross_entropy, "chunk_rows", lambda vocab, device: rows_per_chunk)
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(4, 10, 50, generator=generator)).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (4, 10), generator=generator)
    labels[:, -3:] = -100
    weights = torch.randn(40, generator=generator)

    got = token_cross_entropy(logits, labels)
    (got * weights).sum().backward()
    got_grad, logits.grad = logits.grad, None
    want = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    (want * weights).sum().backward()

    assert got.dtype == torch.float32 and got_grad.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert bool((got.view(4, 10)[:, -3:] == 0).all()) and bool((got_grad[:, -3:] == 0).all())
    torch.testing.assert_close(got_grad, logits.grad)  # both rounded to the logits' dtype once


def test_the_loss_under_bf16_autocast_keeps_no_fp32_copy_of_the_logits():
    head, loss_fn = torch.nn.Linear(8, 64), CrossEntropyLoss()
    hidden, labels, mask = torch.randn(2, 5, 8), torch.randint(0, 64, (2, 5)), torch.ones(2, 5)
    mask[1, 3:] = 0
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(head(hidden), labels, mask)
    assert not [t for t in saved if t.dtype == torch.float32 and t.dim() and t.shape[-1] == 64 and t.numel() >= 10 * 64]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head(hidden)
    kept = mask.flatten() != 0
    want = F.cross_entropy(logits.float().flatten(0, 1)[kept], labels.flatten()[kept])
    torch.testing.assert_close(loss, want.reshape(1), rtol=1e-5, atol=1e-5)  # MindSpore's (1,)
