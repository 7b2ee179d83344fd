"""MindSpore's ``load_checkpoint``, ``load_param_into_net``, ``save_checkpoint`` and ``load_distributed_checkpoint``
for paratrain's checkpoints and MindSpore's files (``paratrain.train.mindspore_checkpoint``).

What ``load_checkpoint`` reads from a MindSpore file keeps MindSpore's names and layout, each tensor a
``paratrain.nn.Parameter`` whose ``checkpoint_layout`` says so; ``load_param_into_net`` maps it onto the net through
the names and layouts its blocks declare (``paratrain.nn.cell.mindspore_names``), and ``save_checkpoint`` writes a net
in them, so that MindSpore's own functions read it into MindSpore's net.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from paratrain.checkpoint.storage import CheckpointError
from paratrain.errors import UserError
from paratrain.nn.cell import ABSENT, SAME, from_mindspore_layout, mindspore_names, to_mindspore_layout
from paratrain.train import mindspore_checkpoint as ms_files

FORMATS = ("ckpt", "safetensors")


def load_checkpoint(ckpt_file_name: str | Path, net=None, strict_load: bool = False, filter_prefix=None,
                    dec_key: bytes | None = None, dec_mode: str = "AES-GCM", specify_prefix=None, choice_func=None,
                    crc_check: bool = False, remove_redundancy: bool = False, format: str = "ckpt", *,
                    trust_unverified: bool = False) -> dict:
    """Every tensor of a checkpoint, whole, by name: a MindSpore ``.ckpt`` file or MindSpore safetensors file (in
    MindSpore's names and layout: ``paratrain.nn.Parameter``s with ``checkpoint_layout="mindspore"``, strings
    MindSpore saved beside them as ``str``), a paratrain ``.safetensors`` file (an integrated save, ``paratrain
    export``), or a paratrain checkpoint directory of any layout (a directory of checkpoints gives its newest). A
    file of another suffix is read as ``format`` says. Needs no process group.

    As MindSpore's: names starting with one of ``specify_prefix`` are kept, then those starting with one of
    ``filter_prefix`` left out; without either, ``choice_func(name)`` chooses; with ``net`` the tensors are also
    loaded into it (``load_param_into_net(net, ..., strict_load)``). ``crc_check`` checks the CRC a MindSpore file
    records. Encrypted files (``dec_key``) and ``remove_redundancy`` are refused. A paratrain checkpoint of format 1
    (no checksums) is read only with ``trust_unverified``."""
    if dec_key is not None:
        raise UserError(f"load_checkpoint({ckpt_file_name}, dec_key=...): paratrain does not read encrypted "
                        f"checkpoints ({dec_mode}); save it again without enc_key in MindSpore")
    _check_format("load_checkpoint", format)
    _refuse_remove_redundancy("load_checkpoint", remove_redundancy)
    specify, left_out = _prefixes(specify_prefix, "specify_prefix"), _prefixes(filter_prefix, "filter_prefix")
    path = Path(ckpt_file_name)
    if path.is_file():
        if path.suffix == ".safetensors" or (format == "safetensors" and path.suffix != ".ckpt"):
            params = (ms_files.read_safetensors(path, crc_check) if ms_files.is_mindspore_safetensors(path)
                      else _load_safetensors(path, trust_unverified))
        else:
            params = ms_files.read_ckpt(path, crc_check)
    elif path.suffix in (".ckpt", ".safetensors"):
        raise CheckpointError(f"load_checkpoint: {path} does not exist")
    else:
        from paratrain.checkpoint import load_full_tensors

        params = load_full_tensors(path, trust_unverified=trust_unverified)

    def chosen(name: str) -> bool:
        if specify is None and left_out is None:
            return choice_func is None or bool(choice_func(name))
        return (specify is None or name.startswith(specify)) and not (left_out and name.startswith(left_out))

    params = {name: value for name, value in params.items() if chosen(name)}
    if not params:
        raise UserError(f"load_checkpoint: nothing of {path} is left after specify_prefix={specify_prefix!r}, "
                        f"filter_prefix={filter_prefix!r}, choice_func={choice_func!r}: loosen them")
    if net is not None:
        load_param_into_net(net, params, strict_load)
    return params


def _check_format(owner: str, format: str) -> None:
    if format not in FORMATS:
        raise UserError(f"{owner}: format={format!r} is not one of {', '.join(map(repr, FORMATS))}")


def _refuse_remove_redundancy(owner: str, remove_redundancy) -> None:
    if remove_redundancy:
        raise UserError(f"{owner}: remove_redundancy=True is not offered: paratrain's checkpoints and MindSpore "
                        f"files it reads and writes hold every tensor whole; leave it out")


def _prefixes(prefix, name: str) -> tuple[str, ...] | None:
    """MindSpore's prefix argument as a tuple of non-empty strings (None: none given)."""
    if prefix is None:
        return None
    prefixes = (prefix,) if isinstance(prefix, str) else prefix
    if not isinstance(prefixes, (list, tuple)) or not prefixes or not all(isinstance(p, str) and p for p in prefixes):
        raise UserError(f"load_checkpoint: {name}={prefix!r}: expected a non-empty string, or a non-empty list or "
                        f"tuple of them")
    return tuple(prefixes)


def _load_safetensors(path: Path, trust_unverified: bool) -> dict[str, torch.Tensor]:
    """The tensors of one paratrain ``.safetensors`` file; the integrated model of a checkpoint is checked against
    the checksum its ``paratrain.json`` records first."""
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


def _modules(net, owner: str) -> list[nn.Module]:
    """The modules holding ``net``'s tensors: a placed net's parts, a list of modules, or the module itself."""
    from paratrain.parallel.placed import PlacedModel

    if isinstance(net, PlacedModel):
        return list(net.parts)
    if isinstance(net, (list, tuple)) and all(isinstance(m, nn.Module) for m in net):
        return list(net)
    if isinstance(net, nn.Module):
        return [net]
    raise UserError(f"{owner}: net={net!r:.60} is not a torch.nn.Module, a placed net or a list of modules")


def _in_mindspore_layout(parameter_dict: dict) -> bool:
    """Whether ``parameter_dict``'s tensors came from a MindSpore file (MindSpore's names and layout)."""
    marks = {getattr(v, "checkpoint_layout", None) == ms_files.MINDSPORE_LAYOUT for v in parameter_dict.values()
             if isinstance(v, torch.Tensor)}
    if len(marks) > 1:
        mixed = [k for k, v in parameter_dict.items()
                 if isinstance(v, torch.Tensor) and getattr(v, "checkpoint_layout", None) != ms_files.MINDSPORE_LAYOUT]
        raise UserError(f"load_param_into_net: parameter_dict mixes tensors read from a MindSpore file (MindSpore's "
                        f"names and layout) with {len(mixed)} others ({', '.join(mixed[:3])}...): the layout of "
                        f"each must be known; load them in separate calls")
    return marks == {True}


@torch.no_grad()
def load_param_into_net(net, parameter_dict: dict, strict_load: bool = False,
                        remove_redundancy: bool = False) -> tuple[list[str], list[str]]:
    """Copy ``parameter_dict`` (whole tensors by name, as ``load_checkpoint`` gives) into the parameters and
    persistent buffers of ``net``: a plain module, or a parallel one (a placed net or a list of its parts), where each
    sharded (DTensor) parameter takes this rank's slice. A dict read from a MindSpore file is matched by the
    MindSpore names of the net's tensors and converted from MindSpore's layout (transposed projections, experts'
    biases); any other dict by the net's own names.

    Returns ``(param_not_load, ckpt_not_load)``, as MindSpore's: the net's names (MindSpore's for a MindSpore dict)
    that found no entry, and the entries not loaded under their own name. Without ``strict_load``, names still
    missing are looked up as MindSpore does, under the one prefix an entry adds to a missing name, repeatedly;
    then, paratrain's addition, as the one entry a missing name ends with (``network.`` of a net wrapped with its
    loss); entries loaded so stay in ``ckpt_not_load``. Float tensors convert to the net's float dtype, int to int,
    unless ``strict_load``. A shape that does not fit raises CheckpointError naming the parameter and both shapes."""
    if not isinstance(parameter_dict, dict):
        raise UserError(f"load_param_into_net: parameter_dict must be a dict of name -> tensor, got "
                        f"{type(parameter_dict).__name__}")
    _refuse_remove_redundancy("load_param_into_net", remove_redundancy)
    in_mindspore = _in_mindspore_layout(parameter_dict)
    targets: dict[str, tuple[str, torch.Tensor, str]] = {}  # key in the dict's naming -> (net name, tensor, layout)
    for module in _modules(net, "load_param_into_net"):
        names = mindspore_names(module)
        for name, tensor in module.state_dict(keep_vars=True).items():
            ms_name, layout = names[name]
            if not in_mindspore:
                targets[name] = (name, tensor, SAME)
            elif layout != ABSENT:
                targets[ms_name] = (name, tensor, layout)
    param_not_load, loaded = [], set()
    for key, target in targets.items():
        if key not in parameter_dict:
            param_not_load.append(key)
        elif isinstance(parameter_dict[key], torch.Tensor):  # else a string MindSpore saved beside the weights
            _copy(key, target, parameter_dict[key], strict_load)
            loaded.add(key)
    if param_not_load and not strict_load:
        _load_under_prefixes(targets, parameter_dict, param_not_load, strict_load)
        _load_wrapped(targets, parameter_dict, param_not_load, strict_load)
    return param_not_load, [key for key in parameter_dict if key not in loaded]


def _load_under_prefixes(targets: dict, parameter_dict: dict, not_loaded: list[str], strict_load: bool) -> None:
    """MindSpore's second pass: the prefix by which the first entry ending with a missing name (the first such name
    in the net's order) extends it; every missing name found under that prefix is loaded; again until no prefix is
    found. (As MindSpore's, a prefix equal to the first missing name at the start counts as none.)"""
    first = not_loaded[0]

    def next_prefix() -> str | None:
        for name in not_loaded:
            entry = next((e for e in parameter_dict if e.endswith(name)), None)
            if entry is not None and entry[:-len(name)] not in ("", first):
                return entry[:-len(name)]
        return None

    while not_loaded:
        prefix = next_prefix()
        if prefix is None:
            return
        found = [name for name in not_loaded if isinstance(parameter_dict.get(prefix + name), torch.Tensor)]
        if not found:
            return
        for name in found:
            _copy(prefix + name, targets[name], parameter_dict[prefix + name], strict_load)
            not_loaded.remove(name)


def _load_wrapped(targets: dict, parameter_dict: dict, not_loaded: list[str], strict_load: bool) -> None:
    """Each missing name that ends with ``.`` + exactly one entry (the net wraps the one saved) takes that entry."""
    for name in list(not_loaded):
        hits = [entry for entry, value in parameter_dict.items()
                if name.endswith("." + entry) and isinstance(value, torch.Tensor)]
        if len(hits) == 1:
            _copy(hits[0], targets[name], parameter_dict[hits[0]], strict_load)
            not_loaded.remove(name)


def _is_int(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def _copy(key: str, target: tuple[str, torch.Tensor, str], source: torch.Tensor, strict_load: bool) -> None:
    """Copy entry ``key`` into the net's tensor ``target`` (net name, tensor, layout of the entry)."""
    name, tensor, layout = target
    expected = tuple(to_mindspore_layout(torch.empty(tensor.shape, device="meta"), layout).shape)
    shape = tuple(source.shape)
    if shape != expected:
        extra = shape[len(expected):]
        if shape[:len(expected)] != expected or not extra or any(d != 1 for d in extra):
            net_side = f"the net's {name} {list(tensor.shape)} in MindSpore's layout" if layout != SAME else (
                f"the net's {name}" if name != key else "the net")
            raise CheckpointError(f"load_param_into_net: {key} has shape {list(shape)} in the checkpoint, "
                                  f"{list(expected)} in {net_side}: is the checkpoint of this net, built with the "
                                  f"same sizes?")
        source = source.reshape(expected)  # MindSpore's trailing dims of 1 (a 4-d (n, c, 1, 1) of GE)
    source = from_mindspore_layout(source, layout)
    if source.dtype != tensor.dtype:
        same_kind = (source.dtype.is_floating_point and tensor.dtype.is_floating_point) or (
            _is_int(source.dtype) and _is_int(tensor.dtype))
        if strict_load or not same_kind:
            raise CheckpointError(f"load_param_into_net: {key} is {source.dtype} in the checkpoint, {tensor.dtype} "
                                  f"in the net: " + ("strict_load=True converts no dtype; load with "
                                                     "strict_load=False" if same_kind else
                                                     "only float to float and int to int convert"))
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        local.copy_(distribute_tensor(source.to(local.device, local.dtype), tensor.device_mesh, tensor.placements,
                                      src_data_rank=None).to_local())
    else:
        tensor.copy_(source)


def save_checkpoint(save_obj, ckpt_file_name: str | Path, integrated_save: bool = True, async_save=False,
                    append_dict: dict | None = None, enc_key: bytes | None = None, enc_mode: str = "AES-GCM",
                    choice_func=None, crc_check: bool = False, format: str = "ckpt", **kwargs) -> None:
    """Write ``save_obj`` to MindSpore checkpoint file ``ckpt_file_name`` (``.<format>`` added where it lacks it):
    a ``.ckpt`` file (``format="ckpt"``) or MindSpore safetensors (``"safetensors"``), which MindSpore's
    ``load_checkpoint`` + ``load_param_into_net`` read into MindSpore's net of the same blocks.

    ``save_obj``: a net (its parameters and persistent buffers, under MindSpore's names and in its layout: LayerNorm
    ``gamma``/``beta``, ``embedding_table``, the (in, out) projections), a placed net (each sharded parameter
    whole: every rank must call it), a dict name -> tensor (or string) or a list of ``{"name": ..., "data": ...}``,
    written as they are. ``choice_func(name)`` chooses what is saved; ``append_dict`` adds entries (numbers as
    0-d tensors, strings); ``crc_check`` appends the CRC MindSpore checks. Written through a temporary file and a
    rename, before it returns (``async_save`` too). Encryption (``enc_key``) and sliced saves of a sharded net
    (``integrated_save=False``: ``ModelCheckpoint`` with ``CheckpointConfig(integrated_save=False)`` saves those)
    are refused."""
    if enc_key is not None:
        raise UserError(f"save_checkpoint({ckpt_file_name}, enc_key=...): paratrain does not encrypt checkpoints "
                        f"({enc_mode}); leave enc_key out")
    _check_format("save_checkpoint", format)
    if async_save not in (False, True, "thread", "process"):
        raise UserError(f"save_checkpoint: async_save={async_save!r} is not one of False, True, 'thread', 'process'")
    unknown = set(kwargs) - {"remove_redundancy"}
    if unknown:
        raise UserError(f"save_checkpoint: unexpected keyword arguments {sorted(unknown)} (paratrain takes MindSpore's "
                        f"remove_redundancy besides the named ones)")
    _refuse_remove_redundancy("save_checkpoint", kwargs.get("remove_redundancy"))
    path = Path(ckpt_file_name)
    if path.is_dir():
        raise UserError(f"save_checkpoint: {path} is a directory; give a file name (say {path / f'net.{format}'})")
    if not path.name.endswith(format):
        path = path.with_name(f"{path.name}.{format}")
    items = {name: value for name, value in _save_items(save_obj, integrated_save).items()
             if choice_func is None or choice_func(name)}
    for name, value in (append_dict or {}).items():
        items[name] = value if isinstance(value, (str, torch.Tensor)) else torch.tensor(
            value, dtype=torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int)
            else torch.float32, device="cpu")  # written to the file from the host
    path.parent.mkdir(parents=True, exist_ok=True)
    write = ms_files.write_ckpt if format == "ckpt" else ms_files.write_safetensors
    write(path, items, crc_check)


def _save_items(save_obj, integrated_save: bool) -> dict[str, torch.Tensor | str]:
    """name -> tensor (or string) of what ``save_checkpoint`` writes of ``save_obj``."""
    if isinstance(save_obj, dict):
        return {name: torch.from_numpy(v) if type(v).__module__ == "numpy" else v for name, v in save_obj.items()}
    if isinstance(save_obj, list) and all(isinstance(e, dict) and {"name", "data"} <= e.keys() for e in save_obj):
        return {e["name"]: e["data"] for e in save_obj}
    if isinstance(save_obj, list) and all(getattr(e, "param_name", None) for e in save_obj):  # named Parameters
        return {e.param_name: e for e in save_obj}
    items = {}
    for module in _modules(save_obj, "save_checkpoint"):
        names = mindspore_names(module)
        for name, tensor in module.state_dict().items():
            if isinstance(tensor, DTensor):
                if not integrated_save:
                    raise UserError(f"save_checkpoint(integrated_save=False): {name} is split over the ranks; "
                                    f"save the slices with ModelCheckpoint(config=CheckpointConfig("
                                    f"integrated_save=False)), or save it whole (integrated_save=True)")
                tensor = tensor.full_tensor()
            ms_name, layout = names[name]
            if layout != ABSENT:
                items[ms_name] = to_mindspore_layout(tensor.detach(), layout)
    return items


def load_distributed_checkpoint(network, checkpoint_filenames, predict_strategy=None,
                                train_strategy_filename: str | None = None, strict_load: bool = False) -> list[str]:
    """Load a checkpoint saved in slices (``CheckpointConfig(integrated_save=False)``, any strategy and device
    count; ``checkpoint_filenames``: its directory or files) into a plain or placed ``network``, each DTensor
    parameter taking this rank's slice. The slices reshard by their own index: leave out MindSpore's strategy
    files (``predict_strategy``, ``train_strategy_filename``). Every rank reads the whole tensors. Returns the
    names of the network that found no entry (``strict_load``: raises)."""
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
    not_loaded, _ = load_param_into_net(network, load_checkpoint(directory))
    if strict_load and not_loaded:
        raise UserError(f"load_distributed_checkpoint: no entry for {', '.join(not_loaded)}")
    return not_loaded
