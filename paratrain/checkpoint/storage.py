"""On-disk format of a checkpoint, finding the newest complete one, and reading it safely.

A checkpoint is one directory ``<checkpoint dir>/step_00000008`` (with a prefix, MindSpore's
``<prefix>-<epoch>_<step in epoch>``)::

    .metadata              DCP's global index of every tensor shard
    __<rank>_0.distcp      DCP shard files: each rank's own slices of model and optimizer tensors
    rank_00003.safetensors per-rank state: RNG generator states (tensors) + JSON metadata
    model.safetensors      (integrated_save) the whole model, plain parameter names
    config.toml            the resolved config, for people
    paratrain.json         written last: step, layout, schedule, loss scale, data position,
                           optimizer settings, the size and xxh3_64 checksum of every file
                           above (``files``) and a checksum of its own content

It is written as ``.tmp-step_00000008``, renamed once every rank has finished, then ``latest`` (a text file naming the
directory) is replaced: a ``step_*`` directory with a ``paratrain.json`` is complete, anything else is a killed save.
Files are hashed as they are written and checked before they are trusted (README: Checksums); format 1 checkpoints
(sizes only) still load. Nothing arbitrary is unpickled: DCP's ``.metadata`` goes through a restricted unpickler and
the loader refuses pickled items, so a crafted file cannot run code.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import re
import secrets
import threading
import warnings
from collections.abc import Callable
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from paratrain.errors import UserError

log = logging.getLogger("paratrain.checkpoint")

META_FILE = "paratrain.json"
DCP_METADATA = ".metadata"
LATEST = "latest"
INTEGRATED_FILE = "model.safetensors"
FORMAT_VERSION = 2  # 2: paratrain.json ``files`` holds each file's bytes and checksum; 1: bytes only
READ_FORMATS = (1, 2)
CHECKSUM = "xxh3_64"
META_CHECKSUM = "checksum"  # paratrain.json's own checksum, over the rest of its content
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


class DamagedCheckpoint(CheckpointError):
    """A file of a complete checkpoint is missing, truncated, unreadable or fails its checksum (named in the
    message): ``resume = "auto"`` goes back to the checkpoint before it."""


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


# --- reading DCP's pickled .metadata without running arbitrary code -----------------------

_DCP_MD = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = {
    (_DCP_MD, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                 "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                                 "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
     ("torch.distributed.checkpoint._extension", "ExtensionRegistry"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}
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
        raise DamagedCheckpoint(f"checkpoint {path} is damaged: file {file} is missing (DCP's index)") from None
    except Exception as exc:  # truncated, corrupt or foreign pickle
        raise DamagedCheckpoint(f"checkpoint {path} is damaged: file {file} is unreadable ({exc})") from None
    if not isinstance(metadata, Metadata):
        raise DamagedCheckpoint(f"checkpoint {path} is damaged: file {file} does not hold DCP's index")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with :func:`read_dcp_metadata` in place of a bare ``pickle.load``."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
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


# --- checksums ------------------------------------------------------------------------------

BLOCK = 8 * 2**20


def file_checksum(path: Path) -> str:
    """The xxh3_64 checksum (hex) of a file's content."""
    digest = xxhash.xxh3_64()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(max(1, min(BLOCK, os.fstat(f.fileno()).st_size)))  # no 8 MiB for a small file
        view = memoryview(buf)
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def file_entry(nbytes: int, checksum: str) -> dict:
    """What ``paratrain.json`` records of one file."""
    return {"bytes": nbytes, CHECKSUM: checksum}


def write_file(path: Path, data: bytes) -> dict:
    """Write ``data`` to ``path`` and fsync it; returns its :func:`file_entry`. An OSError names ``path``."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise named_error(exc, path) from None
    return file_entry(len(data), xxhash.xxh3_64(data).hexdigest())


def named_error(exc: OSError, path) -> OSError:
    """``exc`` naming file ``path`` (a write to an open file raises an OSError that names none)."""
    return exc if exc.filename else OSError(exc.errno, exc.strerror or str(exc), str(path))


class _HashingStream:
    """A file opened for writing that hashes every block written through it (writes are sequential) and keeps
    the OSError of a failed write in ``failure``: torch's zip writer, writing a shard through it, reports that
    as ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos``, which names no cause."""

    def __init__(self, raw, path):
        self.raw, self.path, self.digest, self.nbytes = raw, path, xxhash.xxh3_64(), 0
        self.failure: OSError | None = None

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        try:
            written = self.raw.write(data)
            if written is not None and written < size:  # a raw file on a full disk writes what fits
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({written} of {size} bytes written)")
        except OSError as exc:
            self.failure = named_error(exc, self.path)
            raise self.failure from None
        self.digest.update(data)
        self.nbytes += size
        return size

    def __getattr__(self, name):  # tell, flush, fileno, close...
        return getattr(self.raw, name)


class HashingFileSystem(FileSystem):
    """DCP's local file system, recording the :func:`file_entry` of every file written (keyed by its name
    after any rename), so shards are hashed while they are written, not read back."""

    def __init__(self):
        super().__init__()
        self.entries: dict[str, dict] = {}

    @contextmanager
    def create_stream(self, path, mode: str):
        try:
            with super().create_stream(path, mode) as raw:
                if "w" not in mode:
                    yield raw
                    return
                stream = _HashingStream(raw, path)
                try:
                    yield stream
                except Exception:
                    if stream.failure is not None:  # the cause, whatever the writer made of it
                        raise stream.failure from None
                    raise
        except OSError as exc:  # also the flush when the file is closed
            raise named_error(exc, path) from None
        self.entries[Path(path).name] = file_entry(stream.nbytes, stream.digest.hexdigest())

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        if Path(path).name in self.entries:
            self.entries[Path(new_path).name] = self.entries.pop(Path(path).name)


def _meta_checksum(meta: dict) -> str:
    """Checksum of ``paratrain.json``'s content ``meta`` (JSON values, as read back) without its own checksum,
    keys sorted."""
    body = {k: v for k, v in meta.items() if k != META_CHECKSUM}
    return xxhash.xxh3_64(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_meta(directory: Path, meta: dict) -> None:
    """Write ``paratrain.json`` atomically, with the checksum of its content."""
    meta = json.loads(json.dumps(meta, default=str))  # as it will be read back
    write_atomic(Path(directory) / META_FILE, json.dumps({**meta, META_CHECKSUM: _meta_checksum(meta)}, indent=1))


def checksum_owner(name: str, world_size: int) -> int:
    """The rank that hashes file ``name`` when ``world_size`` ranks load together: rank R's own shard and
    rank file go to R (mod the world size, so a rank mostly hashes what it reads), the rest to rank 0."""
    match = re.match(r"^(?:__(\d+)_\d+\.distcp|rank_(\d+)\.safetensors)$", name)
    return int(match.group(1) or match.group(2)) % world_size if match else 0


# --- validation -------------------------------------------------------------------------------

# what paratrain.json holds in every format, and of which type (a missing key would fail late, mid-load)
META_KEYS = {"step": int, "layout": dict, "config": dict, "scheduler": (dict, type(None)), "optimizer_settings": dict,
             "files": dict}
LAYOUT_KEYS = ("world_size", "data_parallel", "model_parallel", "pipeline_stage", "zero_stage", "ranks")


def read_meta(path: Path) -> dict:
    """``paratrain.json`` of checkpoint ``path``, its own checksum checked before anything in it is read, then
    that it holds what paratrain writes (CheckpointError naming the file; DamagedCheckpoint when damaged)."""
    file = Path(path) / META_FILE
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: {file} is missing "
                              f"(its save did not finish)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DamagedCheckpoint(f"checkpoint {path} is damaged: file {file} is corrupt ({exc})") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read {file} ({exc.strerror})") from None
    if not isinstance(meta, dict):
        raise DamagedCheckpoint(f"checkpoint {path} is damaged: file {file} does not hold a JSON object")
    if META_CHECKSUM in meta and meta[META_CHECKSUM] != _meta_checksum(meta):  # first: a flipped format too
        raise DamagedCheckpoint(f"checkpoint {path} is damaged: file {file} fails its checksum (its content "
                                f"changed after it was written)")
    if meta.get("format") not in READ_FORMATS:
        raise CheckpointError(f"checkpoint {path}: {file} has format {meta.get('format')!r}, "
                              f"this paratrain reads formats {', '.join(map(str, READ_FORMATS))}")
    if meta["format"] >= 2 and META_CHECKSUM not in meta:
        raise DamagedCheckpoint(f"checkpoint {path} is damaged: file {file} lacks its checksum")
    problem = _meta_problem(meta)
    if problem:
        raise DamagedCheckpoint(f"checkpoint {path} is damaged: file {file} {problem}")
    return meta


TRUST_HOW = ("checkpoint.trust_unverified = true (paratrain train, translate), --trust-unverified (paratrain "
             "export) or trust_unverified=True (Model.train, load_checkpoint)")


def require_checksums(path: Path, meta: dict, trust_unverified: bool) -> None:
    """Refuse a checkpoint of format 1, whose files have no checksums to check, unless ``trust_unverified``: its
    content cannot be told from a damaged or altered one (a checkpoint edited to claim format 1 included)."""
    if meta["format"] >= 2:
        return
    if not trust_unverified:
        raise CheckpointError(f"checkpoint {path} has format {meta['format']}, which records no checksums: its files "
                              f"cannot be checked for damage or changes; load it only if you trust where it came "
                              f"from, with {TRUST_HOW}")
    log.warning("checkpoint: loading %s of format %d without checksums (trusted: its files are checked for their "
                "size only)", path, meta["format"])


def _meta_problem(meta: dict) -> str | None:
    """What ``paratrain.json`` content ``meta`` lacks of what paratrain writes, or None."""
    for key, kind in META_KEYS.items():
        if not isinstance(meta.get(key), kind):
            return f"has no valid {key!r}"
    missing = [k for k in LAYOUT_KEYS if k not in meta["layout"]]
    if missing:
        return f"has no {missing[0]!r} in its layout"
    for name, entry in meta["files"].items():
        if name in ("", ".", "..") or name != Path(name).name:
            return f"lists {name!r}, which is not a file name"
        size, checksum = _recorded(entry)
        if not isinstance(size, int) or (meta["format"] >= 2 and not isinstance(checksum, str)):
            return f"records no size or checksum for {name}"
    return None


def _recorded(entry) -> tuple[int, str | None]:
    """(bytes, checksum or None) of a ``files`` entry: format 2 records both, format 1 the size only."""
    if isinstance(entry, dict):
        return entry.get("bytes"), entry.get(CHECKSUM)
    return entry, None


def recorded_bytes(entry) -> int:
    """The size a ``files`` entry of ``paratrain.json`` records."""
    return _recorded(entry)[0]


def verify(path: Path, meta: dict | None = None, checksums: bool = True) -> tuple[dict, Metadata]:
    """Check that every file of checkpoint ``path`` has its recorded size, DCP's index its checksum (before
    it is read) and fits the shards and, with ``checksums``, every other file its checksum.

    Returns (paratrain.json, DCP metadata); raises DamagedCheckpoint naming the first bad file.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    meta = meta if meta is not None else read_meta(path)
    files = meta["files"]
    for name, entry in files.items():
        file, (size, _) = path / name, _recorded(entry)
        try:
            actual = file.stat().st_size
        except FileNotFoundError:
            raise DamagedCheckpoint(f"checkpoint {path} is damaged: file {file} is missing") from None
        except OSError as exc:
            raise DamagedCheckpoint(f"checkpoint {path} is damaged: file {file} is unreadable "
                                    f"({exc.strerror})") from None
        if actual != size:
            raise DamagedCheckpoint(f"checkpoint {path} is damaged: file {file} has {actual} bytes, "
                                    f"{size} were written")
    raise_if_damaged(check_checksums(path, meta, [DCP_METADATA] if DCP_METADATA in files else []))
    metadata = read_dcp_metadata(path)
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = path / name
        if not file.is_file():
            raise DamagedCheckpoint(f"checkpoint {path} is damaged: shard file {file} is missing")
        if file.stat().st_size < end:
            raise DamagedCheckpoint(f"checkpoint {path} is damaged: shard file {file} is truncated "
                                    f"({file.stat().st_size} bytes, the index needs {end})")
    if checksums:
        raise_if_damaged(check_checksums(path, meta, sorted(n for n in files if n != DCP_METADATA)))
    return meta, metadata


def raise_if_damaged(problem: str | None) -> None:
    """Raise DamagedCheckpoint with ``problem`` (a message naming a damaged file), if any."""
    if problem is not None:
        raise DamagedCheckpoint(problem)


def holds_tensor_data(name: str) -> bool:
    """Whether file ``name`` of a checkpoint holds tensor data in bulk (a DCP shard, the integrated model): a
    load hashes it while DCP reads the shards. Every other file is small and is hashed before any is read."""
    return name.endswith(".distcp") or name == INTEGRATED_FILE


def check_checksums(path: Path, meta: dict, names: list[str]) -> str | None:
    """The first of files ``names`` of checkpoint ``path`` whose content fails its recorded checksum, as a
    message naming it, or None when all pass (files of format 1 have none to check)."""
    for name in names:
        size, recorded = _recorded(meta["files"][name])
        if recorded is None:
            continue
        file = Path(path) / name
        try:
            actual = file_checksum(file)
        except OSError as exc:
            return f"checkpoint {path} is damaged: file {file} is unreadable ({exc.strerror})"
        if actual != recorded:
            return (f"checkpoint {path} is damaged: file {file} fails its checksum ({CHECKSUM} {actual}, "
                    f"{recorded} when written)")
    return None


class ChecksumCheck:
    """Hash files of a checkpoint in a background thread (while DCP reads them); ``result()`` waits and
    returns the message naming the first damaged file, or None."""

    def __init__(self, path: Path, meta: dict, names: list[str]):
        self._problem: str | None = None

        def run():
            try:
                self._problem = check_checksums(path, meta, names)
            except Exception as exc:  # reported by result(), never lost in the thread
                self._problem = f"checkpoint {path}: checking checksums failed ({exc})"
        self._thread = threading.Thread(target=run, name="paratrain-checksums", daemon=True)
        self._thread.start()

    def result(self) -> str | None:
        self._thread.join()
        return self._problem


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


def complete_checkpoints(root: Path, warn: bool = True, prefix: str | None = None) -> list[Path]:
    """The complete checkpoints (holding ``paratrain.json``) under ``root`` named with ``prefix`` (None: any),
    newest first, skipping (with a warning) saves that were killed; :func:`verify` says if they are intact."""
    root = Path(root)
    if warn and root.is_dir():
        for tmp in sorted(root.glob(TMP_PREFIX + "*")):
            log.warning("checkpoint: ignoring %s, a save that did not finish (job killed while saving?)", tmp)
    found = []
    for _, path in step_dirs(root, prefix):
        if (path / META_FILE).is_file():
            pointer = root / LATEST
            if warn and not found and pointer.is_file() and pointer.read_text(errors="replace").strip() != path.name:
                log.info("checkpoint: %s is newer than %s names (killed before the pointer was updated); using it",
                         path.name, pointer)
            found.append(path)
        elif warn:
            log.warning("checkpoint: skipping %s, its save did not finish (no %s); using an earlier one",
                        path, META_FILE)
    return found


def newest_complete(root: Path, warn: bool = True, prefix: str | None = None) -> Path | None:
    """The newest of :func:`complete_checkpoints`, or None."""
    found = complete_checkpoints(root, warn, prefix)
    return found[0] if found else None


def is_checkpoint(path: Path) -> bool:
    """Whether directory ``path`` is one checkpoint, complete or not (rather than a directory of them): it holds
    ``paratrain.json`` or DCP's index, or is named as a checkpoint and holds none."""
    if (path / META_FILE).is_file() or (path / DCP_METADATA).is_file():
        return True
    return (parse_name(path.name) is not None and path.is_dir() and not step_dirs(path, None)
            and not (path / "checkpoints").is_dir())


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from what a user names: the checkpoint, a checkpoint dir or a run dir."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    for root in (path, path / "checkpoints"):
        found = newest_complete(root, warn=False)
        if found is not None:
            return found
    raise CheckpointError(f"no checkpoint at {path}: expected a step_* (or <prefix>-<epoch>_<step>) directory "
                          f"holding {META_FILE}, or a directory of them")


def checkpoints_in(path: str | Path) -> list[Path]:
    """Checkpoint ``path`` itself, or every ``step_*`` directory of a checkpoints or run directory, newest first
    (complete or not)."""
    path = Path(path)
    if is_checkpoint(path):
        return [path]
    for root in (path, path / "checkpoints"):
        found = [p for _, p in step_dirs(root, None)]
        if found:
            return found
    raise CheckpointError(f"no checkpoint at {path}: expected a step_* (or <prefix>-<epoch>_<step>) directory "
                          f"holding {META_FILE}, or a checkpoints or run directory holding them")


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    with suppress(OSError):
        os.fsync(fd)
    os.close(fd)


def write_atomic(file: Path, content: str | bytes | Callable[[Path], None]) -> None:
    """Write ``content`` to ``file`` through a temporary file beside it and a rename, so that ``file`` is either
    its old self or wholly new: text, bytes, or a function that writes the temporary file it is given (a
    serializer writing to a path). The temporary name is this process's own (``.<name>.<pid>-<random>.tmp``), so
    that two writers never share it; it is removed when the write fails."""
    file = Path(file)
    tmp = file.with_name(f".{file.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        if callable(content):
            content(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        else:
            write_file(tmp, content.encode() if isinstance(content, str) else content)
        os.replace(tmp, file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(file.parent)


@contextmanager
def _dcp_call():
    """Around a DCP call: host tensors on the CPU (DCP plans shard offsets of 2D (FSDP x TP) tensors with tensors
    made on the default device), no warning for one process (intended), and the exception behind DCP's
    ``CheckpointException`` (the first failed rank's, e.g. a full disk's OSError) raised in place of it, a
    BaseException whose text is a traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings(), torch.device("cpu"):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as exc:
            failure = next(iter(exc.failures.values()), None)
            if isinstance(failure, tuple) and isinstance(failure[0], Exception):
                raise failure[0] from None
            raise


def dcp_save(state: dict, path: Path) -> dict[str, dict]:
    """``dcp.save`` of plain/DTensor tensors, one file per rank, fsynced; no process group needed.

    Returns the :func:`file_entry` of every file this rank wrote (its shards; on rank 0 also ``.metadata``).
    """
    writer = FileSystemWriter(path, single_file_per_rank=True, sync_files=True)
    writer.fs = HashingFileSystem()
    with _dcp_call():
        dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized())
    return writer.fs.entries


def dcp_load(state: dict, path: Path, no_dist: bool | None = None) -> None:
    """``dcp.load`` in place into ``state``'s tensors, tensors only, through the safe metadata reader."""
    no_dist = (not dist.is_initialized()) if no_dist is None else no_dist
    with _dcp_call():
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=TensorOnlyLoadPlanner(), no_dist=no_dist)
