"""``PARATRAIN_SHARED_GPU=1``, the test mode that runs tests/gpu's two-rank tests on a one-GPU machine: the ranks
share the GPU over gloo; without it, and for ``paratrain launch`` always, two ranks on one GPU are refused.
CUDA is faked here (availability and count); tests/gpu runs the mode on a GPU."""
import pytest
import torch

from paratrain import cli
from paratrain.device import SHARED_GPU, backend, device
from paratrain.errors import UserError


@pytest.fixture
def one_gpu_two_ranks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("PARATRAIN_DEVICE", "cuda")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    return monkeypatch


def test_shared_gpu_puts_both_ranks_on_the_gpu_and_their_collectives_on_gloo(one_gpu_two_ranks):
    one_gpu_two_ranks.setenv(SHARED_GPU, "1")
    assert device() == torch.device("cuda", 0)
    assert backend() == backend(host_tensors=True) == "gloo"


def test_without_shared_gpu_two_ranks_on_one_gpu_are_refused_and_one_rank_uses_nccl(one_gpu_two_ranks):
    for value in (None, "0", ""):
        if value is None:
            one_gpu_two_ranks.delenv(SHARED_GPU, raising=False)
        else:
            one_gpu_two_ranks.setenv(SHARED_GPU, value)
        with pytest.raises(UserError, match=r"2 ranks on this host but 1 GPU\(s\) visible"):
            device()
    one_gpu_two_ranks.setenv("LOCAL_RANK", "0")
    one_gpu_two_ranks.setenv("LOCAL_WORLD_SIZE", "1")
    assert backend() == "nccl" and backend(host_tensors=True) == "cpu:gloo,cuda:nccl"


def test_the_launcher_refuses_two_ranks_on_one_gpu_even_in_the_test_mode(one_gpu_two_ranks, tmp_path, capsys):
    one_gpu_two_ranks.setenv(SHARED_GPU, "1")
    one_gpu_two_ranks.setenv("PARATRAIN_HOME", str(tmp_path / "home"))
    code = cli.main(["launch", "--nproc-per-node", "2", "--name", "shared", "--", "train",
                     f"--run.dir={tmp_path / 'run'}", "--parallel.data_parallel=2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("paratrain: 2 ranks on this host but 1 GPU(s) visible"), err
    assert not (tmp_path / "run").exists() and not (tmp_path / "home").exists()


def pipeline_losses(cfg, staged: bool):
    """Worker: a two-stage pipeline's losses, its point-to-point ops staged through host copies as with shared
    GPUs (here the CPU tensors too), and how many received tensors were copied back."""
    from gpu import spawn
    from paratrain.trainer import Trainer

    class Counted(spawn.HostStagedWork):
        received = 0

        def __init__(self, works, received):
            Counted.received += len(received)
            super().__init__(works, received)

    if staged:
        spawn.STAGED_DEVICES, spawn.HostStagedWork = ("cuda", "cpu"), Counted
        spawn.stage_point_to_point_through_host()
    return [r["loss"] for r in Trainer(cfg).train()], Counted.received


@pytest.mark.slow
def test_point_to_point_through_host_copies_leaves_a_pipeline_exact(tmp_path):
    from conftest import tiny_config
    from forked_ranks import run_distributed

    def config(name):
        return tiny_config(run={"dir": str(tmp_path / name)}, model={"kind": "gpt"}, metrics={"progress": False},
                           parallel={"pp": 2, "micro_batch_num": 4, "pipeline_schedule": "1f1b"}, train={"steps": 4})

    plain = run_distributed(pipeline_losses, 2, config("plain"), False)
    staged = run_distributed(pipeline_losses, 2, config("staged"), True)
    assert [r[1] for r in plain] == [0, 0] and all(r[1] > 0 for r in staged)  # both stages received through copies
    assert staged[0][0] == plain[0][0] and plain[0][0][-1] < plain[0][0][0]
