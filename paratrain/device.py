"""The one place that decides a run's device, its collective backend and the torch dtypes of config names.

``PARATRAIN_DEVICE`` = ``auto`` (default: ``cuda:LOCAL_RANK`` when CUDA is present, else the CPU),
``cpu`` or ``cuda``; the backend follows: NCCL on CUDA, gloo on the CPU. More ranks on a host than
GPUs are refused before anything starts (NCCL would fail later with "Duplicate GPU").

``PARATRAIN_SHARED_GPU=1`` is a test mode, not a user feature: tests/gpu sets it to run its two-rank tests on
a machine with one GPU. The ranks of a host then share its GPUs (rank r on ``cuda:r % GPUs``) and their
collectives go over gloo, which carries CUDA tensors through the host (NCCL refuses two ranks on one GPU);
the launcher's refusal above still holds.
"""
from __future__ import annotations

import os

import torch

from paratrain.errors import UserError
from paratrain.host_memory import fix_mmap_threshold

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "bf16": torch.bfloat16, "fp16": torch.float16}  # model.dtype and train.mixed_precision names
CHOICES = ("auto", "cpu", "cuda")
SHARED_GPU = "PARATRAIN_SHARED_GPU"


def _choice(choice: str | None) -> str:
    choice = (choice or os.environ.get("PARATRAIN_DEVICE", "auto")).strip().lower() or "auto"
    if choice not in CHOICES:
        raise UserError(f"PARATRAIN_DEVICE={choice!r} is not one of {', '.join(CHOICES)}")
    return choice


def uses_cuda(choice: str | None = None) -> bool:
    """Whether ``choice`` (default ``PARATRAIN_DEVICE``) puts this host's ranks on GPUs; ``cuda`` without a
    usable GPU is refused (a CPU-only torch build, or no GPU visible)."""
    choice = _choice(choice)
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return False
    if not torch.cuda.is_available():
        why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
               else f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, but no GPU is visible")
        raise UserError(f"PARATRAIN_DEVICE=cuda but torch sees no CUDA device ({why}): install a CUDA build of "
                        f"torch, or unset PARATRAIN_DEVICE (auto) or set it to cpu to train on the CPU")
    return True


def shares_gpus() -> bool:
    """Whether this process runs in the test mode where a host's ranks share its GPUs over gloo."""
    return os.environ.get(SHARED_GPU, "").strip() == "1"


def check_local_ranks(local_ranks: int, choice: str | None = None) -> None:
    """Refuse ``local_ranks`` ranks on this host when they would run on fewer GPUs than that."""
    if not uses_cuda(choice):
        return
    count = torch.cuda.device_count()
    if local_ranks > count:
        raise UserError(f"{local_ranks} ranks on this host but {count} GPU(s) visible: each rank needs a GPU of "
                        f"its own (two ranks on one GPU fail in NCCL): use --nproc-per-node {count} or less, or "
                        f"PARATRAIN_DEVICE=cpu to run the ranks on the CPU")


def device(choice: str | None = None) -> torch.device:
    """This process's device: ``choice`` (auto, cpu or cuda; default ``PARATRAIN_DEVICE``) and ``LOCAL_RANK``
    (refused when ``LOCAL_WORLD_SIZE`` is more than the GPUs)."""
    if not uses_cuda(choice):
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if shares_gpus():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    check_local_ranks(max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), local_rank + 1), choice)
    return torch.device("cuda", local_rank)


def pinned(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch's host tensor bound for ``device``, in pinned memory when that is a GPU (a copy from pageable
    memory may wait for the work queued before it); else as it is."""
    if device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
        return tensor.pin_memory()
    return tensor


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch's host tensor on ``device`` without the host waiting for the device: ``pinned``, then copied
    ``non_blocking``."""
    return pinned(tensor, device).to(device, non_blocking=True)


def backend(host_tensors: bool = False) -> str:
    """The collective backend of this process's device: ``nccl`` on CUDA, ``gloo`` on the CPU and for GPUs
    shared by ranks (``shares_gpus``). With ``host_tensors`` (offloaded gradients, whose norm is reduced on the
    host) CUDA runs add gloo for CPU tensors."""
    if device().type != "cuda" or shares_gpus():
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
