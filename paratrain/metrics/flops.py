"""Model FLOPs per step, device peak FLOP/s and memory, for MFU and the memory column.

FLOPs are counted the usual way (Megatron / PaLM): a matmul of (m, k) x (k, n)
costs 2mkn forward and twice that backward, so every weight used once per token
costs 6 FLOPs per token per step; attention adds QK^T and (softmax)V, 4·Tq·Tk·H
forward per layer and batch row, times 3 for training. Embedding lookups, norms,
softmax and the loss are not counted; padded positions are (the matmuls run on them).
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


def transformer_flops(cfg: ModelConfig, batch_size: int, src_length: int, tgt_length: int) -> float:
    """Training FLOPs (forward + backward) of the encoder-decoder on a (batch, src) x (batch, tgt) batch."""
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    encoder = cfg.encoder_layers * (4 * h * h + 2 * h * f)  # q, k, v, out + ffn weights used per source token
    decoder = cfg.decoder_layers * (8 * h * h + 2 * h * f) + h * v  # + cross-attention and the head
    dense = 6 * batch_size * (src_length * encoder + tgt_length * decoder)
    attention = 12 * batch_size * h * (cfg.encoder_layers * src_length ** 2
                                       + cfg.decoder_layers * (tgt_length ** 2 + tgt_length * src_length))
    return float(dense + attention)


def gpt_flops(cfg: ModelConfig, batch_size: int, seq_length: int) -> float:
    """Training FLOPs of the decoder-only model on a (batch, seq) batch."""
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    per_token = cfg.decoder_layers * (4 * h * h + 2 * h * f) + h * v
    return float(6 * batch_size * seq_length * per_token
                 + 12 * batch_size * h * cfg.decoder_layers * seq_length ** 2)


def batch_flops(cfg: ModelConfig, batch: dict[str, torch.Tensor], replicas: int = 1) -> float:
    """Training FLOPs of one step on ``batch`` (this rank's share) times ``replicas`` data-parallel ranks."""
    if "images" in batch:
        return 0.0  # convolution FLOPs are not counted: no MFU for the ResNet example
    if "input_ids" in batch:
        b, s = batch["input_ids"].shape
        return replicas * gpt_flops(cfg, b, s)
    b, s = batch["src_ids"].shape
    return replicas * transformer_flops(cfg, b, s, batch["tgt_in_ids"].shape[1])


def config_flops(cfg: ModelConfig, global_batch_size: int) -> float:
    """Training FLOPs of one step at the configured (maximum) sequence lengths."""
    if cfg.kind == "gpt":
        return gpt_flops(cfg, global_batch_size, cfg.seq_length)
    return transformer_flops(cfg, global_batch_size, cfg.src_seq_length, cfg.tgt_seq_length)


def gpu_peak_tflops(name: str) -> float | None:
    """The table's bf16 peak for a CUDA device name, or None if it is not listed."""
    return next((peak for key, peak in GPU_PEAK_TFLOPS if key.lower() in name.lower()), None)


def measure_cpu_peak_tflops(size: int = 512, dtype: torch.dtype = torch.float32, seconds: float = 0.3) -> float:
    """Best matmul rate of this process on the CPU (TFLOP/s) with its current thread count."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up
    best, deadline = 0.0, time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        torch.mm(a, b)
        elapsed = time.perf_counter() - start
        best = max(best, 2 * size ** 3 / elapsed / 1e12)
        if time.perf_counter() > deadline:
            return best


def device_peak_tflops(override: float = 0.0) -> tuple[float, str]:
    """(peak TFLOP/s of this rank's device, where it came from): the override, the GPU table or a CPU measurement."""
    if override > 0:
        return override, "metrics.peak_tflops"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        peak = gpu_peak_tflops(name)
        if peak is not None:
            return peak, f"table ({name})"
        return 0.0, f"unknown GPU {name!r}: set metrics.peak_tflops"
    return measure_cpu_peak_tflops(), "measured CPU matmul"


def memory_mb() -> float:
    """Peak memory of this rank in MB: CUDA max allocated, else the process's peak resident set."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def memory_kind() -> str:
    return "cuda_max_allocated" if torch.cuda.is_available() else "rss_peak"


__all__ = ["GPU_PEAK_TFLOPS", "batch_flops", "config_flops", "device_peak_tflops", "gpt_flops", "memory_mb",
           "measure_cpu_peak_tflops", "transformer_flops"]
