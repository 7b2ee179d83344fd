"""Jobs, logs and stop (fake processes), then a few real torchrun launches: detach/stop, kill -9, ssh nodes."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratrain import cli, config_file, progress
from paratrain.launch import jobs as J
from paratrain.launch.jobs import Job

PYTHON = sys.executable


def use_registry(tmp_path, monkeypatch) -> Path:
    """Point PARATRAIN_HOME at ``tmp_path/runs``, outside any Slurm job or coordinated launch; returns it."""
    monkeypatch.setenv("PARATRAIN_HOME", str(tmp_path / "runs"))
    for var in ("SLURM_JOB_ID", "SLURM_NODEID", "PARATRAIN_COORDINATED", "PARATRAIN_JOB_PREPARED"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "runs"


@pytest.fixture
def home(tmp_path, monkeypatch):
    return use_registry(tmp_path, monkeypatch)


def sleeper(ignore_term: bool = False, rank_of: Path | None = None) -> subprocess.Popen:
    """A process that sleeps; with ``rank_of`` (a job directory) its environment makes it a rank of that job."""
    code = "import signal, time\n"
    code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else ""
    code += "print('ready', flush=True)\ntime.sleep(120)\n"
    env = {**os.environ, progress.DIR_ENV: str(rank_of / "progress")} if rank_of else None
    proc = subprocess.Popen([PYTHON, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline() == "ready\n"  # its SIGTERM handler is in place
    return proc


def fake_job(home: Path, name: str, **fields) -> Job:
    (home / name).mkdir(parents=True, exist_ok=True)
    job = Job(name=name, dir=str(home / name), command=["train"], nproc_per_node=2, **fields)
    job.save()
    return job


def test_jobs_table_shows_progress_and_failures(home, capsys):
    running = fake_job(home, "alive", state="running")
    (home / "alive" / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "loss": 5.5}) + "\n" + json.dumps({"step": 2, "loss": 4.25}) + "\n{\"step\": 3")
    fake_job(home, "broken", state="failed", exit_code=1, failing_rank=1,
             failure="rank 1 (pid 9 on h) exited with code 7; last lines of rank1.log:\n    ZeroDivisionError")
    fake_job(home, "ghost", state="running", launcher_pid=2**22 + 12345)  # launcher gone: lost
    assert cli.main(["jobs"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line and not line.startswith(" ")}
    assert rows["alive"][1:3] == ["running", "2"] and rows["alive"][-2:] == ["2", "4.2500"]
    assert rows["broken"][1] == "failed" and rows["broken"][-3:] == ["1", "(rank", "1)"]
    assert rows["ghost"][1] == "lost"
    assert "exited with code 7" in out and "ZeroDivisionError" in out
    assert running.last_metrics() == {"step": 2, "loss": 4.25}


def test_logs_prints_a_rank(home, capsys):
    job = fake_job(home, "j", state="succeeded")
    job.log_path(1).write_text("".join(f"line {i}\n" for i in range(10)))
    assert cli.main(["logs", "j", "--rank", "1", "--tail", "2"]) == 0
    assert capsys.readouterr().out == "line 8\nline 9\n"
    assert cli.main(["logs", "j", "--rank", "1", "--follow"]) == 0  # the job is over: prints all and returns
    assert capsys.readouterr().out.count("line") == 10
    assert cli.main(["logs", "j", "--rank", "5"]) == 2
    assert cli.main(["logs", "nope"]) == 2 and "no job 'nope'" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_stop_terms_then_kills_the_ranks_of_a_launcher_that_is_gone(home, capsys):
    rank0, stubborn = sleeper(rank_of=home / "s"), sleeper(ignore_term=True, rank_of=home / "s")
    try:
        fake_job(home, "s", state="running", launcher_pid=2**22 + 12345, pids={"0": rank0.pid, "1": stubborn.pid})
        cli.build_parser()  # imports every subcommand (torch too) before the timing
        start = time.monotonic()
        assert cli.main(["stop", "s", "--grace", "1.5"]) == 0
        assert 1.5 <= time.monotonic() - start < 10
        assert rank0.wait(5) == -signal.SIGTERM
        assert stubborn.wait(5) == -signal.SIGKILL
        assert "SIGKILL after 1.5 s grace: rank 1" in capsys.readouterr().out
        assert J.load("s").state == "stopped"
        assert cli.main(["stop", "s"]) == 2  # nothing left to stop
    finally:
        for proc in (rank0, stubborn):
            proc.kill()
            proc.wait()


# ---- real launches (torchrun, 2 processes of `paratrain doctor` as the workload) ----

def paratrain(tmp_path, *args, **kwargs):
    env = {**os.environ, "PARATRAIN_HOME": str(tmp_path / "runs"), "TMPDIR": str(tmp_path)}
    return subprocess.run([PYTHON, "-m", "paratrain", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, **kwargs)


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def record(tmp_path, name) -> dict:
    return json.loads((tmp_path / "runs" / name / "job.json").read_text())


def soaking(tmp_path, name):
    """True once rank 0 of a `doctor --duration` job reports its soak phase (all ranks are in collectives)."""
    log = tmp_path / "runs" / name / "rank0.log"
    return log.exists() and "soak:" in log.read_text() and len(record(tmp_path, name)["pids"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_detach_jobs_logs_stop(tmp_path, home, capsys):
    out = paratrain(tmp_path, "launch", "--nproc-per-node", "2", "--name", "bg", "--detach", "--",
                    "doctor", "--size-mb", "1", "--duration", "300", timeout=60)
    assert out.returncode == 0, out.stderr
    assert "bg" in out.stdout and "paratrain stop bg" in out.stdout
    wait_for(lambda: soaking(tmp_path, "bg"), 60, "the detached job to run")
    job = record(tmp_path, "bg")
    assert job["state"] == "running" and os.getsid(job["launcher_pid"]) != os.getsid(0)  # its own session
    assert cli.main(["jobs"]) == 0
    table = capsys.readouterr().out
    assert any(line.split()[:3] == ["bg", "running", "2"] for line in table.splitlines()), table
    assert cli.main(["logs", "bg"]) == 0
    logs = capsys.readouterr().out
    assert "rendezvous: ok, 2 ranks" in logs and "all_reduce: ok" in logs
    env1 = (home / "bg" / "env1.log").read_text()
    assert "RANK=1\n" in env1 and "WORLD_SIZE=2\n" in env1 and "MASTER_PORT=" in env1

    assert cli.main(["stop", "bg", "--grace", "20"]) == 0
    assert "bg: stopped" in capsys.readouterr().out
    job = record(tmp_path, "bg")
    assert job["state"] == "stopped"
    for pid in [job["launcher_pid"], *job["pids"].values()]:
        assert not J.pid_alive(pid)
    for rank in (0, 1):  # SIGTERM wrote every rank's Python stacks into its log
        assert "most recent call first" in (home / "bg" / f"rank{rank}.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_kill_9_of_one_rank_fails_the_job_naming_it(tmp_path):
    env = {**os.environ, "PARATRAIN_HOME": str(tmp_path / "runs"), "TMPDIR": str(tmp_path)}
    launcher = subprocess.Popen([PYTHON, "-m", "paratrain", "launch", "--nproc-per-node", "2", "--name", "k9", "--",
                                 "doctor", "--size-mb", "1", "--duration", "300"], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: soaking(tmp_path, "k9"), 60, "the job to run")
        os.kill(record(tmp_path, "k9")["pids"]["1"], signal.SIGKILL)
        killed = time.monotonic()
        stdout, stderr = launcher.communicate(timeout=60)
        assert time.monotonic() - killed < 60
    finally:
        launcher.kill()
    assert launcher.returncode != 0
    assert "job k9 failed: rank 1" in stderr and "SIGKILL" in stderr and "rank1.log" in stderr, stderr
    job = record(tmp_path, "k9")
    assert (job["state"], job["failing_rank"], job["exit_codes"]["1"]) == ("failed", 1, -9)
    table = paratrain(tmp_path, "jobs").stdout
    assert "(rank 1)" in table and "killed by SIGKILL" in table
    assert "most recent call first" in (tmp_path / "runs" / "k9" / "rank0.log").read_text()  # stacks of the rest


def _training(tmp_path, name):
    """True once both ranks of a ``train`` job run and rank 0 logged a step."""
    metrics = tmp_path / "runs" / name / "metrics.jsonl"
    return metrics.exists() and metrics.read_text().strip() != "" and len(record(tmp_path, name)["pids"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("command", ["doctor", "train"])
def test_orphaned_ranks_of_a_killed_launcher_stop_on_their_own(tmp_path, command):
    """kill -9 of the launcher leaves its ranks no parent to stop them: they get SIGTERM from the kernel and end
    within seconds (not at --duration 300 or step 100000): a ``train`` job's ranks after agreeing to stop and
    saving; ``jobs`` shows the job lost."""
    from test_cluster import CONFIG

    (tmp_path / "tiny.toml").write_text(CONFIG.replace("steps = 3", "steps = 100000"))
    words = (["doctor", "--size-mb", "1", "--duration", "300"] if command == "doctor"
             else ["train", "--config", "tiny.toml"])
    env = {**os.environ, "PARATRAIN_HOME": str(tmp_path / "runs"), "TMPDIR": str(tmp_path)}
    launcher = subprocess.Popen([PYTHON, "-m", "paratrain", "launch", "--nproc-per-node", "2", "--name", "orphans",
                                 "--collective-timeout", "20", "--", *words],
                                cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = []
    try:
        wait_for(lambda: (soaking if command == "doctor" else _training)(tmp_path, "orphans"), 90, "the job to run")
        ranks = list(record(tmp_path, "orphans")["pids"].values())
        assert all(map(J.pid_alive, ranks))
        launcher.kill()
        launcher.wait()
        wait_for(lambda: not any(map(J.pid_alive, ranks)), 40, "the orphaned ranks to end")
    finally:
        launcher.kill()
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert "orphans  lost" in paratrain(tmp_path, "jobs").stdout
    log = (tmp_path / "runs" / "orphans" / "rank0.log").read_text()
    if command == "doctor":
        # SIGTERM's handler began writing the stacks (the process may end, its collective failing as the other rank
        # ends, before the handler's thread writes the last of them)
        assert re.search(r"(Current thread|Thread) 0x", log), log[-2000:]
    else:
        saved = progress.read(tmp_path / "runs" / "orphans" / "progress")
        assert "paratrain: stopped on request, saved at step" in log, log[-2000:]
        assert {r.saved_step for r in saved.values()} == {max(r.step for r in saved.values())}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hostfile_launch_over_ssh_quotes_arguments(tmp_path):
    """A stand-in `ssh` runs the node command with a shell here: the real path up to the remote shell."""
    from forked_ranks import free_port

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text('#!/bin/sh\n'
                                 'while [ "$1" != "--" ]; do shift; done\n'
                                 'echo "$2" >> "$(dirname "$0")/hosts"\n'
                                 'exec /bin/sh -c "$3"\n')
    (bin_dir / "ssh").chmod(0o755)
    (tmp_path / "hostfile").write_text("localhost slots=1\n")
    pwned = tmp_path / "pwned"
    env = {**os.environ, "PARATRAIN_HOME": str(tmp_path / "runs"), "TMPDIR": str(tmp_path),
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = subprocess.run([PYTHON, "-m", "paratrain", "launch", "--hostfile", "hostfile", "--name", "ssh1",
                          "--master-port", str(free_port()), "--", "doctor", f"--name=x; touch {pwned}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert (bin_dir / "hosts").read_text() == "localhost\n"
    assert not pwned.exists()
    job, node = record(tmp_path, "ssh1"), json.loads((tmp_path / "runs" / "ssh1" / "node0.json").read_text())
    assert job["state"] == node["state"] == "succeeded" and job["hosts"] == ["localhost"]
    assert job["exit_codes"] == {"0": 0} and "torch: 2." in (tmp_path / "runs" / "ssh1" / "rank0.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_node_launch_trains_like_one_process(tmp_path):
    """Issue 7: two launches on localhost (--nnodes 2 --node-rank 0/1, 2 ranks each) match one process."""
    from conftest import tiny_config
    from forked_ranks import free_port

    config = tmp_path / "tiny.toml"
    config_file.save(tiny_config(train={"steps": 4}), config)
    env = {**os.environ, "PARATRAIN_HOME": str(tmp_path / "runs"), "TMPDIR": str(tmp_path)}
    reference = subprocess.run([PYTHON, "-m", "paratrain", "train", "--config", str(config),
                                f"--run.dir={tmp_path / 'ref'}"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert reference.returncode == 0, reference.stderr
    port = str(free_port())
    nodes = [subprocess.Popen([PYTHON, "-m", "paratrain", "launch", "--nnodes", "2", "--node-rank", str(node),
                               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port,
                               "--name", "two-nodes", "--", "train", "--config", str(config),
                               "--parallel.data_parallel=4"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outputs = [node.communicate(timeout=200)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)

    def losses(run_dir):
        return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    expected, got = losses(tmp_path / "ref"), losses(tmp_path / "runs" / "two-nodes")
    assert len(expected) == len(got) == 4
    assert got == pytest.approx(expected, rel=1e-4)
    job, node1 = record(tmp_path, "two-nodes"), json.loads((tmp_path / "runs" / "two-nodes" / "node1.json").read_text())
    assert sorted(job["pids"]) == ["0", "1"] and sorted(node1["pids"]) == ["2", "3"]
    assert all((tmp_path / "runs" / "two-nodes" / f"rank{r}.log").exists() for r in range(4))
