"""Issue 17 A and D: `paratrain stop` of a multi-node job signals only this host's processes and reaches the
other nodes through stop.json; the launcher forwards SIGTERM/SIGINT/stop requests to its ranks, waits the grace
period, and reports ranks that exit with EXIT_STOPPED as "stopped, saved at step N"."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from forked_ranks import free_port
from test_launch import sleeper, use_registry, wait_for

from paratrain import cli, progress
from paratrain.launch import jobs as J
from paratrain.launch.jobs import Job

PYTHON = sys.executable


@pytest.fixture
def home(tmp_path, monkeypatch):
    return use_registry(tmp_path, monkeypatch)


@pytest.mark.timeout(60)
def test_stop_never_signals_a_pid_another_host_recorded(home, capsys):
    """The reproduction: node 1 (another host) recorded pids that here belong to an unrelated process; and a pid
    recorded here but reused since by an unrelated process is left alone too."""
    bystander, reused, rank0 = sleeper(), sleeper(), sleeper(rank_of=home / "mn")
    try:
        (home / "mn").mkdir(parents=True)
        Job(name="mn", dir=str(home / "mn"), nnodes=2, state="running", launcher_pid=2**22 + 5,
            pids={"0": rank0.pid, "2": reused.pid}).save()  # node 0, here, its launcher gone: stop signals its rank
        node1 = Job(name="mn", dir=str(home / "mn"), host="other-host", nnodes=2, node_rank=1, state="running",
                    launcher_pid=bystander.pid, pids={"1": bystander.pid}, record="node1.json")
        node1.save()
        requests = []

        def node1_launcher():  # what the launcher on other-host does: act on stop.json, record the outcome
            wait_for(lambda: (home / "mn" / "stop.json").exists(), 30, "stop.json")
            requests.append(json.loads((home / "mn" / "stop.json").read_text()))
            node1.finish("stopped", 143)

        cli.build_parser()  # its imports (torch too) may take longer than node1_launcher waits
        remote = threading.Thread(target=node1_launcher)
        remote.start()
        assert cli.main(["stop", "mn", "--grace", "2"]) == 0
        remote.join()
        assert rank0.wait(5) == -signal.SIGTERM
        assert bystander.poll() is None and reused.poll() is None  # alive: never signalled
        assert requests[0]["grace_s"] == 2 and requests[0]["now"] is False
        assert "mn: stopped" in capsys.readouterr().out
        assert J.load("mn").state == "stopped"
    finally:
        for proc in (bystander, reused, rank0):
            proc.kill()
            proc.wait()


FAKE_SSH = """#!/bin/sh
# Stand-in for ssh: runs the remote command on this machine as host "$2" (its own UTS namespace, so that
# socket.gethostname() there says "$2") and in a session of its own, so that ending this client leaves what it
# started running, as with a real ssh.
while [ "$1" != "--" ]; do shift; done
echo "$2" >> "$(dirname "$0")/hosts"
setsid unshare -r -u /bin/sh -c 'hostname "$1" && exec /bin/sh -c "$2"' fake-ssh "$2" "$3" &
wait $!
"""


def namespaces_work() -> bool:
    return subprocess.run(["unshare", "-r", "-u", "hostname", "x"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.skipif(not namespaces_work(), reason="needs unprivileged user namespaces (unshare -r -u)")
def test_stop_of_a_hostfile_job_reaches_the_ranks_of_every_host(tmp_path, home, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    (tmp_path / "hostfile").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    env = {**os.environ, "PARATRAIN_HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "GLOO_SOCKET_IFNAME": "lo"}
    with open(tmp_path / "launch.log", "w") as log:
        coordinator = subprocess.Popen([PYTHON, "-m", "paratrain", "launch", "--hostfile", "hostfile", "--name", "mn",
                                        "--master-port", str(free_port()), "--", "doctor", "--size-mb", "0.01",
                                        "--duration", "300"], cwd=tmp_path, env=env, stdout=log, stderr=log)
    try:
        def nodes():
            return [Job.from_file(p) for p in sorted((home / "mn").glob("node*.json"))]

        def running():
            assert coordinator.poll() is None, (tmp_path / "launch.log").read_text()
            log = home / "mn" / "rank0.log"
            return log.exists() and "soak:" in log.read_text() and len(nodes()) == 2 and all(n.pids for n in nodes())

        wait_for(running, 100, "both nodes to run")
        assert sorted((bin_dir / "hosts").read_text().split()) == ["127.0.0.1", "127.0.0.2"]  # started together
        assert [n.host for n in nodes()] == ["127.0.0.1", "127.0.0.2"] != [socket.gethostname()] * 2
        remote_pids = {p for n in nodes() for p in (n.launcher_pid, *n.pids.values())}
        signalled, real_kill = [], os.kill
        with monkeypatch.context() as spy:
            spy.setattr(os, "kill", lambda pid, sig: (sig and signalled.append(pid), real_kill(pid, sig))[1])
            assert cli.main(["stop", "mn", "--grace", "10"]) == 0
        assert "mn: stopped" in capsys.readouterr().out
        assert not set(signalled) & remote_pids  # the other hosts' pids were never signalled from here
        assert coordinator.wait(30) == 128 + signal.SIGTERM, (tmp_path / "launch.log").read_text()
        assert [(n.state, n.exit_codes) for n in nodes()] == [("stopped", {"0": -15}), ("stopped", {"1": -15})]
        assert not any(J.pid_alive(pid) for pid in remote_pids)  # their own launchers stopped them
        assert J.load("mn").state == "stopped"
    finally:
        coordinator.kill()
        coordinator.wait()
        for path in (home / "mn").glob("node*.json"):
            for pid in [Job.from_file(path).launcher_pid, *Job.from_file(path).pids.values()]:
                if J.pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)


# ---- the launcher's side of a stop: torchrun with a stand-in rank that saves on SIGTERM ----

RANK = """
import os, signal, sys, time
from pathlib import Path
from paratrain import progress

terms = []
signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(signum))
progress.start()
progress.step_done(3)
progress.saved(0)  # a first checkpoint, so that the record of step 3 is on disk at once
while not terms:
    time.sleep(0.05)
Path(os.environ[progress.DIR_ENV], f"sigterm{os.environ['RANK']}").touch()
time.sleep(float(os.environ["SAVE_S"]))  # saving a checkpoint takes a while
sys.exit(progress.stopped(3))
"""

LAUNCHER = """
import sys
from pathlib import Path
from paratrain.launch import launcher
from paratrain.launch.hosts import Topology
from paratrain.launch.jobs import Job

job_dir = Path(sys.argv[1])
job_dir.mkdir(parents=True)
job = Job(name=job_dir.name, dir=str(job_dir), command=["rank.py"], nproc_per_node=2)
sys.exit(launcher.run_node(job, Topology(nproc_per_node=2), [sys.executable, sys.argv[2]], console=False,
                           join_timeout_s=60))
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how, save_s, code, codes, saved", [
    ("SIGTERM", 1, progress.EXIT_STOPPED, progress.EXIT_STOPPED, 3),  # Slurm, kill: ranks save, job "stopped, saved"
    ("stop", 1, progress.EXIT_STOPPED, progress.EXIT_STOPPED, 3),
    ("stop --grace 1", 60, 128 + signal.SIGTERM, -signal.SIGKILL, None),  # a save longer than the grace: killed
    ("stop --now", 1, 128 + signal.SIGKILL, -signal.SIGKILL, None),  # killed at once, no SIGTERM, no save
])
def test_launcher_forwards_a_stop_to_its_ranks_and_waits_for_their_save(tmp_path, home, capsys, how, save_s, code,
                                                                         codes, saved):
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    job_dir = home / "saver"
    launcher = subprocess.Popen([PYTHON, str(tmp_path / "launcher.py"), str(job_dir), str(tmp_path / "rank.py")],
                                env={**os.environ, "SAVE_S": str(save_s)}, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(progress.read(job_dir / "progress")) == 2 and len(J.load("saver").pids) == 2, 60,
                 "both ranks to run")
        start = time.monotonic()
        if how.startswith("stop"):
            assert cli.main(how.split()[:1] + ["saver", *how.split()[1:]]) == 0
            assert f"saver: {'stopped, saved at step 3' if saved else 'stopped'}\n" in capsys.readouterr().out
        else:
            launcher.send_signal(getattr(signal, how))
        stderr = launcher.communicate(timeout=60)[1]
        assert time.monotonic() - start < 15
    finally:
        launcher.kill()
    job = J.load("saver")
    assert (job.state, job.exit_codes, job.saved_step) == ("stopped", {"0": codes, "1": codes}, saved), stderr
    assert launcher.returncode == code, stderr
    got_sigterm = sorted(p.name for p in (job_dir / "progress").glob("sigterm*"))
    assert got_sigterm == ([] if how == "stop --now" else ["sigterm0", "sigterm1"])
    if saved:
        assert "job saver stopped, saved at step 3" in stderr
        assert cli.main(["jobs"]) == 0
        assert "saver: stopped, saved at step 3" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_a_launcher_pid_now_held_by_another_process_is_dead_to_jobs_stop_and_launch(tmp_path, home, capsys):
    """The launcher of a job was killed and its pid given to an unrelated process: ``jobs`` shows the job as lost,
    ``stop`` leaves that process alone and ``launch --name`` takes the name over; with the recorded start time the
    same pid is the job's launcher."""
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        started = J.process_start(bystander.pid)
        assert started is not None
        for name, start in (("stale", started - 1), ("taken", started - 1), ("live", started)):
            (home / name).mkdir(parents=True)
            Job(name=name, dir=str(home / name), command=["script.py"], state="running", launcher_pid=bystander.pid,
                launcher_start=start).save()
        assert cli.main(["jobs"]) == 0
        out = capsys.readouterr().out
        states = {line.split()[0]: line.split()[1] for line in out.splitlines()[1:] if line.split()}
        assert (states["stale"], states["taken"], states["live"]) == ("lost", "lost", "running"), out
        assert "stale: lost: its launcher (pid" in out and "another process" in out

        assert cli.main(["stop", "stale", "--grace", "0"]) == 0
        assert bystander.poll() is None  # never signalled
        assert J.load("stale").state == "stopped"
        assert cli.main(["stop", "live", "--grace", "0", "--now"]) == 0  # the same pid, recorded as the launcher
        assert bystander.wait(10) == -signal.SIGKILL
    finally:
        bystander.kill()
        bystander.wait()
    bystander = subprocess.Popen(["sleep", "60"])  # another process with the taken job's launcher's (old) pid
    try:
        record = J.load("taken")
        record.launcher_pid = bystander.pid
        record.save()
        (tmp_path / "hello.py").write_text("print('hello', flush=True)\n")
        env = {**os.environ, "PARATRAIN_HOME": str(home), "PARATRAIN_DEVICE": "cpu"}
        run = subprocess.run([PYTHON, "-m", "paratrain", "launch", "--name", "taken", "--", "hello.py"], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=100)
        assert run.returncode == 0, run.stderr
        assert "taking over the record" in run.stderr and "another process" in run.stderr
        assert J.load("taken").state == "succeeded" and bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
