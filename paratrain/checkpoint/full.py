"""Whole tensors out of a sliced checkpoint in one process: export to safetensors, and ``info``."""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch

from paratrain.checkpoint.storage import (INTEGRATED_FILE, dcp_load, named_error, read_meta, recorded_bytes,
                                          require_checksums, resolve, tensor_entries, verify, write_atomic)

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."


def load_full_tensors(path: str | Path, prefix: str = MODEL_PREFIX,
                      trust_unverified: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint ``path`` whose key starts with ``prefix``, whole, keyed without it, read from
    the DCP shards of all ranks in this process (no process group used). A checkpoint without checksums
    (format 1) is read only with ``trust_unverified`` (:func:`~paratrain.checkpoint.storage.require_checksums`)."""
    path = resolve(path)
    meta = read_meta(path)
    require_checksums(path, meta, trust_unverified)
    _, metadata = verify(path, meta)
    state = {key: torch.empty(entry.size, dtype=entry.properties.dtype, device="cpu")
             for key, entry in tensor_entries(metadata).items() if key.startswith(prefix)}
    dcp_load(state, path, no_dist=True)
    return {key[len(prefix):]: value for key, value in state.items()}


def export(path: str | Path, out: str | Path, dtype: torch.dtype | None = None, trust_unverified: bool = False) -> Path:
    """Write the model of checkpoint ``path`` to one ``.safetensors`` file with plain parameter names, tied
    weights under each of their names, as ``model.load_state_dict(safetensors.torch.load_file(out))`` takes."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    path = resolve(path)
    meta = read_meta(path)
    tensors = load_full_tensors(path, trust_unverified=trust_unverified)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    metadata = {"step": str(meta["step"]), "config": json.dumps(meta["config"])}
    try:
        write_atomic(out, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    except (OSError, SafetensorError) as exc:
        raise _as_os_error(exc, out) from None
    return out


def _as_os_error(exc: Exception, path: Path) -> Exception:
    """safetensors' error for a failed write (``I/O error: No space left on device (os error 28)``) as the
    OSError it wraps, naming ``path``; other errors as they are."""
    if isinstance(exc, OSError):
        return named_error(exc, path)
    code = re.search(r"\(os error (\d+)\)", str(exc))
    return OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) if code else exc


def info(path: str | Path) -> dict:
    """What a checkpoint holds: step, layout, and every tensor with its shape, dtype and bytes."""
    path = resolve(path)
    meta, metadata = verify(path, checksums=False)  # sizes only: `paratrain checkpoint verify` reads every byte
    tensors = {}
    for key, entry in sorted(tensor_entries(metadata).items()):
        tensors[key] = {"shape": list(entry.size), "dtype": str(entry.properties.dtype).removeprefix("torch."),
                        "bytes": math.prod(entry.size) * entry.properties.dtype.itemsize, "shards": len(entry.chunks)}
    files = meta["files"]
    return {"path": str(path), "step": meta["step"], "layout": meta["layout"], "saved_at": meta.get("saved_at"),
            "integrated": INTEGRATED_FILE in files, "disk_bytes": sum(recorded_bytes(e) for e in files.values()),
            "tensors": tensors}


def format_info(summary: dict, all_tensors: bool = False) -> str:
    lay = summary["layout"]
    lines = [f"checkpoint {summary['path']}",
             f"  step           {summary['step']}",
             f"  saved at       {summary['saved_at']}",
             f"  layout         world {lay['world_size']}: dp {lay['data_parallel']} x mp {lay['model_parallel']} "
             f"x pp {lay['pipeline_stage']}, zero stage {lay['zero_stage']}",
             f"  on disk        {summary['disk_bytes'] / 2**20:.2f} MiB"
             + (" (with model.safetensors)" if summary["integrated"] else "")]
    for title, prefix in {"model": MODEL_PREFIX, "optimizer": OPTIM_PREFIX}.items():
        items = {k[len(prefix):]: v for k, v in summary["tensors"].items() if k.startswith(prefix)}
        total = sum(v["bytes"] for v in items.values())
        numel = sum(v["bytes"] // max(1, getattr(torch, v["dtype"]).itemsize) for v in items.values())
        lines.append(f"  {title:<14} {len(items)} tensors, {numel:,} elements, {total / 2**20:.2f} MiB")
        if title == "model" or all_tensors:
            width = max((len(k) for k in items), default=0)
            for name, v in items.items():
                shape = "x".join(map(str, v["shape"])) or "scalar"
                lines.append(f"    {name:<{width}}  {shape:>12}  {v['dtype']:<8} {v['bytes']:>10,} B"
                             f"  {v['shards']} shard{'s' if v['shards'] != 1 else ''}")
    return "\n".join(lines)
