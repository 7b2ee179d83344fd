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
