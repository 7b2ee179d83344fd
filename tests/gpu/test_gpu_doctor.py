"""`paratrain doctor --nproc-per-node 2` on two GPUs: rendezvous, exact all-reduce and bandwidth over NCCL (over
gloo when the ranks share one GPU: conftest)."""
import os
import re
import subprocess

import pytest

from conftest import PYTHON
from gpu.spawn import collective_backend, gpu_env
from paratrain.device import shares_gpus


@pytest.mark.gpu(2)
@pytest.mark.timeout(240)
def test_doctor_two_gpus(tmp_path):
    env = {**os.environ, **gpu_env(tmp_path)}
    if shares_gpus():  # the launcher refuses two ranks on one GPU, as it does for users: torchrun starts them
        # (all-reduces up to 64 MB: through host memory a GB says nothing more)
        command = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "paratrain", "doctor",
                   "--size-mb", "64"]
    else:
        command = ["-m", "paratrain", "doctor", "--nproc-per-node", "2", "--name", "doctor-gpu"]
    proc = subprocess.run([PYTHON, *command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    rank0 = tmp_path / "runs" / "doctor-gpu" / "rank0.log"
    log = rank0.read_text() if rank0.exists() else proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr + log
    assert f"backend: {collective_backend()}" in log and re.search(r"nccl: \d+\.\d+", log), log
    assert "rendezvous: ok, 2 ranks" in log and "all_reduce: ok" in log, log
    bandwidths = [float(b) for b in re.findall(r"bus +([\d.]+) GB/s", log)]
    assert bandwidths and bandwidths[-1] > 0, log  # the largest all-reduce moved data between the GPUs
