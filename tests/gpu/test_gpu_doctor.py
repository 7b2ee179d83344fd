"""`paratrain doctor --nproc-per-node 2` on two GPUs: rendezvous, exact all-reduce and bandwidth over NCCL."""
import os
import re
import subprocess

import pytest

from conftest import PYTHON
from gpu.spawn import gpu_env


@pytest.mark.gpu(2)
@pytest.mark.timeout(240)
def test_doctor_two_gpus_over_nccl(tmp_path):
    env = {**os.environ, **gpu_env(tmp_path)}
    proc = subprocess.run([PYTHON, "-m", "paratrain", "doctor", "--nproc-per-node", "2", "--name", "doctor-gpu"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    rank0 = tmp_path / "runs" / "doctor-gpu" / "rank0.log"
    log = rank0.read_text() if rank0.exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log
    assert "backend: nccl" in log and re.search(r"nccl: \d+\.\d+", log), log
    assert "rendezvous: ok, 2 ranks" in log and "all_reduce: ok" in log, log
    bandwidths = [float(b) for b in re.findall(r"bus +([\d.]+) GB/s", log)]
    assert bandwidths and bandwidths[-1] > 0, log  # the largest all-reduce moved data between the GPUs
