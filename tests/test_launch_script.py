"""`paratrain launch -- script.py ARGS`: a user script on every rank, with a launch's logs, record and fail-fast."""
import json
import os
import subprocess
import sys
import time

import pytest

from paratrain import cli

PYTHON = sys.executable

SCRIPT = """\
import os, sys, time
import helper  # from the script's own folder, as with `python script.py`

from paratrain import communication

communication.init()
rank, world = communication.get_rank(), communication.get_group_size()
print(f"rank {rank} of {world} env {os.environ['RANK']}/{os.environ['WORLD_SIZE']} args {sys.argv[1:]} {helper.WORD}",
      flush=True)
if "--fail-rank" in sys.argv and rank == int(sys.argv[sys.argv.index("--fail-rank") + 1]):
    raise SystemExit(7)
if "--fail-rank" in sys.argv:
    time.sleep(120)  # the launcher must stop this rank when the other fails
"""


def launch(tmp_path, *words, timeout=120):
    env = {**os.environ, "PARATRAIN_HOME": str(tmp_path / "runs"), "TMPDIR": str(tmp_path)}
    return subprocess.run([PYTHON, "-m", "paratrain", "launch", "--nproc-per-node", "2", *words], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def project(tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "script.py").write_text(SCRIPT)
    (folder / "helper.py").write_text("WORD = 'helper-imported'\n")
    return folder


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_script_runs_on_every_rank_with_logs_and_record(tmp_path, project):
    out = launch(tmp_path, "--name", "user", "--", "project/script.py", "--x", "1")
    assert out.returncode == 0, out.stderr
    job_dir = tmp_path / "runs" / "user"
    for rank in (0, 1):
        log = (job_dir / f"rank{rank}.log").read_text()
        assert f"rank {rank} of 2 env {rank}/2 args ['--x', '1'] helper-imported" in log, log
    record = json.loads((job_dir / "job.json").read_text())
    assert record["state"] == "succeeded" and record["command"] == ["project/script.py", "--x", "1"]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_failing_rank_stops_the_script_job_naming_it(tmp_path, project):
    start = time.monotonic()
    out = launch(tmp_path, "--name", "bad", "--", "project/script.py", "--fail-rank", "1")
    assert out.returncode == 1 and time.monotonic() - start < 90  # rank 0 sleeps 120 s: it was stopped
    assert "rank 1" in out.stderr and "code 7" in out.stderr
    record = json.loads((tmp_path / "runs" / "bad" / "job.json").read_text())
    assert record["state"] == "failed" and record["failing_rank"] == 1


def test_script_names_the_job_and_a_missing_script_is_refused(tmp_path, project, monkeypatch, capsys):
    monkeypatch.setenv("PARATRAIN_HOME", str(tmp_path / "runs"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["launch", "--nproc-per-node", "2", "--dry-run", "--", "project/script.py", "--x", "1"]) == 0
    out = capsys.readouterr().out
    assert "# job script-" in out and "-u project/script.py --x 1" in out and "-m paratrain" not in out
    assert cli.main(["launch", "--dry-run", "--", "nope.py"]) == 2
    assert "script nope.py does not exist" in capsys.readouterr().err


def test_a_train_config_is_checked_for_the_launched_world_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PARATRAIN_HOME", str(tmp_path / "runs"))
    code = cli.main(["launch", "--nproc-per-node", "3", "--dry-run", "--", "train", "--parallel.model_parallel=2"])
    assert code == 2
    err = capsys.readouterr().err
    assert "does not divide the world size 3" in err and "data_parallel (not given)" in err
    assert cli.main(["launch", "--nproc-per-node", "4", "--dry-run", "--", "train", "--parallel.model_parallel=2"]) == 0


MODEL_TRAIN = """\
import torch
import torch.nn.functional as F
from torch import nn

from paratrain import communication
from paratrain.context import ParallelMode, set_auto_parallel_context
from paratrain.train import LossMonitor, Model


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 1)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)


class Printed(LossMonitor):
    def on_train_step_end(self, run_context):
        args = run_context.original_args()
        print(f"step {args.cur_step_num} loss {float(args.net_outputs)!r}", flush=True)


communication.init()
set_auto_parallel_context(parallel_mode=ParallelMode.DATA_PARALLEL)
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
data = [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(5)]
net = Net()
callbacks = [Printed()] if "--every-step" in __import__("sys").argv else []
Model(net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2)).train(1, data, callbacks=callbacks)
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("every_step", [True, False], ids=["loss-monitor", "no-callbacks"])
def test_jobs_shows_the_step_and_loss_of_a_model_train_script(tmp_path, every_step):
    (tmp_path / "net.py").write_text(MODEL_TRAIN)
    out = launch(tmp_path, "--name", "ms", "--", "net.py", *(["--every-step"] if every_step else []))
    assert out.returncode == 0, out.stderr
    env = {**os.environ, "PARATRAIN_HOME": str(tmp_path / "runs")}
    table = subprocess.run([PYTHON, "-m", "paratrain", "jobs"], cwd=tmp_path, env=env, capture_output=True,
                           text=True).stdout
    row = next(line.split() for line in table.splitlines() if line.startswith("ms "))
    assert row[1] == "succeeded" and row[6] == "5", table
    if every_step:  # the loss rank 0 printed at its last step
        printed = (tmp_path / "runs" / "ms" / "rank0.log").read_text().splitlines()[-1].split()
        assert printed[:2] == ["step", "5"] and row[7] == f"{float(printed[3]):.4f}", table
    else:
        assert float(row[7]) > 0, table
