"""Job records: ``job.json`` in each job's run directory, listing, logs and stop.

The registry is one directory (``$PARATRAIN_HOME``, default ``runs``) holding
one run directory per job name. A launcher process owns its job's record and
rewrites it atomically as the job moves through its states.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from paratrain.errors import UserError

ACTIVE = ("starting", "running")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class JobError(UserError, ValueError):
    """A job that does not exist, a bad job name, or an operation its state does not allow."""


def jobs_home() -> Path:
    """The registry directory: ``$PARATRAIN_HOME`` or ``runs`` (relative to the working directory)."""
    return Path(os.environ.get("PARATRAIN_HOME") or "runs").absolute()


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise JobError(f"job name {name!r}: use letters, digits, '.', '_' and '-' (starting with a letter or digit)")
    return name


def new_name(command: list[str]) -> str:
    """``<subcommand>-YYYYmmdd-HHMMSS-<4 hex>``, unique in practice."""
    prefix = re.sub(r"[^A-Za-z0-9]", "", command[0]) if command else "job"
    return f"{prefix or 'job'}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(2).hex()}"


@dataclass
class Job:
    """The record of one launched job, saved as ``job.json`` (``node{R}.json`` for the other nodes)."""

    name: str
    dir: str
    command: list[str] = field(default_factory=list)
    argv: list[str] = field(default_factory=list)
    run_dir: str = ""
    host: str = field(default_factory=socket.gethostname)
    hosts: list[str] = field(default_factory=list)
    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int = 1
    launcher_pid: int = field(default_factory=os.getpid)
    pids: dict[str, int] = field(default_factory=dict)  # global rank -> pid (this node's ranks)
    start_time: float = field(default_factory=time.time)
    end_time: float | None = None
    state: str = "starting"  # starting, running, succeeded, failed, stopped
    exit_code: int | None = None
    exit_codes: dict[str, int] = field(default_factory=dict)  # global rank -> exit code (-N: signal N)
    failing_rank: int | None = None
    failure: str = ""
    record: str = "job.json"  # node{R}.json for a node of a job another process owns

    @property
    def path(self) -> Path:
        return Path(self.dir) / self.record

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def save(self) -> None:
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, self.path)

    @classmethod
    def from_file(cls, path: Path) -> "Job":
        data = json.loads(path.read_text())
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def finish(self, state: str, exit_code: int, exit_codes: dict[int, int] | None = None,
               failing_rank: int | None = None, failure: str = "") -> None:
        self.state, self.exit_code, self.end_time = state, exit_code, time.time()
        self.exit_codes.update({str(r): c for r, c in (exit_codes or {}).items()})
        self.failing_rank, self.failure = failing_rank, failure
        self.save()

    def log_path(self, rank: int) -> Path:
        return Path(self.dir) / f"rank{rank}.log"

    def shown_state(self) -> str:
        """The recorded state, or ``lost`` when an active job's launcher (on this host) is gone."""
        if self.state in ACTIVE and self.host == socket.gethostname() and not pid_alive(self.launcher_pid):
            return "lost"
        return self.state

    def all_pids(self) -> dict[int, int]:
        """Rank -> pid over this record and the other nodes' ``node{R}.json`` records."""
        pids = {int(r): p for r, p in self.pids.items()}
        for node in Path(self.dir).glob("node*.json"):
            pids.update({int(r): p for r, p in Job.from_file(node).pids.items()})
        return pids

    def last_metrics(self) -> dict:
        """The last ``metrics.jsonl`` record of the run directory ({} if none yet)."""
        path = Path(self.run_dir or self.dir) / "metrics.jsonl"
        last = {}
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    last = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line being written
        return last


def load(name: str) -> Job:
    path = jobs_home() / check_name(name) / "job.json"
    if not path.exists():
        known = ", ".join(j.name for j in list_jobs()) or "none"
        raise JobError(f"no job {name!r} in {jobs_home()} (jobs: {known})")
    return Job.from_file(path)


def list_jobs() -> list[Job]:
    """Every job of the registry, oldest first."""
    home = jobs_home()
    jobs = [Job.from_file(p) for p in home.glob("*/job.json")] if home.is_dir() else []
    return sorted(jobs, key=lambda j: j.start_time)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited: its state letter in /proc is Z
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def tail(path: Path, lines: int = 20) -> list[str]:
    """The last ``lines`` lines of a text file ([] if missing)."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
        return f.read().decode(errors="replace").splitlines()[-lines:]


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def format_table(jobs: list[Job]) -> str:
    """The ``paratrain jobs`` table, then what went wrong in each failed job."""
    rows = [("NAME", "STATE", "RANKS", "START", "ELAPSED", "STEP", "LOSS", "EXIT")]
    notes = []
    for job in jobs:
        state = job.shown_state()
        metrics = job.last_metrics()
        end = job.end_time or (time.time() if state in ACTIVE else job.start_time)
        exit_text = "" if job.exit_code is None else str(job.exit_code)
        if job.failing_rank is not None:
            exit_text += f" (rank {job.failing_rank})"
            notes.append(f"{job.name}: {job.failure}")
        loss = metrics.get("loss")
        rows.append((job.name, state, str(job.world_size),
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.start_time)),
                     _duration(end - job.start_time), str(metrics.get("step", "")),
                     f"{loss:.4f}" if isinstance(loss, (int, float)) else "", exit_text))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    return "\n\n".join([table, *notes])


def follow(job: Job, rank: int, out=None, poll_s: float = 0.5) -> None:
    """Print a rank's log and keep printing what is appended until the job is no longer active."""
    out = out or sys.stdout
    path = job.log_path(rank)
    position = 0
    while True:
        active = load(job.name).shown_state() in ACTIVE
        if path.exists():
            with open(path, "rb") as f:
                f.seek(position)
                chunk = f.read()
                position += len(chunk)
            out.write(chunk.decode(errors="replace"))
            out.flush()
        if not active:
            return
        time.sleep(poll_s)


def stop(job: Job, grace_s: float = 10.0, out=None) -> None:
    """SIGTERM the launcher and every rank, wait up to ``grace_s``, SIGKILL what is left; state ``stopped``."""
    out = out or sys.stdout
    if job.shown_state() not in ACTIVE:
        raise JobError(f"job {job.name!r} is not running (state {job.shown_state()})")
    if job.host != socket.gethostname():
        raise JobError(f"job {job.name!r} was launched on {job.host}: run 'paratrain stop' there")
    targets = {"launcher": job.launcher_pid, **{f"rank {r}": p for r, p in sorted(job.all_pids().items())}}
    for pid in targets.values():
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in targets.values()):
        time.sleep(0.2)
    killed = [who for who, pid in targets.items() if pid_alive(pid) and _signal(pid, signal.SIGKILL)]
    if killed:
        print(f"{job.name}: SIGKILL after {grace_s:g} s grace: {', '.join(killed)}", file=out)
    job = load(job.name)  # the launcher may have recorded exit codes on its way out
    job.finish("stopped", job.exit_code if job.exit_code is not None else -signal.SIGTERM,
               failing_rank=None, failure="")
    print(f"{job.name}: stopped", file=out)


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
