"""MindSpore's ``Model.train`` on the engine ``paratrain train`` runs (``paratrain.engine``): amp levels and
loss-scale managers, SummaryCollector's records, a non-finite loss ending the run with exit code 3."""
import contextlib
import io
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from forked_ranks import run_distributed
from paratrain.amp import DynamicLossScaleManager, FixedLossScaleManager
from paratrain.context import reset_auto_parallel_context
from paratrain.errors import UserError
from paratrain.train import LossMonitor, Model, SummaryCollector
from test_metrics import _train as train_builtin


class Net(nn.Module):
    """A user's net of two matmuls that returns its loss."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 1)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(torch.tanh(self.fc1(x))).float(), y)


class Losses(LossMonitor):
    """Each step's loss (``net_outputs``), read on the host every step."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_step_end(self, run_context):
        self.losses.append(float(run_context.original_args().net_outputs))


@pytest.fixture(autouse=True)
def fresh_context():
    yield
    reset_auto_parallel_context()


def dataset(batches=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(batches)]


def model_losses(amp_level="O0", manager=None, data=None, callbacks=()):
    torch.manual_seed(0)
    net = Net()
    model = Model(net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2), amp_level=amp_level,
                  loss_scale_manager=manager)
    losses = Losses()
    model.train(1, data or dataset(), callbacks=[losses, *callbacks])
    return losses.losses


def plain_bf16_losses(data):
    """The same net in a plain loop under ``paratrain train``'s bf16: fp32 weights, matmuls autocast to bf16."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    losses = []
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = net(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("amp_level", ["O1", "O2", "O3"])
def test_amp_levels_train_in_bf16_as_paratrain_train_does(amp_level):
    data = dataset()
    bf16, fp32 = model_losses(amp_level, data=data), model_losses("O0", data=data)
    assert bf16 == pytest.approx(plain_bf16_losses(data), rel=1e-6)
    assert max(abs(a - b) for a, b in zip(bf16, fp32)) > 1e-4  # bf16 compute, not fp32


@pytest.mark.parametrize("manager", [FixedLossScaleManager(1024.0), DynamicLossScaleManager(2.0 ** 10, 2, 2)],
                         ids=["fixed", "dynamic"])
def test_loss_scale_managers_train_in_fp16_and_record_the_scale(tmp_path, manager):
    data = dataset()
    fp16 = model_losses("O2", manager, data, callbacks=[SummaryCollector(tmp_path, collect_freq=1)])
    fp32 = model_losses("O0", data=data)
    assert fp16 == pytest.approx(fp32, rel=2e-2) and fp16 != fp32
    scales = [json.loads(line)["loss_scale"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    growth = isinstance(manager, DynamicLossScaleManager)
    assert scales == ([2.0 ** 10 * 2 ** (i // 2) for i in range(1, 5)] if growth else [1024.0] * 4)


def test_fixed_loss_scale_skips_an_overflowed_step():
    data = dataset()
    data[1] = (data[1][0] * 1e4, data[1][1])  # fp16 overflows in step 2's gradients at this scale
    torch.manual_seed(0)
    net = Net()
    model = Model(net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2), amp_level="O2",
                  loss_scale_manager=FixedLossScaleManager(2.0 ** 15))
    model.train(1, data)
    assert int(model.loss_scaler.skipped_steps) >= 1 and float(model.loss_scaler.scale) == 2.0 ** 15
    assert all(torch.isfinite(p).all() for p in model.train_network.parameters())


def test_summary_collector_writes_paratrain_trains_keys_and_tensorboard(tmp_path):
    builtin = train_builtin(tmp_path, "builtin", steps=2, log_steps=1)
    model_losses(data=dataset(5), callbacks=[SummaryCollector(tmp_path / "summary", collect_freq=2)])
    logged = [json.loads(line) for line in (tmp_path / "summary" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [2, 4, 5]  # every collect_freq steps and the last
    assert set(logged[0]) == set(builtin[0]) | {"time"}
    assert all(r["tokens_per_s"] > 0 and r["samples_per_s"] == pytest.approx(8 / r["step_time_s"]) for r in logged)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "summary"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [2, 4, 5]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([r["loss"] for r in logged])


def _logged_flops(directory) -> list[float]:
    records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    return [r["tflops"] * 1e12 * r["step_time_s"] for r in records]


def test_summary_collector_counts_a_user_nets_flops_as_torchs_flop_counter_does(tmp_path):
    from torch.utils.flop_counter import FlopCounterMode

    data = dataset(2)
    model_losses(data=data, callbacks=[SummaryCollector(tmp_path, collect_freq=1)])
    with FlopCounterMode(display=False) as counter:
        Net()(*data[0]).backward()
    assert _logged_flops(tmp_path) == pytest.approx([counter.get_total_flops()] * 2, rel=1e-9)


class _NetOfValues(Net):
    """A net whose forward reads a value of its input."""

    def forward(self, x, y):
        return super().forward(x if bool(x.sum() > -1e9) else -x, y)


def test_a_net_that_needs_values_is_counted_as_6_n_tokens_and_says_so(tmp_path, capsys):
    torch.manual_seed(0)
    net = _NetOfValues()
    model = Model(net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2))
    model.train(1, dataset(1), callbacks=[SummaryCollector(tmp_path, collect_freq=1)])
    assert "6 x parameters x tokens: its forward does not run on tensors without values" in capsys.readouterr().out
    assert _logged_flops(tmp_path) == pytest.approx([6.0 * sum(p.numel() for p in net.parameters()) * 8], rel=1e-9)


def test_summary_collector_breakdown_has_the_phases_of_a_user_net(tmp_path):
    model_losses(data=dataset(2), callbacks=[SummaryCollector(tmp_path, collect_freq=1, breakdown=True)])
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    b = record["breakdown"]
    assert b["forward_s"] > 0 and b["backward_s"] > 0 and b["optimizer_s"] > 0
    assert sum(b[f"{p}_pct"] for p in ("forward", "backward", "optimizer", "comm", "pipeline_idle", "other")) \
        == pytest.approx(100, abs=2)


def test_summary_collector_refuses_what_it_cannot_write(tmp_path):
    with pytest.raises(UserError, match="collect_freq"):
        SummaryCollector(tmp_path, collect_freq=0)
    with pytest.raises(UserError, match="histogram_regular"):
        SummaryCollector(tmp_path, collect_specified_data={"histogram_regular": "^fc"})


def test_a_non_finite_loss_ends_the_run_with_exit_3_naming_the_step(capsys):
    data = dataset()
    data[2] = (data[2][0], torch.full_like(data[2][1], float("nan")))
    with pytest.raises(SystemExit) as stopped:
        model_losses(data=data, callbacks=[])
    assert stopped.value.code == 3
    assert "paratrain: training stopped: loss is nan at step 3" in capsys.readouterr().err


def _train_dp2_bf16():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        return model_losses("O2", data=dataset())


@pytest.mark.timeout(120)
def test_bf16_on_two_data_parallel_ranks_gives_the_losses_of_one_process():
    one = model_losses("O2", data=dataset())
    for losses in run_distributed(_train_dp2_bf16, 2):
        assert losses == pytest.approx(one, rel=1e-2)


def _graph_mode_losses(graph):
    import paratrain

    paratrain.set_context(mode=paratrain.GRAPH_MODE if graph else paratrain.PYNATIVE_MODE)
    torch.manual_seed(0)
    net = Net()
    model = Model(net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2))
    losses = Losses()
    model.train(1, dataset(3), callbacks=[losses])
    return losses.losses, model.train_network.parts[0]._compiled_call_impl is not None


@pytest.mark.slow
def test_graph_mode_compiles_the_net_with_the_eager_losses():
    # child processes: inductor's compile workers must not be inherited by the processes later tests fork
    (eager, eager_compiled), = run_distributed(_graph_mode_losses, 1, False, timeout=240)
    (graph, graph_compiled), = run_distributed(_graph_mode_losses, 1, True, timeout=240)
    assert graph_compiled and not eager_compiled
    assert graph == pytest.approx(eager, rel=1e-4)


def test_graph_mode_with_pipeline_stages_is_refused_before_placing():
    """A traced pipeline stage runs its layers inlined, so they cannot be compiled one by one: Model refuses
    GRAPH_MODE with pipeline stages before it places anything (no layout is needed to say so)."""
    import paratrain
    from paratrain.config import ParallelConfig
    from paratrain.train.placement import place_by_mode

    paratrain.set_context(mode=paratrain.GRAPH_MODE)
    try:
        with pytest.raises(UserError, match=r"GRAPH_MODE\) with pipeline stages"):
            place_by_mode(Net(), ParallelConfig(pipeline_stage=2, micro_batch_num=2), layout=None, batch=())
    finally:
        paratrain.set_context(mode=paratrain.PYNATIVE_MODE)


def test_set_context_refuses_what_it_cannot_honour():
    import paratrain

    with pytest.raises(UserError, match="GRAPH_MODE"):
        paratrain.set_context(mode=2)
    with pytest.raises(UserError, match="Ascend"):
        paratrain.set_context(device_target="Ascend")
    with pytest.raises(UserError, match="this run is on the CPU"):
        paratrain.set_context(device_target="GPU")
    with pytest.raises(UserError, match="not offered"):
        paratrain.set_context(save_graphs=True)
    assert paratrain.get_context("mode") == paratrain.PYNATIVE_MODE


def test_a_net_that_cannot_fit_is_refused_before_its_first_step(monkeypatch):
    from paratrain import preflight

    monkeypatch.setattr(preflight, "host_memory", lambda: 4096)  # bytes: less than the net's state
    torch.manual_seed(0)
    net = Net()
    ran = []
    net.register_forward_pre_hook(lambda *_: ran.append(1))
    params = sum(p.numel() for p in net.parameters())
    with pytest.raises(UserError, match=f"the net's {params:.3g} parameters need .* more than this host's 4 KiB"):
        Model(net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2)).train(1, dataset(1))
    assert not ran


def _pipelined_losses(stages, amp_level):
    import paratrain
    from paratrain.nn import PipelineCell
    from test_user_net import Net as TokenNet, _batches

    torch.manual_seed(0)
    net = TokenNet()
    for i, block in enumerate(net.blocks):
        block.pipeline_stage = i * stages // len(net.blocks)
    if stages > 1:
        paratrain.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=stages)
    losses = Losses()
    model = Model(PipelineCell(net, 2), optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2), amp_level=amp_level)
    model.train(1, _batches(4), callbacks=[losses])
    return losses.losses


@pytest.mark.timeout(200)
def test_bf16_through_pipeline_stages_gives_the_losses_of_one_process():
    # the stages' bf16 outputs travel in the traced fp32 (the receive buffers' dtype), not as raw bf16 bytes
    one = _pipelined_losses(1, "O2")
    for losses in run_distributed(_pipelined_losses, 2, 2, "O2", timeout=180):
        assert losses == pytest.approx(one, rel=5e-3)


def test_auto_parallel_wrapper_sets_the_layout_as_the_context_does():
    import paratrain
    from paratrain.context import parallel_config_for

    net = paratrain.AutoParallel(Net(), parallel_mode="semi_auto")
    net.pipeline(stages=2, interleave=True, scheduler="1f1b")
    net.hsdp(optimizer_level="level3")
    config = parallel_config_for([], 8, segments=2)
    assert (config.pipeline_stage, config.data_parallel, config.effective_zero_stage) == (2, 4, 3)
    assert (config.pipeline_schedule, config.virtual_pipeline_stage) == ("interleaved_1f1b", 2)
    assert [name for name, _ in net.named_parameters()] == [f"network.{n}" for n, _ in Net().named_parameters()]
    with pytest.raises(UserError, match="output_broadcast"):
        net.pipeline(stages=2, output_broadcast=True)
    with pytest.raises(UserError, match="shard_size"):
        net.hsdp(shard_size=2)
    with pytest.raises(UserError, match="parallel_mode='auto'"):
        paratrain.AutoParallel(Net(), parallel_mode="auto")


def _hsdp_losses():
    import paratrain

    torch.manual_seed(0)
    net = paratrain.AutoParallel(Net())
    net.hsdp(optimizer_level="level3")
    losses = Losses()
    model = Model(net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2))
    model.train(1, dataset(), callbacks=[losses])
    return losses.losses, model.train_network.config.effective_zero_stage


@pytest.mark.timeout(120)
def test_auto_parallel_hsdp_level3_on_two_ranks_gives_the_losses_of_one_process():
    one = model_losses(data=dataset())
    for losses, zero in run_distributed(_hsdp_losses, 2, timeout=100):
        assert zero == 3 and losses == pytest.approx(one, rel=1e-5)


def _scenario(directory, parallel=True, signal_rank=None, resume="none"):
    """The issue's check, on 8 ranks: a user's token net of blocks declaring their tensor-parallel split,
    data_parallel=2 x model_parallel=2 x 2 interleaved pipeline stages (two segments each, 1F1B) x 2 micro-batches,
    in bf16, with a
    SummaryCollector and a ModelCheckpoint (without ``parallel``: one process, the same context); rank
    ``signal_rank`` gets SIGTERM at the start of step 2. Returns (exit code, [(step, loss)])."""
    import os
    import signal

    import paratrain
    from paratrain import TransformerOpParallelConfig
    from paratrain.train import Callback, CheckpointConfig, ModelCheckpoint
    from test_user_net import Net as TokenNet, _batches

    torch.manual_seed(0)
    net = TokenNet()
    net.parallel_config = TransformerOpParallelConfig(data_parallel=2 if parallel else 1,
                                                      model_parallel=2 if parallel else 1, micro_batch_num=2)
    for i, block in enumerate(net.blocks):
        block.pipeline_stage, block.pipeline_segment = i % 2, i // 2
    paratrain.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_config={
        "pipeline_interleave": True, "pipeline_scheduler": "1f1b"})
    if parallel:
        paratrain.set_auto_parallel_context(pipeline_stages=2)
    steps = []

    class Steps(Callback):
        def on_train_step_begin(self, run_context):
            params = run_context.original_args()
            if params.rank == signal_rank and params.cur_step_num + 1 == 2:
                os.kill(os.getpid(), signal.SIGTERM)

        def on_train_step_end(self, run_context):
            params = run_context.original_args()
            steps.append((params.cur_step_num, float(params.net_outputs)))

    model = Model(net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2), amp_level="O2")
    saver = ModelCheckpoint(prefix="net", directory=directory, config=CheckpointConfig(save_checkpoint_steps=100))
    try:
        model.train(1, _batches(5), callbacks=[Steps(), saver, SummaryCollector(directory, collect_freq=1)],
                    resume=resume)
    except SystemExit as exc:
        return exc.code, steps
    return 0, steps


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_users_net_dp2_mp2_interleaved_pp2_bf16_stopped_and_resumed_gives_one_process_losses(tmp_path):
    code, one = _scenario(str(tmp_path / "one"), parallel=False)  # one process: no pipeline, dp 1, mp 1
    assert code == 0 and [step for step, _ in one] == [1, 2, 3, 4, 5]
    stopped = run_distributed(_scenario, 8, str(tmp_path / "run"), True, 5, timeout=240)
    assert [code for code, _ in stopped] == [4] * 8  # rank 5 signalled in step 2: all stop after step 3, saved
    resumed = run_distributed(_scenario, 8, str(tmp_path / "run"), True, None, "auto", timeout=240)
    assert [code for code, _ in resumed] == [0] * 8
    losses = stopped[0][1] + resumed[0][1]
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5]
    assert [loss for _, loss in losses] == pytest.approx([loss for _, loss in one], rel=5e-3)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5] and all(r["mfu"] > 0 for r in logged)


def _deferred_losses(deferred, model_parallel=1):
    """Losses of the token net with its blocks split over ``model_parallel`` ranks, built plainly or under
    no_init_parameters (then placed on the meta device and materialised shard by shard)."""
    import contextlib

    import paratrain
    from paratrain import TransformerOpParallelConfig
    from test_user_net import Net as TokenNet, _batches

    torch.manual_seed(0)
    with paratrain.no_init_parameters() if deferred else contextlib.nullcontext():
        net = TokenNet()
        net.parallel_config = TransformerOpParallelConfig(model_parallel=model_parallel)
    assert all(p.is_meta for p in net.parameters()) == deferred
    losses = Losses()
    model = Model(net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2))
    model.train(1, _batches(3), callbacks=[losses])
    return losses.losses


@pytest.mark.timeout(120)
def test_a_net_built_under_no_init_parameters_trains_as_the_plain_build():
    plain = _deferred_losses(False)
    assert _deferred_losses(True) == plain
    for losses in run_distributed(_deferred_losses, 2, True, 2, timeout=100):  # each rank makes its shards only
        assert losses == pytest.approx(plain, rel=1e-5)


def test_a_meta_net_not_built_under_no_init_parameters_is_refused():
    net = Net().to("meta")
    with pytest.raises(UserError, match="not built under paratrain.no_init_parameters"):
        Model(net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2)).train(1, dataset(1))
