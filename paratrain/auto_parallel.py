"""MindSpore 2.6+'s ``AutoParallel(network, parallel_mode="semi_auto")``: a network wrapped with its parallel
settings (``.pipeline(...)``, ``.hsdp(...)``...), which ``paratrain.train.Model`` trains as it trains the
network under the same ``set_auto_parallel_context`` options."""
from __future__ import annotations

from torch import nn

from paratrain.context import ParallelMode, set_auto_parallel_context
from paratrain.errors import UserError

MODES = {"semi_auto": ParallelMode.SEMI_AUTO_PARALLEL, "sharding_propagation": ParallelMode.AUTO_PARALLEL,
         "recursive_programming": ParallelMode.AUTO_PARALLEL}
SEARCH_MODES = {"sharding_propagation": "sharding_propagation", "recursive_programming": "dynamic_programming"}


class AutoParallel(nn.Module):
    """``network`` with MindSpore's parallel settings; ``forward`` is the network's. Each setting takes effect as the
    auto-parallel context option it stands for (so every net of the process shares them, as the context is one) or
    is refused with the reason. Parameter names are the network's."""

    def __init__(self, network: nn.Module, parallel_mode: str = "semi_auto"):
        super().__init__()
        if parallel_mode not in MODES:
            raise UserError(f"AutoParallel(parallel_mode={parallel_mode!r}): expected one of {', '.join(MODES)}")
        set_auto_parallel_context(parallel_mode=MODES[parallel_mode])
        if parallel_mode in SEARCH_MODES:
            set_auto_parallel_context(search_mode=SEARCH_MODES[parallel_mode])
        self.network = network

    def forward(self, *args, **kwargs):
        return self.network(*args, **kwargs)

    def pipeline(self, stages: int = 1, output_broadcast: bool = False, interleave: bool = False,
                 scheduler: str = "1f1b") -> None:
        """``stages`` pipeline stages (the cells' ``pipeline_stage``), interleaved over their ``pipeline_segment``
        with ``interleave``, run by ``scheduler`` ("1f1b", "gpipe"; "zero_bubble_v" interleaved)."""
        if output_broadcast:
            raise UserError("AutoParallel.pipeline(output_broadcast=True) is for inference; Model.train needs none")
        set_auto_parallel_context(pipeline_stages=stages, pipeline_config={"pipeline_interleave": interleave,
                                                                            "pipeline_scheduler": scheduler})

    def hsdp(self, shard_size: int = -1, threshold: int = 64, optimizer_level: str = "level1") -> None:
        """Shard the optimizer state ("level1"), also the gradients ("level2") and the weights ("level3") over
        every data-parallel rank (ZeRO stages 1-3, FSDP2)."""
        if shard_size != -1:
            raise UserError(f"AutoParallel.hsdp(shard_size={shard_size}): shards go over all data-parallel ranks; "
                            f"leave shard_size at -1")
        set_auto_parallel_context(enable_parallel_optimizer=True,
                                  parallel_optimizer_config={"optimizer_level": optimizer_level})

    def enable_gradients_mean(self) -> None:
        """Average the data-parallel ranks' gradients instead of summing them."""
        set_auto_parallel_context(gradients_mean=True)

    def save_param_strategy_file(self, file_path: str) -> None:
        """Where the chosen operator strategies are written (auto parallel)."""
        set_auto_parallel_context(strategy_ckpt_save_file=file_path)

    def load_operator_strategy_file(self, file_path: str) -> None:
        """Where operator strategies are read from (auto parallel)."""
        set_auto_parallel_context(strategy_ckpt_load_file=file_path)
