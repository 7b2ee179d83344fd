"""paratrain.train's Model.eval with MindSpore's Accuracy and Loss: the metrics against hand computations, Model.eval
in one process against a plain torch loop, and on dp2, dp2 x mp2 and semi-auto mp2 against one process."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from forked_ranks import run_distributed
from paratrain import ParallelMode, TransformerOpParallelConfig, reset_auto_parallel_context, set_auto_parallel_context
from paratrain.errors import UserError
from paratrain.train import Accuracy, Callback, Loss, Metric, Model
from test_semi_auto import MLP, SquaredError
from test_user_net import Block


@pytest.fixture(autouse=True)
def fresh_context():
    yield
    reset_auto_parallel_context()


# --- the metrics ------------------------------------------------------------------------------------------------

SCORES = torch.tensor([[0.2, 0.5], [0.3, 0.1], [0.9, 0.6]])


def test_accuracy_counts_correct_over_total_across_updates():
    metric = Accuracy()
    metric.update(SCORES, torch.tensor([1, 0, 1]))  # MindSpore's example: 2 of 3
    assert metric.eval() == pytest.approx(2 / 3)
    metric.update(torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.3, 0.7]]), torch.tensor([0, 0, 0]))  # 1 of 3
    assert (metric._correct_num, metric._total_num) == (3, 6) and metric.eval() == 0.5
    metric.clear()
    metric.update(SCORES, F.one_hot(torch.tensor([1, 1, 1]), 2))  # one-hot labels: their argmax
    assert metric.eval() == pytest.approx(1 / 3)
    scores = torch.tensor([[[0.1, 0.9], [0.8, 0.2]], [[0.3, 0.4], [0.7, 0.6]]])  # (N, C, T): argmax over C
    assert Accuracy()(scores, torch.tensor([[1, 0], [1, 0]])) == 0.75


def test_accuracy_multilabel_needs_every_class_right_and_indexes_pick_the_inputs():
    y_pred = torch.tensor([[0, 1, 1], [1, 0, 1]])
    assert Accuracy("multilabel")(y_pred, torch.tensor([[0, 1, 1], [1, 1, 1]])) == 0.5
    metric = Accuracy().set_indexes([0, 2])  # MindSpore's example: the third input is the label
    assert metric(SCORES, torch.tensor([1, 0, 1]), torch.tensor([0, 0, 1])) == pytest.approx(1 / 3)
    assert metric.indexes == [0, 2]


def test_accuracy_refuses_what_mindspore_refuses():
    with pytest.raises(UserError, match="eval_type='top5'"):
        Accuracy("top5")
    with pytest.raises(UserError, match="takes 2 inputs"):
        Accuracy().update(SCORES)
    with pytest.raises(UserError, match=r"labels of shape \(N, \.\.\.\)"):
        Accuracy().update(SCORES, torch.tensor([[1, 0, 1]]))
    with pytest.raises(UserError, match="only 0 and 1"):
        Accuracy("multilabel").update(SCORES, SCORES)
    metric = Accuracy()
    metric.update(SCORES, torch.tensor([1, 0, 1]))
    with pytest.raises(UserError, match="3 classes, earlier ones 2"):
        metric.update(torch.zeros(2, 3), torch.tensor([0, 1]))
    with pytest.raises(UserError, match="no sample"):
        Accuracy().eval()


def test_loss_is_the_mean_over_updates_of_each_updates_mean():
    metric = Loss()
    metric.update(torch.tensor(1.0))
    metric.update(torch.tensor([2.0, 4.0]))
    assert metric.eval() == 2.0  # (1 + 3) / 2, MindSpore's: not weighted by rows
    with pytest.raises(UserError, match=r"scalar or 1-d, got shape \[1, 2\]"):
        metric.update(torch.ones(1, 2))
    with pytest.raises(UserError, match="no loss"):
        Loss().eval()


# --- Model.eval in one process ----------------------------------------------------------------------------------

class Classifier(nn.Module):
    """x (N, 4) -> logits (N, 3), through a block that declares its tensor-parallel split (its config says
    the layout)."""

    def __init__(self, config=None):
        super().__init__()
        self.fc, self.blocks, self.head = nn.Linear(4, 16), nn.ModuleList([Block(16)]), nn.Linear(16, 3)
        if config is not None:
            self.blocks[0].parallel_config = config

    def forward(self, x):
        return self.head(self.blocks[0](torch.tanh(self.fc(x))))


def batches(rows=(6, 6, 5)):
    """Batches of ``rows`` rows: the last one smaller, so data-parallel ranks get unequal shares of it."""
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in rows]


def plain_metrics(net, data):
    """Accuracy and MindSpore's Loss (the mean of the batches' losses) of a plain torch loop."""
    with torch.no_grad():
        correct = sum(int((net(x).argmax(1) == y).sum()) for x, y in data)
        losses = [float(F.cross_entropy(net(x), y)) for x, y in data]
    return {"acc": correct / sum(len(y) for _, y in data), "loss": sum(losses) / len(losses)}


def model_of(net, **kwargs):
    return Model(net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), lr=0.5), **kwargs)


def test_eval_before_and_after_training_gives_a_plain_loops_metrics_and_leaves_train_mode():
    torch.manual_seed(0)
    net, data = Classifier(), batches()
    want = plain_metrics(net, data)
    model = model_of(net, metrics={"acc": Accuracy(), "loss": Loss()})
    assert model.eval(data) == pytest.approx(want, rel=1e-6)  # placed on the first batch
    model.train(2, data)
    placed = model.train_network.parts[0]
    assert placed.training and all(m.training for m in placed.modules())
    assert model.eval(data) == pytest.approx(plain_metrics(net, data), rel=1e-6)
    assert model.eval(data)["acc"] != want["acc"] or model.eval(data)["loss"] != want["loss"]  # it trained


def test_training_after_an_eval_is_the_training_without_it():
    def trained(eval_first):
        torch.manual_seed(0)
        net = Classifier()
        model = model_of(net, metrics={"loss"})
        if eval_first:
            model.eval(batches())
        model.train(2, batches())
        return model.eval(batches())["loss"]

    assert trained(True) == trained(False)  # the optimizer was rebuilt on the net eval placed


class WithEval(nn.Module):
    """A user's eval network: (logits, loss, label) in an order of its own."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, label):
        logits = self.net(x)
        return logits, F.cross_entropy(logits, label), label


class Steps(Callback):
    def __init__(self):
        self.calls = []

    def on_eval_begin(self, run_context):
        self.calls.append("begin")

    def on_eval_step_end(self, run_context):
        args = run_context.original_args()
        self.calls.append((args.cur_step_num, len(args.net_outputs)))

    def on_eval_end(self, run_context):
        self.calls.append("end")


def test_eval_network_and_indexes_and_names_give_the_same_metrics_with_callbacks():
    torch.manual_seed(0)
    net, data = Classifier(), batches()
    want = plain_metrics(net, data)
    steps = Steps()
    model = Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), metrics={"accuracy", "loss"},
                  eval_network=WithEval(net), eval_indexes=[1, 0, 2])
    got = model.eval(data, callbacks=[steps])
    assert got == pytest.approx({"accuracy": want["acc"], "loss": want["loss"]}, rel=1e-6)
    assert steps.calls == ["begin", (1, 3), (2, 3), (3, 3), "end"]
    sink = Steps()
    model.eval(data, callbacks=[sink], dataset_sink_mode=True)
    assert sink.calls == ["begin", (3, 3), "end"]
    # no eval_indexes: every output to every metric; set_indexes picks the metric's own
    model = Model(net, metrics={"acc": Accuracy().set_indexes([0, 2]), "loss": Loss().set_indexes([1])},
                  eval_network=WithEval(net))
    assert model.eval(data) == pytest.approx(want, rel=1e-6)


def test_model_eval_refuses_what_it_cannot_do():
    net = Classifier()
    with pytest.raises(UserError, match=r"unknown metric name 'precision'.*'acc', 'accuracy', 'loss'"):
        Model(net, nn.CrossEntropyLoss(), metrics={"acc", "precision"})
    with pytest.raises(UserError, match=r"'acc': str"):
        Model(net, nn.CrossEntropyLoss(), metrics={"acc": "accuracy"})
    with pytest.raises(UserError, match="dict or a set of names, got list"):
        Model(net, nn.CrossEntropyLoss(), metrics=["acc"])
    with pytest.raises(UserError, match="needs an eval_network, or a loss_fn"):
        Model(net, metrics={"acc"})
    with pytest.raises(UserError, match=r"eval_indexes=\[0, 1\]"):
        Model(net, metrics={"acc"}, eval_network=WithEval(net), eval_indexes=[0, 1])
    with pytest.raises(UserError, match="Model.eval needs metrics"):
        Model(net, nn.CrossEntropyLoss()).eval(batches())
    with pytest.raises(UserError, match="gave no batch"):
        Model(net, nn.CrossEntropyLoss(), metrics={"acc"}).eval([])


class SplitBatches(list):
    """Batches said to be this rank's share of a dataset split in two (MindSpore's ``num_shards``)."""

    num_shards = 2


@pytest.mark.parametrize("run", ["train", "eval"])
def test_a_dataset_split_for_other_ranks_is_refused_by_train_and_eval_alike(run):
    net = Classifier()
    model = Model(net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), lr=0.1), metrics={"acc"})
    call = (lambda data: model.train(1, data)) if run == "train" else model.eval
    with pytest.raises(UserError, match=rf"^Model.{run}: the dataset is split into num_shards=2 for 1 ranks, 1 of "
                                        rf"them data-parallel: .* num_shards=get_group_size\(\) and no model or "
                                        rf"pipeline parallelism"):
        call(SplitBatches(batches()))


# --- Model.eval on several processes ----------------------------------------------------------------------------

class Rows(Metric):
    """A metric of the user's own that says nothing of how its state adds up over ranks."""

    def clear(self):
        self.rows = 0

    def update(self, logits, label):
        self.rows += len(label)

    def eval(self):
        return self.rows


def _eval_on(data_parallel, model_parallel):
    """Model.eval before and after two epochs of training, on this layout; and the refusal of a metric of the
    user's own under data parallel."""
    torch.manual_seed(0)
    net = Classifier(TransformerOpParallelConfig(data_parallel=data_parallel, model_parallel=model_parallel))
    model = model_of(net, metrics={"acc": Accuracy(), "loss": Loss()})
    before = model.eval(batches())
    model.train(2, batches(rows=(6, 6, 6)))  # training splits batches evenly; eval need not
    after = model.eval(batches())
    try:
        Model(Classifier(net.blocks[0].parallel_config), nn.CrossEntropyLoss(), metrics={"rows": Rows()}).eval(
            batches())
        refused = None
    except UserError as exc:
        refused = str(exc)
    return before, after, refused


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [(2, 1), (2, 2)], ids=["dp2", "dp2_mp2"])
def test_data_and_model_parallel_eval_gives_every_rank_the_metrics_of_one_process(layout):
    want_before, want_after, _ = _eval_on(1, 1)
    data_parallel, model_parallel = layout
    results = run_distributed(_eval_on, data_parallel * model_parallel, *layout, timeout=240)
    for before, after, refused in results:
        assert before == pytest.approx(want_before, rel=1e-5) and after == pytest.approx(want_after, rel=1e-5)
        assert "metric 'rows' (Rows) names no state to add over the 2 data-parallel ranks" in refused
    assert want_after != want_before


def _semi_auto_eval(world):
    """Model.eval of the Megatron MLP (DTensor outputs) with a loss of ops, after four steps, on one-hot labels."""
    if world > 1:
        set_auto_parallel_context(parallel_mode=ParallelMode.SEMI_AUTO_PARALLEL, device_num=world)
    net = MLP(1, world)
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(8, 16, generator=g), F.one_hot(torch.randint(0, 8, (8,), generator=g), 8).float())
            for _ in range(4)]
    model = Model(net, SquaredError(), torch.optim.SGD(net.parameters(), lr=0.1), metrics={"acc", "loss"})
    model.train(1, data)
    return model.eval(data)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_semi_auto_eval_of_sharded_outputs_gives_the_metrics_of_one_process():
    want = _semi_auto_eval(1)
    for got in run_distributed(_semi_auto_eval, 2, 2, timeout=200):
        assert got == pytest.approx(want, rel=1e-5)


def _pipeline_eval():
    torch.manual_seed(0)
    net = Classifier(TransformerOpParallelConfig(pipeline_stage=2, micro_batch_num=2))
    try:
        model_of(net, metrics={"acc"}).eval(batches())
    except UserError as exc:
        return str(exc)


@pytest.mark.timeout(120)
def test_a_pipeline_eval_is_refused_with_the_reason():
    for message in run_distributed(_pipeline_eval, 2, timeout=100):
        assert message.startswith("Model.eval: pipeline_stage=2: the traced stages of a pipeline end in the loss")


def test_a_one_shot_iterator_is_trained_and_evaluated_from_its_first_batch():
    """A generator's first batch, drawn to place the net, still gets its step and its share of the metrics."""
    torch.manual_seed(0)
    net, data = Classifier(), batches()
    model = model_of(net, metrics={"acc": Accuracy(), "loss": Loss()})
    assert model.eval(iter(data)) == pytest.approx(plain_metrics(net, data), rel=1e-6)
    torch.manual_seed(0)
    reference = Classifier()
    model_of(reference).train(1, data)
    model.train(1, (batch for batch in data))
    for mine, want in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, want, rtol=0, atol=0)


def test_an_evaluated_token_loss_divides_by_its_count_plus_the_losses_epsilon():
    """Model.eval's loss of a placed net's (sum, count) pair: MindSpore's CrossEntropyLoss, sum / (count + 1e-5)."""
    from paratrain.train.metrics import global_loss

    pair = torch.tensor([3.0, 2.0])
    assert float(global_loss(pair, 8, True, None, torch.device("cpu"), 1e-5)) == pytest.approx(3.0 / (2.0 + 1e-5),
                                                                                               rel=1e-12)
    assert float(global_loss(pair, 8, True, None, torch.device("cpu"))) == pytest.approx(1.5, rel=1e-12)
