"""On-disk format of a checkpoint, finding the newest complete one, and reading it safely.

A checkpoint is one directory ``<checkpoint dir>/step_00000008`` (with ``checkpoint.prefix``, or
from ``paratrain.train.ModelCheckpoint``, MindSpore's ``<prefix>-<epoch>_<step in epoch>``)::

    .metadata              DCP's global index of every tensor shard (written by PyTorch)
    __<rank>_0.distcp      DCP shard files: each rank's own slices of model and optimizer tensors
    rank_00003.safetensors per-rank state: RNG generator states (tensors) + JSON metadata
    model.safetensors      (integrated_save) the whole model, plain parameter names
    config.toml            the resolved config, for people
    paratrain.json         written last: step, layout, schedule, loss scale, data position,
                           the optimizer's non-tensor settings and the size of every file above

It is written as ``.tmp-step_00000008`` and renamed once every rank has finished and
``paratrain.json`` is in place, then ``latest`` (a text file naming the directory) is
replaced. So a directory named ``step_*`` with a ``paratrain.json`` is complete; a
``.tmp-*`` directory, or a ``step_*`` one without ``paratrain.json``, is a save that
was killed.

Never unpickling arbitrary objects: everything we store ourselves is JSON or
safetensors. The tensors we hand DCP are plain tensors only (no non-tensor values,
which DCP would pickle with ``torch.save`` and read back with ``torch.load(weights_only=False)``);
DCP reads tensor shards with ``torch.load(weights_only=True)``; the loader refuses
any pickled-bytes item (:class:`TensorOnlyLoadPlanner`). The one pickle left is DCP's
own ``.metadata`` index: :class:`SafeFileSystemReader` reads it with an unpickler that
only resolves the handful of DCP metadata classes, ``torch.Size``, dtypes and layouts
(:data:`_METADATA_GLOBALS`) and rejects anything else, so a crafted file cannot run code.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from paratrain.errors import UserError

log = logging.getLogger("paratrain.checkpoint")

META_FILE = "paratrain.json"
DCP_METADATA = ".metadata"
LATEST = "latest"
INTEGRATED_FILE = "model.safetensors"
FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step_(\d+)$")
NAMED_DIR = re.compile(r"^(.+)-(\d+)_(\d+)$")
TMP_PREFIX = ".tmp-"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used; the message names the directory or file and why."""


def checkpoint_name(step: int, prefix: str = "", epoch: int = 1) -> str:
    """``step_00000008``; with a ``prefix`` MindSpore's ``<prefix>-<epoch>_<step>``, ``step`` counted in the epoch."""
    return f"{prefix}-{epoch}_{step}" if prefix else f"step_{step:08d}"


def parse_name(name: str) -> tuple[str, int, int] | None:
    """(prefix, epoch, step) of a checkpoint directory name (``("", 0, step)`` for ``step_*``), None for others."""
    if m := STEP_DIR.match(name):
        return "", 0, int(m.group(1))
    if m := NAMED_DIR.match(name):
        return m.group(1), int(m.group(2)), int(m.group(3))
    return None


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


# --- reading DCP's pickled .metadata without running arbitrary code -----------------------

_DCP_MD = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = {
    (_DCP_MD, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                 "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                                 "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint._extension", "ExtensionRegistry"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}
_DTYPE_NAMES = {str(t).removeprefix("torch.") for t in vars(torch).values() if isinstance(t, torch.dtype)}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and name in _DTYPE_NAMES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of DCP checkpoint metadata")


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's ``.metadata`` of checkpoint ``path``, through the restricted unpickler."""
    file = Path(path) / DCP_METADATA
    try:
        with open(file, "rb") as f:
            metadata = _RestrictedUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: the DCP index {file} is missing") from None
    except Exception as exc:  # truncated, corrupt or foreign pickle
        raise CheckpointError(f"checkpoint {path}: the DCP index {file} is unreadable ({exc})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {path}: {file} does not hold DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with :func:`read_dcp_metadata` in place of a bare ``pickle.load``."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """Loads tensors only: a pickled (BYTE_IO) item would need ``torch.load(weights_only=False)``."""

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"checkpoint item {read_item.dest_index.fqn!r} is a pickled object; "
                              f"paratrain loads tensors only")


# --- validation -------------------------------------------------------------------------------

def read_meta(path: Path) -> dict:
    """``paratrain.json`` of checkpoint ``path`` (CheckpointError naming the file when bad)."""
    file = Path(path) / META_FILE
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: {file} is missing "
                              f"(its save did not finish)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {file} is corrupt ({exc})") from None
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path}: {file} has format {meta.get('format')!r}, "
                              f"this paratrain reads format {FORMAT_VERSION}")
    return meta


def verify(path: Path, meta: dict | None = None, metadata: Metadata | None = None) -> tuple[dict, Metadata]:
    """Check that every file of checkpoint ``path`` is there with its recorded size.

    Returns (paratrain.json, DCP metadata); raises CheckpointError naming the first
    missing, truncated or unreadable file.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    meta = meta if meta is not None else read_meta(path)
    for name, size in meta.get("files", {}).items():
        file = path / name
        try:
            actual = file.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path} is damaged: file {file} is missing") from None
        if actual != size:
            raise CheckpointError(f"checkpoint {path} is damaged: file {file} has {actual} bytes, "
                                  f"{size} were written")
    metadata = metadata if metadata is not None else read_dcp_metadata(path)
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is damaged: shard file {file} is missing")
        if file.stat().st_size < end:
            raise CheckpointError(f"checkpoint {path} is damaged: shard file {file} is truncated "
                                  f"({file.stat().st_size} bytes, the index needs {end})")
    return meta, metadata


def tensor_entries(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


# --- finding checkpoints ----------------------------------------------------------------------

def step_dirs(root: Path, prefix: str | None = "") -> list[tuple[tuple[int, int], Path]]:
    """((epoch, step), path) of every checkpoint directory under ``root`` named with ``prefix`` (``""``:
    ``step_*``; None: any), newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(parsed[1:], p) for p in root.iterdir()
             if (parsed := parse_name(p.name)) and (prefix is None or parsed[0] == prefix) and p.is_dir()]
    return sorted(found, reverse=True)


def newest_complete(root: Path, warn: bool = True, prefix: str | None = None) -> Path | None:
    """The newest complete checkpoint under ``root``, skipping (with a warning) saves that were killed.

    Complete = renamed from its temporary name and holding ``paratrain.json``. A
    complete checkpoint whose files are damaged is not skipped: loading it raises
    a CheckpointError naming the file, rather than silently going further back.
    """
    root = Path(root)
    if warn and root.is_dir():
        for tmp in sorted(root.glob(TMP_PREFIX + "*")):
            log.warning("checkpoint: ignoring %s, a save that did not finish (job killed while saving?)", tmp)
    for _, path in step_dirs(root, prefix):
        if (path / META_FILE).is_file():
            pointer = root / LATEST
            if warn and pointer.is_file() and pointer.read_text().strip() != path.name:
                log.info("checkpoint: %s is newer than %s names (killed before the pointer was updated); using it",
                         path.name, pointer)
            return path
        if warn:
            log.warning("checkpoint: skipping %s, its save did not finish (no %s); using an earlier one",
                        path, META_FILE)
    return None


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from what a user names: the checkpoint, a checkpoint dir or a run dir."""
    path = Path(path)
    if (path / META_FILE).is_file() or (path / DCP_METADATA).is_file():
        return path
    for root in (path, path / "checkpoints"):
        found = newest_complete(root, warn=False)
        if found is not None:
            return found
    raise CheckpointError(f"no checkpoint at {path}: expected a step_* (or <prefix>-<epoch>_<step>) directory "
                          f"holding {META_FILE}, or a directory of them")


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(file: Path, text: str) -> None:
    """Write ``text`` to ``file`` through a temporary file and a rename."""
    tmp = file.with_name(file.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)
    fsync_dir(file.parent)


def dcp_save(state: dict, path: Path) -> None:
    """``dcp.save`` of plain/DTensor tensors, one file per rank, fsynced; no process group needed."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    no_dist = not dist.is_initialized()
    # DCP plans shard offsets of 2D (FSDP x TP) tensors with host tensors made on the default device
    with warnings.catch_warnings(), torch.device("cpu"):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process is intended
        dcp.save(state, storage_writer=FileSystemWriter(path, single_file_per_rank=True, sync_files=True),
                 no_dist=no_dist)


def dcp_load(state: dict, path: Path, no_dist: bool | None = None) -> None:
    """``dcp.load`` in place into ``state``'s tensors, tensors only, through the safe metadata reader."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    no_dist = (not dist.is_initialized()) if no_dist is None else no_dist
    with warnings.catch_warnings(), torch.device("cpu"):  # see dcp_save
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=TensorOnlyLoadPlanner(), no_dist=no_dist)
