"""Model.train's step costs what a plain torch loop over the same net costs: on a step no callback reads, no
read of a device value by the host but the net's own (its stack recognising the mask, once a forward), no more ops over tensors (forward, backward, gradient norm, optimizer,
zero_grad) than the loop's, and only a few more on scalars (the loss's token count and normalisation). The checks
of a batch on the host (its shapes, its ids against the embedding tables) come as it is drawn, before its step
begins, and are not counted here."""
import collections

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import host_reads

from paratrain import nn as msnn
from paratrain.train import Callback, Model

B, T, H, V = 4, 16, 32, 64
MEASURED_STEP = 3  # a step after the first (placement, optimizer state made)
# at most this many more ops on scalars: the loss's (sum, count) pair, its token mean and its normalisation over
# the step's tokens (paratrain.parallel.micro_batches.StepLoss), each a kernel of one element on a GPU (33
# measured, 3 of them the loss's own mean, which the placement's hook on its TokenMean then replaces)
SCALAR_OPS = 33


class LanguageModel(torch.nn.Module):
    """The tutorial's LM: word and position embeddings, an encoder under a causal x padding mask, a head, the
    masked token loss."""

    def __init__(self):
        super().__init__()
        self.words, self.positions = msnn.VocabEmbedding(V, H), msnn.VocabEmbedding(T, H)
        self.encoder = msnn.TransformerEncoder(batch_size=B, num_layers=2, hidden_size=H, ffn_hidden_size=2 * H,
                                               seq_length=T, num_heads=4, attention_dropout_rate=0.0,
                                               hidden_dropout_rate=0.0)
        self.head, self.loss = torch.nn.Linear(H, V), msnn.CrossEntropyLoss()

    def forward(self, ids, input_mask, labels):
        words, _ = self.words(ids)
        positions, _ = self.positions(torch.arange(T, device=ids.device)[None].expand(B, T))
        mask = torch.ones(T, T, device=ids.device).tril().expand(B, T, T) * input_mask[:, None, :]
        hidden, _ = self.encoder(words + positions, mask)
        return self.loss(self.head(hidden), labels, input_mask)


def batches(steps: int):
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, V, (B, T), generator=generator)
        yield ids, torch.ones(B, T), ids.roll(-1, 1)


class OpCounter(TorchDispatchMode):
    """The ops dispatched while it is on, by name: in ``ops`` those of any tensor with more than 2 elements, in
    ``scalar_ops`` the others."""

    def __init__(self):
        super().__init__()
        self.ops, self.scalar_ops = collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        (self.ops if any(t.numel() > 2 for t in tensors) else self.scalar_ops)[str(func.overloadpacket)] += 1
        return out


def optimizer(net):
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, foreach=True)  # reads no step count


def model_step(host_reads) -> tuple[OpCounter, list]:
    torch.manual_seed(0)
    net = LanguageModel()
    counter, reads = OpCounter(), []

    class Measure(Callback):
        def on_train_step_begin(self, run_context):
            if run_context.original_args().cur_step_num == MEASURED_STEP:
                host_reads.clear()
                counter.__enter__()

        def on_train_step_end(self, run_context):
            if run_context.original_args().cur_step_num == MEASURED_STEP + 1:
                counter.__exit__(None, None, None)
                reads.extend(host_reads)

    Model(net, optimizer=optimizer(net)).train(1, list(batches(MEASURED_STEP + 2)), callbacks=[Measure()])
    return counter, reads


def loop_step(host_reads) -> tuple[OpCounter, list]:
    torch.manual_seed(0)
    net = LanguageModel()
    opt = optimizer(net)
    counter, reads = OpCounter(), []
    for step, batch in enumerate(batches(MEASURED_STEP + 2)):
        if step == MEASURED_STEP:
            host_reads.clear()
            counter.__enter__()
        net(*batch).backward()
        torch.nn.utils.get_total_norm([p.grad for p in net.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == MEASURED_STEP:
            counter.__exit__(None, None, None)
            reads.extend(host_reads)
    return counter, reads


@pytest.mark.timeout(120)
def test_a_model_train_step_reads_nothing_and_adds_only_scalar_ops(monkeypatch):
    reads = host_reads(monkeypatch)
    model, model_reads = model_step(reads)
    loop, loop_reads = loop_step(reads)
    # the net's one read, in both: how many rows of its mask are causal (paratrain.nn.layers.recognise_mask)
    assert model_reads == loop_reads == ["__int__"]
    assert sum(loop.ops.values()) > 100  # the count saw forward, backward and the optimizer
    assert model.ops == loop.ops, (model.ops - loop.ops, loop.ops - model.ops)
    extra_scalar_ops = sum(model.scalar_ops.values()) - sum(loop.scalar_ops.values())
    assert extra_scalar_ops <= SCALAR_OPS, (extra_scalar_ops, model.scalar_ops - loop.scalar_ops)
