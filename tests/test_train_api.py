"""paratrain.train: MindSpore's Model.train, callbacks, ModelCheckpoint and weights-only loading for a user's net:
in one process against a plain torch loop, and data-parallel on two processes against one."""
import contextlib
import copy
import os
import io
import re
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from forked_ranks import run_distributed
from paratrain import (TransformerOpParallelConfig, load_checkpoint, load_param_into_net, reset_auto_parallel_context,
                       set_auto_parallel_context)
from paratrain.errors import UserError
from paratrain.amp import FixedLossScaleManager
from paratrain.train import (Callback, CheckpointConfig, LossMonitor, Model, ModelCheckpoint, TimeMonitor,
                             group_names, rebuild_optimizer)


class Net(nn.Module):
    """A user's net that returns its loss."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(torch.tanh(self.norm(self.fc1(x)))), y)


class Recording(Net):
    """The net, noting the batches it is given."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x, y):
        self.seen.append(x)
        return super().forward(x, y)


@pytest.fixture(autouse=True)
def fresh_context():
    yield
    reset_auto_parallel_context()


def dataset(batches=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(batches)]


def decay_optimizer(net, optimizer=torch.optim.AdamW):
    decay = [p for n, p in net.named_parameters() if n.endswith("weight") and not n.startswith("norm")]
    rest = [p for n, p in net.named_parameters() if not (n.endswith("weight") and not n.startswith("norm"))]
    return optimizer([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                     lr=1e-2, betas=(0.8, 0.95))


def plain_losses(net, data, epochs, loss_of=lambda net, batch: net(*batch)):
    """The losses of a plain loop: one optimizer step per batch."""
    opt = decay_optimizer(net)
    losses = []
    for _ in range(epochs):
        for batch in data:
            loss = loss_of(net, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


def test_loss_monitor_prints_mindspore_lines_with_the_losses_of_a_plain_loop(capsys):
    torch.manual_seed(0)
    net, data = Net(), dataset()
    reference = copy.deepcopy(net)
    Model(net, optimizer=decay_optimizer(net)).train(2, data, callbacks=[LossMonitor()])
    losses = plain_losses(reference, data, 2)
    expected = [f"epoch: {1 + i // 3} step: {1 + i % 3}, loss is {loss}" for i, loss in enumerate(losses)]
    assert capsys.readouterr().out.splitlines() == expected
    for a, b in zip(net.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_loss_monitor_every_other_step_and_never(capsys):
    torch.manual_seed(0)
    net = Net()
    Model(net, optimizer=decay_optimizer(net)).train(2, dataset(), callbacks=LossMonitor(2))
    printed = [re.match(r"epoch: (\d) step: (\d), loss is [-\d.e]+$", line).groups()
               for line in capsys.readouterr().out.splitlines()]
    assert printed == [("1", "2"), ("2", "1"), ("2", "3")]  # global steps 2, 4, 6
    Model(net, optimizer=decay_optimizer(net)).train(1, dataset(), callbacks=LossMonitor(0))
    assert capsys.readouterr().out == ""
    with pytest.raises(UserError, match=r"LossMonitor\(per_print_times=-1\)"):
        LossMonitor(-1)


@pytest.mark.parametrize("loss_fn", [nn.MSELoss(), F.mse_loss], ids=["module", "function"])
def test_loss_fn_gets_the_output_and_the_label(capsys, loss_fn):
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    reference = copy.deepcopy(backbone)
    opt = torch.optim.AdamW(backbone.parameters(), lr=1e-2, betas=(0.8, 0.95))
    model = Model(backbone, loss_fn=loss_fn, optimizer=opt)
    model.train(1, dataset(), callbacks=[LossMonitor()])
    printed = [float(line.rsplit(" ", 1)[1]) for line in capsys.readouterr().out.splitlines()]
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.8, 0.95))
    expected = []
    for x, y in dataset():
        loss = F.mse_loss(reference(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        expected.append(loss.item())
    assert printed == expected
    assert [n for n, _ in model.train_network.named_parameters()][0] == "network.0.weight"


def test_optimizer_rebuilt_with_class_groups_and_hyperparameters():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW([{"params": [net.fc1.weight], "weight_decay": 0.1},
                             {"params": [net.fc1.bias, net.norm.weight, net.norm.bias], "weight_decay": 0.0},
                             {"params": list(net.fc2.parameters()), "lr": 5e-3}],
                            lr=1e-2, betas=(0.8, 0.95), eps=1e-6, amsgrad=True)
    # this rank holds copies of everything but fc2: its group is dropped
    here = [(n, nn.Parameter(p.detach().clone())) for n, p in net.named_parameters() if not n.startswith("fc2")]
    rebuilt = rebuild_optimizer(opt, group_names(opt, net), here)
    assert type(rebuilt) is torch.optim.AdamW and rebuilt.defaults == opt.defaults
    assert len(rebuilt.param_groups) == 2
    copies = dict(here)
    assert rebuilt.param_groups[0]["params"] == [copies["fc1.weight"]]
    assert rebuilt.param_groups[1]["params"] == [copies["fc1.bias"], copies["norm.weight"], copies["norm.bias"]]
    for new, old in zip(rebuilt.param_groups, opt.param_groups):
        assert {k: v for k, v in new.items() if k != "params"} == {k: v for k, v in old.items() if k != "params"}

    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    again = rebuild_optimizer(sgd, group_names(sgd, net), net.named_parameters())
    assert type(again) is torch.optim.SGD and again.defaults == sgd.defaults
    assert again.param_groups[0]["params"] == list(net.parameters())

    named = torch.optim.AdamW(net.named_parameters(), lr=1e-3)
    kept = rebuild_optimizer(named, group_names(named, net), here)
    assert kept.param_groups[0]["param_names"] == [n for n, _ in here]

    with pytest.raises(UserError, match="not in the network"):
        group_names(torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=1), net)
    net(*dataset(1)[0]).backward()
    sgd.step()
    with pytest.raises(UserError, match="taken steps"):
        group_names(sgd, net)


def test_callbacks_see_mindspore_counts_in_both_hook_styles():
    seen = []

    class Old(Callback):
        def begin(self, rc):
            seen.append(("begin", rc.original_args().cur_step_num))

        def epoch_end(self, rc):
            args = rc.original_args()
            seen.append(("epoch_end", args.cur_epoch_num, args.cur_step_num, args.batch_num))

    class New(Callback):
        def on_train_step_end(self, rc):
            args = rc.original_args()
            seen.append(("step", args.cur_epoch_num, args.cur_step_in_epoch, args.cur_step_num))
            if args.cur_step_num == 5:
                rc.request_stop()

        def on_train_end(self, rc):
            seen.append(("end", rc.original_args().cur_step_num))

    torch.manual_seed(0)
    net = Net()
    Model(net, optimizer=decay_optimizer(net)).train(3, dataset(), callbacks=[Old(), New()])
    assert seen == [("begin", 0), ("step", 1, 1, 1), ("step", 1, 2, 2), ("step", 1, 3, 3), ("epoch_end", 1, 3, 3),
                    ("step", 2, 1, 4), ("step", 2, 2, 5), ("epoch_end", 2, 5, 3), ("end", 5)]


def test_sink_mode_calls_step_callbacks_once_per_sink():
    steps = []

    class Steps(Callback):
        def step_end(self, rc):
            steps.append((rc.original_args().cur_epoch_num, rc.original_args().cur_step_num))

    torch.manual_seed(0)
    data = dataset()
    net = Recording()
    Model(net, optimizer=decay_optimizer(net)).train(2, data, callbacks=Steps(), dataset_sink_mode=True)
    assert steps == [(1, 3), (2, 6)]
    steps.clear()
    net.seen.clear()
    Model(net, optimizer=decay_optimizer(net)).train(3, data, callbacks=Steps(), dataset_sink_mode=True, sink_size=2)
    assert steps == [(1, 2), (2, 4), (3, 6)]
    drawn = [next(i for i, (x, _) in enumerate(data) if torch.equal(x, seen)) for seen in net.seen]
    assert drawn == [0, 1, 2, 0, 1, 2]  # sinks draw on through the dataset across epochs


def test_time_monitor_prints_epoch_and_step_time(capsys):
    torch.manual_seed(0)
    net = Net()
    Model(net, optimizer=decay_optimizer(net)).train(2, dataset(), callbacks=[TimeMonitor()])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    for line in lines:
        epoch_ms, step_ms = map(float, re.match(r"epoch time: ([\d.]+) ms, per step time: ([\d.]+) ms$", line).groups())
        assert step_ms == pytest.approx(epoch_ms / 3, abs=1e-3)


def test_model_checkpoint_names_keeps_and_loads(tmp_path):
    torch.manual_seed(0)
    net = Net()
    config = CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=2)
    Model(net, optimizer=decay_optimizer(net)).train(
        2, dataset(), callbacks=[ModelCheckpoint(prefix="test", directory=tmp_path, config=config)])
    # saved at steps 2, 4 and 6: test-1_2, test-2_1, test-2_3; the two newest are kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "test-2_1", "test-2_3"]
    assert (tmp_path / "test-2_3" / "model.safetensors").is_file()  # integrated_save=True by default

    trained = {n: p.detach().clone() for n, p in net.named_parameters()}
    for source in (tmp_path / "test-2_3", tmp_path, tmp_path / "test-2_3" / "model.safetensors"):
        params = load_checkpoint(source)
        assert params.keys() == trained.keys()
        assert all(torch.equal(params[n], trained[n]) for n in trained)

    fresh = Net()
    assert load_param_into_net(fresh, params) == ([], [])
    assert all(torch.equal(p, trained[n]) for n, p in fresh.named_parameters())
    bigger = nn.Module()
    bigger.network, bigger.extra = Net(), nn.Linear(2, 2)  # a wrapper's prefix, and one parameter more
    # the wrapped names are found by their ends; those entries are not loaded under their own names
    assert load_param_into_net(bigger, params) == (["extra.weight", "extra.bias"], list(params))
    assert torch.equal(bigger.network.fc1.weight, trained["fc1.weight"])
    assert load_checkpoint(tmp_path, filter_prefix="fc1").keys() == trained.keys() - {"fc1.weight", "fc1.bias"}
    params["fc2.weight"] = torch.zeros(3, 3)
    with pytest.raises(UserError, match="fc2.weight has shape"):
        load_param_into_net(fresh, params)


def test_last_step_is_saved_and_only_its_prefix_is_pruned(tmp_path):
    (tmp_path / "other-9_9").mkdir()
    torch.manual_seed(0)
    net = Net()
    config = CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=5, integrated_save=False)
    Model(net, optimizer=decay_optimizer(net)).train(
        1, dataset(5), callbacks=[ModelCheckpoint(prefix="test", directory=tmp_path, config=config)])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "other-9_9", "test-1_2", "test-1_4", "test-1_5"]
    assert not (tmp_path / "test-1_5" / "model.safetensors").exists()


def test_checkpoint_config_refuses_what_it_cannot_do():
    with pytest.raises(UserError, match="save_checkpoint_seconds"):
        CheckpointConfig(save_checkpoint_seconds=60)
    with pytest.raises(UserError, match="save_checkpoint_steps"):
        CheckpointConfig(save_checkpoint_steps=0)
    with pytest.raises(UserError, match="prefix"):
        ModelCheckpoint(prefix="a/b")


def test_model_reads_the_blocks_config_and_the_context():
    class Blocks(Net):
        def __init__(self, config):
            super().__init__()
            self.fc1.parallel_config = config  # as a block keeps the config it was given

    config = TransformerOpParallelConfig(model_parallel=1, micro_batch_num=2)
    set_auto_parallel_context(enable_parallel_optimizer=True)
    torch.manual_seed(0)
    net = Blocks(config)
    model = Model(net, optimizer=decay_optimizer(net))
    model.train(1, dataset(1))
    used = model.train_network.config
    assert used.micro_batch_num == 2 and used.effective_zero_stage == 1 and used.data_parallel == 1
    assert model.train_network.layout.config is used and config.effective_zero_stage == 0  # the user's is unchanged


def test_model_refuses_what_it_cannot_do():
    net = Net()
    with pytest.raises(UserError, match="metrics=.... needs an eval_network, or a loss_fn"):
        Model(net, optimizer=decay_optimizer(net), metrics={"acc"})
    with pytest.raises(UserError, match="amp_level"):
        Model(net, optimizer=decay_optimizer(net), amp_level="O5")
    with pytest.raises(UserError, match="fp32 needs no loss scaling"):
        Model(net, optimizer=decay_optimizer(net), loss_scale_manager=FixedLossScaleManager())
    with pytest.raises(UserError, match="needs an optimizer"):
        Model(net).train(1, dataset())
    with pytest.raises(UserError, match="no batch in epoch 2"):
        Model(net, optimizer=decay_optimizer(net)).train(2, iter(dataset()))


def _load_into_a_sharded_parameter(params):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    module = nn.Linear(3, 4)
    module.weight = nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]))
    missing, _ = load_param_into_net([module], params)
    return missing, module.weight.to_local().tolist(), module.bias.tolist()  # tensors do not cross processes


@pytest.mark.timeout(120)
def test_load_param_into_a_parallel_net_takes_this_ranks_shard():
    params = {"weight": torch.arange(12.0).reshape(4, 3), "bias": torch.tensor([1.0, 2.0, 3.0, 4.0])}
    results = run_distributed(_load_into_a_sharded_parameter, 2, params)
    for rank, (missing, local, bias) in enumerate(results):
        assert missing == []
        assert local == params["weight"][2 * rank:2 * rank + 2].tolist()
        assert bias == params["bias"].tolist()


def printed_losses(text):
    """(epoch, step, loss) of every LossMonitor line."""
    return [(int(e), int(s), float(loss)) for e, s, loss in re.findall(r"^epoch: (\d+) step: (\d+), loss is (\S+)$",
                                                                           text, re.M)]


def _train_data_parallel(directory, zero):
    torch.manual_seed(0)
    net = Net()
    if zero:
        set_auto_parallel_context(enable_parallel_optimizer=True)
    model = Model(net, optimizer=decay_optimizer(net))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        model.train(2, dataset(), callbacks=[LossMonitor(), ModelCheckpoint(
            prefix="dp", directory=directory, config=CheckpointConfig(save_checkpoint_steps=6))])
    missing, _ = load_param_into_net(model.train_network, load_checkpoint(directory))
    names = {p: n for n, p in model.train_network.named_parameters()}
    return out.getvalue(), missing, sorted(names[p] for p in model.optimizer.state)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero", [False, True], ids=["dp2", "dp2-zero1"])
def test_data_parallel_on_two_ranks_prints_the_losses_of_one_process(tmp_path, zero):
    torch.manual_seed(0)
    net = Net()
    out = io.StringIO()  # not capsys: the forked ranks would inherit its stderr, which has no file descriptor
    with contextlib.redirect_stdout(out):
        Model(net, optimizer=decay_optimizer(net)).train(2, dataset(), callbacks=[LossMonitor()])
    one = printed_losses(out.getvalue())
    assert len(one) == 6

    results = run_distributed(_train_data_parallel, 2, str(tmp_path), zero)
    (text0, missing0, held0), (text1, missing1, held1) = results
    two = printed_losses(text0)
    assert [(e, s) for e, s, _ in two] == [(e, s) for e, s, _ in one] and text1 == ""  # rank 0 prints
    for (_, _, a), (_, _, b) in zip(two, one):
        assert a == pytest.approx(b, rel=1e-5)
    every = sorted(name for name, _ in net.named_parameters())
    if zero:  # enable_parallel_optimizer took effect: each rank steps a disjoint share of the parameters
        assert held0 and held1 and not set(held0) & set(held1) and sorted(held0 + held1) == every
    else:
        assert held0 == held1 == every
    assert missing0 == missing1 == []  # each rank reloaded its shard
    saved = load_checkpoint(tmp_path / "dp-2_3")
    for name, param in net.named_parameters():  # the two-rank run saved what one process trained
        assert torch.allclose(saved[name], param.detach(), rtol=1e-4, atol=1e-6), name


def test_a_second_train_call_goes_on_with_the_same_placed_net(capsys):
    torch.manual_seed(0)
    net, data = Net(), dataset()
    reference = copy.deepcopy(net)
    model = Model(net, optimizer=decay_optimizer(net))
    model.train(1, data, callbacks=[LossMonitor()])
    placed, optimizer = model.train_network, model.optimizer
    model.train(1, data, callbacks=[LossMonitor()])
    assert model.train_network is placed and model.optimizer is optimizer  # Adam's moments go on
    losses = plain_losses(reference, data, 2)
    printed = [float(line.rsplit(" ", 1)[1]) for line in capsys.readouterr().out.splitlines()]
    assert printed == losses


class TutorialNet(nn.Module):
    """The tutorial's shape of net from paratrain.nn blocks (decoder-only, tiny): the Transformer is given the
    TransformerOpParallelConfig, which Model.train reads."""

    def __init__(self, config, vocab=16, length=8):
        from paratrain.nn import AttentionMask, CrossEntropyLoss, Transformer, VocabEmbedding

        super().__init__()
        self.embedding = VocabEmbedding(vocab, 16, parallel_config=config.embedding_dp_mp_config)
        self.transformer = Transformer(hidden_size=16, batch_size=8, ffn_hidden_size=32, src_seq_length=length,
                                       tgt_seq_length=length, encoder_layers=2, decoder_layers=0, num_heads=2,
                                       attention_dropout_rate=0.0, hidden_dropout_rate=0.0, parallel_config=config)
        self.attention_mask = AttentionMask(length)
        self.loss = CrossEntropyLoss(parallel_config=config.dp_mp_config)

    def forward(self, ids, labels, mask):
        words, table = self.embedding(ids)
        output = self.transformer(words, self.attention_mask(mask))[0]
        return self.loss((output @ table.t()).flatten(0, 1), labels.flatten(), mask.flatten())


def token_batches():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 16, (3, 8, 8), generator=g)
    mask = (torch.arange(8) < torch.randint(4, 9, (3, 8, 1), generator=g)).float()
    return [(i * m.long(), i.roll(1, -1) * m.long(), m) for i, m in zip(ids, mask)]


def _train_tutorial_net(model_parallel):
    torch.manual_seed(0)
    net = TutorialNet(TransformerOpParallelConfig(model_parallel=model_parallel))
    model = Model(net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        model.train(2, token_batches(), callbacks=[LossMonitor()])
    return out.getvalue(), model.train_network.config.model_parallel


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_net_of_paratrain_nn_blocks_trains_model_parallel_as_one_process():
    text, used = _train_tutorial_net(1)
    one = printed_losses(text)
    assert used == 1 and len(one) == 6 and one[-1][2] < one[0][2]
    (text0, used0), (text1, _) = run_distributed(_train_tutorial_net, 2, 2)
    assert used0 == 2 and text1 == ""  # the blocks' model_parallel=2 was read; rank 0 prints
    two = printed_losses(text0)
    assert [(e, s) for e, s, _ in two] == [(e, s) for e, s, _ in one]
    for (_, _, a), (_, _, b) in zip(two, one):
        assert a == pytest.approx(b, rel=1e-4)


class _Signal(Callback):
    """Sends this process ``sig`` at the start of step ``step`` on rank ``rank``."""

    def __init__(self, rank, step, sig=signal.SIGTERM):
        self.rank, self.step, self.sig = rank, step, sig

    def on_train_step_begin(self, run_context):
        params = run_context.original_args()
        if params.rank == self.rank and params.cur_step_num + 1 == self.step:
            os.kill(os.getpid(), self.sig)


def _stopped_model(directory, signal_rank, signal_step, exit_callback):
    """Model.train over 6 steps on this rank, ``signal_rank`` signalled in ``signal_step``: (exit code, step
    the ranks stopped at, the checkpoints in ``directory``)."""
    from paratrain.train import OnRequestExit

    torch.manual_seed(0)
    net = Net()
    saver = (OnRequestExit(file_name="exit", directory=directory) if exit_callback else
             ModelCheckpoint(prefix="stop", directory=directory, config=CheckpointConfig(save_checkpoint_steps=100)))
    steps = []

    class Steps(Callback):
        def on_train_step_end(self, run_context):
            steps.append(run_context.original_args().cur_step_num)

    try:
        Model(net, optimizer=decay_optimizer(net)).train(
            1, dataset(6), callbacks=[_Signal(signal_rank, signal_step, signal.SIGINT), saver, Steps()])
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, steps[-1], sorted(p.name for p in Path(directory).glob("*-*"))  # the checkpoints


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("exit_callback", [False, True], ids=["ModelCheckpoint", "OnRequestExit"])
def test_a_stopped_model_train_saves_the_agreed_step_on_every_rank_and_exits_4(tmp_path, exit_callback):
    torch.manual_seed(0)
    net = Net()
    whole = tmp_path / "whole"
    Model(net, optimizer=decay_optimizer(net)).train(1, dataset(6), callbacks=[ModelCheckpoint(
        prefix="whole", directory=whole, config=CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=0))])

    results = run_distributed(_stopped_model, 2, str(tmp_path / "stopped"), 1, 2, exit_callback)
    prefix = "exit" if exit_callback else "stop"
    # rank 1 is signalled in step 2; the ranks agree a step later and both stop after step 3, saved
    assert results == [(4, 3, [f"{prefix}-1_3"])] * 2
    saved, want = load_checkpoint(tmp_path / "stopped" / f"{prefix}-1_3"), load_checkpoint(whole / "whole-1_3")
    assert saved.keys() == want.keys()
    assert all(torch.allclose(saved[n], want[n], rtol=1e-5, atol=1e-7) for n in want)


class _Losses(Callback):
    """Records (step, loss) after every step."""

    def __init__(self):
        self.losses = []

    def on_train_step_end(self, run_context):
        params = run_context.original_args()
        self.losses.append((params.cur_step_num, float(params.net_outputs)))


def _train_two_epochs(directory, resume="none", signal_rank=None, signal_step=0):
    """Model.train of 2 epochs of 4 batches with a ModelCheckpoint in ``directory``; (exit code, (step, loss)
    of each step this run took)."""
    torch.manual_seed(0)
    net = Net()
    losses = _Losses()
    callbacks = [_Signal(signal_rank, signal_step), losses, ModelCheckpoint(
        prefix="run", directory=directory, config=CheckpointConfig(save_checkpoint_steps=100, keep_checkpoint_max=0))]
    try:
        Model(net, optimizer=decay_optimizer(net)).train(2, dataset(4), callbacks=callbacks, resume=resume)
    except SystemExit as exc:
        return exc.code, losses.losses
    return 0, losses.losses


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_run_stopped_on_two_ranks_resumes_exactly_on_one(tmp_path):
    code, whole = _train_two_epochs(tmp_path / "whole")
    assert code == 0 and [step for step, _ in whole] == list(range(1, 9))

    stopped = run_distributed(_train_two_epochs, 2, str(tmp_path / "run"), "auto", 1, 2)
    assert [code for code, _ in stopped] == [4, 4]  # rank 1 signalled in step 2: all stop after step 3
    assert [step for step, _ in stopped[0][1]] == [1, 2, 3]
    assert [loss for _, loss in stopped[0][1]] == pytest.approx([loss for _, loss in whole[:3]], rel=1e-5)

    code, resumed = _train_two_epochs(tmp_path / "run", resume="auto")  # one process: another layout
    assert code == 0 and [step for step, _ in resumed] == list(range(4, 9))  # epoch 1's last batch, then epoch 2
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in whole[3:]], rel=1e-5)
    code, again = _train_two_epochs(tmp_path / "run", resume="auto")  # from the end: nothing left to do
    assert code == 0 and again == []


def test_resume_refuses_what_it_cannot_do(tmp_path):
    torch.manual_seed(0)
    net = Net()
    model = Model(net, optimizer=decay_optimizer(net))
    with pytest.raises(UserError, match="give exactly one ModelCheckpoint callback, not 0"):
        model.train(1, dataset(), resume="auto")
    with pytest.raises(UserError, match="expected 'none', 'auto' or a checkpoint's path"):
        model.train(1, dataset(), resume="")
    with pytest.raises(UserError, match="dataset_sink_mode"):
        model.train(1, dataset(), callbacks=[ModelCheckpoint(directory=tmp_path)], dataset_sink_mode=True,
                    resume="auto")


def test_a_default_adam_on_cuda_parameters_is_rebuilt_fused_and_a_chosen_kernel_kept(monkeypatch):
    from paratrain.train.placement import fused_where_equal

    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))]
    monkeypatch.setattr(nn.Parameter, "is_cuda", property(lambda self: True))  # as placed on a GPU
    for kind in (torch.optim.Adam, torch.optim.AdamW):
        opt = kind(params, lr=1e-3)
        assert fused_where_equal(opt, opt.defaults, opt.param_groups) == {"fused": True}
        chosen = kind(params, lr=1e-3, foreach=False)
        assert fused_where_equal(chosen, chosen.defaults, chosen.param_groups) == {}
        grouped = kind([{"params": params[:1], "foreach": True}, {"params": params[1:]}], lr=1e-3)
        assert fused_where_equal(grouped, grouped.defaults, grouped.param_groups) == {}
    sgd = torch.optim.SGD(params, lr=0.1)
    assert fused_where_equal(sgd, sgd.defaults, sgd.param_groups) == {}
    monkeypatch.undo()
    cpu = torch.optim.AdamW(params, lr=1e-3)
    assert fused_where_equal(cpu, cpu.defaults, cpu.param_groups) == {}  # on the CPU: torch's default, as given
    rebuilt = rebuild_optimizer(cpu, [["a", "b"]], [("a", params[0]), ("b", params[1])])
    assert rebuilt.defaults["fused"] is None and rebuilt.param_groups[0]["fused"] is None
