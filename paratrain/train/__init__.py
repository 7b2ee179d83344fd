"""MindSpore's ``mindspore.train`` for a user's own net: ``Model``, the callbacks (``LossMonitor``,
``TimeMonitor``, ``ModelCheckpoint`` with its ``CheckpointConfig``, ``OnRequestExit``, ``SummaryCollector``), the
loss-scale managers, the metrics of ``Model.eval`` (``Metric``, ``Accuracy``, ``Loss``, ``rearrange_inputs``) and
the weights-only loading and saving, MindSpore's files too (``load_checkpoint``, ``load_param_into_net``,
``load_distributed_checkpoint``, ``save_checkpoint``).
``Model.train`` runs its steps on ``paratrain.engine``, as ``paratrain train``."""
from paratrain.amp import DynamicLossScaleManager, FixedLossScaleManager, LossScaleManager
from paratrain.checkpoint.storage import CheckpointError
from paratrain.train.callbacks import (Callback, CallbackParams, CheckpointConfig, LossMonitor, ModelCheckpoint,
                                       OnRequestExit, RunContext, SummaryCollector, TimeMonitor)
from paratrain.nn.metrics import Accuracy, Loss, Metric, rearrange_inputs
from paratrain.train.model import Model, WithLoss
from paratrain.train.placement import group_names, rebuild_optimizer
from paratrain.train.serialization import (load_checkpoint, load_distributed_checkpoint, load_param_into_net,
                                           save_checkpoint)

__all__ = ["Accuracy", "Callback", "CallbackParams", "CheckpointConfig", "CheckpointError", "DynamicLossScaleManager",
           "FixedLossScaleManager", "Loss", "LossMonitor", "LossScaleManager", "Metric", "Model", "ModelCheckpoint",
           "OnRequestExit", "RunContext", "SummaryCollector", "TimeMonitor", "WithLoss", "group_names",
           "load_checkpoint", "load_distributed_checkpoint", "load_param_into_net", "rearrange_inputs",
           "rebuild_optimizer", "save_checkpoint"]
