"""Plain single-device models; parallelism is applied from outside."""
from torch import nn

from paratrain.config import ModelConfig
from paratrain.models.transformer import GPTModel, Seq2SeqModel, token_loss_sum


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model named by ``cfg.kind`` (``paratrain.config.MODEL_KINDS``) with fresh weights (seed the RNG first)."""
    return cfg.spec.build_function()(cfg)


__all__ = ["GPTModel", "Seq2SeqModel", "build_model", "token_loss_sum"]
