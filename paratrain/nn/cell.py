"""``Cell``: the base of every block and of a user's cells (``forward`` runs MindSpore's ``construct``), stating
what the parallel runtime applies from outside (a block never calls a collective): ``pipeline_stage`` (set by
``lambda_func`` or by hand); ``recompute_mode`` (``"none"``, ``"full"`` or ``"selective"``); ``comm_fusion``, its
gradient communication group (MindSpore's fusion index, None when unset); ``parallel_plan()``, how its own
direct ``nn.Linear`` / ``nn.Embedding`` children split over ``model_parallel`` by child name, in
``paratrain.parallel.tensor``'s kinds (``"colwise"``, ``"rowwise"``, ``"vocab_rows"``; ``{}``: nothing split); and
``mindspore_params()``, the names and layouts its tensors have in MindSpore's cell of the same name, which
MindSpore's checkpoints (``paratrain.save_checkpoint``, ``load_param_into_net``) read and write through
``mindspore_names``.
"""
from __future__ import annotations

import torch
from torch import nn

from paratrain.errors import UserError
from paratrain.nn.config import check_sizes
from paratrain.nn.parameter import with_name

RECOMPUTE_MODES = ("none", "full", "selective")

# how a tensor is laid out in MindSpore, next to torch's: the same; its last two dims swapped (MindSpore's _Linear
# keeps (in, out) weights); an expert's bias (experts, out) held as (1, experts, 1, out); absent (torch's batch
# norm counts its batches, MindSpore's does not): neither saved to nor expected from a MindSpore file
SAME, TRANSPOSED, EXPERT_BIAS, ABSENT = "same", "transposed", "expert_bias", "absent"
# the MindSpore names (and layouts) of plain torch modules' tensors, where MindSpore's own cell of that kind differs
LAYER_NORM_NAMES = {"weight": ("gamma", SAME), "bias": ("beta", SAME)}
TORCH_MINDSPORE_NAMES = {
    nn.LayerNorm: LAYER_NORM_NAMES, nn.Embedding: {"weight": ("embedding_table", SAME)},
    nn.modules.batchnorm._BatchNorm: {**LAYER_NORM_NAMES, "running_mean": ("moving_mean", SAME),
                                      "running_var": ("moving_variance", SAME),
                                      "num_batches_tracked": ("num_batches_tracked", ABSENT)}}


def to_mindspore_layout(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """``tensor`` (torch's layout) in MindSpore's ``layout`` (a view where it can be)."""
    if layout == TRANSPOSED:
        return tensor.transpose(-2, -1)
    if layout == EXPERT_BIAS:
        return tensor.reshape(1, tensor.shape[0], 1, tensor.shape[1])
    return tensor


def from_mindspore_layout(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """``tensor`` in MindSpore's ``layout`` back in torch's (its shape already checked against the target's)."""
    if layout == TRANSPOSED:
        return tensor.transpose(-2, -1)
    if layout == EXPERT_BIAS:
        return tensor.reshape(tensor.shape[1], tensor.shape[3])
    return tensor


def mindspore_names(module: nn.Module) -> dict[str, tuple[str, str]]:
    """(MindSpore name, layout) of every tensor of ``module``'s state dict, by its name there: what the ``Cell``s
    in it declare (``Cell.mindspore_params``; an outer cell's word wins over a cell inside it), the MindSpore names
    of torch's LayerNorm, Embedding and batch norm tensors (``TORCH_MINDSPORE_NAMES``), else its own name and
    layout."""
    names: dict[str, tuple[str, str]] = {}
    for prefix, sub in module.named_modules():
        if isinstance(sub, Cell):
            declared = sub.mindspore_params()
        else:
            declared = next((table for kind, table in TORCH_MINDSPORE_NAMES.items() if isinstance(sub, kind)), {})
        for name, (ms_name, layout) in declared.items():
            names.setdefault(f"{prefix}.{name}" if prefix else name,
                             (f"{prefix}.{ms_name}" if prefix else ms_name, layout))
    return {name: names.get(name, (name, SAME)) for name in module.state_dict(keep_vars=True)}


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

    def mindspore_params(self) -> dict[str, tuple[str, str]]:
        """How MindSpore's cell of this name names and lays out this cell's tensors where it differs from torch:
        {name in this cell's state dict: (MindSpore's name in the cell, layout ``SAME``, ``TRANSPOSED``,
        ``EXPERT_BIAS`` or ``ABSENT``)}. Tensors left out keep their names and layout; ``{}``: all of them."""
        return {}

    def trainable_params(self, recurse: bool = True) -> list[nn.Parameter]:
        """The parameters that require grad (``mindspore_named``)."""
        return mindspore_named(self, recurse)


def mindspore_named(net: nn.Module, recurse: bool = True, named=None) -> list[nn.Parameter]:
    """The parameters of ``net`` (or the (path in ``net``, parameter) pairs ``named``: a placed net's) that require
    grad, each with its MindSpore ``name`` (``with_name``; ``mindspore_names``: its path in ``net``, a LayerNorm's
    weight and bias named ``gamma`` and ``beta``, the names MindSpore's optimizers filter by)."""
    ms_names = mindspore_names(net)
    return [with_name(param, ms_names[path][0] if path in ms_names else path)
            for path, param in (net.named_parameters(recurse=recurse) if named is None else named)
            if param.requires_grad]


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
