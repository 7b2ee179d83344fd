"""``Cell``: the base of every block and of a user's cells (``forward`` runs MindSpore's ``construct``), stating
what the parallel runtime applies from outside (a block never calls a collective): ``pipeline_stage`` (set by
``lambda_func`` or by hand); ``recompute_mode`` (``"none"``, ``"full"`` or ``"selective"``); ``comm_fusion``, its
gradient communication group (MindSpore's fusion index, None when unset); and ``parallel_plan()``, how its own
direct ``nn.Linear`` / ``nn.Embedding`` children split over ``model_parallel`` by child name, in
``paratrain.parallel.tensor``'s kinds (``"colwise"``, ``"rowwise"``, ``"vocab_rows"``; ``{}``: nothing split).
"""
from __future__ import annotations

from torch import nn

from paratrain.errors import UserError
from paratrain.nn.config import check_sizes
from paratrain.nn.parameter import with_name

RECOMPUTE_MODES = ("none", "full", "selective")
LAYER_NORM_NAMES = {"weight": "gamma", "bias": "beta"}


class Cell(nn.Module):
    """A ``torch.nn.Module`` with MindSpore's per-cell parallel settings (see the module docstring). A subclass
    defines its computation as MindSpore's ``construct`` or as torch's ``forward``."""

    pipeline_stage = 0
    recompute_mode = "none"
    comm_fusion = None

    def forward(self, *args, **kwargs):
        return self.construct(*args, **kwargs)

    def construct(self, *args, **kwargs):
        raise UserError(f"{type(self).__name__} defines neither construct nor forward: a Cell computes in one of them")

    def recompute(self, mode: bool | str = True, **mindspore_options) -> None:
        """Recompute this cell's forward in backward: True means ``"full"``, False ``"none"``, or a mode name.
        MindSpore's keyword options are accepted and change nothing: a recomputed cell redoes its collectives too."""
        unknown = set(mindspore_options) - {"mp_comm_recompute", "parallel_optimizer_comm_recompute",
                                            "recompute_slice_activation"}
        if unknown:
            raise TypeError(f"recompute() got unexpected keyword arguments {sorted(unknown)}")
        if isinstance(mode, bool):
            mode = "full" if mode else "none"
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute mode {mode!r} is not one of {', '.join(RECOMPUTE_MODES)} (or True/False)")
        self.recompute_mode = mode

    def set_comm_fusion(self, fusion_type: int, recurse: bool = True) -> None:
        """Put this cell's gradients (and, with ``recurse``, those of the cells inside it) in group ``fusion_type``."""
        for cell in (self.modules() if recurse else [self]):
            if isinstance(cell, Cell):
                cell.comm_fusion = fusion_type

    def parallel_plan(self) -> dict[str, str]:
        """Tensor-parallel split of this cell's direct Linear/Embedding children by name; ``{}``: none."""
        return {}

    def trainable_params(self, recurse: bool = True) -> list[nn.Parameter]:
        """The parameters that require grad (``mindspore_named``)."""
        return mindspore_named(self, recurse)


def mindspore_named(net: nn.Module, recurse: bool = True, named=None) -> list[nn.Parameter]:
    """The parameters of ``net`` (or the (path in ``net``, parameter) pairs ``named``: a placed net's) that require
    grad, each with its MindSpore ``name`` (``with_name``): its path in ``net``, a LayerNorm's weight and bias named
    ``gamma`` and ``beta`` (the names MindSpore's optimizers filter by)."""
    params = []
    for path, param in (net.named_parameters(recurse=recurse) if named is None else named):
        if param.requires_grad:
            owner, _, leaf = path.rpartition(".")
            if isinstance(net.get_submodule(owner), nn.LayerNorm):
                leaf = LAYER_NORM_NAMES.get(leaf, leaf)
            params.append(with_name(param, f"{owner}.{leaf}" if owner else leaf))
    return params


class PipelineCell(nn.Module):
    """MindSpore's ``PipelineCell(network, micro_size, stage_config=None, segment_config=None)``: ``network``
    trained in ``micro_size`` micro-batches over the pipeline stages of its cells' ``pipeline_stage``, interleaved
    over the virtual stages of their ``pipeline_segment`` (stage s, segment g: virtual stage g * stages + s).
    ``stage_config`` / ``segment_config`` (cell name -> stage / segment) set those attributes. ``forward`` is
    the network's on one device; ``paratrain.train.Model`` places it. Parameter names stay the network's."""

    def __init__(self, network: nn.Module, micro_size: int, stage_config: dict | None = None,
                 segment_config: dict | None = None):
        super().__init__()
        if not isinstance(network, nn.Module):
            raise UserError(f"PipelineCell(network={network!r:.60}): expected the net, a torch.nn.Module")
        check_sizes("PipelineCell", micro_size=micro_size)
        for kind, option in (("stage", stage_config), ("segment", segment_config)):
            for name, value in (option or {}).items():
                try:
                    cell = network.get_submodule(name)
                except AttributeError:
                    raise UserError(f"PipelineCell: {kind}_config names {name!r}, which is no cell of the "
                                    f"network") from None
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise UserError(f"PipelineCell: {kind}_config[{name!r}]={value!r}: expected an int >= 0")
                setattr(cell, f"pipeline_{kind}", value)
        self.network, self.micro_size = network, micro_size
        self.placed = None  # set by paratrain.train.Model once the network is placed on the layout

    def forward(self, *batch):
        return self.network(*batch)

    def infer_param_pipeline_stage(self) -> list[nn.Parameter]:
        """The trainable parameters this rank holds, with their ``name`` (as ``Cell.trainable_params()``): its
        pipeline stage's once ``Model`` placed the network, before that all of them (the optimizer built on them
        is rebuilt on this rank's own)."""
        return mindspore_named(self.network, named=None if self.placed is None else self.placed.named_parameters())
