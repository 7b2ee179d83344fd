"""MindSpore's parallel configs for the blocks (``TransformerOpParallelConfig`` is paratrain's
``ParallelConfig``), their defaults, and the checks every block shares."""
from __future__ import annotations

import torch

# the configs live in paratrain.config; MindSpore users import them from nn.transformer, so they are here too
from paratrain.config import (EmbeddingOpParallelConfig, MoEConfig, OpParallelConfig, ParallelConfig,  # noqa: F401
                              TransformerOpParallelConfig, TransformerRecomputeConfig)
from paratrain.device import DTYPES
from paratrain.errors import UserError

default_transformer_config = TransformerOpParallelConfig()
default_dpmp_config = OpParallelConfig()
default_embedding_parallel_config = EmbeddingOpParallelConfig()
default_moe_config = MoEConfig()


def to_dtype(value, name: str, owner: str) -> torch.dtype:
    """A dtype argument (``torch.float16`` or ``"float16"``/``"float32"``/``"bfloat16"``) as a torch dtype."""
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    if value in (torch.float32, torch.float16, torch.bfloat16):
        return value
    raise UserError(f"{owner}: {name}={value!r} is not a supported dtype: use torch.float32, torch.float16, "
                    f"torch.bfloat16 or their names 'float32', 'float16', 'bfloat16'")


def op_config(parallel_config, owner: str, embedding: bool = False) -> OpParallelConfig:
    """The per-operator view (data_parallel, model_parallel, and vocab_emb_dp with ``embedding``) of any
    of the parallel configs."""
    view = EmbeddingOpParallelConfig if embedding else OpParallelConfig
    if isinstance(parallel_config, ParallelConfig):
        return parallel_config.embedding_dp_mp_config if embedding else parallel_config.dp_mp_config
    if isinstance(parallel_config, view):
        return parallel_config
    raise UserError(f"{owner}: parallel_config must be an {view.__name__} or a TransformerOpParallelConfig, "
                    f"got {type(parallel_config).__name__}")


def check_divisible(owner: str, model_parallel: int, **sizes: int) -> None:
    """Refuse sizes the tensor-parallel split cannot cut evenly, naming each argument."""
    bad = [f"{name}={value}" for name, value in sizes.items() if value % model_parallel]
    if bad:
        raise UserError(f"{owner}: {', '.join(bad)} must be divisible by parallel_config.model_parallel="
                        f"{model_parallel}: use multiples of {model_parallel} or a smaller model_parallel")


def refuse_unsupported(owner: str, use_past: bool = False) -> None:
    """Options of MindSpore's blocks that paratrain does not run, refused by name."""
    if use_past:
        raise UserError(f"{owner}: use_past=True (incremental decoding with saved keys and values) is not "
                        f"supported; build the block with use_past=False")


def check_moe(owner: str, moe_config: MoEConfig, parallel_config) -> None:
    """Refuse a MoEConfig the block cannot build, naming the numbers."""
    expert_parallel = getattr(parallel_config, "expert_parallel", 1)
    if not 1 <= moe_config.num_experts_chosen <= max(moe_config.expert_num, 1):
        raise UserError(f"{owner}: moe_config.num_experts_chosen={moe_config.num_experts_chosen} must be in "
                        f"1..expert_num={moe_config.expert_num}")
    if moe_config.capacity_factor <= 0:
        raise UserError(f"{owner}: moe_config.capacity_factor={moe_config.capacity_factor} leaves the experts no "
                        f"capacity: use a positive factor such as 1.1")
    if moe_config.expert_num % expert_parallel:
        raise UserError(f"{owner}: moe_config.expert_num={moe_config.expert_num} is not divisible by "
                        f"parallel_config.expert_parallel={expert_parallel}: use a multiple of {expert_parallel}")


def check_rate(owner: str, **rates: float) -> None:
    """Refuse dropout rates outside [0, 1), naming each."""
    for name, value in rates.items():
        if not 0 <= value < 1:
            raise UserError(f"{owner}: {name}={value} is outside [0, 1): use a probability such as 0.1, or 0 for none")
