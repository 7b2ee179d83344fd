"""paratrain: train Transformer models on many devices with one parallel config."""
from paratrain.config import Config, ConfigError, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from paratrain.config_rules import check, validate

# the MindSpore face's context (``paratrain.context``), imported on first use: the engine and the command line's
# modules import ``paratrain`` without it
CONTEXT_NAMES = ("GRAPH_MODE", "PYNATIVE_MODE", "ParallelMode", "TransformerOpParallelConfig", "get_algo_parameters",
                 "get_auto_parallel_context", "get_context", "reset_algo_parameters", "reset_auto_parallel_context",
                 "set_algo_parameters", "set_auto_parallel_context", "set_context")

__all__ = ["AutoParallel", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "GRAPH_MODE", "LossMonitor",
           "Model", "ModelCheckpoint", "ModelConfig", "PYNATIVE_MODE", "ParallelConfig", "ParallelMode", "TimeMonitor",
           "TrainConfig", "TransformerOpParallelConfig", "check", "get_algo_parameters", "get_auto_parallel_context",
           "get_context", "get_seed", "load_checkpoint", "load_distributed_checkpoint", "load_param_into_net",
           "no_init_parameters", "reset_algo_parameters", "reset_auto_parallel_context", "save_checkpoint",
           "set_algo_parameters", "set_auto_parallel_context", "set_context", "set_seed", "validate"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # imported on first use: `import paratrain` (and the command line) stays without torch
    if name in CONTEXT_NAMES:
        from paratrain import context
        return getattr(context, name)
    if name == "AutoParallel":
        from paratrain.auto_parallel import AutoParallel
        return AutoParallel
    if name == "no_init_parameters":
        from paratrain.parallel.deferred_init import no_init_parameters
        return no_init_parameters
    if name in ("load_checkpoint", "load_param_into_net", "load_distributed_checkpoint", "save_checkpoint"):
        from paratrain.train import serialization
        return getattr(serialization, name)
    if name in ("set_seed", "get_seed"):
        from paratrain import seed
        return getattr(seed, name)
    if name in ("Model", "CheckpointConfig", "LossMonitor", "ModelCheckpoint", "TimeMonitor"):
        from paratrain import train
        return getattr(train, name)
    from paratrain.dtype import TORCH_NAMES

    if name in TORCH_NAMES and name != "bool":  # paratrain.bool_, as mindspore.bool_
        import torch
        return getattr(torch, TORCH_NAMES[name])
    raise AttributeError(f"module 'paratrain' has no attribute {name!r}")
