"""MindSpore's ``nn.SyncBatchNorm``: batch normalization over the whole data-parallel batch."""
from __future__ import annotations

from torch import nn

from paratrain.errors import UserError


class SyncBatchNorm(nn.BatchNorm2d):
    """``SyncBatchNorm(num_features, eps=1e-5, momentum=0.9, affine=True, use_batch_statistics=None,
    process_groups=None)``: (B, C, H, W) -> same, normalised in training with the global batch's statistics:
    under ``Model.train``'s data parallelism a layer all-reduces them over the ranks (a plain ``nn.BatchNorm2d``
    normalises each rank's rows alone). ``momentum`` is MindSpore's, the moving statistics' weight (torch's:
    ``1 - momentum``)."""

    global_statistics = True  # paratrain.parallel.data.sync_batch_norm replaces it under data parallelism

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.9, affine: bool = True,
                 use_batch_statistics: bool | None = None, process_groups=None, device=None):
        if not 0 <= momentum <= 1:
            raise UserError(f"SyncBatchNorm(momentum={momentum!r}): expected a number in [0, 1] (MindSpore's: the "
                            f"weight of the moving statistics, 0.9 by default)")
        if process_groups is not None:
            raise UserError("SyncBatchNorm(process_groups=...) is not offered: statistics are shared over all the "
                            "data-parallel ranks; leave it out")
        if use_batch_statistics is not None:
            raise UserError("SyncBatchNorm(use_batch_statistics=...) is not offered: batch statistics in training, "
                            "moving ones in eval (net.train() / net.eval()); leave it out")
        super().__init__(num_features, eps=eps, momentum=1 - momentum, affine=affine, device=device)
