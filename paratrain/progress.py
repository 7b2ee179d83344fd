"""Per-rank progress records that the launcher and ``paratrain jobs`` read: last step and loss, collectives issued,
heartbeat, saved step.

A rank started by ``paratrain launch`` (``$PARATRAIN_PROGRESS_DIR`` set) calls :func:`start` once, then
:func:`step_done` after every step (it only stores an integer: the loop never waits for a device),
:func:`loss_known` when losses reach the host and :func:`saved` after every checkpoint; a daemon thread
rewrites ``rank{R}.json`` every :data:`HEARTBEAT_S` seconds. The launcher reads the records to name the rank
that stopped making progress when a collective times out, and the step saved by ranks that exit with
:data:`EXIT_STOPPED`; ``paratrain jobs`` shows rank 0's step and loss. Imports nothing heavy.
"""
from __future__ import annotations

import atexit
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path

EXIT_STOPPED = 4  # a rank stopped by SIGTERM/SIGINT after saving a checkpoint; torchrun passes it through
DIR_ENV = "PARATRAIN_PROGRESS_DIR"
HEARTBEAT_S = 1.0


@dataclass
class Progress:
    """What one rank last reported; ``heartbeat`` is the wall-clock time of that report."""

    rank: int
    pid: int = 0
    step: int | None = None  # last completed step
    collectives: int | None = None  # collectives issued on the default process group
    saved_step: int | None = None  # step of the last checkpoint saved
    heartbeat: float = 0.0
    loss_step: int | None = None  # the last step whose loss is on the host (the loop brings losses in batches)
    loss: float | None = None  # its loss


def record_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.json"


def _collectives_issued() -> int | None:
    """The default process group's sequence number (a host-side counter), None before it exists."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
    except (AttributeError, RuntimeError, ValueError):  # no sequence numbers, or the group just went away
        return None


_lock = threading.Lock()
_record: Progress | None = None  # this rank's, once start() ran
_path: Path | None = None


def _write(count_collectives: bool = True) -> None:
    with _lock:
        if count_collectives:
            _record.collectives = _collectives_issued()
        _record.heartbeat = time.time()
        tmp = _path.with_name(f"{_path.name}.tmp")
        tmp.write_text(json.dumps(asdict(_record)))
        os.replace(tmp, _path)


def _write_quietly(count_collectives: bool = True) -> None:
    with suppress(OSError):  # a full or vanished directory must not end the training; the next beat retries
        _write(count_collectives)


def _beat() -> None:
    while True:
        time.sleep(HEARTBEAT_S)
        _write_quietly()


def start(rank: int | None = None) -> bool:
    """Start reporting this rank's (default ``$RANK``) progress if the launcher asked for it; True if it did.
    Call after the process group is initialised (its collectives are counted); later calls do nothing."""
    global _record, _path
    directory = os.environ.get(DIR_ENV)
    if _record is not None or not directory:
        return _record is not None
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    Path(directory).mkdir(parents=True, exist_ok=True)
    _record, _path = Progress(rank=rank, pid=os.getpid()), record_path(directory, rank)
    _write()
    threading.Thread(target=_beat, name="paratrain-progress", daemon=True).start()
    # the last step and loss, which a process ending before the next beat has not written yet; the collectives
    # as the last beat counted them (the process group may be gone)
    atexit.register(_write_quietly, count_collectives=False)
    return True


def step_done(step: int) -> None:
    """Record that ``step`` (a Python int) is complete; written by the next heartbeat."""
    if _record is not None:
        _record.step = step


def loss_known(step: int, loss: float) -> None:
    """Record the loss of ``step`` once it is on the host (``paratrain jobs`` shows it); written by the next
    heartbeat."""
    if _record is not None:
        _record.loss_step, _record.loss = step, loss


def saved(step: int) -> None:
    """Record, at once, that a checkpoint of ``step`` is saved (the launcher reports it when the job stops)."""
    if _record is not None:
        _record.saved_step = step
        _write_quietly()


def stopped(saved_step: int | None) -> int:
    """Record that this rank stops on request after saving a checkpoint of ``saved_step`` (None: nothing
    saved); returns :data:`EXIT_STOPPED`, the exit code to end the process with.

    SIGTERM and SIGINT are ignored from here on: torchrun's agent sends SIGTERM to the others when the first
    rank exits, which would kill a rank that saved on its way out (Python restores the default handlers).
    """
    if saved_step is not None:
        saved(saved_step)
    faulthandler.unregister(signal.SIGTERM)  # else its exit puts back the handler it displaced, ours or SIG_DFL
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    return EXIT_STOPPED


def read(directory: str | Path) -> dict[int, Progress]:
    """Rank -> its last record, for every readable ``rank{R}.json`` in ``directory``."""
    records = {}
    for path in Path(directory).glob("rank*.json"):
        try:
            record = Progress(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # not a record this module wrote
        records[record.rank] = record
    return records


def clear(directory: str | Path, ranks: range) -> None:
    """Remove the records of ``ranks`` left by an earlier run of the same job."""
    for rank in ranks:
        record_path(directory, rank).unlink(missing_ok=True)
