"""MindSpore's ``mindspore.nn`` blocks as plain ``torch.nn.Module``s, for users' own models: a port changes
imports only: a ``Cell`` subclass defines ``construct`` (or ``forward``). Each block is a ``Cell`` declaring its
tensor-parallel split, pipeline stage and recompute mode, which the parallel runtime applies from outside;
plain torch modules in a user's net stay data-parallel."""
from paratrain.nn.cell import Cell, PipelineCell
from paratrain.nn.config import (EmbeddingOpParallelConfig, MoEConfig, OpParallelConfig, TransformerOpParallelConfig,
                                 TransformerRecomputeConfig, default_dpmp_config, default_embedding_parallel_config,
                                 default_moe_config, default_transformer_config)
from paratrain.nn.dense import Dense
from paratrain.nn.dropout import Dropout
from paratrain.nn.layers import AttentionMask, FeedForward, MoE, MultiHeadAttention, VocabEmbedding
from paratrain.nn.loss import CrossEntropyLoss, TokenMean
from paratrain.nn.metrics import Accuracy, Loss, Metric, rearrange_inputs  # MindSpore 1.x's place; 2.x: train
from paratrain.nn.normalization import SyncBatchNorm
from paratrain.nn.dynamic_lr import (cosine_decay_lr, exponential_decay_lr, inverse_decay_lr, natural_exp_decay_lr,
                                     piecewise_constant_lr, polynomial_decay_lr, warmup_lr)
from paratrain.nn.learning_rate_schedule import (CosineDecayLR, ExponentialDecayLR, InverseDecayLR,
                                                 LearningRateSchedule, NaturalExpDecayLR, PolynomialDecayLR, WarmUpLR)
from paratrain.nn.optim import AdamWeightDecay, Momentum
from paratrain.nn.parameter import Parameter
from paratrain.nn.transformer import (Transformer, TransformerDecoder, TransformerDecoderLayer, TransformerEncoder,
                                      TransformerEncoderLayer)

__all__ = ["Cell", "PipelineCell", "TransformerOpParallelConfig", "OpParallelConfig", "EmbeddingOpParallelConfig",
           "TransformerRecomputeConfig", "MoEConfig", "default_transformer_config", "default_dpmp_config",
           "default_embedding_parallel_config", "default_moe_config", "VocabEmbedding", "AttentionMask", "FeedForward",
           "MoE", "MultiHeadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder",
           "TransformerDecoder", "Transformer", "CrossEntropyLoss", "TokenMean", "Dense", "Dropout", "Parameter", "Momentum",
           "AdamWeightDecay",
           "LearningRateSchedule", "WarmUpLR", "PolynomialDecayLR", "CosineDecayLR", "ExponentialDecayLR",
           "NaturalExpDecayLR", "InverseDecayLR", "piecewise_constant_lr", "exponential_decay_lr",
           "natural_exp_decay_lr", "inverse_decay_lr", "cosine_decay_lr", "polynomial_decay_lr", "warmup_lr",
           "SyncBatchNorm", "Accuracy", "Loss", "Metric", "rearrange_inputs"]

