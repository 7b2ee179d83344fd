"""``paratrain stop``: ``stop.json`` in the job's (shared) run directory asks every node's launcher to stop its
ranks and record it; ``stop`` itself signals only this host's processes whose launcher is gone, and after the
grace period whatever is left here.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

from paratrain import progress
from paratrain.launch.jobs import ACTIVE, PROGRESS_DIR, Job, JobError, load, pid_alive

STOP_FILE = "stop.json"
CONFIRM_S = 10.0  # after the grace period, how long launchers get to record the outcome


@dataclass
class StopRequest:
    """What ``stop.json`` asks of every launcher of a job."""

    now: bool = False  # SIGKILL at once, no graceful save
    grace_s: float = 10.0  # SIGTERM -> SIGKILL
    reason: str = "paratrain stop"
    host: str = field(default_factory=socket.gethostname)
    time: float = field(default_factory=time.time)


def request(job_dir: str | Path, stop: StopRequest) -> None:
    """Ask every launcher of the job in ``job_dir`` to stop its ranks."""
    path = Path(job_dir) / STOP_FILE
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(stop)) + "\n")
    os.replace(tmp, path)


def pending(job_dir: str | Path, since: float) -> StopRequest | None:
    """The stop request of ``job_dir`` made at or after ``since`` (a launcher's start), if any."""
    try:
        stop = StopRequest(**json.loads((Path(job_dir) / STOP_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None  # none, or one being replaced
    return stop if stop.time >= since else None


def signal_pid(pid: int, sig: int) -> bool:
    """Send ``sig`` to ``pid``; False if it no longer exists."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def stop(job: Job, grace_s: float = 10.0, now: bool = False, out=None) -> Job:
    """Stop every node of ``job`` and wait for their launchers to record it; returns the final record."""
    out = out or sys.stdout
    if job.state not in ACTIVE:  # a "lost" job (launcher gone) may have ranks left to stop
        raise JobError(f"job {job.name!r} is not running (state {job.shown_state()})")
    here = socket.gethostname()
    nodes, unreadable = job.node_records()
    for problem in unreadable:
        print(f"{job.name}: {problem}; that node acts on the stop request alone", file=out)
    request(job.dir, StopRequest(now=now, grace_s=grace_s))
    records = [job, *nodes]
    local = [r for r in records if r.host == here]
    launchers, ranks, orphans = _local_processes(local, job.dir)
    for pid in (ranks if now else orphans).values():
        signal_pid(pid, signal.SIGKILL if now else signal.SIGTERM)
        signal_pid(pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
    start, killed = time.monotonic(), {}
    while time.monotonic() < start + grace_s + CONFIRM_S:
        if time.monotonic() > start + grace_s and not killed:
            killed = _kill(_local_processes(local, job.dir)[2])  # those still ranks of this job
        # done when every launcher that can record its stop has, and the processes here have exited
        recording = [r for r in _active(records) if not r.launcher_gone()]
        if not recording and not any(map(pid_alive, [*launchers.values(), *orphans.values()])):
            break
        time.sleep(0.2)
    # a launcher that recorded its stop is left to finish exiting; one that did not, and its ranks, are killed
    stuck_launchers, stuck_ranks, _ = _local_processes([r for r in _active(records) if r.host == here], job.dir)
    killed.update(_kill({**_local_processes(local, job.dir)[2], **stuck_ranks, **stuck_launchers}))
    if killed:
        print(f"{job.name}: SIGKILL after {grace_s:g} s grace: {', '.join(killed)}", file=out)
    for record in _active([r for r in records if r.host != here]):
        if record.launcher_gone():
            print(f"{job.name}: {_node(record)} counts as lost: {record.lost_because()}", file=out)
        else:
            print(f"{job.name}: {_node(record)} on {record.host} has not recorded its stop yet "
                  f"(it acts on {Path(job.dir) / STOP_FILE})", file=out)
    final = load(job.name)
    if final.state in ACTIVE and (final.host == here or final.launcher_gone()):  # its launcher was gone or killed
        final.finish("stopped", 128 + (signal.SIGKILL if now or killed else signal.SIGTERM))
    print(f"{job.name}: {final.outcome}", file=out)
    return final


def _local_processes(records: list[Job], job_dir: str) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(launchers alive, ranks, ranks whose launcher is gone) of the active ``records``, as who -> pid; a
    recorded pid counts only while it is still this job's launcher (its start time) or one of its ranks (their
    environment): a reused pid is left alone."""
    launchers, ranks, orphans = {}, {}, {}
    marker = f"{progress.DIR_ENV}={Path(job_dir) / PROGRESS_DIR}".encode()  # in the environment of the job's ranks
    for record in records:
        if record.state not in ACTIVE:
            continue
        has_launcher = record.launcher_alive()
        if has_launcher:
            launchers[f"launcher of {_node(record)}"] = record.launcher_pid
        for rank, pid in sorted(record.pids.items(), key=lambda kv: int(kv[0])):
            with suppress(OSError):  # (Linux /proc) a pid gone or not ours
                if marker not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    continue
                ranks[f"rank {rank}"] = pid
                if not has_launcher:
                    orphans[f"rank {rank}"] = pid
    return launchers, ranks, orphans


def _kill(targets: dict[str, int]) -> dict[str, int]:
    """SIGKILL those of ``targets`` still alive; returns them."""
    return {who: pid for who, pid in targets.items() if pid_alive(pid) and signal_pid(pid, signal.SIGKILL)}


def _node(record: Job) -> str:
    return "the coordinator" if record.is_coordinator else f"node {record.node_rank}"


def _active(records: list[Job]) -> list[Job]:
    """Those of ``records`` whose file still says they are starting or running."""
    active = []
    for record in records:
        with suppress(JobError):  # a damaged record cannot be waited for
            if Job.from_file(record.path).state in ACTIVE:
                active.append(record)
    return active
