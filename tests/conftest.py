import contextlib
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


@pytest.fixture(autouse=True)
def _tmp_env(tmp_path, monkeypatch):
    """Keep every temporary file and cache of a test inside its own folder."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # a launcher run in the test's own process sets its ranks' progress directory there: gone after the test
    monkeypatch.setenv("PARATRAIN_PROGRESS_DIR", "")
    monkeypatch.delenv("PARATRAIN_PROGRESS_DIR")
    for name in list(os.environ):  # a suite run inside a SLURM, MPI or Kubeflow job is not one of its ranks
        if name.startswith(("SLURM_", "OMPI_", "PMI_", "PET_")):
            monkeypatch.delenv(name)
    yield


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    """Compare like with like: a test's single-process reference runs with one thread, as every forked
    worker and every launched rank does (torchrun sets OMP_NUM_THREADS=1), and so does any process a test
    starts. Another thread count sums in another order, and how far that moves a result depends on the CPU.
    Other CPUs' kernels sum in other orders too: a comparison must hold with ATEN_CPU_CAPABILITY=default
    (ATen's scalar kernels), MKL_CBWR=COMPATIBLE (MKL's matmuls) and ONEDNN_MAX_CPU_ISA=SSE41 (oneDNN's
    convolutions) set, which is how the suite was checked."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with one_thread():
        yield


@contextlib.contextmanager
def one_thread():
    """torch on one thread inside, as ``_one_thread`` gives every test; for a module's fixture, which is made
    before any test's own fixtures and would otherwise run on all of the machine's threads."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def host_reads(monkeypatch) -> list[str]:
    """The names of the reads of a tensor's value by the host (``item``, ``tolist``, ``float()``, ``int()``)
    from now on, in order: each waits for the device."""
    import torch

    reads = []
    for name in ("item", "tolist", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: reads.append(_n) or _o(
            self, *a, **k))
    return reads


def tiny_config(**sections):
    """A tiny Config for tests: dropout 0, 2+2 layers, hidden 32; override with section dicts."""
    from paratrain import config_file

    base = {
        "model": {"kind": "transformer", "vocab_size": 48, "hidden_size": 32, "num_heads": 4,
                  "ffn_hidden_size": 64, "encoder_layers": 2, "decoder_layers": 2, "src_seq_length": 12,
                  "tgt_seq_length": 12, "seq_length": 16, "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "train": {"global_batch_size": 8, "steps": 10, "lr": 3e-3, "warmup_steps": 2},
        "metrics": {"log_steps": 1},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return config_file.from_dict(base)
