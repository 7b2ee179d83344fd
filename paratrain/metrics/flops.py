"""Model FLOPs per step, device peak FLOP/s and memory, for MFU and the memory column.

A step's FLOPs are counted on the model itself (``paratrain.plan.counts``): its forward and backward on fake tensors,
each op's FLOPs by ``torch.utils.flop_counter`` (a matmul of (m, k) x (k, n): 2mkn; attention's QK^T and
(softmax)V), norms, activations and the loss's elementwise work left out, padded positions in (the matmuls run on
them), recompute left out (model FLOPs, not hardware FLOPs). This is the one FLOP count: the trainer's MFU and the
planner (``paratrain.plan``) use it.
"""
from __future__ import annotations

import resource
import time

import torch

from paratrain.config import ModelConfig

# Dense bf16 tensor-core peak (TFLOP/s) of one device, matched as a substring of the CUDA device name;
# the first match wins, so more specific names come first.
GPU_PEAK_TFLOPS = [
    ("GB200", 2500.0), ("B200", 2250.0), ("B100", 1750.0),
    ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("H800", 989.0), ("GH200", 989.0),
    ("A100", 312.0), ("A800", 312.0), ("A30", 165.0), ("A10G", 70.0), ("A10", 125.0),
    ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
    ("RTX 6000 Ada", 364.0), ("A6000", 155.0), ("RTX 4090", 165.0), ("RTX 3090", 71.0),
    ("V100", 125.0), ("T4", 65.0),  # fp16 (no bf16 on these)
    ("MI300X", 1307.0), ("MI250X", 383.0), ("MI250", 362.0),
]


def model_flops(m: ModelConfig, batch: int, lengths: tuple[int, int] | None = None) -> float:
    """Training FLOPs (forward and backward, no recompute) of one step on ``batch`` sequences of ``lengths``
    (source, target; default ``ModelConfig.lengths``): every layer's and part's."""
    from paratrain.plan.counts import model_counts

    counted = model_counts(m, lengths=lengths, rows=batch)
    layers = sum(n * counted.layers[kind].at(batch).train_flops for kind, n in m.layer_counts().items())
    return float(layers + sum(piece.at(batch).train_flops for piece in counted.parts.values()))


def batch_flops(cfg: ModelConfig, batch: dict[str, torch.Tensor], replicas: int = 1) -> float:
    """Training FLOPs of one step on ``batch`` (this rank's share) times ``replicas`` data-parallel ranks."""
    if "images" in batch:
        return 0.0  # convolution FLOPs are not counted: no MFU for the ResNet example
    if "input_ids" in batch:
        b, s = batch["input_ids"].shape
        return replicas * model_flops(cfg, b, (s, s))
    b, s = batch["src_ids"].shape
    return replicas * model_flops(cfg, b, (s, batch["tgt_in_ids"].shape[1]))


def gpu_peak_tflops(name: str) -> float | None:
    """The table's bf16 peak for a CUDA device name, or None if it is not listed."""
    return next((peak for key, peak in GPU_PEAK_TFLOPS if key.lower() in name.lower()), None)


def measure_cpu_peak_tflops(size: int = 512, trials: int = 5, seconds: float = 0.06) -> float:
    """Best matmul rate of this process on the CPU (TFLOP/s) with its current thread count: the fastest
    single (size x size) fp32 matmul over ``trials`` timed windows of ``seconds``, so that a passing load
    lowers at most some windows."""
    a = torch.randn(size, size, dtype=torch.float32, device="cpu")
    b = torch.randn(size, size, dtype=torch.float32, device="cpu")
    torch.mm(a, b)  # warm-up
    best = 0.0
    for _ in range(trials):
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * size ** 3 / (time.perf_counter() - start) / 1e12)
        time.sleep(seconds / 2)
    return best


def device_peak_tflops(override: float = 0.0, device: torch.device | str = "cpu") -> tuple[float, str]:
    """(peak TFLOP/s of ``device``, where it came from): the override, the GPU table or a CPU measurement."""
    device = torch.device(device)
    if override > 0:
        return override, "metrics.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name)
        if peak is not None:
            return peak, f"table ({name})"
        return 0.0, f"unknown GPU {name!r}: set metrics.peak_tflops"
    return measure_cpu_peak_tflops(), (f"fastest 512x512 fp32 CPU matmul in 5 trials at start, "
                                      f"{torch.get_num_threads()} threads")


def memory_mb(device: torch.device | str = "cpu") -> float:
    """Peak memory of this rank in MB: CUDA max allocated on a GPU, else the process's peak resident set."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
