"""MindSpore's parallel configs for the blocks (``TransformerOpParallelConfig`` is paratrain's ``ParallelConfig``,
checked when given: ``paratrain.context``), their defaults, and the checks every block shares, by the rules
``paratrain train`` applies to the same settings (``paratrain.config_rules``)."""
from __future__ import annotations

import dataclasses

import torch

from paratrain import config
from paratrain.config import ParallelConfig
# the configs as a script builds them (paratrain.context); MindSpore users import them from nn.transformer
from paratrain.context import (EmbeddingOpParallelConfig, MoEConfig, OpParallelConfig,  # noqa: F401
                               TransformerOpParallelConfig, TransformerRecomputeConfig)
from paratrain.config_rules import (divisible_problems, expert_split_problems, moe_problems, parallel_field_problem,
                                   parallel_problems, value_problem)
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
    view = config.EmbeddingOpParallelConfig if embedding else config.OpParallelConfig
    if isinstance(parallel_config, ParallelConfig):
        _check_parallel(owner, parallel_config)
        return parallel_config.embedding_dp_mp_config if embedding else parallel_config.dp_mp_config
    if isinstance(parallel_config, view):
        _check_parallel(owner, parallel_config)
        return parallel_config
    raise UserError(f"{owner}: parallel_config must be an {view.__name__} or a TransformerOpParallelConfig, "
                    f"got {type(parallel_config).__name__}")


def _check_parallel(owner: str, parallel_config) -> None:
    """Refuse the settings of a parallel config or view (one built as ``TransformerOpParallelConfig`` is checked
    when given; a ``paratrain.config`` one here) by ``paratrain train``'s rules for ``[parallel]``."""
    where = f"{owner}: parallel_config."
    problems = (parallel_problems(parallel_config, where) if isinstance(parallel_config, ParallelConfig) else
                [q for f in dataclasses.fields(parallel_config)
                 if (q := parallel_field_problem(f.name, getattr(parallel_config, f.name), where))])
    if problems:
        raise UserError(problems[0])


def check_sizes(owner: str, least: int = 1, **sizes: int) -> None:
    """Refuse sizes that are not integers of at least ``least`` (``paratrain train``'s rule for the model's sizes),
    naming each."""
    for name, value in sizes.items():
        problem = value_problem(name, value, 1) or (f"{name}={value} must be at least {least}" if value < least
                                                    else None)
        if problem:
            raise UserError(f"{owner}: {problem}")


def check_divisible(owner: str, model_parallel: int, **sizes: int) -> None:
    """Refuse sizes that are not positive integers (``check_sizes``) or that the tensor-parallel split cannot cut
    evenly, naming each argument."""
    check_sizes(owner, **sizes)
    problems = divisible_problems(sizes, model_parallel, "", "parallel_config.")
    if problems:
        raise UserError(f"{owner}: {'; '.join(problems)}")


def refuse_unsupported(owner: str, use_past: bool = False) -> None:
    """Options of MindSpore's blocks that paratrain does not run, refused by name."""
    if use_past:
        raise UserError(f"{owner}: use_past=True (incremental decoding with saved keys and values) is not "
                        f"supported; build the block with use_past=False")


def check_moe(owner: str, moe_config: config.MoEConfig, parallel_config) -> None:
    """Refuse a MoEConfig the block cannot build (changed since it was made, or split over expert_parallel ranks
    that do not divide its experts), by ``paratrain train``'s rules for ``model.moe``."""
    if not isinstance(moe_config, config.MoEConfig):
        raise UserError(f"{owner}: moe_config must be a MoEConfig, got {type(moe_config).__name__}")
    if isinstance(parallel_config, ParallelConfig):
        _check_parallel(owner, parallel_config)
    problems = moe_problems(vars(moe_config), f"{owner}: moe_config.") or expert_split_problems(
        moe_config.expert_num, getattr(parallel_config, "expert_parallel", 1), None, f"{owner}: moe_config.",
        "parallel_config.")
    if problems:
        raise UserError(problems[0])


def check_rate(owner: str, **rates: float) -> None:
    """Refuse dropout rates outside [0, 1), naming each."""
    for name, value in rates.items():
        problem = value_problem(name, value, 0.0)
        if problem:
            raise UserError(f"{owner}: {problem}")
        if not 0 <= value < 1:
            raise UserError(f"{owner}: {name}={value} is outside [0, 1): use a probability such as 0.1, or 0 for none")
