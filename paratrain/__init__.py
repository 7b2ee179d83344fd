"""paratrain: train Transformer models on many devices with one parallel config."""
from paratrain.config import (Config, ConfigError, DataConfig, ModelConfig, ParallelConfig, TrainConfig,
                              TransformerOpParallelConfig, check, validate)

__all__ = ["Config", "ConfigError", "DataConfig", "ModelConfig", "ParallelConfig", "TrainConfig",
           "TransformerOpParallelConfig", "check", "validate"]
__version__ = "0.1.0"
