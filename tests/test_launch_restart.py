"""Issue 28, restarts that resume: ``paratrain launch --max-restarts N`` (``launch.max_restarts``) brings a job
whose rank died back from its newest checkpoint with the losses of an uninterrupted run, the job record keeps
every attempt, a stop never restarts, and a bad count is refused before anything starts."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from forked_ranks import free_port
from test_cluster import CONFIG
from test_launch import record, use_registry, wait_for
from test_launch_inputs import refused
from test_launch_stop import RANK

from conftest import PYTHON
from paratrain import cli, progress
from paratrain import config_file
from paratrain.launch import launcher
from paratrain.launch.hosts import Topology
from paratrain.launch.jobs import PROGRESS_DIR, Job
from paratrain.trainer import Trainer

CHECKPOINTS = '\n[checkpoint]\nsave_steps = 2\nresume = "none"\n'  # "none": a restart resumes all the same
# `paratrain train` whose rank 1 kills itself (SIGKILL) after step 3 of the first attempt, after the save of step 2
DIES = """
import os, signal, sys
from paratrain import cli, host_memory, progress

if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    step_done = progress.step_done

    def die_after_3(step):
        step_done(step)
        if step == 3:
            os.kill(os.getpid(), signal.SIGKILL)

    progress.step_done = die_after_3
os.environ[host_memory.RESTARTED_ENV] = "1"  # train in this process, which holds the hook
sys.exit(cli.main(["train", *sys.argv[1:]]))
"""


@pytest.fixture
def home(tmp_path, monkeypatch):
    return use_registry(tmp_path, monkeypatch)


def _config(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(CONFIG.replace("steps = 3", "steps = 6") + CHECKPOINTS + extra)
    return path


def _launch(tmp_path: Path, *args: str) -> subprocess.Popen:
    """``paratrain launch ARGS`` in ``tmp_path``, the registry under it."""
    env = {**os.environ, "PARATRAIN_HOME": str(tmp_path / "runs"), "TMPDIR": str(tmp_path), "SAVE_S": "0.5"}
    return subprocess.Popen([PYTHON, "-m", "paratrain", "launch", *args], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nodes", [1, 2])
def test_a_killed_rank_restarts_the_job_from_its_checkpoint_with_the_losses_of_an_uninterrupted_run(
        tmp_path, home, capsys, nodes):
    """2 ranks on one node, or on two nodes (two launchers here) that meet through a c10d rendezvous: the node
    whose rank did not fail is restarted by the other's new round, with a restart count of 0 of its own."""
    config = _config(tmp_path)
    Trainer(config_file.load(config, [f"run.dir={tmp_path / 'alone'}"])).train()  # one process, uninterrupted
    reference = dict(_losses(tmp_path / "alone"))
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]

    (tmp_path / "dies.py").write_text(DIES)
    run_dir = home / "r"
    command = ["--max-restarts", "1", "--name", "r", "--", "dies.py", "--config", str(config), f"--run.dir={run_dir}"]
    if nodes == 1:
        launchers = [_launch(tmp_path, "--nproc-per-node", "2", *command)]
    else:
        where = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
                 str(free_port())]
        launchers = [_launch(tmp_path, *where, "--node-rank", str(node), *command) for node in (0, 1)]
    try:
        stderrs = [launcher.communicate(timeout=240)[1] for launcher in launchers]
    finally:
        for launcher in launchers:
            launcher.kill()
    assert [launcher.returncode for launcher in launchers] == [0] * nodes, stderrs
    assert all("job r succeeded (attempt 2 of 2)" in stderr for stderr in stderrs)
    logged = _losses(run_dir)
    # the second attempt went on from the checkpoint of step 2: steps 1 and 2 were trained once
    assert [step for step, _ in logged].count(1) == [step for step, _ in logged].count(2) == 1
    log = (run_dir / "rank0.log").read_text()
    assert "resumed from" in log and "step_00000002" in log
    last = dict(logged)  # a step trained again in the second attempt: its last loss
    assert sorted(last) == sorted(reference)
    assert [last[s] for s in sorted(last)] == pytest.approx([reference[s] for s in sorted(reference)], rel=1e-5)

    # each node's record keeps its attempts; the rendezvous numbers the ranks of two nodes in its own order
    records = [Job.from_file(path) for path in sorted(run_dir.glob("*.json"))]  # job.json, node1.json
    assert len(records) == nodes
    failed = next(r for r in records if "1" in r.pids)
    assert [(a["number"], a["state"], a["failing_rank"], a["exit_code"]) for a in failed.attempts] == [
        (0, "failed", 1, -9), (1, "succeeded", None, None)]
    assert failed.attempts[0]["end_time"] <= failed.attempts[1]["start_time"]
    for other in records:
        if other is not failed:  # the other node's agent saw the new round first, or its rank lost the dead peer
            first, second = other.attempts
            assert (second["number"], second["state"]) == (1, "succeeded"), other.attempts
            assert (first["number"], first["state"]) == (0, "restarted") or (
                (first["number"], first["state"], first["failing_rank"]) == (0, "failed", 0)
                and first["exit_code"] not in (None, -9)), other.attempts
    assert (run_dir / "rank1.attempt0.log").exists()  # the first attempt's log, kept
    if nodes == 1:
        assert cli.main(["jobs", "r"]) == 0
        out = capsys.readouterr().out
        assert "r: 2 attempts (max_restarts 1): attempt 0 (started " in out and ") failed: rank 1 exit -9" in out
        assert "attempt 1 (started " in out and ") succeeded" in out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["paratrain stop", "SIGTERM to rank 1 alone"])
def test_ranks_that_stop_and_save_never_restart_the_job(tmp_path, home, capsys, how):
    """Ranks that exit with EXIT_STOPPED after saving, which torchrun's agent counts as failed: whether the job
    was stopped or one rank was (a scheduler's SIGTERM), the job ends stopped and saved, in one attempt."""
    (tmp_path / "rank.py").write_text(RANK)  # a stand-in rank that saves and exits on SIGTERM
    job = _launch(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "--name", "s", "--", "rank.py")
    try:
        wait_for(lambda: len(progress.read(home / "s" / PROGRESS_DIR)) == 2, 60, "both ranks to run")
        if how == "paratrain stop":
            assert cli.main(["stop", "s", "--grace", "30"]) == 0
            assert "s: stopped, saved at step 3" in capsys.readouterr().out
        else:
            os.kill(progress.read(home / "s" / PROGRESS_DIR)[1].pid, signal.SIGTERM)
        _, stderr = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == progress.EXIT_STOPPED, stderr
    final = record(tmp_path, "s")
    assert (final["state"], final["saved_step"]) == ("stopped", 3)
    assert [(a["number"], a["state"]) for a in final["attempts"]] == [(0, "stopped")]
    assert not list((home / "s").glob("rank*.attempt*.log"))


def test_max_restarts_from_the_flag_or_the_config(tmp_path, home, capsys):
    config = _config(tmp_path, "\n[launch]\nmax_restarts = 3\n")

    def torchrun_line(*flags: str) -> str:
        assert cli.main(["launch", *flags, "--dry-run", "--", "train", "--config", str(config)]) == 0
        return capsys.readouterr().out

    assert "--max-restarts 3" in torchrun_line("--nproc-per-node", "2")
    assert "--max-restarts 0" in torchrun_line("--nproc-per-node", "2", "--max-restarts", "0")  # the flag wins
    # several nodes that may restart meet through a c10d rendezvous on node 0; without restarts, a static one
    line = torchrun_line("--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", "29999")
    assert "--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29999 --rdzv-id" in line and "--node-rank" not in line
    line = torchrun_line("--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--max-restarts", "0")
    assert "--node-rank 1 --master-addr 127.0.0.1" in line and "c10d" not in line
    parsed, _, _ = launcher._torchrun_config(launcher.torchrun_args(Topology(2, 2, 1, "127.0.0.1", 29999), "j",
                                                                    ["true"], 60, max_restarts=3))
    assert (parsed.min_nodes, parsed.max_nodes, parsed.max_restarts, parsed.rdzv_backend, parsed.rdzv_endpoint) == (
        2, 2, 3, "c10d", "127.0.0.1:29999")
    assert parsed.rdzv_configs["join_timeout"] == "60"  # seconds, read by the c10d handler


def test_a_bad_max_restarts_is_refused_before_anything_starts(tmp_path, home, capsys):
    err = refused(capsys, "launch", "--max-restarts", "-1", "--name", "n", "--", "doctor")
    assert "--max-restarts must be 0 (no restart) or the number of times a failed job restarts" in err
    assert "got -1" in err
    for bad, said in (("-2", "launch.max_restarts=-2 must be 0 (no restart)"),
                      ("'twice'", "launch.max_restarts='twice': expected an integer")):
        config = _config(tmp_path, f"\n[launch]\nmax_restarts = {bad}\n")
        assert said in refused(capsys, "launch", "--name", "n", "--", "train", "--config", str(config))
    assert not home.exists()  # nothing was started or recorded


def test_jobs_lists_the_attempts(home, capsys):
    (home / "j").mkdir(parents=True)
    started = time.time() - 60
    Job(name="j", dir=str(home / "j"), state="running", max_restarts=2, attempts=[
        {"number": 0, "start_time": started, "end_time": started + 10, "state": "failed", "failing_rank": 3,
         "exit_code": -9},
        {"number": 1, "start_time": started + 12, "end_time": None, "state": "running", "failing_rank": None,
         "exit_code": None}]).save()
    assert cli.main(["jobs"]) == 0
    out = capsys.readouterr().out
    clock = time.strftime("%H:%M:%S", time.localtime(started))
    assert f"j: 2 attempts (max_restarts 2): attempt 0 (started {clock}) failed: rank 3 exit -9; attempt 1" in out
    assert Job.from_file(home / "j" / "job.json").attempts[0]["failing_rank"] == 3  # saved and loaded
