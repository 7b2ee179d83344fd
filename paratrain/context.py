"""MindSpore's auto-parallel context (``set_auto_parallel_context`` and friends, ``ParallelMode``) and
``set_context``.

MindSpore's config classes a script builds (``TransformerOpParallelConfig``, ``OpParallelConfig``,
``EmbeddingOpParallelConfig``, ``MoEConfig``, ``TransformerRecomputeConfig``) are ``paratrain.config``'s, checked
when given by the rules ``paratrain train`` applies to the same settings (``paratrain.config_rules``).

``parallel_config_for`` completes the ``TransformerOpParallelConfig`` of a user's blocks (none: data parallel over
every rank) with what only the context says: ``enable_parallel_optimizer`` and its ``optimizer_level`` (ZeRO stages
1..3), ``pipeline_stages``, ``pipeline_config`` and ``parallel_mode`` (``stand_alone``: one process;
``data_parallel``: no model or pipeline parallelism; the others: ``paratrain.train.parallel_modes``). Where both state
a value they must agree: a contradiction is refused naming both, and an option paratrain cannot honour is refused when
set, with the reason.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from paratrain import config as settings
from paratrain.config import DERIVED, ConfigError, ParallelConfig
from paratrain.config_rules import (expert_split_problems, moe_problems, parallel_field_problem, parallel_problems,
                                   type_problems, value_problem, world_size_problems)
from paratrain.errors import UserError


class _CheckedWhenSet:
    """Base of the parallel configs a script builds: each setting is checked when it is given or set later, by the
    rule ``paratrain train`` applies to the same setting of ``[parallel]`` (``config_rules.parallel_field_problem``);
    a bad one is refused in one line naming it."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dataclass_fields__:
            problem = parallel_field_problem(name, value, f"{type(self).__name__}.")
            if problem:
                raise ConfigError([problem])
        super().__setattr__(name, value)


@dataclass
class OpParallelConfig(_CheckedWhenSet, settings.OpParallelConfig):
    """MindSpore's per-operator view (``data_parallel``, ``model_parallel``), checked when given."""


@dataclass
class EmbeddingOpParallelConfig(_CheckedWhenSet, settings.EmbeddingOpParallelConfig):
    """MindSpore's embedding view (``vocab_emb_dp=False`` shards vocab rows over model_parallel), checked when
    given."""


@dataclass(init=False)
class TransformerOpParallelConfig(_CheckedWhenSet, ParallelConfig):
    """``paratrain.config.ParallelConfig`` under MindSpore's name, as a script builds it: MindSpore's arguments in
    MindSpore's order and with its defaults (``gradient_aggregation_group=4``: 4 communication groups of layers;
    ``[parallel]``'s default 0 is one per layer), then any other ``ParallelConfig`` setting by keyword.
    ``pipeline_segment`` is ``virtual_pipeline_stage`` (model chunks per pipeline rank). ``data_parallel`` not
    given is derived from the world size. Every setting is checked when given and when set later, and the
    settings together when built (``config_rules.parallel_problems``: optimizer offload needs a zero stage...)."""

    GROUPS_MAY_EXCEED_LAYERS = True

    def __init__(self, data_parallel=DERIVED, model_parallel=1, expert_parallel=1, pipeline_stage=1,
                 pipeline_segment=1, micro_batch_num=1, recompute="none", optimizer_shard=False,
                 gradient_aggregation_group=4, vocab_emb_dp=True, **settings_by_name):
        virtual = settings_by_name.pop("virtual_pipeline_stage", pipeline_segment)
        if pipeline_segment not in (1, virtual):
            raise UserError(f"{type(self).__name__}(pipeline_segment={pipeline_segment}, virtual_pipeline_stage="
                            f"{virtual}): both name the model chunks per pipeline rank; give one")
        super().__init__(data_parallel=data_parallel, model_parallel=model_parallel, expert_parallel=expert_parallel,
                         pipeline_stage=pipeline_stage, virtual_pipeline_stage=virtual,
                         micro_batch_num=micro_batch_num, recompute=recompute, optimizer_shard=optimizer_shard,
                         gradient_aggregation_group=gradient_aggregation_group, vocab_emb_dp=vocab_emb_dp,
                         **settings_by_name)
        ConfigError.raise_any(parallel_problems(self, f"{type(self).__name__}."))

    @property
    def pipeline_segment(self) -> int:
        """MindSpore's name for ``virtual_pipeline_stage``."""
        return self.virtual_pipeline_stage

    @pipeline_segment.setter
    def pipeline_segment(self, value: int) -> None:
        self.virtual_pipeline_stage = value


@dataclass
class MoEConfig(settings.MoEConfig):
    """MindSpore's ``MoEConfig`` (``paratrain.config.MoEConfig``), checked when built by ``paratrain train``'s rules
    for ``model.moe`` (``config_rules.moe_problems``). MindSpore's communication options ``group_wise_a2a``,
    ``comp_comm_parallel`` and ``comp_comm_parallel_degree`` are checked and taken; they change how MindSpore
    overlaps the experts' all-to-all, not the result, and here they change nothing. paratrain's ``every`` is
    keyword-only, after MindSpore's arguments in their positional order."""

    every: int = dataclasses.field(default=1, kw_only=True)
    group_wise_a2a: bool = False
    comp_comm_parallel: bool = False
    comp_comm_parallel_degree: int = 2

    def __post_init__(self):
        problems = moe_problems(vars(self), "MoEConfig.")
        problems += [q for name in COMMUNICATION_OPTIONS
                     if (q := value_problem(f"MoEConfig.{name}", getattr(self, name), MOE_COMMUNICATION[name]))]
        if not problems and self.comp_comm_parallel_degree < 1:
            problems.append(f"MoEConfig.comp_comm_parallel_degree={self.comp_comm_parallel_degree} must be positive")
        ConfigError.raise_any(problems)


COMMUNICATION_OPTIONS = ("group_wise_a2a", "comp_comm_parallel", "comp_comm_parallel_degree")
MOE_COMMUNICATION = {name: MoEConfig.__dataclass_fields__[name].default for name in COMMUNICATION_OPTIONS}


@dataclass
class TransformerRecomputeConfig(settings.TransformerRecomputeConfig):
    """MindSpore's recompute switches (``paratrain.config.TransformerRecomputeConfig``), each a bool, checked when
    built (``config_rules.type_problems``)."""

    def __post_init__(self):
        ConfigError.raise_any(type_problems(self, "TransformerRecomputeConfig."))


class ParallelMode:
    """MindSpore's parallel modes (the strings ``set_auto_parallel_context(parallel_mode=...)`` takes)."""

    STAND_ALONE = "stand_alone"
    DATA_PARALLEL = "data_parallel"
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"
    AUTO_PARALLEL = "auto_parallel"
    HYBRID_PARALLEL = "hybrid_parallel"
    MODE_LIST = [STAND_ALONE, DATA_PARALLEL, HYBRID_PARALLEL, SEMI_AUTO_PARALLEL, AUTO_PARALLEL]


# what get_auto_parallel_context answers for an option never set: paratrain's behaviour
DEFAULTS: dict[str, Any] = {
    "parallel_mode": ParallelMode.STAND_ALONE, "device_num": 1, "global_rank": 0, "gradients_mean": False,
    "full_batch": True, "dataset_strategy": "full_batch", "loss_repeated_mean": True, "gradient_fp32_sync": True,
    "enable_parallel_optimizer": False, "parallel_optimizer_config": {}, "pipeline_stages": 1,
    "parameter_broadcast": False, "enable_alltoall": False, "search_mode": "dynamic_programming",
    "strategy_ckpt_save_file": "", "strategy_ckpt_load_file": "", "pipeline_config": {},
}
# MindSpore's pipeline_scheduler, by pipeline_interleave -> paratrain's parallel.pipeline_schedule
PIPELINE_SCHEDULERS = {False: {"1f1b": "1f1b", "gpipe": "gpipe"},
                       True: {"1f1b": "interleaved_1f1b", "gpipe": "looped_bfs", "zero_bubble_v": "zbv_zero_bubble"}}
SEARCH_MODES = ("dynamic_programming", "sharding_propagation")
CHOICES = {"parallel_mode": ParallelMode.MODE_LIST, **dict.fromkeys(("search_mode", "auto_parallel_search_mode"),
                                                                  SEARCH_MODES)}
OPTIMIZER_CONFIG_KEYS = ("gradient_accumulation_shard", "parallel_optimizer_threshold", "optimizer_weight_shard_size",
                         "optimizer_level")
OPTIMIZER_LEVELS = {"level1": 1, "level2": 2, "level3": 3}  # what is sharded: optimizer state, + gradients, + weights
REFUSED = {  # options that exist in MindSpore and have no counterpart here: why
    "strategy_ckpt_config": "give the files as strategy_ckpt_save_file and strategy_ckpt_load_file",
    **dict.fromkeys(("all_reduce_fusion_config", "comm_fusion"), "communication buckets are set by "
                    "TransformerOpParallelConfig.gradient_aggregation_group or a block's set_comm_fusion(k)"),
}

# in data_parallel mode (paratrain.train.Model) gradients_mean=False sums the ranks' gradients and
# parameter_broadcast gives every rank rank 0's initial parameters
BOOL_OPTIONS = ("enable_parallel_optimizer", "gradients_mean", "parameter_broadcast", "full_batch",
                "loss_repeated_mean", "gradient_fp32_sync", "enable_alltoall")
ONE_VALUE = {  # options paratrain honours with one value only: (that value, why)
    "full_batch": (True, "every rank gives Model.train the whole global batch and keeps its own rows; a rank "
                         "reading only its rows is not offered"),
    "dataset_strategy": ("full_batch", "only 'full_batch' is offered: every rank reads the whole global batch and "
                                       "keeps its own rows"),
    "loss_repeated_mean": (True, "the loss is always the mean over the whole global batch"),
    "gradient_fp32_sync": (True, "gradients are always reduced in float32"),
    "enable_alltoall": (False, "no layout here uses all-to-all"),
}

_values: dict[str, Any] = {}  # the options set, as given


def _refuse(key: str, value: Any, why: str) -> UserError:
    return UserError(f"set_auto_parallel_context({key}={value!r}): {why}")


def _bool(key: str, value: Any) -> bool:
    problem = value_problem(key, value, False)
    if problem:
        raise _refuse(key, value, problem)
    return value


def _check(key: str, value: Any) -> Any:
    """``value`` if paratrain honours option ``key`` with it (checks against other options wait for
    ``parallel_config_for``); a UserError with the reason otherwise."""
    if key in REFUSED:
        raise _refuse(key, value, REFUSED[key])
    if key not in DEFAULTS and key not in CHOICES:
        raise _refuse(key, value, f"unknown option; known: {', '.join(sorted([*DEFAULTS, *REFUSED]))}")
    if key in CHOICES and value not in CHOICES[key]:
        why = "" if key == "parallel_mode" else (" (dynamic_programming is paratrain's search over a cost model of "
                                                 "bytes moved and memory per device)")
        raise _refuse(key, value, f"expected one of {', '.join(CHOICES[key])}{why}")
    if key in ("strategy_ckpt_save_file", "strategy_ckpt_load_file") and not isinstance(value, str):
        raise _refuse(key, value, "expected a file path")
    if key == "pipeline_stages":  # the blocks' pipeline_stage, by paratrain train's rule for it
        problem = parallel_field_problem("pipeline_stage", value, "")
        if problem:
            raise _refuse(key, value, problem)
    if key in ("device_num", "global_rank"):
        from paratrain import communication

        world = key == "device_num"
        if value_problem(key, value, 1) or value < int(world):
            raise _refuse(key, value, "expected a positive integer" if world else "expected a rank")
        actual = communication.get_group_size() if world else communication.get_rank()
        if value != actual:
            raise _refuse(key, value, f"this job's {'world size' if world else 'rank'} is {actual}: it follows from "
                                      f"the launch (paratrain launch --nproc-per-node)")
    if key in BOOL_OPTIONS:
        _bool(key, value)
    if key in ONE_VALUE and value != ONE_VALUE[key][0]:
        raise _refuse(key, value, ONE_VALUE[key][1])
    if key == "parallel_optimizer_config":
        return _optimizer_config(value)
    if key == "pipeline_config":
        return _pipeline_config(value)
    return value


def _optimizer_config(value: Any) -> dict:
    key = "parallel_optimizer_config"
    if not isinstance(value, dict) or set(value) - set(OPTIMIZER_CONFIG_KEYS):
        raise _refuse(key, value, f"expected a dict with keys among {', '.join(OPTIMIZER_CONFIG_KEYS)}")
    _bool(f"{key}['gradient_accumulation_shard']", value.get("gradient_accumulation_shard", False))
    if value.get("optimizer_level", "level1") not in OPTIMIZER_LEVELS:
        raise _refuse(key, value, f"optimizer_level must be one of {', '.join(OPTIMIZER_LEVELS)}")
    if value.get("parallel_optimizer_threshold", 0) != 0:
        raise _refuse(key, value, "every parameter is sharded whatever its size (FSDP): leave "
                                  "parallel_optimizer_threshold out")
    if value.get("optimizer_weight_shard_size", -1) != -1:
        raise _refuse(key, value, "the optimizer is sharded over all data-parallel ranks: leave "
                                  "optimizer_weight_shard_size out")
    return dict(value)


def _pipeline_config(value: Any) -> dict:
    key = "pipeline_config"
    if not isinstance(value, dict) or set(value) - {"pipeline_interleave", "pipeline_scheduler"}:
        raise _refuse(key, value, "expected a dict with keys among pipeline_interleave, pipeline_scheduler")
    interleave = _bool(f"{key}['pipeline_interleave']", value.get("pipeline_interleave", False))
    scheduler = value.get("pipeline_scheduler", "1f1b")
    if scheduler not in PIPELINE_SCHEDULERS[interleave]:
        offered = ", ".join(f"{s!r}" for s in PIPELINE_SCHEDULERS[interleave])
        raise _refuse(key, value, f"with pipeline_interleave={interleave} the schedulers offered are {offered} "
                                  f"(torch.distributed.pipelining's; seqpipe and seqvpp have no counterpart there)")
    return {"pipeline_interleave": interleave, "pipeline_scheduler": scheduler}


def set_auto_parallel_context(**kwargs) -> None:
    """Set MindSpore's auto-parallel options; each takes effect in ``paratrain.train.Model`` or is refused
    here (a UserError with the reason). Nothing is set when one option is refused."""
    checked = {key: _check(key, value) for key, value in kwargs.items()}
    if "auto_parallel_search_mode" in checked:  # MindSpore's older name
        checked["search_mode"] = checked.pop("auto_parallel_search_mode")
    _values.update(checked)


def _lookup(owner: str, key: str, defaults: dict[str, Any], values: dict[str, Any]) -> Any:
    """Option ``key`` of ``owner``'s: its value in ``values``, else its default; a UserError for an unknown one."""
    if key not in defaults:
        raise UserError(f"{owner}({key!r}): unknown option; known: {', '.join(sorted(defaults))}")
    return values.get(key, defaults[key])


def get_auto_parallel_context(key: str) -> Any:
    """The value of option ``key``: as set, else what paratrain does."""
    return _lookup("get_auto_parallel_context", key, DEFAULTS, _values)


def reset_auto_parallel_context() -> None:
    """Forget every option set."""
    _values.clear()


# MindSpore's set_algo_parameters options (how its AUTO_PARALLEL search picks strategies) and their defaults;
# paratrain's search (paratrain.train.parallel_modes.auto) reads none of them; under SEMI_AUTO_PARALLEL strategies
# are given
ALGO_DEFAULTS: dict[str, Any] = {"fully_use_devices": True, "elementwise_op_strategy_follow": False,
                                 "enable_algo_approxi": False, "algo_approxi_epsilon": 0.1,
                                 "tensor_slice_align_enable": False, "tensor_slice_align_size": 16}
_algo_values: dict[str, Any] = {}


def set_algo_parameters(**kwargs) -> None:
    """MindSpore's ``set_algo_parameters``: its options are checked and kept (``get_algo_parameters``) and change
    nothing here: they tune MindSpore's strategy search, not paratrain's."""
    for key, value in kwargs.items():
        if key not in ALGO_DEFAULTS:
            raise UserError(f"set_algo_parameters({key}={value!r}): unknown option; known: "
                            f"{', '.join(sorted(ALGO_DEFAULTS))}")
        if key == "algo_approxi_epsilon":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1
        elif key == "tensor_slice_align_size":
            ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 1024
        else:
            ok = isinstance(value, bool)
        if not ok:
            want = {"algo_approxi_epsilon": "a number in (0, 1]", "tensor_slice_align_size": "an int in 1..1024"}
            raise UserError(f"set_algo_parameters({key}={value!r}): expected {want.get(key, 'True or False')}")
    _algo_values.update(kwargs)


def get_algo_parameters(key: str) -> Any:
    """The value of ``set_algo_parameters`` option ``key``: as set, else MindSpore's default."""
    return _lookup("get_algo_parameters", key, ALGO_DEFAULTS, _algo_values)


def reset_algo_parameters() -> None:
    """Forget every ``set_algo_parameters`` option set."""
    _algo_values.clear()


def _set_multi_subgraphs(multi_subgraph: bool = True) -> None:
    """MindSpore's private ``_set_multi_subgraphs`` (its graph compiler's switch), accepted as ports call it; a net
    here is one PyTorch module whatever it is set to."""
    if not isinstance(multi_subgraph, bool):
        raise UserError(f"_set_multi_subgraphs({multi_subgraph!r}): expected True or False")


WHERE = "TransformerOpParallelConfig."  # how the rules of paratrain.config_rules name the blocks' settings
LAYOUT_FIELDS = ("data_parallel", "model_parallel", "pipeline_stage", "micro_batch_num", "effective_zero_stage")


def parallel_config_for(configs: list[ParallelConfig], world_size: int, segments: int = 1) -> ParallelConfig:
    """The layout of a user's net on ``world_size`` ranks: a copy of its blocks' config (``configs``; none:
    data parallel over every rank) completed by the context, with ``segments`` virtual stages per pipeline
    rank (the cells' ``pipeline_segment``); raises ConfigError listing every contradiction."""
    # the rules below multiply and divide these sizes
    ConfigError.raise_any(list(dict.fromkeys(q for c in configs for q in parallel_problems(c, WHERE))))
    problems = []
    for other in configs[1:]:
        differs = [f for f in LAYOUT_FIELDS if getattr(other, f) != getattr(configs[0], f)]
        if differs:
            problems.append("the net's blocks were given parallel configs that differ in " + ", ".join(
                f"{f} ({getattr(configs[0], f)} and {getattr(other, f)})" for f in differs) + ": give them one")
    config = dataclasses.replace(configs[0]) if configs else ParallelConfig()
    mode, stages = _values.get("parallel_mode"), _values.get("pipeline_stages")
    if mode == ParallelMode.STAND_ALONE and world_size > 1:
        problems.append(f"parallel_mode='stand_alone' runs one process, but the job has {world_size}: use "
                        f"semi_auto_parallel (or data_parallel)")
    deepest = max(config.pipeline_stage, stages or 1)
    if mode == ParallelMode.DATA_PARALLEL and (config.model_parallel > 1 or deepest > 1):
        problems.append(f"parallel_mode='data_parallel' with model_parallel={config.model_parallel} and "
                        f"pipeline_stage={deepest}: use semi_auto_parallel for model or pipeline parallelism")
    if stages and config.pipeline_stage == 1:
        config.pipeline_stage = stages
    elif stages not in (None, config.pipeline_stage):
        problems.append(f"set_auto_parallel_context(pipeline_stages={stages}) contradicts the blocks' "
                        f"TransformerOpParallelConfig(pipeline_stage={config.pipeline_stage}): make them equal")
    pipeline = _values.get("pipeline_config", {})
    interleave = pipeline.get("pipeline_interleave", False)
    if segments > 1 and not interleave:
        problems.append(f"the net's cells have pipeline_segment 0..{segments - 1}, but the pipeline is not "
                        f"interleaved: set_auto_parallel_context(pipeline_config={{'pipeline_interleave': True}})")
    config.pipeline_schedule = PIPELINE_SCHEDULERS[interleave][pipeline.get("pipeline_scheduler", "1f1b")]
    config.virtual_pipeline_stage = segments
    if config.pipeline_schedule == "zbv_zero_bubble" and segments != 2:
        problems.append(f"pipeline_scheduler='zero_bubble_v' runs two segments per stage (a V), not {segments}: "
                        f"give the cells pipeline_segment 0 and 1")
    shard = _values.get("enable_parallel_optimizer")
    if shard:
        options = _values.get("parallel_optimizer_config", {})
        stage = max(OPTIMIZER_LEVELS[options.get("optimizer_level", "level1")],
                    2 if options.get("gradient_accumulation_shard") else 1)
        config.zero_stage = max(config.effective_zero_stage, stage)
    elif shard is False and config.effective_zero_stage > 0:
        problems.append(f"set_auto_parallel_context(enable_parallel_optimizer=False) contradicts the blocks' "
                        f"TransformerOpParallelConfig (zero_stage={config.effective_zero_stage}): make them agree")
    config.derive(world_size)
    problems += world_size_problems(config, world_size, WHERE)
    if config.data_parallel_given:
        problems += expert_split_problems(None, config.expert_parallel, config.data_parallel, where_parallel=WHERE)
    ConfigError.raise_any(problems)
    return config


GRAPH_MODE, PYNATIVE_MODE = 0, 1  # MindSpore's values
_CONTEXT: dict[str, Any] = {"mode": PYNATIVE_MODE, "device_target": None}
DEVICE_TARGETS = {"CPU": "cpu", "GPU": "cuda"}


def set_context(**kwargs) -> None:
    """MindSpore's ``set_context``: ``mode=GRAPH_MODE`` compiles each transformer layer of a user's net (the
    whole net when it has none) with ``torch.compile``, as ``train.compile`` does for the built-in models,
    after tensor parallel and recompute, before data parallel; ``PYNATIVE_MODE`` (the default) runs eagerly.
    ``device_target`` "CPU" or "GPU" must match the device this run chose (``PARATRAIN_DEVICE``). Other
    options are refused with the reason; nothing is set when one is refused."""
    for key, value in kwargs.items():
        if key == "mode":
            if value not in (GRAPH_MODE, PYNATIVE_MODE) or isinstance(value, bool):
                raise UserError(f"set_context(mode={value!r}): expected paratrain.GRAPH_MODE ({GRAPH_MODE}) or "
                                f"paratrain.PYNATIVE_MODE ({PYNATIVE_MODE})")
        elif key == "device_target":
            from paratrain.device import uses_cuda

            if value not in DEVICE_TARGETS:
                raise UserError(f"set_context(device_target={value!r}): expected 'CPU' or 'GPU' (no Ascend here)")
            actual = "cuda" if uses_cuda() else "cpu"
            if DEVICE_TARGETS[value] != actual:
                raise UserError(f"set_context(device_target={value!r}): this run is on the {actual.upper()}; the "
                                f"device is chosen once per run (PARATRAIN_DEVICE=cpu|cuda)")
        else:
            raise UserError(f"set_context({key}=...): not offered; paratrain's context has mode and device_target "
                            f"(parallel options: set_auto_parallel_context)")
    _CONTEXT.update(kwargs)


def get_context(key: str) -> Any:
    """The value of ``set_context`` option ``key`` (``mode``, ``device_target``)."""
    if key not in _CONTEXT:
        raise UserError(f"get_context({key!r}): unknown option; known: {', '.join(_CONTEXT)}")
    return _CONTEXT[key]
