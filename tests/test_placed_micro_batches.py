"""Semi-auto and hybrid nets in micro-batches (gradient accumulation) and with sum-and-count losses: the losses of
one process computed in the same test; the options these modes do not honour refused with the reason; the eval loss
of a sum-and-count net on one process."""
import pytest
import torch
from torch import nn

from forked_ranks import loss_recorder, run_distributed
from paratrain import ParallelMode, TransformerOpParallelConfig, reset_auto_parallel_context, set_auto_parallel_context
from paratrain.errors import UserError
from paratrain.nn import Momentum, PipelineCell
from paratrain.train import Model
from test_semi_auto import (MLP, Classifier, HybridParallelNet, SquaredError, data, hybrid_reference, reference_losses,
                            scalar_data)


class RowCounter(nn.Module):
    """``net`` noting the rows of each forward's first input (a DTensor's are the global micro-batch's)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net, self.rows = net, []

    def forward(self, x, *rest):
        self.rows.append(x.shape[0])
        return self.net(x, *rest)


def _semi_auto_micro2(world):
    reset_auto_parallel_context()
    set_auto_parallel_context(parallel_mode=ParallelMode.SEMI_AUTO_PARALLEL)
    net, losses = RowCounter(MLP(2, 2)), loss_recorder()
    model = Model(PipelineCell(net, micro_size=2), loss_fn=SquaredError(),
                  optimizer=Momentum(net.parameters(), 0.05, 0.9))
    model.train(1, data(), callbacks=[losses])
    return losses.values, net.rows[1:]  # the first: the recording forward on the example micro-batch


@pytest.mark.slow
def test_semi_auto_ops_net_in_two_micro_batches_gives_one_process_losses():
    expected = reference_losses(MLP(), SquaredError())
    for losses, rows in run_distributed(_semi_auto_micro2, 4, 4, timeout=180):
        assert rows == [4] * 2 * len(data())  # two micro-batches of 4 rows a step
        assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)


def _hybrid_micro2(world):
    from paratrain.communication import get_rank

    reset_auto_parallel_context()
    set_auto_parallel_context(parallel_mode=ParallelMode.HYBRID_PARALLEL)
    net, losses = HybridParallelNet(get_rank(), world), loss_recorder()
    net.parallel_config = TransformerOpParallelConfig(micro_batch_num=2)
    counted = RowCounter(net)
    Model(counted, loss_fn=nn.MSELoss(), optimizer=Momentum(net.parameters(), 0.001, 0.9)).train(
        1, scalar_data(), callbacks=[losses])
    return losses.values, counted.rows, net.weight.detach().tolist()


@pytest.mark.slow
def test_hybrid_net_in_two_micro_batches_gives_one_process_losses_and_weights():
    expected, one = hybrid_reference()
    (losses0, rows0, w0), (losses1, rows1, w1) = run_distributed(_hybrid_micro2, 2, 2, timeout=120)
    assert rows0 == rows1 == [4] * 2 * len(scalar_data())
    assert losses0 == losses1 == pytest.approx(expected, rel=1e-5)
    assert torch.allclose(torch.cat([torch.tensor(w0), torch.tensor(w1)], 1), one.weight.detach(), atol=1e-6)


def classifier_batches():
    """Masks that keep a different number of tokens in each half: a mean of the halves' means is not the mean."""
    g = torch.Generator().manual_seed(3)
    masks = [torch.tensor([1, 1, 1, 1, 1, 1, 0, 1.0]), torch.tensor([1, 0, 0, 0, 1, 1, 1, 1.0])]
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 8, (8,), generator=g), mask) for mask in masks * 2]


def _token_loss_output_outside_a_step(loss) -> list[int]:
    """The shape of what the token loss ``loss`` returns outside a training step."""
    with torch.no_grad():
        return list(loss(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int32), torch.ones(2)).shape)


def _classifier_micro2(world):
    reset_auto_parallel_context()
    set_auto_parallel_context(parallel_mode=ParallelMode.SEMI_AUTO_PARALLEL)
    net, losses = Classifier(world), loss_recorder()
    Model(PipelineCell(net, micro_size=2), optimizer=Momentum(net.parameters(), 0.05, 0.9)).train(
        1, classifier_batches(), callbacks=[losses])
    return losses.values, _token_loss_output_outside_a_step(net.loss)


@pytest.mark.slow
def test_sum_and_count_loss_under_semi_auto_in_micro_batches_is_the_global_token_mean():
    net = Classifier()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    expected = []
    for batch in classifier_batches():  # the token mean of the whole global batch
        loss = net(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    for losses, outside in run_distributed(_classifier_micro2, 2, 2, timeout=120):
        assert outside == [2]  # placed: the net's loss gives its (sum, count)
        assert losses == pytest.approx(expected, rel=1e-5)


def test_hybrid_refuses_the_parallel_optimizer_and_recompute_with_the_reason():
    reset_auto_parallel_context()
    set_auto_parallel_context(parallel_mode=ParallelMode.HYBRID_PARALLEL, enable_parallel_optimizer=True)
    net = HybridParallelNet(0, 1)
    net.parallel_config = TransformerOpParallelConfig(recompute=True)
    try:
        with pytest.raises(UserError, match=r"hybrid_parallel does not offer recompute=True: .*; the parallel "
                                            r"optimizer \(zero_stage=1, enable_parallel_optimizer\): each rank's "
                                            r"layerwise_parallel parameters are its own: leave these options"):
            Model(net, loss_fn=nn.MSELoss(), optimizer=Momentum(net.parameters(), 0.001, 0.9)).train(
                1, scalar_data(1))
    finally:
        reset_auto_parallel_context()


class _EvalClassifier(nn.Module):
    """``Classifier``'s (loss, logits, labels) for ``Model.eval``, through its modules."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, labels, mask):
        logits = self.net.mlp(x)
        return self.net.loss(logits, labels, mask), logits, labels


def test_eval_loss_of_a_sum_and_count_net_on_one_process_is_the_token_mean_not_the_pair():
    reset_auto_parallel_context()
    net = Classifier()
    batches = classifier_batches()
    with torch.no_grad():  # the Loss metric's mean over the batches of each one's token mean
        expected = sum(net(*batch) for batch in batches) / len(batches)
    model = Model(net, optimizer=Momentum(net.parameters(), 0.0, 0.0), metrics={"loss"},
                  eval_network=_EvalClassifier(net), eval_indexes=[0, 1, 2])
    got = model.eval(batches)["loss"]
    assert _token_loss_output_outside_a_step(net.loss) == [2]  # placed: the net's loss gives its (sum, count)
    assert got == pytest.approx(float(expected), rel=1e-5)
