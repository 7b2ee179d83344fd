"""One run per directory: a run holds an advisory lock on its run directory and its checkpoint directory.

The lock is a POSIX record lock (``fcntl.lockf``) on ``<directory>/.paratrain.lock``, taken by rank 0 before anything
is written there. POSIX locks rather than ``flock``: NFS (through its lock manager) and most cluster file systems
honour them between nodes, where ``flock`` may lock on one node only. The kernel drops the lock when its process ends,
however it ends, so the lock file a killed run leaves never blocks; the holder's pid, host, start time and job written
into the file are information for the refusal message only. A run that ends removes the file. A second run is refused
before it writes anything there: it opens the file without truncating it and reads it.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from paratrain.errors import UserError

LOCK_FILE = ".paratrain.lock"
_held: dict[str, tuple[int, int]] = {}  # lock file -> (this process's pid, its open descriptor)


def holder_info() -> dict:
    """Who this process is, as the lock file records it."""
    from paratrain import progress

    progress_dir = os.environ.get(progress.DIR_ENV)
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "job": Path(progress_dir).parent.name if progress_dir else None,  # the launcher's <jobs>/<name>/progress
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:200]}


def describe_holder(text: str) -> str:
    """The holder a lock file's content names, in words."""
    try:
        info = json.loads(text)
        words = f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (ValueError, TypeError, KeyError):
        return "a process whose details are not recorded"
    if info.get("job"):
        words += f", job {info['job']}"
    return words + (f" ({info['command']})" if info.get("command") else "")


def lock_problem(directory: Path, key: str) -> str | None:
    """Lock ``directory`` (given as ``key``) for this process, until :func:`release` or its end; returns why it is in
    use by another process (naming the holder), or None once held. Taking it again in this process holds it still."""
    directory.mkdir(parents=True, exist_ok=True)
    file = directory / LOCK_FILE
    name = str(file.resolve())
    if _held.get(name, (None,))[0] == os.getpid():
        return None
    while True:
        fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)  # never O_TRUNC: the holder's details stay
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace")
            os.close(fd)
            return (f"{key}={directory} is in use by another run: {describe_holder(holder)}; wait for it to end or "
                    f"stop it, or choose another {key}")
        if _same_file(fd, file):
            break
        os.close(fd)  # its holder removed the file between our open and our lock: lock the one there now
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder_info()).encode(), 0)
    _held[name] = (os.getpid(), fd)  # closing any descriptor of the file would drop a POSIX lock: keep it open
    return None


def _same_file(fd: int, file: Path) -> bool:
    try:
        on_disk = os.stat(file)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def release(directory: Path) -> None:
    """Drop this process's lock on ``directory``, if it holds one, and remove the lock file (a run that ends; one
    that is killed leaves the file, which blocks nothing)."""
    file = Path(directory) / LOCK_FILE
    held = _held.pop(str(file.resolve()), None)
    if held is not None and held[0] == os.getpid():
        file.unlink(missing_ok=True)  # while still locked: a run that opened this file retries on a new one
        os.close(held[1])


def hold(directories: list[tuple[str, Path]]) -> None:
    """Rank 0 locks each of ``directories`` ((key, directory) pairs) before anything is written there; every rank
    raises the same UserError when one is in use by another run (a collective when a process group is up), and
    rank 0 then holds none of them."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    problem = None
    if rank == 0:
        for key, directory in directories:
            problem = problem or lock_problem(Path(directory), key)
    if dist.is_initialized():
        shared = [problem]
        dist.broadcast_object_list(shared, src=0)
        problem = shared[0]
    if problem:
        for _, directory in directories:
            release(directory)
        raise UserError(problem)
