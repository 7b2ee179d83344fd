"""One start per process: the launcher's variables filled once and the config checked once, whichever way the run
starts (``paratrain train``, a rank of ``paratrain launch``, a rank of a bare torchrun, ``Trainer(cfg)``); and on both
faces every save made after the ranks' stop agreement."""
import os
import signal

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny_config

from paratrain import cli, cluster, config_file, distributed, loop, preflight
from paratrain.checkpoint import Checkpointer
from paratrain.stopping import StopAgreement

TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}


def _config(run_dir, steps=1, parallel=None, **checkpoint):
    return tiny_config(run={"dir": str(run_dir)}, model={"encoder_layers": 1, "decoder_layers": 1},
                       train={"steps": steps}, metrics={"log_steps": 100, "progress": False}, checkpoint=checkpoint,
                       parallel=parallel or {})


@pytest.fixture
def environ(monkeypatch):
    """This process's environment as a test found it, given back after it (a launch in this process writes the
    ranks' variables into it); no launcher's or torchrun's variables."""
    saved = dict(os.environ)
    for name in (preflight.CHECKED_ENV, "TORCHELASTIC_RESTART_COUNT", *TORCHRUN_ENV):
        os.environ.pop(name, None)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


class _Calls(dict):
    """How many times ``cluster.fill_env`` and ``preflight.check`` ran, by their name; ``resolved``: each check's
    (True: of the layout that ``parallel.auto``'s plan chose)."""

    def __init__(self):
        super().__init__(fill_env=0, check=0)
        self.resolved = []


@pytest.fixture
def calls(monkeypatch):
    """The ``_Calls`` of this test."""
    counted = _Calls()
    fill_env, check = cluster.fill_env, preflight.check

    def counted_fill_env(*args, **kwargs):
        counted["fill_env"] += 1
        return fill_env(*args, **kwargs)

    def counted_check(*args, resolved=False, **kwargs):
        counted["check"] += 1
        counted.resolved.append(resolved)
        return check(*args, resolved=resolved, **kwargs)

    monkeypatch.setattr(cluster, "fill_env", counted_fill_env)
    monkeypatch.setattr(distributed, "fill_env", counted_fill_env)
    monkeypatch.setattr(preflight, "check", counted_check)
    return counted


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher, auto", [("none", False), ("torchrun", False), ("none", True)])
def test_paratrain_train_fills_the_env_and_checks_once(launcher, auto, tmp_path, environ, calls):
    """A process of ``paratrain train`` of its own, or a rank torchrun started: one fill, one check (and with
    ``parallel.auto`` one more of the layout the plan chose)."""
    config_file.save(_config(tmp_path / "run"), tmp_path / "run.toml")
    if launcher == "torchrun":
        environ.update(TORCHRUN_ENV)
    assert cli.main(["train", "--config", str(tmp_path / "run.toml"), f"--parallel.auto={str(auto).lower()}"]) == 0
    assert calls == {"fill_env": 1, "check": 1 + auto} and calls.resolved == [not auto] + [True] * auto


@pytest.mark.timeout(60)
def test_a_trainer_of_a_config_starts_once(tmp_path, environ, calls):
    from paratrain.trainer import Trainer

    trainer = Trainer(_config(tmp_path))
    assert calls == {"fill_env": 1, "check": 1}
    assert len(trainer.train()) == 1 and calls == {"fill_env": 1, "check": 1}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank_runs, rank_checks", [("the launched config", [False]), ("another config", [False, True]),
                                                    ("a restart", [False, True]), ("a planned layout", [False, True])],
                         ids=["launched", "another-config", "restart", "planned"])
def test_a_launched_rank_checks_only_what_its_launcher_did_not(rank_runs, rank_checks, tmp_path, environ, calls,
                                                               monkeypatch):
    """``paratrain launch`` checks the config once before any rank starts, and its rank (run here, in this
    process, as torchrun would start it) does not check it again; a rank whose config is not the one the launcher
    checked, or one torchrun restarts, checks; with ``parallel.auto`` the rank checks the layout its plan chose.
    ``rank_checks``: every check's ``resolved``, the launcher's first."""
    from paratrain.launch import launcher

    environ["PARATRAIN_HOME"] = str(tmp_path / "jobs")
    config_file.save(_config(tmp_path / "run", parallel={"auto": rank_runs == "a planned layout"}),
                     tmp_path / "run.toml")
    exits = []

    def run_rank(job, topo, command, **options):
        assert calls == {"fill_env": 0, "check": 1}  # the launcher's check, before any rank
        environ.update(TORCHRUN_ENV)
        words = command[command.index("paratrain") + 1:]
        if rank_runs == "another config":
            words.append("--train.lr=0.002")
        elif rank_runs == "a restart":
            environ["TORCHELASTIC_RESTART_COUNT"] = "1"
        exits.append(cli.main(words))
        return exits[-1]

    monkeypatch.setattr(launcher, "run_node", run_rank)
    assert cli.main(["launch", "--nproc-per-node", "1", "--name", "once", "--", "train", "--config",
                     str(tmp_path / "run.toml")]) == 0
    assert exits == [0] and calls == {"fill_env": 1, "check": len(rank_checks)} and calls.resolved == rank_checks


class _Net(nn.Module):
    """A user's net that returns its loss."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)


def _train_the_user_net(directory, steps: int, save_steps: int, signal_step: int) -> None:
    """``Model.train`` of a user's net with a ModelCheckpoint every ``save_steps`` steps, SIGTERM as step
    ``signal_step`` begins."""
    from paratrain.train import Callback, CheckpointConfig, Model, ModelCheckpoint

    class Signal(Callback):
        def on_train_step_begin(self, run_context):
            if run_context.original_args().cur_step_num + 1 == signal_step:
                os.kill(os.getpid(), signal.SIGTERM)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(steps)]
    net = _Net()
    saver = ModelCheckpoint(prefix="net", directory=directory,
                            config=CheckpointConfig(save_checkpoint_steps=save_steps))
    model = Model(net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2))
    with pytest.raises(SystemExit) as stopped:
        model.train(1, batches, callbacks=[Signal(), saver])
    assert stopped.value.code == 4  # stopped on request, saved


def _train_the_config(directory, steps: int, save_steps: int, signal_step: int) -> None:
    """``Trainer(cfg).train()`` saving every ``save_steps`` steps, SIGTERM during step ``signal_step``."""
    from paratrain.trainer import Trainer

    trainer = Trainer(_config(directory, steps=steps, save_steps=save_steps))
    step = trainer.train_step

    def train_step():
        if trainer.step + 1 == signal_step:
            os.kill(os.getpid(), signal.SIGTERM)
        return step()

    trainer.train_step = train_step
    trainer.train()
    assert trainer.stopped_at == signal_step


@pytest.mark.timeout(60)
@pytest.mark.parametrize("face", [_train_the_config, _train_the_user_net], ids=["trainer", "model-train"])
def test_every_save_comes_after_the_stop_agreement(face, tmp_path, monkeypatch):
    """Stopped by SIGTERM during step 3 with saves every 2 steps: step 2 is saved after step 2's agreement and the
    stopped step 3 after the last agreement, on both faces."""
    events = []

    class Agreement(StopAgreement):
        def agreed(self):
            events.append("agree")
            return super().agreed()

    save = Checkpointer.save

    def recorded_save(self, step, *args, **kwargs):
        events.append(("save", step, events.count("agree")))
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(loop, "StopAgreement", Agreement)
    monkeypatch.setattr(Checkpointer, "save", recorded_save)
    face(tmp_path, steps=5, save_steps=2, signal_step=3)
    saves = [event[1:] for event in events if event != "agree"]
    assert [step for step, _ in saves] == [2, 3]
    assert all(agreements >= step for step, agreements in saves)
    assert saves[-1][1] == events.count("agree")  # the stopped step: after the last, blocking agreement
