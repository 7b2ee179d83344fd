"""The one place that decides a run's device, its collective backend and the torch dtypes of config names.

``PARATRAIN_DEVICE`` = ``auto`` (default: ``cuda:LOCAL_RANK`` when CUDA is present, else the CPU),
``cpu`` or ``cuda``. The collective backend follows the device: NCCL on CUDA, gloo on the CPU.
"""
from __future__ import annotations

import os

import torch

from paratrain.errors import UserError
from paratrain.host_memory import fix_mmap_threshold

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "bf16": torch.bfloat16, "fp16": torch.float16}  # model.dtype and train.mixed_precision names
CHOICES = ("auto", "cpu", "cuda")


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
    TF32 tensor cores (bf16/fp16 runs are unaffected); on the CPU, glibc's fixed mmap threshold unless an
    allocator is preloaded (``paratrain.host_memory``)."""
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        fix_mmap_threshold()
