"""Where am I: the torch.distributed variables filled from SLURM, MPI and Kubeflow's, the refusals of
contradictory ones, what ``paratrain launch`` reads in an allocation or a pod, and ranks started by hand
with only a cluster's variables forming one job with the losses of one process."""
import json
import os
import random
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PYTHON, ROOT
from paratrain import cli
from paratrain.cluster import TopologyError, expand_nodelist, fill_env, locate, tasks_per_node
from paratrain.launch.jobs import LOST_AFTER_S, Job, load

FILLED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_scontrol(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", os.path.dirname(PYTHON))  # no scontrol: the project's own node-list expansion
    monkeypatch.setenv("PARATRAIN_HOME", str(tmp_path / "runs"))


def _slurm(procid, ntasks=4, per_node="2", nodelist="node[01-02]", **more):
    return {"SLURM_JOB_ID": "4242", "SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks),
            "SLURM_NTASKS_PER_NODE": per_node, "SLURM_JOB_NODELIST": nodelist, **more}


def _filled(env):
    env = dict(env)
    fill_env(env, report=None)
    return tuple(env.get(name) for name in FILLED)


def test_nodelists_and_tasks_per_node():
    assert expand_nodelist("node[01-04,07],gpu-a1") == ["node01", "node02", "node03", "node04", "node07", "gpu-a1"]
    assert expand_nodelist("r[8-10]-ib,x") == ["r8-ib", "r9-ib", "r10-ib", "x"]
    assert tasks_per_node("4(x2),3") == [4, 4, 3]
    assert tasks_per_node("2") == [2]
    with pytest.raises(TopologyError, match="'4x2'"):
        tasks_per_node("4x2")


def test_torchrun_or_nothing_leaves_the_environment_alone():
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "9"}
    assert locate(torchrun) is None and locate({}) is None
    assert _filled(torchrun) == ("1", "2", "1", None, None, None)


def test_slurm_one_task_per_rank():
    # 2 nodes x 2 tasks: task 3 is the second of node02; the address is the first node, the port the job's
    expected = {0: ("0", "4", "0", "2"), 1: ("1", "4", "1", "2"), 2: ("2", "4", "0", "2"), 3: ("3", "4", "1", "2")}
    for procid, numbers in expected.items():
        assert _filled(_slurm(procid)) == (*numbers, "node01", str(29500 + 4242 % 1000))
    # srun's compressed counts of an uneven step, the node told by the task's rank
    assert _filled(_slurm(9, ntasks=11, per_node="", SLURM_TASKS_PER_NODE="4(x2),3", nodelist="n[1-3]"))[:4] == (
        "9", "11", "1", "3")
    assert _filled(_slurm(1, ntasks=2, per_node="", nodelist="one", MASTER_PORT="1234"))[4:] == ("one", "1234")


@pytest.mark.parametrize("env, message", [
    (_slurm(0, ntasks=3), r"SLURM_NTASKS=3 but SLURM_NTASKS_PER_NODE=2 on 2 node\(s\) makes 4 tasks"),
    (_slurm(0, per_node=""), r"SLURM_NTASKS=4 on 2 nodes .* without a tasks-per-node count"),
    (_slurm(0, per_node="2,2,2"), r"gives 3 node\(s\) but the node list node\[01-02\] has 2"),
    (_slurm(5), "SLURM_PROCID=5 is not below SLURM_NTASKS=4"),
    ({**_slurm(1), "RANK": "0"}, "RANK=0 but SLURM job 4242 .* says 1"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "export MASTER_ADDR=<host of rank 0>"),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": "4"}, "run 'paratrain launch -- train"),
    ({"PET_NNODES": "1:4", "PET_NODE_RANK": "0"}, "elastic"),
    (_slurm(0, ntasks=0, per_node=""), "SLURM_NTASKS=0: a job runs at least one rank"),
    (_slurm(0, per_node="2,0"), r"'0' counts no task"),
    ({"PMI_RANK": "0", "PMI_SIZE": "0"}, "PMI_SIZE=0: a job runs at least one rank"),
    ({"PET_NNODES": "0", "PET_NODE_RANK": "0"}, "PET_NNODES=0: a job runs at least one rank"),
])
def test_contradictions_are_refused(env, message):
    with pytest.raises(TopologyError, match=message):
        locate(env)


def test_mpi_and_kubeflow():
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "head", "MASTER_PORT": "5000"}
    assert _filled(ompi) == ("3", "4", "1", "2", "head", "5000")
    assert _filled({"PMI_RANK": "1", "PMI_SIZE": "2"})[:5] == ("1", "2", "1", "2", "localhost")
    assert _filled({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
                    "MASTER_ADDR": "h"})[:5] == ("1", "4", "1", "2", "h")
    # what the training operator sets in the second of two pods of one process each
    pod = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "1", "RANK": "1", "WORLD_SIZE": "2",
           "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456"}
    assert _filled(pod) == ("1", "2", "0", "1", "job-master-0", "23456")


def test_refusal_is_one_line_before_anything_starts(tmp_path, monkeypatch, capsys):
    for key, value in _slurm(0, ntasks=3).items():
        monkeypatch.setenv(key, value)
    assert cli.main(["train", f"--run.dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "paratrain: SLURM_NTASKS=3 but SLURM_NTASKS_PER_NODE=2 on 2 node(s) makes 4 tasks: give srun --ntasks "
        "equal to the nodes times --ntasks-per-node, or only one"]
    assert not any(name in os.environ for name in FILLED)


def _dry_run(capsys, monkeypatch, env, *flags):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code = cli.main(["launch", *flags, "--dry-run", "--", "doctor"])
    return code, capsys.readouterr()


def test_launch_in_an_allocation(capsys, monkeypatch):
    one_node = {"SLURM_JOB_ID": "9", "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "cn1",
                "SLURM_GPUS_ON_NODE": "4"}
    code, out = _dry_run(capsys, monkeypatch, one_node)
    assert code == 0 and "--nproc-per-node 4" in out.out and "--nnodes 1 " in out.out
    # srun started the launcher as 2 tasks on this node: both would start the node's ranks
    code, out = _dry_run(capsys, monkeypatch, {**_slurm(1, ntasks=2, per_node="2", nodelist="cn1"),
                                               "SLURM_STEP_ID": "0"})
    assert code == 2 and "srun started 2 tasks on this node" in out.err
    assert "srun --ntasks-per-node=2 python -m paratrain train" in out.err


@pytest.mark.parametrize("env, message", [
    ({"PET_NNODES": "0"}, "Kubeflow: PET_NNODES='0' is not a whole number of 1 or more"),
    ({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "0"}, "PET_NPROC_PER_NODE='0' is not a whole number of 1 or more"),
    ({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "-2"}, "PET_NPROC_PER_NODE='-2' is not a whole number of 1 or more"),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "m"}, "PET_NODE_RANK='2' is not a whole number "
                                                                        "from 0 to 1"),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "0"},
     "PET_MASTER_PORT='0' is not a whole number from 1 to 65535"),
    ({"SLURM_JOB_ID": "9", "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "0", "SLURM_JOB_NODELIST": "cn1"},
     "Slurm: SLURM_JOB_NUM_NODES='0' is not a whole number of 1 or more"),
    ({"SLURM_JOB_ID": "9", "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "two", "SLURM_JOB_NODELIST": "cn1"},
     "SLURM_JOB_NUM_NODES='two' is not a whole number"),
    ({"SLURM_JOB_ID": "9", "SLURM_NODEID": "-1", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "cn[1-2]"},
     "SLURM_NODEID='-1' is not a whole number from 0 to 1"),
    ({"SLURM_JOB_ID": "9", "SLURM_NODEID": "2", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "cn[1-2]"},
     "SLURM_NODEID='2' is not a whole number from 0 to 1"),
])
def test_launch_refuses_zero_or_negative_counts_of_a_cluster_in_one_line(capsys, monkeypatch, env, message):
    code, out = _dry_run(capsys, monkeypatch, env)
    assert code == 2 and message in out.err and len(out.err.strip().splitlines()) == 1, out.err
    assert out.out == ""


def test_launch_in_a_kubeflow_pod(capsys, monkeypatch):
    pod = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "2", "PET_MASTER_ADDR": "job-master-0",
           "PET_MASTER_PORT": "23456", "PET_MAX_RESTARTS": "3", "PET_RDZV_BACKEND": "etcd"}
    code, out = _dry_run(capsys, monkeypatch, pod)
    assert code == 0, out.err
    for flag in ("--nnodes 2", "--node-rank 1", "--master-addr job-master-0", "--master-port 23456",
                 "--nproc-per-node 2"):
        assert flag in out.out
    # torchrun's parser takes PET_* as its defaults: a one-pod launch must still be one node, no restarts
    from paratrain.launch import launcher
    from paratrain.launch.hosts import Topology

    monkeypatch.setenv("PET_NNODES", "4")
    config, _, _ = launcher._torchrun_config(launcher.torchrun_args(Topology(2), "j", ["true"], 60))
    assert (config.min_nodes, config.max_nodes, config.max_restarts, config.rdzv_backend) == (1, 1, 0, "c10d")


def _free_slurm_job_id() -> str:
    """A job id whose derived port (29500 + id mod 1000) is free here now; tried in random order, so that suites
    running side by side (other checkouts) do not all take the same port and join each other's jobs."""
    for offset in random.sample(range(1, 1000), 999):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 29500 + offset))
            except OSError:
                continue
        return str(123000 + offset)
    pytest.skip("no free port in 29500..30499")


def _cluster_env(source: str, rank: int, job_id: str) -> dict[str, str]:
    if source == "slurm":
        return {"SLURM_JOB_ID": job_id, "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2",
                "SLURM_LOCALID": str(rank), "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost"}
    port = str(29500 + int(job_id) % 1000)
    if source == "openmpi":
        return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2", "MASTER_PORT": port,
                "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    return {"PET_NNODES": "2", "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": "1", "RANK": str(rank),
            "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": port, "PET_MASTER_ADDR": "localhost",
            "PET_MASTER_PORT": port}


CONFIG = """
[model]
kind = "transformer"
vocab_size = 32
hidden_size = 32
num_heads = 4
ffn_hidden_size = 64
encoder_layers = 1
decoder_layers = 1
src_seq_length = 8
tgt_seq_length = 8
hidden_dropout = 0.0
attention_dropout = 0.0

[train]
global_batch_size = 8
steps = 3
lr = 3e-3
warmup_steps = 1

[data]
kind = "synthetic"
task = "copy"

[metrics]
log_steps = 1
progress = false
"""


def _train(tmp_path: Path, name: str, envs: list[dict[str, str]]) -> tuple[list[float], str]:
    """Start one ``python -m paratrain train`` per environment, by hand; rank 0's losses and output."""
    config = tmp_path / "tiny.toml"
    config.write_text(CONFIG)
    run_dir = tmp_path / name
    base = {k: v for k, v in os.environ.items() if k not in FILLED and not k.startswith(("SLURM_", "OMPI_", "PET_"))}
    procs = [subprocess.Popen([PYTHON, "-m", "paratrain", "train", "--config", str(config), f"--run.dir={run_dir}",
                               f"--parallel.dp={len(envs)}"], env={**base, **env}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for env in envs]
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    except subprocess.TimeoutExpired:
        outputs = None
    finally:
        for p in procs:
            p.kill()
    if outputs is None:
        printed = "\n".join(p.communicate()[0] for p in procs)
        pytest.fail(f"a rank ran for more than 180 s; the ranks printed:\n{printed}")
    assert [p.returncode for p in procs] == [0] * len(procs), outputs
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records], outputs[0]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The losses of the config trained by one process: the reference of every 2-rank run."""
    losses, _ = _train(tmp_path_factory.mktemp("alone"), "alone", [{}])
    assert len(losses) == 3
    return losses


@pytest.mark.parametrize("source, said", [("slurm", "from SLURM job"), ("openmpi", "from Open MPI"),
                                          ("kubeflow", "from a Kubeflow PyTorchJob pod")])
def test_ranks_started_by_a_cluster_form_one_job(tmp_path, one_process, source, said):
    job_id = _free_slurm_job_id()
    together, out = _train(tmp_path, source, [_cluster_env(source, rank, job_id) for rank in range(2)])
    assert together == pytest.approx(one_process, rel=1e-5)
    assert f"paratrain: 2 rank(s), {1 if source == 'kubeflow' else 2} on this node, {said}" in out


def _record(home: Path, name: str, host: str, heard_s_ago: float) -> Job:
    """An active record of ``name`` saved by a launcher on ``host`` ``heard_s_ago`` seconds ago."""
    (home / name).mkdir(parents=True, exist_ok=True)
    job = Job(name=name, dir=str(home / name), host=host, state="running", launcher_pid=2**22 + 7)
    job.save()
    data = json.loads(job.path.read_text())
    job.path.write_text(json.dumps({**data, "heartbeat": time.time() - heard_s_ago}))
    return Job.from_file(job.path)


def test_a_record_whose_launcher_is_gone_is_cleared_by_stop(tmp_path, capsys):
    home = tmp_path / "runs"
    assert _record(home, "fresh", "other-node", 10).shown_state() == "running"
    assert _record(home, "here", socket.gethostname(), 10).shown_state() == "lost"  # its pid is dead
    assert _record(home, "old", "other-node", LOST_AFTER_S + 60).shown_state() == "lost"
    started = time.monotonic()
    assert cli.main(["stop", "old", "--grace", "5"]) == 0
    assert time.monotonic() - started < 5  # nothing to wait for
    out = capsys.readouterr().out
    assert "node 0 counts as lost: its launcher on other-node has not saved it" in out
    assert load("old").state == "stopped"
    # a launcher of another host heard from lately may still run: a launch of the same name is refused
    assert cli.main(["launch", "--name", "fresh", "--", "train"]) == 2
    assert "job 'fresh' is running (pid 4194311 on other-node): stop it" in capsys.readouterr().err


def test_a_requeued_slurm_job_takes_over_its_record(tmp_path, monkeypatch, capsys):
    home = tmp_path / "runs"
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    monkeypatch.setenv("SLURM_JOB_ID", "55")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    old = _record(home, "requeued", "other-node", 10)  # saved 10 s ago by the job's first requeue
    assert old.shown_state() == "running"
    monkeypatch.setenv("SLURM_JOB_ID", "56")  # another Slurm job says nothing about it
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert old.shown_state() == "running"
    monkeypatch.setenv("SLURM_JOB_ID", "55")  # the same job, requeued again since
    assert old.shown_state() == "lost"
    assert old.lost_because() == "Slurm requeued job 55 since (SLURM_RESTART_COUNT 1 -> 2)"
    assert cli.main(["launch", "--name", "requeued", "--", str(script)]) == 0
    assert "taking over the record of an earlier launch, running on other-node: Slurm requeued" in (
        capsys.readouterr().err)
    assert (load("requeued").state, load("requeued").slurm_restart_count) == ("succeeded", 2)
    # the launcher that died abruptly on another node: a launch of the same name runs, saying so
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    _record(home, "stale", "other-node", LOST_AFTER_S + 60)
    assert cli.main(["launch", "--name", "stale", "--", str(script)]) == 0
    assert "taking over the record of an earlier launch, running on other-node" in capsys.readouterr().err
    assert (load("stale").state, load("stale").host) == ("succeeded", socket.gethostname())
