"""Weights-only loading for fine-tuning, as MindSpore's ``load_checkpoint`` and ``load_param_into_net``."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from paratrain.errors import UserError


def load_checkpoint(path: str | Path, net: nn.Module | None = None,
                    filter_prefix: str | tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """Every model tensor of a paratrain checkpoint, whole, by name: a sliced checkpoint directory (any
    layout wrote it; a directory of checkpoints gives its newest), or a ``.safetensors`` file (an
    integrated save or ``paratrain export``). Names starting with ``filter_prefix`` are left out; with
    ``net`` the tensors are also loaded into it (``load_param_into_net``). Needs no process group."""
    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        from safetensors.torch import load_file

        params = load_file(str(path))
    else:
        from paratrain.checkpoint import load_full_tensors

        params = load_full_tensors(path)
    if filter_prefix:
        prefixes = (filter_prefix,) if isinstance(filter_prefix, str) else tuple(filter_prefix)
        params = {k: v for k, v in params.items() if not k.startswith(prefixes)}
    if net is not None:
        load_param_into_net(net, params)
    return params


def _lookup(name: str, params: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The entry for ``name``: the same name, else the one name that differs by a wrapper's leading module
    names on either side (``network.`` of a net trained with a ``loss_fn``, say)."""
    if name in params:
        return params[name]
    hits = [k for k in params if k.endswith("." + name) or name.endswith("." + k)]
    return params[hits[0]] if len(hits) == 1 else None


def _modules(net) -> list[nn.Module]:
    """The modules of ``net``: a module, a list of them, or a placed net (its ``parts`` on this rank)."""
    if hasattr(net, "parts"):
        return list(net.parts)
    if isinstance(net, (list, tuple)):
        return list(net)
    return [net]


@torch.no_grad()
def load_param_into_net(net, parameter_dict: dict[str, torch.Tensor]) -> list[str]:
    """Copy ``parameter_dict`` (whole tensors by name, as ``load_checkpoint`` gives) into the parameters and
    persistent buffers of ``net``: a plain module, or a parallel one (a placed net or its parts), where each
    sharded (DTensor) parameter takes this rank's slice. Returns the names of ``net`` that found no entry."""
    not_loaded = []
    for module in _modules(net):
        for name, target in module.state_dict(keep_vars=True).items():
            source = _lookup(name, parameter_dict)
            if source is None:
                not_loaded.append(name)
                continue
            if tuple(source.shape) != tuple(target.shape):
                raise UserError(f"load_param_into_net: {name} has shape {list(source.shape)} in the checkpoint, "
                                f"{list(target.shape)} in the net")
            if isinstance(target, DTensor):
                local = target.to_local()
                source = distribute_tensor(source.to(local.device, local.dtype), target.device_mesh,
                                           target.placements, src_data_rank=None).to_local()
                local.copy_(source)
            else:
                target.copy_(source)
    return not_loaded
