"""The MindSpore face refuses bad settings in one line naming the argument and its value, before any step, by the
same rule functions (``paratrain.config_rules``) that check a TOML file's settings."""
import math

import pytest
import torch

from paratrain import config_rules
from paratrain.config import Config, ConfigError, ModelConfig, ParallelConfig
from paratrain.errors import UserError

INF, NAN = float("inf"), float("nan")


def one_line_naming(exc: BaseException, *fragments: str) -> str:
    text = str(exc)
    assert "\n" not in text, text
    for fragment in fragments:
        assert fragment in text, text
    return text


BAD_PARALLEL = [  # (setting, value, what the message says)
    ("zero_stage", 7, "is not one of 0, 1, 2, 3"),
    ("zero_stage", -1, "is not one of 0, 1, 2, 3"),
    ("zero_stage", True, "must be an integer"),
    ("optimizer_shard", "no", "must be True or False"),
    ("optimizer_shard", 1, "must be True or False"),
    ("vocab_emb_dp", "no", "must be True or False"),
    ("sequence_parallel", "false", "must be True or False"),
    ("pipeline_stage", 0, "must be positive"),
    ("micro_batch_num", 0, "must be positive"),
    ("micro_batch_num", -3, "must be positive"),
    ("expert_parallel", 0, "must be positive"),
    ("expert_parallel", -1, "must be positive"),
    ("data_parallel", 2.5, "must be an integer"),
    ("model_parallel", "2", "must be an integer"),
    ("model_parallel", True, "must be an integer"),
    ("model_parallel", NAN, "must be an integer"),
    ("virtual_pipeline_stage", 0, "must be positive"),
    ("offload_optimizer", "gpu", "is not one of none, cpu, nvme"),
    ("offload_param", 1, "must be a string"),
    ("pipeline_schedule", "zigzag", "is not one of gpipe"),
    ("gradient_aggregation_group", -2, "must be 0"),
    ("recompute", "sometimes", "is not one of none, full, selective"),
    ("recompute", 3, "must be a mode name"),
    ("layer_stages", "0,1", "must be a list"),
]


@pytest.mark.parametrize("name,value,says", BAD_PARALLEL)
def test_transformer_op_parallel_config_refuses_a_bad_setting_when_given_and_when_set(name, value, says):
    from paratrain.nn import TransformerOpParallelConfig

    with pytest.raises(ConfigError) as given:
        TransformerOpParallelConfig(**{name: value})
    one_line_naming(given.value, f"TransformerOpParallelConfig.{name}=", says)
    config = TransformerOpParallelConfig()
    with pytest.raises(ConfigError) as set_later:
        setattr(config, name, value)
    assert str(set_later.value) == str(given.value)
    assert getattr(config, name) == getattr(TransformerOpParallelConfig(), name)  # nothing was set


@pytest.mark.parametrize("name,value,says", BAD_PARALLEL)
def test_both_faces_refuse_a_bad_parallel_setting_by_one_rule(name, value, says, monkeypatch):
    """The TOML face's validator and the MindSpore face's config call ``parallel_field_problem`` with the value
    and give the same problem, only named differently (``parallel.`` and ``TransformerOpParallelConfig.``)."""
    from paratrain.nn import TransformerOpParallelConfig

    calls = []
    rule = config_rules.parallel_field_problem

    def spy(field, got, where="parallel.", num_layers=None):
        problem = rule(field, got, where, num_layers)
        calls.append((field, where, problem))
        return problem

    from paratrain import context

    assert context.parallel_field_problem is rule  # the MindSpore face's classes check by that very function
    for module in (config_rules, context):
        monkeypatch.setattr(module, "parallel_field_problem", spy)
    toml_face = config_rules.validate(Config(parallel=ParallelConfig(**{name: value})), world_size=1)
    with pytest.raises(ConfigError) as ms_face:
        TransformerOpParallelConfig(**{name: value})
    toml_problem = next(p for f, w, p in calls if f == name and w == "parallel.")
    ms_problem = next(p for f, w, p in calls if f == name and w == "TransformerOpParallelConfig.")
    assert toml_face == [toml_problem]
    assert toml_problem.removeprefix("parallel.") == ms_problem.removeprefix("TransformerOpParallelConfig.")
    assert ms_problem in str(ms_face.value) and says in ms_problem


def test_settings_checked_together_when_built():
    from paratrain.nn import TransformerOpParallelConfig

    with pytest.raises(ConfigError) as err:
        TransformerOpParallelConfig(offload_optimizer="cpu")
    one_line_naming(err.value, "offload_optimizer='cpu'", "zero_stage")
    assert TransformerOpParallelConfig(zero_stage=1, offload_optimizer="cpu").offloads
    assert TransformerOpParallelConfig(optimizer_shard=True, model_parallel=2).effective_zero_stage == 1


@pytest.mark.parametrize("kwargs,says", [
    ({"model_parallel": 0}, "model_parallel=0 must be positive"),
    ({"model_parallel": -2}, "model_parallel=-2 must be positive"),
    ({"pipeline_stage": 0}, "pipeline_stage=0 must be positive"),
    ({"data_parallel": -2}, "data_parallel=-2 must be positive"),
])
def test_a_plain_config_in_the_blocks_is_refused_without_odd_advice(kwargs, says):
    from paratrain.context import parallel_config_for

    with pytest.raises(ConfigError) as err:
        parallel_config_for([ParallelConfig(**kwargs)], 4)
    text = one_line_naming(err.value, says)
    assert "launch 0" not in text and "multiple of -" not in text and "processes" not in text


def test_a_plain_config_changed_after_the_blocks_took_it_is_refused_before_the_layout():
    from paratrain.context import parallel_config_for
    from paratrain.nn import TransformerOpParallelConfig

    config = ParallelConfig()
    config.expert_parallel = -2  # a plain ParallelConfig is not checked when set: the layout checks it
    with pytest.raises(ConfigError) as err:
        parallel_config_for([config], 2)
    one_line_naming(err.value, "expert_parallel=-2 must be positive")
    with pytest.raises(ConfigError) as err:  # expert_parallel that does not divide the derived data_parallel
        parallel_config_for([TransformerOpParallelConfig(expert_parallel=4)], 2)
    one_line_naming(err.value, "expert_parallel=4 does not divide", "data_parallel=2")


BAD_MOE = [
    ("expert_num", "4", "must be an integer"),
    ("expert_num", 0, "must be positive"),
    ("expert_num", -4, "must be positive"),
    ("expert_num", 4.0, "must be an integer"),
    ("capacity_factor", NAN, "is not a finite number"),
    ("capacity_factor", INF, "is not a finite number"),
    ("capacity_factor", 0.0, "capacity of 0 tokens"),
    ("capacity_factor", "1.1", "must be a number"),
    ("aux_loss_factor", -0.5, "must not be negative"),
    ("aux_loss_factor", NAN, "is not a finite number"),
    ("num_experts_chosen", 0, "must be in 1..expert_num"),
    ("expert_group_size", 0, "must be positive"),
    ("expert_group_size", "64", "must be an integer"),
    ("every", 0, "must be positive"),
]


@pytest.mark.parametrize("name,value,says", BAD_MOE)
def test_moe_config_refuses_a_bad_setting_by_the_toml_face_rule(name, value, says):
    from paratrain.nn import MoEConfig

    with pytest.raises(ConfigError) as ms_face:
        MoEConfig(**{name: value})
    one_line_naming(ms_face.value, f"MoEConfig.{name}=", says)
    toml_face = config_rules.validate(Config(model=ModelConfig(kind="gpt", moe={name: value})), 1)
    assert [p.removeprefix("model.moe.") for p in toml_face] == \
        [str(ms_face.value).removeprefix("invalid configuration: MoEConfig.")]


def test_moe_config_takes_mindspores_arguments_by_position():
    """MindSpore's MoEConfig(expert_num, capacity_factor, aux_loss_factor, num_experts_chosen, expert_group_size,
    group_wise_a2a, comp_comm_parallel, comp_comm_parallel_degree); paratrain's ``every`` only by name."""
    from paratrain.nn import MoEConfig

    moe = MoEConfig(4, 1.5, 0.01, 2, 8, True, True, 3)
    assert (moe.expert_num, moe.capacity_factor, moe.aux_loss_factor, moe.num_experts_chosen, moe.expert_group_size,
            moe.group_wise_a2a, moe.comp_comm_parallel, moe.comp_comm_parallel_degree, moe.every) == (
        4, 1.5, 0.01, 2, 8, True, True, 3, 1)
    assert MoEConfig(4, every=2).every == 2


def test_a_block_refuses_a_moe_config_changed_after_it_was_made():
    from paratrain.nn import MoE, MoEConfig

    moe = MoEConfig(expert_num=4)
    moe.expert_num = 0
    with pytest.raises(UserError) as err:
        MoE(16, 32, 0.0, moe_config=moe)
    one_line_naming(err.value, "MoE: moe_config.expert_num=0 must be positive")
    with pytest.raises(UserError) as err:
        MoE(16, 32, 0.0, moe_config={"expert_num": 4})
    one_line_naming(err.value, "moe_config must be a MoEConfig")


@pytest.mark.parametrize("build,says", [
    (lambda nn: nn.VocabEmbedding(0, 8), "vocab_size=0 must be at least 1"),
    (lambda nn: nn.VocabEmbedding(-5, 8), "vocab_size=-5 must be at least 1"),
    (lambda nn: nn.VocabEmbedding("16", 8), "vocab_size='16' must be an integer"),
    (lambda nn: nn.VocabEmbedding(16, 8.0), "embedding_size=8.0 must be an integer"),
    (lambda nn: nn.MultiHeadAttention(0, 8, 8, 16, 2), "batch_size=0 must be at least 1"),
    (lambda nn: nn.MultiHeadAttention(2, 8, 8, 16, 2, hidden_dropout_rate=NAN), "hidden_dropout_rate=nan"),
    (lambda nn: nn.TransformerEncoder(2, True, 16, 32, 8, 2), "num_layers=True must be an integer"),
    (lambda nn: nn.Transformer(16, 2, 32, 8, 8, encoder_layers="1"), "encoder_layers='1' must be an integer"),
    (lambda nn: nn.VocabEmbedding(16, 8, parallel_config=ParallelConfig(model_parallel=0)),
     "parallel_config.model_parallel=0 must be positive"),
    (lambda nn: nn.PipelineCell(torch.nn.Linear(2, 2), 0), "PipelineCell: micro_size=0 must be at least 1"),
    (lambda nn: nn.PipelineCell(torch.nn.Linear(2, 2), "4"), "PipelineCell: micro_size='4' must be an integer"),
    (lambda nn: nn.PipelineCell(None, 4), "PipelineCell(network=None)"),
    (lambda nn: nn.AttentionMask(0), "AttentionMask: seq_length=0 must be at least 1"),
    (lambda nn: nn.Dense(4, 0), "Dense: out_channels=0 must be at least 1"),
    (lambda nn: nn.Dense("4", 2), "Dense: in_channels='4' must be an integer"),
])
def test_blocks_refuse_bad_sizes_naming_them(build, says):
    import paratrain.nn

    with pytest.raises(UserError) as err:
        build(paratrain.nn)
    one_line_naming(err.value, says)


@pytest.mark.parametrize("build,says", [
    (lambda amp: amp.FixedLossScaleManager(INF), "loss_scale=inf is not a finite number"),
    (lambda amp: amp.FixedLossScaleManager(NAN), "loss_scale=nan is not a finite number"),
    (lambda amp: amp.FixedLossScaleManager(-INF), "loss_scale=-inf is not a finite number"),
    (lambda amp: amp.FixedLossScaleManager(0), "loss_scale=0 must be at least 1"),
    (lambda amp: amp.FixedLossScaleManager(0.5), "loss_scale=0.5 must be at least 1"),
    (lambda amp: amp.FixedLossScaleManager("128"), "loss_scale='128' must be a number"),
    (lambda amp: amp.FixedLossScaleManager(True), "loss_scale=True must be a number"),
    (lambda amp: amp.FixedLossScaleManager(1e39), "overflows float32"),
    (lambda amp: amp.FixedLossScaleManager(128, "no"), "drop_overflow_update='no' must be True or False"),
    (lambda amp: amp.DynamicLossScaleManager(INF), "init_loss_scale=inf is not a finite number"),
    (lambda amp: amp.DynamicLossScaleManager(NAN, 2, 100), "init_loss_scale=nan is not a finite number"),
    (lambda amp: amp.DynamicLossScaleManager(-8.0), "init_loss_scale=-8.0 must be at least 1"),
    (lambda amp: amp.DynamicLossScaleManager(2 ** 10, INF), "scale_factor=inf is not a finite number"),
    (lambda amp: amp.DynamicLossScaleManager(2 ** 10, "2"), "scale_factor='2' must be a number"),
    (lambda amp: amp.DynamicLossScaleManager(2 ** 10, 3), "scale_factor=3"),
    (lambda amp: amp.DynamicLossScaleManager(2 ** 10, 2, 0), "scale_window=0 must be at least 1"),
    (lambda amp: amp.DynamicLossScaleManager(2 ** 10, 2, 10.5), "scale_window=10.5 must be an integer"),
    (lambda amp: amp.DynamicLossScaleManager(2 ** 10, 2, INF), "scale_window=inf must be an integer"),
])
def test_loss_scale_managers_refuse_bad_scales_when_built(build, says):
    from paratrain import amp

    with pytest.raises(UserError) as err:
        build(amp)
    one_line_naming(err.value, "LossScaleManager", says)


def test_loss_scale_managers_keep_good_scales():
    from paratrain import amp

    assert amp.FixedLossScaleManager(2 ** 10).get_loss_scale() == 1024.0
    manager = amp.DynamicLossScaleManager(2.0 ** 16, 2.0, 50)
    assert (manager.init_loss_scale, manager.scale_window) == (65536.0, 50)
    assert math.isfinite(manager.init_loss_scale)


def _linear():
    net = torch.nn.Linear(4, 2)
    return net, torch.optim.SGD(net.parameters(), lr=0.1)


@pytest.mark.parametrize("call,says", [
    (lambda Model, net, opt: Model(None), "Model(network=None): expected the net"),
    (lambda Model, net, opt: Model("net"), "Model(network='net')"),
    (lambda Model, net, opt: Model(net, optimizer="adam"), "Model(optimizer='adam'): expected"),
    (lambda Model, net, opt: Model(net, optimizer=torch.optim.AdamW), "Model(optimizer="),
    (lambda Model, net, opt: Model(net, loss_fn="mse"), "Model(loss_fn='mse')"),
    (lambda Model, net, opt: Model(net, eval_network=3), "Model(eval_network=3)"),
    (lambda Model, net, opt: Model(net, optimizer=opt).train(1, None), "Model.train(train_dataset=None)"),
    (lambda Model, net, opt: Model(net, optimizer=opt).train(1, 7), "Model.train(train_dataset=7)"),
    (lambda Model, net, opt: Model(net, optimizer=opt).train(1, "batches"), "Model.train(train_dataset='batches')"),
    (lambda Model, net, opt: Model(net, optimizer=opt).train("1", []), "epoch must be a positive int, got '1'"),
    (lambda Model, net, opt: Model(net, optimizer=opt).train(1, [], dataset_sink_mode="no"),
     "dataset_sink_mode='no'"),
    (lambda Model, net, opt: Model(net, torch.nn.MSELoss(), metrics={"loss"}).eval(None),
     "Model.eval(valid_dataset=None)"),
])
def test_model_refuses_arguments_of_the_wrong_kind(call, says):
    from paratrain.train import Model

    net, opt = _linear()
    with pytest.raises(UserError) as err:
        call(Model, net, opt)
    one_line_naming(err.value, says)


@pytest.mark.parametrize("build,says", [
    (lambda cb: cb.ModelCheckpoint(config={"save_checkpoint_steps": 2}), "ModelCheckpoint(config={'save_checkpoint"),
    (lambda cb: cb.ModelCheckpoint(directory=5), "ModelCheckpoint(directory=5)"),
    (lambda cb: cb.CheckpointConfig(integrated_save="no"), "integrated_save='no' must be True or False"),
    (lambda cb: cb.CheckpointConfig(save_checkpoint_steps=0), "save_checkpoint_steps=0 must be >= 1"),
    (lambda cb: cb.CheckpointConfig(save_checkpoint_steps=2.0), "save_checkpoint_steps=2.0 must be an integer"),
    (lambda cb: cb.CheckpointConfig(keep_checkpoint_max=-1), "keep_checkpoint_max=-1 must be >= 0"),
    (lambda cb: cb.CheckpointConfig(keep_checkpoint_max="5"), "keep_checkpoint_max='5' must be an integer"),
    (lambda cb: cb.LossMonitor("1"), "LossMonitor(per_print_times='1')"),
    (lambda cb: cb.LossMonitor(-1), "LossMonitor(per_print_times=-1)"),
    (lambda cb: cb.TimeMonitor(0), "TimeMonitor(data_size=0)"),
    (lambda cb: cb.TimeMonitor("10"), "TimeMonitor(data_size='10')"),
    (lambda cb: cb.SummaryCollector("s", breakdown="no"), "SummaryCollector(breakdown='no')"),
    (lambda cb: cb.SummaryCollector(None), "SummaryCollector(summary_dir=None)"),
    (lambda cb: cb.SummaryCollector("s", collect_specified_data=["collect_metric"]),
     "SummaryCollector(collect_specified_data=['collect_metric'])"),
])
def test_callbacks_refuse_arguments_of_the_wrong_kind(build, says, tmp_path, monkeypatch):
    from paratrain.train import callbacks

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as err:
        build(callbacks)
    one_line_naming(err.value, says)


def test_directories_of_the_callbacks_expand_the_home_directory(tmp_path, monkeypatch):
    from paratrain.train import ModelCheckpoint, OnRequestExit, SummaryCollector

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    saver = ModelCheckpoint(directory="~/checkpoints")
    assert saver.directory == home / "checkpoints" and saver.directory.is_dir()
    assert SummaryCollector("~/summaries").summary_dir == home / "summaries"
    assert OnRequestExit(directory="~/exit").directory == home / "exit"
    assert not (work / "~").exists()


class _BlocksNet(torch.nn.Module):
    """A tiny net of paratrain.nn blocks built for batches of 4 rows of 8 ids below 16."""

    def __init__(self):
        from paratrain.nn import Transformer, VocabEmbedding

        super().__init__()
        self.embedding = VocabEmbedding(16, 16)
        self.transformer = Transformer(hidden_size=16, batch_size=4, ffn_hidden_size=32, src_seq_length=8,
                                       tgt_seq_length=8, encoder_layers=1, decoder_layers=0, num_heads=2,
                                       attention_dropout_rate=0.0, hidden_dropout_rate=0.0)

    def forward(self, ids, labels):
        words, table = self.embedding(ids)
        logits = self.transformer(words, torch.ones(ids.shape[0], ids.shape[1], ids.shape[1]))[0] @ table.t()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("rows,length,top,says", [
    (4, 8, 16, None),
    (2, 8, 16, "2 rows, but the net's blocks were built with batch_size=4"),
    (4, 5, 16, "length 5, but the net's blocks were built with sequence lengths [8]"),
    (4, 8, 40, "holds id 39, but the net's largest embedding table has vocab_size=16"),
])
def test_model_train_refuses_batches_unlike_the_blocks_before_any_step(rows, length, top, says):
    from paratrain.train import Model

    torch.manual_seed(0)
    net = _BlocksNet()
    before = [p.detach().clone() for p in net.parameters()]
    ids = torch.randint(0, 16, (rows, length))
    ids[0, 0] = top - 1  # the largest id
    model = Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    if says is None:
        model.train(1, [(ids, ids.roll(1, -1))])
        assert any(not torch.equal(a, b.detach()) for a, b in zip(before, model.train_network.parameters()))
        return
    with pytest.raises(UserError) as err:
        model.train(1, [(ids, ids.roll(1, -1))])
    one_line_naming(err.value, "Model.train: batch index 0 of epoch 1", says)
    assert model.train_network is None  # refused before the net was placed or stepped
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


@pytest.mark.parametrize("rows,says", [
    (16, None),  # micro-batches of 4 rows: the blocks' batch_size, as MindSpore's tutorial builds them
    (4, None),  # the whole batch: the blocks' batch_size
    (8, "8 rows, but the net's blocks were built with batch_size=4: build the blocks with batch_size=8 or with "
        "the rows of one of its micro_size=4 micro-batches (2)"),
])
def test_a_pipeline_cell_takes_blocks_built_for_its_micro_batches(rows, says):
    from paratrain.nn import PipelineCell
    from paratrain.train import Model

    torch.manual_seed(0)
    net = PipelineCell(_BlocksNet(), 4)
    ids = torch.randint(0, 16, (rows, 8))
    model = Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    if says is None:
        model.train(1, [(ids, ids.roll(1, -1))])
        assert model.train_network is not None
        return
    with pytest.raises(UserError) as err:
        model.train(1, [(ids, ids.roll(1, -1))])
    one_line_naming(err.value, "Model.train: batch index 0 of epoch 1", says)


@pytest.mark.parametrize("name", ["recompute", "parallel_optimizer_comm_recompute", "mp_comm_recompute",
                                  "recompute_slice_activation"])
def test_recompute_config_refuses_what_is_not_a_bool(name):
    from paratrain.nn import TransformerRecomputeConfig

    for value in ("no", 0, None):
        with pytest.raises(ConfigError) as err:
            TransformerRecomputeConfig(**{name: value})
        one_line_naming(err.value, f"TransformerRecomputeConfig.{name}={value!r} must be True or False")
    assert TransformerRecomputeConfig(**{name: True}).mode == ("full" if name == "recompute" else "none")


def test_numpy_batches_train_as_the_same_tensors_do():
    """MindSpore's datasets give NumPy arrays: Model.train takes them as the tensors they hold."""
    import numpy as np

    from paratrain.train import Model

    class Squared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 1)

        def forward(self, x, y):
            return ((self.fc(x) - y) ** 2).mean()

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(3)]
    trained = []
    for batches in (data, [(x.numpy(), y.numpy()) for x, y in data]):
        torch.manual_seed(0)
        net = Squared()
        model = Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
        model.train(1, batches)
        trained.append([p.detach().clone() for p in model.train_network.parameters()])
    torch.manual_seed(0)
    initial = [p.detach() for p in Squared().parameters()]
    assert all(torch.equal(a, b) for a, b in zip(*trained))
    assert not any(torch.equal(a, b) for a, b in zip(trained[0], initial))  # it trained
