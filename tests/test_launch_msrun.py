"""``paratrain msrun``: MindSpore's msrun flags start the same launch as ``paratrain launch``; the flags with no
counterpart are refused, each with its reason."""
import os
import subprocess

import pytest

from conftest import PYTHON
from paratrain import cli

SCRIPT = """\
import sys
import torch
import torch.distributed as dist
from paratrain import communication

communication.init()
total = torch.tensor([float(communication.get_rank() + 1)], device="cpu")
dist.all_reduce(total)
print(f"rank {communication.get_rank()} of {communication.get_group_size()}: sum {total.item()} args {sys.argv[1:]}")
"""


def _run(monkeypatch, capsys, *argv):
    code = cli.main(list(argv))
    return code, capsys.readouterr()


def test_msrun_flags_start_the_launch_of_the_same_numbers(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARATRAIN_HOME", str(tmp_path / "runs"))
    (tmp_path / "net.py").write_text(SCRIPT)
    msrun = cli.build_parser().parse_args(["msrun", "--worker_num=8", "--local_worker_num", "4", "--node_rank=1",
                                           "--master_addr=10.0.0.1", "--master_port=8118", "--join=True",
                                           "--cluster_time_out=90", "--log_dir=logs", "net.py", "--epochs", "2"])
    from paratrain.launch.msrun import launch_argv

    argv = launch_argv(msrun)
    assert argv[argv.index("--"):] == ["--", "net.py", "--epochs", "2"] and "--name=logs" in argv
    # its torchrun command is the one of the launch given the same numbers by hand
    code, ours = _run(monkeypatch, capsys, "launch", "--dry-run", *argv)
    assert code == 0, ours.err
    code, by_hand = _run(monkeypatch, capsys, "launch", "--dry-run", "--nnodes=2", "--node-rank=1",
                         "--nproc-per-node=4", "--master-addr=10.0.0.1", "--master-port=8118", "--join-timeout=90",
                         "--name=logs", "--", "net.py", "--epochs", "2")
    assert code == 0 and ours.out == by_hand.out and "--nnodes 2 --node-rank 1" in ours.out
    # msrun's default --join=False starts the workers in the background
    assert "--detach" in launch_argv(cli.build_parser().parse_args(["msrun", "net.py"]))


@pytest.mark.parametrize("flags, message", [
    (["--bind_core=True"], "does not pin ranks to CPU cores"),
    (["--sim_level=1"], "no simulated"),
    (["--rank_table_file=rt.json"], "paratrain launch --rank-table FILE"),
    (["--worker_log_name=w"], "rank{R}.log"),
    (["--worker_num=6", "--local_worker_num=4"], "not a multiple of --local_worker_num=4"),
    (["--worker_num=8", "--local_worker_num=4"], "give each its index 0..1"),
    (["--cluster_time_out=-1"], "waits a bounded time"),
    (["--worker_num=0", "--local_worker_num=0"], "--worker_num=0: the number of workers on all nodes is 1 or more"),
    (["--worker_num=-2", "--local_worker_num=-2"], "--worker_num=-2: the number of workers on all nodes is 1 or"),
    (["--worker_num=4", "--local_worker_num=-2"], "--local_worker_num=-2 --worker_num=4: each node runs 1 to 4"),
    (["--worker_num=2", "--local_worker_num=2", "--master_port=-5"], "--master_port=-5 is not a TCP port"),
    (["--unknown=1"], "msrun: unexpected --unknown=1"),
])
def test_flags_that_do_not_map_are_refused_with_the_reason(tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.py").write_text(SCRIPT)
    code, out = _run(monkeypatch, capsys, "msrun", *flags, "net.py")
    assert code == 2 and message in out.err and len(out.err.strip().splitlines()) == 1, out.err


def _rank_logs(job_dir) -> list[str]:
    return [(job_dir / f"rank{rank}.log").read_text().strip() for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_msrun_on_two_local_workers_gives_what_launch_gives(tmp_path):
    (tmp_path / "net.py").write_text(SCRIPT)
    env = {**os.environ, "PARATRAIN_HOME": str(tmp_path / "runs")}

    def paratrain(*argv):
        out = subprocess.run([PYTHON, "-m", "paratrain", *argv], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=240)
        assert out.returncode == 0, out.stderr

    paratrain("msrun", "--worker_num=2", "--local_worker_num=2", "--log_dir=msrun_log", "--join=True", "net.py", "x")
    paratrain("launch", "--nproc-per-node=2", "--name=by-launch", "--", "net.py", "x")
    by_msrun, by_launch = _rank_logs(tmp_path / "msrun_log"), _rank_logs(tmp_path / "runs" / "by-launch")
    assert by_msrun == by_launch and by_launch[1] == "rank 1 of 2: sum 3.0 args ['x']"
