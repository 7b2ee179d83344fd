"""``Model.eval``'s run over a validation dataset on the placed net: each batch's outputs on this rank's rows,
the loss the global batch's, the metrics updated and then added over the ranks, with the ``on_eval_*`` hooks."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.config import ParallelConfig
from paratrain.errors import UserError
from paratrain.precision import autocast
from paratrain.train.batches import as_batch, dataset_shards
from paratrain.train.callbacks import RunContext
from paratrain.train.metrics import check_reducible, evaluating, global_loss, reduce_metrics, update_metrics


def eval_shards(config: ParallelConfig, world_size: int, valid_dataset: Iterable) -> int:
    """The shards ``valid_dataset`` is split into (1: every rank gives the global batch); a pipeline and a split
    other than one per data-parallel rank are refused."""
    if config.pipeline_stage > 1:
        raise UserError(f"Model.eval: pipeline_stage={config.pipeline_stage}: the traced stages of a pipeline end "
                        f"in the loss, so the metrics cannot see the network's output; evaluate the trained "
                        f"weights in a net placed without pipeline stages (load_checkpoint + load_param_into_net)")
    return dataset_shards("Model.eval", config, world_size, valid_dataset)


class Evaluation:
    """One ``Model.eval`` call on the placed net (``placed``): what runs each batch (the eval network, or the
    placed net's ``(loss, output, label)``), and the metrics it updates (cleared here)."""

    def __init__(self, placed, eval_network: nn.Module | None, metrics: dict, eval_indexes: list[int] | None,
                 precision: str, rows_of_this_rank: bool):
        self.placed, self.eval_network, self.metrics, self.eval_indexes = placed, eval_network, metrics, eval_indexes
        self.precision, self.rows_of_this_rank = precision, rows_of_this_rank
        self.root = placed.parts[0]  # run through it: its hooks gather and track the placed parameters
        if eval_network is None:
            self.forward, self.run_net = self.root.evaluate, self.root
        elif any(m is self.root for m in eval_network.modules()):  # it calls the placed net itself
            self.forward, self.run_net = None, eval_network
        else:
            self.forward, self.run_net = eval_network.__call__, self.root
        self.loss_at = eval_indexes[0] if eval_indexes else None
        self.group = None  # the ranks whose metrics' sums are added: those holding other rows
        for metric in metrics.values():
            metric.clear()

    def run(self, valid_dataset: Iterable, hooks, run_context: RunContext, sink_mode: bool) -> dict:
        """``{name: metric.eval()}`` over ``valid_dataset``, calling the ``on_eval_*`` hooks of ``hooks`` (in sink
        mode the step hooks once, around the dataset)."""
        params = run_context.original_args()
        with hooks, evaluating(self.root, self.forward, [self.root, self.eval_network]):
            hooks.call("on_eval_begin", run_context)
            hooks.call("on_eval_epoch_begin", run_context)
            if sink_mode:
                hooks.call("on_eval_step_begin", run_context)
            for batch in valid_dataset:
                if not sink_mode:
                    hooks.call("on_eval_step_begin", run_context)
                outputs = self.outputs(as_batch(batch), first=params.cur_step_num == 0)
                update_metrics(self.metrics, outputs, self.eval_indexes)
                params.net_outputs = tuple(outputs)
                params.cur_step_num += 1
                if not sink_mode:
                    hooks.call("on_eval_step_end", run_context)
            if sink_mode:
                hooks.call("on_eval_step_end", run_context)
            reduce_metrics(self.metrics, self.group, self.placed.device)
            hooks.call("on_eval_epoch_end", run_context)
            hooks.call("on_eval_end", run_context)
        return {name: metric.eval() for name, metric in self.metrics.items()}

    def outputs(self, batch: tuple, first: bool) -> list:
        """The eval network's outputs of this rank's rows of ``batch`` as whole tensors, the loss the global
        batch's (the same on every rank); ``first``: the first batch, whose ranks the metrics are checked for."""
        inputs, self.group = self.placed.loss.eval_rows(self.placed, batch, self.rows_of_this_rank)
        if first:
            check_reducible(self.metrics, self.group)
        with autocast(self.precision, self.placed.device):  # as the net trains: amp_level
            outputs = self.run_net(*inputs)
        outputs = [o.full_tensor() if isinstance(o, DTensor) else o
                   for o in (outputs if isinstance(outputs, (tuple, list)) else (outputs,))]
        if self.loss_at is not None:
            rows = next((t.shape[0] for t in inputs if isinstance(t, torch.Tensor) and t.ndim), 1)
            outputs[self.loss_at] = global_loss(outputs[self.loss_at], rows, self.placed.loss.summed, self.group,
                                                self.placed.device, self.placed.loss.count_epsilon)
        return outputs
