"""Every test here needs CUDA: it is marked ``gpu`` (``gpu(n)``: n GPUs, default 1) and skipped, with the
reason on one line, when there is no GPU or ``PARATRAIN_DEVICE=cpu`` keeps the run on the CPU. A test that needs
more GPUs than are visible runs with its ranks sharing them (``PARATRAIN_SHARED_GPU=1``, a test mode:
``paratrain.device``): the lent machines have one GPU, so the two-rank tests run there with gloo carrying the
CUDA tensors instead of NCCL; ``PARATRAIN_SHARED_GPU=0`` skips them instead. ``PARATRAIN_GPU_TESTS=one`` (or
``several``) keeps only the tests that need one GPU (or more), so that tools/gpu_check.sh times them apart."""
import os
from pathlib import Path

import pytest
import torch

from paratrain.device import SHARED_GPU

HERE = Path(__file__).parent


def shares_gpus(needed: int) -> bool:
    """Whether a test that needs ``needed`` GPUs runs with its ranks sharing the visible ones."""
    return os.environ.get(SHARED_GPU, "1") != "0" and 0 < torch.cuda.device_count() < needed


def missing_gpus(needed: int) -> str | None:
    """Why a test that needs ``needed`` GPUs cannot run here, or None when it can."""
    if os.environ.get("PARATRAIN_DEVICE", "").strip().lower() == "cpu":
        return "PARATRAIN_DEVICE=cpu keeps this run on the CPU (make gpu-test runs the GPU suite)"
    if not torch.cuda.is_available():
        return f"CUDA is not available (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})"
    count = torch.cuda.device_count()
    if count < needed and not shares_gpus(needed):
        return f"needs {needed} GPUs, {count} visible ({SHARED_GPU}=0: ranks may not share a GPU)"
    return None


def needed_gpus(item) -> int:
    marker = item.get_closest_marker("gpu")
    return marker.args[0] if marker and marker.args else 1


@pytest.fixture(autouse=True)
def share_the_gpu_when_too_few(request, monkeypatch):
    """Ranks spawned by a test that needs more GPUs than there are share them (they inherit the variable)."""
    if shares_gpus(needed_gpus(request.node)):
        monkeypatch.setenv(SHARED_GPU, "1")


def pytest_collection_modifyitems(config, items):
    wanted = os.environ.get("PARATRAIN_GPU_TESTS", "").strip()
    if wanted:
        if wanted not in ("one", "several"):
            raise pytest.UsageError(f"PARATRAIN_GPU_TESTS={wanted!r}: expected one or several (or unset: all)")
        left_out = [item for item in items if item.path.is_relative_to(HERE)
                    and (needed_gpus(item) > 1) != (wanted == "several")]
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]
    for item in items:
        if not item.path.is_relative_to(HERE):  # this hook sees the whole session's tests
            continue
        if item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.gpu(1))
        reason = missing_gpus(needed_gpus(item))
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
