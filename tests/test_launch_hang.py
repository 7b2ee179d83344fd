"""Issue 17 B: when a collective times out, the launcher names the rank that stopped making progress (from the
ranks' progress records), not only the rank that timed out."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from paratrain import progress
from paratrain.launch import jobs as J
from paratrain.launch.failure import describe_laggards
from paratrain.progress import Progress

PYTHON = sys.executable


def test_progress_records_step_collectives_heartbeat_and_saved_step(tmp_path):
    """A rank's record appears at start, follows step_done within a heartbeat, and saved() is written at once."""
    script = ("import time\nfrom paratrain import progress\n"
              "assert progress.start(rank=3)\n"
              "progress.step_done(7)\ntime.sleep(1.6 * progress.HEARTBEAT_S)\nprogress.saved(6)\n")
    env = {**os.environ, progress.DIR_ENV: str(tmp_path / "progress")}
    before = time.time()
    subprocess.run([PYTHON, "-c", script], env=env, check=True, timeout=30)
    (tmp_path / "progress" / "rank9.json").write_text("{not a record")
    records = progress.read(tmp_path / "progress")
    assert list(records) == [3]
    record = records[3]
    assert (record.step, record.saved_step, record.collectives) == (7, 6, None)  # no process group: no count
    assert before < record.heartbeat < time.time()
    env.pop(progress.DIR_ENV)  # not launched: nothing is reported
    out = subprocess.run([PYTHON, "-c", "from paratrain import progress; print(progress.start())"], env=env,
                         capture_output=True, text=True, check=True)
    assert out.stdout == "False\n"


def test_laggards_are_the_ranks_behind_then_the_silent_ones():
    now = 1000.0
    fresh = dict(heartbeat=now - 0.5)
    behind = {0: Progress(0, step=3, collectives=41, **fresh),
              1: Progress(1, step=3, collectives=40, heartbeat=now - 9),
              2: Progress(2, step=3, collectives=41, **fresh)}
    assert describe_laggards(behind, now, failed_rank=0) == (
        "rank 1 stopped making progress at step 3, collective 40 (last heartbeat 9 s before rank 0 failed); "
        "rank 0 timed out waiting for it")
    silent = {0: Progress(0, step=5, collectives=9, **fresh), 1: Progress(1, step=5, collectives=9, heartbeat=now - 8),
              2: Progress(2, step=5, collectives=9, heartbeat=now - 7)}
    assert describe_laggards(silent, now, failed_rank=0).startswith(
        "ranks 1, 2 stopped making progress at step 5, collective 9 (last heartbeat 8 s, 7 s before rank 0 failed)")
    healthy = {0: Progress(0, step=5, collectives=9, **fresh), 1: Progress(1, step=5, collectives=9, **fresh)}
    assert describe_laggards(healthy, now, failed_rank=1) is None
    assert describe_laggards({0: Progress(0, step=2, **fresh), 1: Progress(1, step=3, **fresh)}, now, 0) is None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stopped_rank_is_named_when_rank_0_times_out_waiting_for_it(tmp_path):
    env = {**os.environ, "PARATRAIN_HOME": str(tmp_path / "runs")}
    job_dir = tmp_path / "runs" / "hang"
    with open(tmp_path / "launch.log", "w") as log:
        launcher = subprocess.Popen([PYTHON, "-m", "paratrain", "launch", "--nproc-per-node", "2", "--name", "hang",
                                     "--collective-timeout", "5", "--", "doctor", "--size-mb", "0.01",
                                     "--duration", "300"], cwd=tmp_path, env=env, stdout=log, stderr=log)
    rank1 = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # both ranks have finished a soak step and reported it
            records = progress.read(job_dir / "progress")
            if len(records) == 2 and all((r.step or 0) >= 1 for r in records.values()):
                break
            assert launcher.poll() is None, (tmp_path / "launch.log").read_text()
            time.sleep(0.3)
        rank1 = json.loads((job_dir / "job.json").read_text())["pids"]["1"]
        os.kill(rank1, signal.SIGSTOP)
        stopped = time.monotonic()
        launcher.wait(60)
        assert time.monotonic() - stopped < 40
    finally:
        launcher.kill()
        launcher.wait()
        if rank1 is not None and J.pid_alive(rank1):
            os.kill(rank1, signal.SIGKILL)
    out = (tmp_path / "launch.log").read_text()
    assert launcher.returncode == 1, out
    named = "rank 1 stopped making progress at step "
    assert named in out and "rank 0 timed out waiting for it" in out, out
    job = json.loads((job_dir / "job.json").read_text())
    assert job["state"] == "failed" and job["failure"].startswith(named)
