"""Model FLOPs per step, device peak FLOP/s and memory, for MFU and the memory column.

FLOPs are counted the usual way (Megatron / PaLM): a matmul of (m, k) x (k, n) costs 2mkn forward and twice
that backward, so every weight used once per token costs 6 FLOPs per token per step; attention adds QK^T and
(softmax)V, 4·Tq·Tk·H forward per layer and batch row, times 3 for training. Embedding lookups, norms, softmax
and the loss are not counted; padded positions are (the matmuls run on them). This is the one FLOP model: the
trainer's MFU and the planner (``paratrain.plan``) use it.
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


def layer_flops(m: ModelConfig, decoder: bool, batch: int, lengths: tuple[int, int] | None = None,
                experts: bool = False) -> dict:
    """Forward FLOPs of one layer on ``batch`` sequences: its weight matmuls (``dense``) and attention's QK^T and
    (softmax)V (``core``). ``lengths``: (source, target), (seq, seq) for GPT; default ``ModelConfig.lengths``. A
    decoder layer's cross-attention K and V run over the source (the memory); a mixture-of-experts layer (``experts``)
    counts its router and the ``num_experts_chosen`` experts a token goes to."""
    h, f = m.hidden_size, m.ffn_hidden_size
    q, kv = m.num_heads * m.head_size, m.kv_heads * m.head_size  # query and key/value widths (grouped heads)
    source, target = lengths or m.lengths
    own = target if decoder else source
    n = batch * own
    if experts:  # the router and the k experts a token runs through
        moe = m.moe_config
        f = f * moe.num_experts_chosen + moe.expert_num / 2
    dense = 2 * n * (2 * h * q + 2 * h * kv + m.spec.ffn_matrices * h * f)
    core = 4 * n * own * q
    if decoder:
        dense += 2 * n * 2 * h * h + 2 * batch * source * 2 * h * h  # cross-attention q, out | k, v
        core += 4 * n * source * h
    return {"dense": dense, "core": core}


def model_flops(m: ModelConfig, batch: int, lengths: tuple[int, int] | None = None) -> float:
    """Training FLOPs (forward + backward = 3 x forward, no recompute) of one step on ``batch`` sequences;
    ``lengths`` as in ``layer_flops``. Layers plus the output head over the target tokens."""
    forward = sum(n * sum(layer_flops(m, decoder, batch, lengths, experts).values())
                  for (decoder, experts), n in m.layer_counts().items())
    forward += 2 * batch * (lengths or m.lengths)[1] * m.hidden_size * m.vocab_size
    return float(3 * forward)


def gpt_flops(cfg: ModelConfig, batch_size: int, seq_length: int) -> float:
    """Training FLOPs of the decoder-only model on a (batch, seq) batch."""
    return model_flops(cfg, batch_size, (seq_length, seq_length))


def transformer_flops(cfg: ModelConfig, batch_size: int, src_length: int, tgt_length: int) -> float:
    """Training FLOPs of the encoder-decoder on a (batch, src) x (batch, tgt) batch."""
    return model_flops(cfg, batch_size, (src_length, tgt_length))


def batch_flops(cfg: ModelConfig, batch: dict[str, torch.Tensor], replicas: int = 1) -> float:
    """Training FLOPs of one step on ``batch`` (this rank's share) times ``replicas`` data-parallel ranks."""
    if "images" in batch:
        return 0.0  # convolution FLOPs are not counted: no MFU for the ResNet example
    if "input_ids" in batch:
        b, s = batch["input_ids"].shape
        return replicas * gpt_flops(cfg, b, s)
    b, s = batch["src_ids"].shape
    return replicas * transformer_flops(cfg, b, s, batch["tgt_in_ids"].shape[1])


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
