"""Every test here needs CUDA: it is marked ``gpu`` (``gpu(n)``: n GPUs, default 1) and skipped, with the
reason on one line, when the GPUs it needs are not there or ``PARATRAIN_DEVICE=cpu`` keeps the run on the CPU."""
import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def missing_gpus(needed: int) -> str | None:
    """Why a test that needs ``needed`` GPUs cannot run here, or None when it can."""
    if os.environ.get("PARATRAIN_DEVICE", "").strip().lower() == "cpu":
        return "PARATRAIN_DEVICE=cpu keeps this run on the CPU (make gpu-test runs the GPU suite)"
    if not torch.cuda.is_available():
        return f"CUDA is not available (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})"
    count = torch.cuda.device_count()
    if count < needed:
        return f"needs {needed} GPUs, {count} visible"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not item.path.is_relative_to(HERE):  # this hook sees the whole session's tests
            continue
        if item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.gpu(1))
        marker = item.get_closest_marker("gpu")
        reason = missing_gpus(marker.args[0] if marker.args else 1)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
