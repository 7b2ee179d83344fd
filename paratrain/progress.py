"""Per-rank progress records that the launcher reads: last step, collectives issued, heartbeat, saved step.

A rank started by ``paratrain launch`` finds ``$PARATRAIN_PROGRESS_DIR`` set. It calls :func:`start` once
after joining its process group, :func:`step_done` after every step and :func:`saved` after every
checkpoint; a daemon thread rewrites ``rank{R}.json`` in that directory every :data:`HEARTBEAT_S`
seconds (atomically, without fsync). :func:`step_done` only stores an integer, so the training loop pays
nothing and never waits for a device. A rank asked to stop (SIGTERM/SIGINT) that saved a checkpoint ends
with ``sys.exit(progress.stopped(step))``. The launcher reads the records (:func:`read`) to name the rank
that stopped making progress when a collective times out, and to report the step of the checkpoint saved by
ranks that exit with :data:`EXIT_STOPPED`.

This module imports nothing heavy, so the trainer, ``doctor`` and the launcher can all use it.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
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


class _Reporter:
    """Keeps one rank's record and rewrites its file on every heartbeat."""

    def __init__(self, path: Path, rank: int):
        self.path, self.record = path, Progress(rank=rank, pid=os.getpid())
        self.lock = threading.Lock()

    def write(self) -> None:
        with self.lock:
            self.record.collectives = _collectives_issued()
            self.record.heartbeat = time.time()
            tmp = self.path.with_name(f"{self.path.name}.tmp")
            tmp.write_text(json.dumps(asdict(self.record)))
            os.replace(tmp, self.path)

    def beat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            try:
                self.write()
            except OSError:
                pass  # a full or vanished directory must not end the training; the next beat retries


_reporter: _Reporter | None = None


def start(rank: int | None = None) -> bool:
    """Start reporting this rank's progress if the launcher asked for it; True if it did.

    ``rank`` defaults to ``$RANK``. Call once, after the process group is initialised (so that the
    collectives it issued can be counted); later calls do nothing.
    """
    global _reporter
    directory = os.environ.get(DIR_ENV)
    if _reporter is not None or not directory:
        return _reporter is not None
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    Path(directory).mkdir(parents=True, exist_ok=True)
    _reporter = _Reporter(record_path(directory, rank), rank)
    _reporter.write()
    threading.Thread(target=_reporter.beat, name="paratrain-progress", daemon=True).start()
    return True


def step_done(step: int) -> None:
    """Record that ``step`` (a Python int) is complete; written by the next heartbeat."""
    if _reporter is not None:
        _reporter.record.step = step


def saved(step: int) -> None:
    """Record, at once, that a checkpoint of ``step`` is saved (the launcher reports it when the job stops)."""
    if _reporter is not None:
        _reporter.record.saved_step = step
        try:
            _reporter.write()
        except OSError:
            pass  # as for a heartbeat: a full or vanished directory must not end the training


def stopped(saved_step: int | None) -> int:
    """Record that this rank stops on request after saving a checkpoint of ``saved_step`` (None: stopped
    before its first step, nothing to save); returns :data:`EXIT_STOPPED`, the exit code to end the process
    with.

    From here on SIGTERM and SIGINT are ignored: when the first rank exits, torchrun's agent sends SIGTERM to
    the others, and Python restores the default handlers while it exits, so a rank that saved would otherwise
    die of that signal on its way out and no longer look saved.
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
