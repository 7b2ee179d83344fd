"""fp8 training (``train.mixed_precision = "fp8"``, ``Model(amp_level="fp8")``): refused in one line where it
cannot run; where it runs, torchao's float8 Linears replace the right layers and train as bf16 does. On the
CPU torchao emulates the fp8 matmuls (``torch._scaled_mm``), so the numbers are checked here; the GPU run is
tests/gpu/test_gpu_fp8.py. torchao comes with the test extra (``make install``) or ``paratrain[fp8]``; it is not
imported from the zip in wheels/ here: this process forks workers, which would share its open file of the zip."""
import copy
import sys

import pytest
import torch
from torch import nn

from conftest import tiny_config
from forked_ranks import run_distributed
from test_checkpoint import train_stopped_after
from test_launch_inputs import refused
from paratrain import precision, preflight
from paratrain.amp import precision_of
from paratrain.checkpoint import info
from paratrain.errors import UserError
from paratrain.trainer import Trainer

pytest.importorskip("torchao.float8", reason="torchao: make install, or pip install 'paratrain[fp8]'")

GPT = {"kind": "gpt", "vocab_size": 64, "hidden_size": 32, "num_heads": 4, "ffn_hidden_size": 64,
       "decoder_layers": 2, "seq_length": 16}


@pytest.fixture
def fp8_runs_here(monkeypatch):
    """Let fp8 past the device check: the CPU emulates the fp8 matmuls that a Hopper GPU runs."""
    monkeypatch.setattr(precision, "fp8_unavailable", lambda device: None)


def test_train_refuses_fp8_on_the_cpu_in_one_line_before_it_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PARATRAIN_DEVICE", "cpu")
    err = refused(capsys, "train", f"--run.dir={tmp_path / 'run'}", "--train.mixed_precision=fp8", "--train.steps=1")
    assert "train.mixed_precision='fp8' cannot run here: the device is the CPU" in err
    assert "compute capability 8.9" in err and "mixed_precision='bf16'" in err
    assert not (tmp_path / "run").exists()  # nothing was built


def test_launch_refuses_fp8_on_the_cpu_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PARATRAIN_DEVICE", "cpu")
    monkeypatch.setenv("PARATRAIN_HOME", str(tmp_path / "home"))
    err = refused(capsys, "launch", "--nproc-per-node", "2", "--name", "fp8", "--", "train",
                  f"--run.dir={tmp_path / 'run'}", "--train.mixed_precision=fp8", "--parallel.data_parallel=2")
    assert "train.mixed_precision='fp8' cannot run here: the device is the CPU" in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "home").exists()


def test_fp8_is_refused_before_hopper_and_without_torchao(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert precision.fp8_unavailable(cuda) == ("NVIDIA A100-SXM4-80GB has compute capability 8.0, and fp8 matmuls "
                                               "need 8.9 or more (Ada, Hopper)")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert precision.fp8_unavailable(cuda) is None
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # an import that fails
    why = precision.fp8_unavailable(cuda)
    assert why.startswith(f"torchao's float8 training does not import with torch {torch.__version__} "
                          f"(ModuleNotFoundError: ")
    assert why.endswith("pip install 'paratrain[fp8]' (torchao)")


def test_fp8_with_tensor_parallel_is_refused_by_the_rules(tmp_path, fp8_runs_here):
    cfg = tiny_config(run={"dir": str(tmp_path)}, model=GPT, parallel={"model_parallel": 2},
                      train={"mixed_precision": "fp8"})
    with pytest.raises(UserError, match=r"'fp8' with parallel.model_parallel=2: .* use model_parallel=1"):
        preflight.check(cfg, 2)


def test_model_refuses_amp_level_fp8_on_the_cpu_and_with_a_loss_scale_manager(monkeypatch):
    from paratrain.amp import DynamicLossScaleManager

    monkeypatch.setenv("PARATRAIN_DEVICE", "cpu")
    with pytest.raises(UserError, match=r"^Model\(amp_level='fp8'\) cannot run here: the device is the CPU"):
        precision_of("fp8", None)
    monkeypatch.setattr(precision, "fp8_unavailable", lambda device: None)
    assert precision_of("fp8", None) == "fp8"
    with pytest.raises(UserError, match="bf16 needs no loss scaling"):
        precision_of("fp8", DynamicLossScaleManager())


class Net(nn.Module):
    """Linears of every kind the filter tells apart."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.odd = nn.Linear(32, 24)  # 24: not a multiple of 16
        self.subclass = type("OwnForward", (nn.Linear,), {})(32, 32)
        self.head = nn.Linear(32, 48)

    def forward(self, x):
        x = self.block(x)
        return self.head(x + self.subclass(x)), self.odd(x)


def test_the_filter_converts_plain_aligned_linears_and_keeps_the_head_and_subclasses():
    net = Net()
    assert precision.fp8_linear_names(net) == ["block.0", "block.2"]
    keys = list(net.state_dict())
    assert precision.convert_to_fp8(net) == ["block.0", "block.2"]
    assert [type(m).__name__ for m in (net.block[0], net.block[2], net.odd, net.subclass, net.head)] == \
        ["Float8Linear", "Float8Linear", "Linear", "OwnForward", "Linear"]
    assert list(net.state_dict()) == keys


def linear_names(trainer: Trainer, kind: str) -> set[str]:
    return {name for name, m in trainer.model.named_modules() if type(m).__name__ == kind}


def test_the_gpt_converts_every_projection_but_not_its_fused_head(tmp_path, fp8_runs_here):
    def trainer(mixed_precision):
        return Trainer(tiny_config(run={"dir": str(tmp_path / mixed_precision)}, model=GPT, metrics={"progress": False},
                                   train={"mixed_precision": mixed_precision, "steps": 1}))

    fp8, bf16 = trainer("fp8"), trainer("bf16")
    projections = linear_names(bf16, "Linear")  # this GPT's are all multiples of 16
    assert len(projections) >= 2 * 2 and not linear_names(bf16, "Float8Linear")  # attention's and the FFN's
    assert linear_names(fp8, "Float8Linear") == projections and not linear_names(fp8, "Linear")
    assert type(fp8.model.head) is type(bf16.model.head)  # the fused head and loss, kept


def test_fp8_linears_compute_close_to_the_plain_ones_with_the_same_parameters():
    torch.manual_seed(0)
    net = Net()
    reference = copy.deepcopy(net)
    precision.convert_to_fp8(net)
    x = torch.randn(3, 7, 32)  # 21 tokens: the inner dimension of the weight gradient is padded to 32
    (out, odd), (want, want_odd) = net(x), reference(x)
    (out.square().mean() + odd.square().mean()).backward()
    (want.square().mean() + want_odd.square().mean()).backward()
    assert (out - want).norm() / want.norm() < 0.1
    assert (out - want).abs().max() > 0  # the matmuls really ran in fp8
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        assert (p.grad - q.grad).norm() / q.grad.norm() < 0.15, name


def losses(tmp_path, name, mixed_precision, **sections):
    cfg = tiny_config(run={"dir": str(tmp_path / name)}, model=GPT,
                      train={"mixed_precision": mixed_precision, "steps": 20, "lr": 1e-2}, **sections)
    return [r["loss"] for r in Trainer(cfg).train()]


def test_fp8_trains_as_bf16_does(tmp_path, fp8_runs_here):
    bf16, fp8 = losses(tmp_path, "bf16", "bf16"), losses(tmp_path, "fp8", "fp8")
    assert fp8[-1] < 0.8 * fp8[0]
    assert fp8 == pytest.approx(bf16, rel=5e-2)
    assert fp8 != pytest.approx(bf16, rel=1e-6)


def test_an_fp8_run_resumes_from_its_checkpoint_as_if_uninterrupted(tmp_path, fp8_runs_here):
    """The fp8 Linears keep the plain parameters: the checkpoint (DCP) has the keys of a bf16 run's and a run
    stopped after its save resumes exactly as the uninterrupted one goes on."""
    def config(name):
        return tiny_config(run={"dir": str(tmp_path / name)}, model=GPT, checkpoint={"save_steps": 4},
                           train={"mixed_precision": "fp8", "steps": 8, "lr": 1e-2}, metrics={"progress": False})

    whole = [r["loss"] for r in Trainer(config("whole")).train()]
    train_stopped_after(config("stopped"), 4)
    resumed = Trainer(config("stopped"))
    assert resumed.step == 4
    assert [r["loss"] for r in resumed.train()] == whole[4:]
    saved = info(tmp_path / "whole" / "checkpoints")["tensors"]
    bf16 = Trainer(tiny_config(run={"dir": str(tmp_path / "bf16")}, model=GPT, train={"mixed_precision": "bf16"}))
    assert {f"model.{name}" for name in bf16.model.state_dict()} <= set(saved)


def fp8_run(cfg):
    """The losses, and how many of this rank's Linears are fp8."""
    trainer = Trainer(cfg)
    linears = len(linear_names(trainer, "Float8Linear"))
    return [r["loss"] for r in trainer.train()], linears


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"dp": 2, "zero_stage": 3}, {"pp": 2, "micro_batch_num": 2}],
                         ids=["dp2_zero3", "pp2"])
def test_fp8_with_data_parallel_and_pipeline_follows_one_process(tmp_path, fp8_runs_here, parallel):
    """FSDP2 gathers the fp8 Linears' weights in bf16 and each stage converts its own layers; the scales are
    per tensor on each rank's batch, so the losses match one process to fp8's rounding, not exactly."""
    def config(name, layout):
        return tiny_config(run={"dir": str(tmp_path / name)}, model=GPT, parallel=layout,
                           train={"mixed_precision": "fp8", "steps": 8, "lr": 1e-2}, metrics={"progress": False})

    want, linears = fp8_run(config("one", {}))
    ranks = run_distributed(fp8_run, 2, config("two", parallel))
    counts = [n for _, n in ranks]  # each rank converts what it holds: all of it, or its stage's layers
    assert linears > 0 and (counts == [linears] * 2 if "dp" in parallel else sum(counts) == linears and all(counts))
    assert ranks[0][0] == pytest.approx(want, rel=3e-2)


class Regression(nn.Module):
    """A MindSpore-face user's net that returns its loss: an fp8-sized block and a head."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.head(self.block(x)).float(), y)


def model_face_losses(amp_level):
    from paratrain.train import Model
    from test_model_engine import Losses

    torch.manual_seed(0)
    net = Regression()
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)) for _ in range(8)]
    model = Model(net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2), amp_level=amp_level)
    losses = Losses()
    model.train(1, data, callbacks=[losses])
    return losses.losses, [type(m).__name__ for m in (net.block[0], net.block[2], net.head)]


def test_model_amp_level_fp8_trains_the_users_linears_in_fp8_as_o2_trains_them_in_bf16(fp8_runs_here):
    bf16, kinds = model_face_losses("O2")
    fp8, fp8_kinds = model_face_losses("fp8")
    assert kinds == ["Linear"] * 3 and fp8_kinds == ["Float8Linear", "Float8Linear", "Linear"]
    assert fp8[-1] < fp8[0]
    assert fp8 == pytest.approx(bf16, rel=5e-2) and fp8 != pytest.approx(bf16, rel=1e-6)


def _fp8_tutorial_net_on_two_ranks():
    from paratrain.nn import TransformerOpParallelConfig
    from paratrain.train import Model
    from test_train_api import TutorialNet, token_batches

    precision.fp8_unavailable = lambda device: None  # this forked rank only: past the device check
    torch.manual_seed(0)
    net = TutorialNet(TransformerOpParallelConfig(model_parallel=2))
    model = Model(net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2), amp_level="fp8")
    try:
        model.train(1, token_batches())
    except UserError as exc:
        return str(exc)


def test_fp8_with_the_blocks_model_parallel_is_refused_by_the_same_rule():
    """The MindSpore face refuses fp8 beside tensor parallel as the TOML face does, naming its own settings."""
    for message in run_distributed(_fp8_tutorial_net_on_two_ranks, 2, timeout=120):
        assert message.startswith("Model.train: Model(amp_level='fp8') with the blocks' model_parallel=2: fp8 "
                                  "Linears are not split by tensor parallel"), message
        assert message.endswith("or amp_level='O2' (bf16)")
