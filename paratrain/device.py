"""The one place that decides a run's device, its collective backend and the torch dtypes of config names.

``PARATRAIN_DEVICE`` = ``auto`` (default: ``cuda:LOCAL_RANK`` when CUDA is present, else the CPU),
``cpu`` or ``cuda``. The collective backend follows the device: NCCL on CUDA, gloo on the CPU.
"""
from __future__ import annotations

import ctypes
import os
import sys

import torch

from paratrain.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "bf16": torch.bfloat16, "fp16": torch.float16}  # model.dtype and train.mixed_precision names
CHOICES = ("auto", "cpu", "cuda")
HOST_MMAP_THRESHOLD = 4 << 20  # bytes; see fix_host_mmap_threshold
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def device(choice: str | None = None) -> torch.device:
    """This process's device: ``choice`` (auto, cpu or cuda; default ``PARATRAIN_DEVICE``) and ``LOCAL_RANK``."""
    choice = (choice or os.environ.get("PARATRAIN_DEVICE", "auto")).strip().lower() or "auto"
    if choice not in CHOICES:
        raise UserError(f"PARATRAIN_DEVICE={choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("PARATRAIN_DEVICE=cuda but torch sees no CUDA device: unset it or use cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def backend(host_tensors: bool = False) -> str:
    """The collective backend of this process's device: ``nccl`` on CUDA, ``gloo`` on the CPU. With
    ``host_tensors`` (offloaded gradients, whose norm is reduced on the host) CUDA runs add gloo for
    CPU tensors."""
    if device().type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if host_tensors else "nccl"


def configure(dev: torch.device) -> None:
    """This process's settings for ``dev``: on a GPU it is the current CUDA device and fp32 matmuls use
    TF32 tensor cores (bf16/fp16 runs are unaffected)."""
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        fix_host_mmap_threshold()


def fix_host_mmap_threshold() -> bool:
    """Serve host blocks of 4 MiB and more from their own mappings, returned to the system when freed.

    glibc raises its mmap threshold (up to 32 MiB) each time such a block is freed and then
    serves them from its heap, which keeps the freed space: a CPU run's peak resident memory
    grows with its allocation pattern (FSDP2's gather and reduce buffers most), 10-25 % of a
    rank's peak in ``bench/peers.py``. A fixed threshold stops that. Left alone when
    ``MALLOC_MMAP_THRESHOLD_`` is set or the C library is not glibc; returns whether it was set.
    """
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD))
    except (OSError, AttributeError):  # not glibc
        return False
