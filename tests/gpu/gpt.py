"""The small GPT the GPU tests train, and what a worker reports about a trainer's tensors."""
from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from conftest import tiny_config

# head_dim 64 and no dropout: what flash attention runs; seq_length divisible by model_parallel=2
GPT = {"kind": "gpt", "vocab_size": 512, "hidden_size": 256, "num_heads": 4, "ffn_hidden_size": 1024,
       "decoder_layers": 4, "seq_length": 256, "hidden_dropout": 0.0, "attention_dropout": 0.0}


# the Llama family's of the same sizes: grouped kv heads (2 of 64), a SwiGLU feed-forward
LLAMA = {**GPT, "kind": "llama", "num_kv_heads": 2, "ffn_hidden_size": 768}


def gpt_config(run_dir: Path, steps: int, parallel: dict | None = None, model: dict = GPT, **sections):
    """bf16 GPT (or ``model``: ``LLAMA``) on the synthetic Markov chain, 16 x 256 tokens a step, logged every 4
    steps."""
    return tiny_config(run={"dir": str(run_dir)}, model=model, parallel=parallel or {},
                       train={"steps": steps, "global_batch_size": 16, "lr": 1e-3, "warmup_steps": 2,
                              "mixed_precision": "bf16"},
                       metrics={"log_steps": 4, "progress": False}, **sections)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def devices(tensors) -> set[str]:
    """The devices ("cuda:0", ...) that hold these tensors' local parts."""
    return {str(local(t).device) for t in tensors}


def numbers(history: list[dict], keys=("step", "loss", "grad_norm", "memory_mb")) -> list[dict]:
    """The records' values as plain floats (a CUDA tensor must not reach the pytest process)."""
    return [{k: float(r[k]) for k in keys} for r in history]
