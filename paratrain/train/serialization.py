"""Weights-only loading for fine-tuning, as MindSpore's ``load_checkpoint``, ``load_param_into_net`` and
``load_distributed_checkpoint``."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from paratrain.errors import UserError


def load_checkpoint(path: str | Path, net: nn.Module | None = None,
                    filter_prefix: str | tuple[str, ...] | None = None,
                    trust_unverified: bool = False) -> dict[str, torch.Tensor]:
    """Every model tensor of a paratrain checkpoint, whole, by name: a sliced checkpoint directory (any
    layout wrote it; a directory of checkpoints gives its newest), or a ``.safetensors`` file (an
    integrated save or ``paratrain export``). Names starting with ``filter_prefix`` are left out; with
    ``net`` the tensors are also loaded into it (``load_param_into_net``). Needs no process group. A
    checkpoint of format 1 (no checksums) is read only with ``trust_unverified``."""
    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        params = _load_safetensors(path, trust_unverified)
    else:
        from paratrain.checkpoint import load_full_tensors

        params = load_full_tensors(path, trust_unverified=trust_unverified)
    if filter_prefix:
        prefixes = (filter_prefix,) if isinstance(filter_prefix, str) else tuple(filter_prefix)
        params = {k: v for k, v in params.items() if not k.startswith(prefixes)}
    if net is not None:
        load_param_into_net(net, params)
    return params


def _load_safetensors(path: Path, trust_unverified: bool) -> dict[str, torch.Tensor]:
    """The tensors of one ``.safetensors`` file; the integrated model of a checkpoint is checked against the
    checksum its ``paratrain.json`` records first."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from paratrain.checkpoint.storage import (META_FILE, check_checksums, raise_if_damaged, read_meta,
                                              require_checksums)

    if (path.parent / META_FILE).is_file():
        meta = read_meta(path.parent)
        if path.name in meta["files"]:
            require_checksums(path.parent, meta, trust_unverified)
            raise_if_damaged(check_checksums(path.parent, meta, [path.name]))
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise UserError(f"load_checkpoint: {path} is not a readable safetensors file ({exc})") from None


def _lookup(name: str, params: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The entry for ``name``: the same name, else the one name that differs by a wrapper's leading module
    names on either side (``network.`` of a net trained with a ``loss_fn``, say)."""
    if name in params:
        return params[name]
    hits = [k for k in params if k.endswith("." + name) or name.endswith("." + k)]
    return params[hits[0]] if len(hits) == 1 else None


@torch.no_grad()
def load_param_into_net(net, parameter_dict: dict[str, torch.Tensor]) -> list[str]:
    """Copy ``parameter_dict`` (whole tensors by name, as ``load_checkpoint`` gives) into the parameters and
    persistent buffers of ``net``: a plain module, or a parallel one (a placed net or its parts), where each
    sharded (DTensor) parameter takes this rank's slice. Returns the names of ``net`` that found no entry."""
    not_loaded = []
    modules = net.parts if hasattr(net, "parts") else net if isinstance(net, (list, tuple)) else [net]
    for module in modules:
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
                local.copy_(distribute_tensor(source.to(local.device, local.dtype), target.device_mesh,
                                              target.placements, src_data_rank=None).to_local())
            else:
                target.copy_(source)
    return not_loaded


def load_distributed_checkpoint(network, checkpoint_filenames, predict_strategy=None,
                                train_strategy_filename: str | None = None, strict_load: bool = False) -> list[str]:
    """Load a checkpoint saved in slices (``CheckpointConfig(integrated_save=False)``, any strategy and device
    count; ``checkpoint_filenames``: its directory or files) into a plain or placed ``network``, each DTensor
    parameter taking this rank's slice. The slices reshard by their own index: leave out MindSpore's strategy
    files (``predict_strategy``, ``train_strategy_filename``). Every rank reads the whole tensors. Returns the
    names that found no entry (``strict_load``: raises)."""
    if predict_strategy is not None or train_strategy_filename is not None:
        raise UserError("load_distributed_checkpoint: predict_strategy and train_strategy_filename are not needed "
                        "(paratrain's slices record their own layout): leave them out")
    if isinstance(checkpoint_filenames, (str, Path)):
        directory = Path(checkpoint_filenames)
    else:
        parents = {Path(f).parent for f in checkpoint_filenames}
        if len(parents) != 1:
            raise UserError(f"load_distributed_checkpoint: the files lie in {len(parents)} directories; give the "
                            f"files of one checkpoint (or its directory)")
        directory = parents.pop()
    not_loaded = load_param_into_net(network, load_checkpoint(directory))
    if strict_load and not_loaded:
        raise UserError(f"load_distributed_checkpoint: no entry for {', '.join(not_loaded)}")
    return not_loaded
