"""Nothing lost: the last step is always saved, and SIGTERM/SIGINT makes every rank stop at the same step,
save it and end with the stopped-and-saved code; the resumed run continues as if uninterrupted."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_config
from forked_ranks import run_distributed

from paratrain import config_file


def _config(run_dir, steps=6, log_steps=100, **checkpoint):
    return tiny_config(run={"dir": str(run_dir)}, model={"encoder_layers": 1, "decoder_layers": 1},
                       parallel={"dp": int(os.environ.get("WORLD_SIZE", "1"))}, train={"steps": steps},
                       metrics={"log_steps": log_steps, "progress": False}, checkpoint=checkpoint)


def test_the_last_step_is_saved(tmp_path):
    from paratrain.trainer import Trainer

    Trainer(_config(tmp_path, steps=5, save_steps=2)).train()
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert saved == ["step_00000002", "step_00000004", "step_00000005"]


class _Evaluation:
    """Stands in for the BLEU evaluator: evaluates at step ``at`` and is signalled while it does."""

    def __init__(self, at: int):
        self.at = at

    def due(self, step: int) -> bool:
        return step == self.at

    def __call__(self, step: int, record: dict) -> None:
        if self.due(step):
            os.kill(os.getpid(), signal.SIGTERM)


def _stop_and_resume(root, signal_rank, signal_step, during="step", **options):
    """Uninterrupted losses; the losses of a run that ``signal_rank`` SIGTERMs during step ``signal_step``
    (``during`` "step", "save": while saving it, "evaluation": while evaluating after it); the step it
    stopped at; the losses of its resumed run."""
    import torch

    from paratrain.trainer import Trainer

    torch.set_num_threads(1)
    signalled = int(os.environ.get("RANK", "0")) == signal_rank
    whole = [r["loss"] for r in Trainer(_config(f"{root}/whole", **options)).train()]
    stopped = Trainer(_config(f"{root}/stopped", **options))
    if during == "step":
        step = stopped.train_step

        def train_step():
            if signalled and stopped.step + 1 == signal_step:
                os.kill(os.getpid(), signal.SIGTERM)
            return step()
        stopped.train_step = train_step
    elif during == "save":
        save = stopped.checkpointer.save

        def save_and_signal(step):
            save(step)
            if signalled and step == signal_step:
                os.kill(os.getpid(), signal.SIGTERM)
        stopped.checkpointer.save = save_and_signal
    elif signalled:
        stopped.evaluator = _Evaluation(signal_step)
    first = [r["loss"] for r in stopped.train()]
    resumed = [r["loss"] for r in Trainer(_config(f"{root}/stopped", **options)).train()]
    return whole, first, stopped.stopped_at, resumed


def test_sigterm_saves_and_the_resumed_run_continues(tmp_path):
    whole, first, stopped_at, resumed = _stop_and_resume(str(tmp_path), 0, 3)
    assert stopped_at == 3 and first == whole[:3] and resumed == whole[3:]


@pytest.mark.parametrize("during, signal_step, options, stops_at", [
    ("step", 3, {"log_steps": 1}, 3),  # every step logged: the stop lands on a logged step
    ("step", 4, {"log_steps": 2, "save_steps": 2}, 4),  # on a logged and saved step
    ("save", 2, {"save_steps": 2}, 3),  # while saving step 2: the next step is the agreed one
    ("evaluation", 2, {}, 2),
    ("step", 6, {"log_steps": 1}, 6),  # during the last step: the run ends stopped, saved
    ("save", 6, {"save_steps": 3}, 6),  # during the last save
])
def test_a_stop_at_any_point_of_a_step_saves_and_resumes_exactly(tmp_path, during, signal_step, options, stops_at):
    whole, first, stopped_at, resumed = _stop_and_resume(str(tmp_path), 0, signal_step, during, **options)
    assert stopped_at == stops_at and first == whole[:stops_at] and resumed == whole[stops_at:]


@pytest.mark.slow
def test_every_rank_stops_at_the_same_step(tmp_path):
    results = run_distributed(_stop_and_resume, 2, str(tmp_path), 1, 2, timeout=240)
    for whole, first, stopped_at, resumed in results:
        assert stopped_at == 3  # the step after the one rank 1 was signalled in: agreed one step later
        assert first == pytest.approx(whole[:3], rel=1e-6) and resumed == pytest.approx(whole[3:], rel=1e-6)


# ---- the command line: a stop at any moment, by hand or through the launcher, ends saved and resumes ----

def _cli_config(tmp_path, name: str, steps: int = 8) -> Path:
    path = tmp_path / f"{name}.toml"
    config_file.save(tiny_config(run={"dir": str(tmp_path / name)}, model={"encoder_layers": 1, "decoder_layers": 1},
                                 train={"steps": steps}, metrics={"log_steps": 1, "progress": False}), path)
    return path


def _start(tmp_path, *words) -> subprocess.Popen:
    env = {**os.environ, "PARATRAIN_HOME": str(tmp_path / "runs"), "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "paratrain", *words], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss of every step ``metrics.jsonl`` holds (the latest record of a step)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (paratrain's, from the first line of ``main``)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def _wait(predicate, what: str, timeout_s: float = 90):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_hand_run_stopped_while_training_or_starting_resumes_exactly(tmp_path):
    whole = _start(tmp_path, "train", "--config", str(_cli_config(tmp_path, "whole")))
    assert whole.wait(120) == 0, whole.stderr.read()
    reference = _losses(tmp_path / "whole")
    config = _cli_config(tmp_path, "run")

    run = _start(tmp_path, "train", "--config", str(config))  # Ctrl-C after step 2, a logged step
    _wait(lambda: len(_losses(tmp_path / "run")) >= 2, "step 2")
    run.send_signal(signal.SIGINT)
    err = run.communicate(timeout=60)[1]
    stopped_at = max(_losses(tmp_path / "run"))
    assert run.returncode == 4 and "Traceback" not in err, err
    assert err.splitlines()[-1] == f"paratrain: stopped on request, saved at step {stopped_at}"

    run = _start(tmp_path, "train", "--config", str(config))  # SIGTERM while it starts (imports torch, resumes)
    _wait(lambda: _catches_sigterm(run.pid), "the stop handler")
    run.send_signal(signal.SIGTERM)
    err = run.communicate(timeout=60)[1]
    assert run.returncode == 4 and "Traceback" not in err, err
    assert err.splitlines()[-1] == ("paratrain: stopped on request (SIGTERM) while starting, before this run's "
                                    "first step: nothing to save")
    assert max(_losses(tmp_path / "run")) == stopped_at

    run = _start(tmp_path, "train", "--config", str(config))
    assert run.wait(120) == 0, run.stderr.read()
    assert _losses(tmp_path / "run") == pytest.approx(reference, rel=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_launched_job_stopped_while_starting_or_training_records_what_its_ranks_did(tmp_path, monkeypatch):
    from paratrain import cli
    from paratrain.launch import jobs

    whole = _start(tmp_path, "train", "--config", str(_cli_config(tmp_path, "whole", steps=60)))
    assert whole.wait(120) == 0, whole.stderr.read()
    reference = _losses(tmp_path / "whole")
    config = _cli_config(tmp_path, "run", steps=60)
    home = tmp_path / "runs"  # a launched run's directory is its job's
    monkeypatch.setenv("PARATRAIN_HOME", str(home))  # for cli.main's stop and jobs.load in this process

    def launch() -> subprocess.Popen:
        return _start(tmp_path, "launch", "--nproc-per-node", "2", "--name", "st", "--", "train", "--config",
                      str(config), "--parallel.data_parallel=2")

    def job_with_ranks() -> bool:
        try:
            return len(jobs.load("st").pids) == 2
        except (jobs.JobError, OSError, ValueError):
            return False

    launcher = launch()  # stopped while its ranks start
    _wait(job_with_ranks, "the ranks to start")
    assert cli.main(["stop", "st", "--grace", "60"]) == 0
    err = launcher.communicate(timeout=90)[1]
    job = jobs.load("st")
    assert (launcher.returncode, job.state, job.saved_step) == (4, "stopped", None), err
    assert not list((home / "st").glob("checkpoints/step_*"))

    launcher = launch()  # stopped after step 2, a logged step
    _wait(lambda: len(_losses(home / "st")) >= 2, "step 2")
    assert cli.main(["stop", "st", "--grace", "60"]) == 0
    err = launcher.communicate(timeout=90)[1]
    job, stopped_at = jobs.load("st"), max(_losses(home / "st"))
    assert (launcher.returncode, job.state, job.saved_step) == (4, "stopped", stopped_at), err
    assert set(job.exit_codes.values()) == {4}, err
    for rank in (0, 1):
        assert "Traceback" not in (home / "st" / f"rank{rank}.log").read_text()
    assert f"saved at step {stopped_at}" in (home / "st" / "rank0.log").read_text()

    launcher = launch()
    assert launcher.wait(150) == 0, launcher.stderr.read()
    assert _losses(home / "st") == pytest.approx(reference, rel=1e-5)
