"""Job records: ``job.json`` (other nodes: ``node{R}.json``) in each job's run directory under ``$PARATRAIN_HOME``,
rewritten atomically by its launcher; listing (an unreadable record hides no other job) and logs."""
from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
import types
import typing
from contextlib import suppress
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from paratrain import progress
from paratrain.config import NAME_RULE, is_plain_name
from paratrain.errors import UserError

ACTIVE = ("starting", "running")
HEARTBEAT_S = 30.0  # how often a running launcher rewrites its record
LOST_AFTER_S = 300.0  # a record of another host not rewritten for this long: its launcher is gone
PROGRESS_DIR = "progress"  # in a job's directory: the ranks' progress records (paratrain.progress)


class JobError(UserError, ValueError):
    """A job that does not exist, a bad job name, or an operation its state does not allow."""


class UnreadableRecord(JobError):
    """A ``job.json`` or ``node{R}.json`` that is not a job record; ``reason`` says why."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: unreadable ({reason})")
        self.path, self.reason = path, reason


def jobs_home() -> Path:
    """The registry directory: ``$PARATRAIN_HOME`` or ``runs`` (relative to the working directory)."""
    return Path(os.environ.get("PARATRAIN_HOME") or "runs").absolute()


def check_name(name: str) -> str:
    """``name`` if it can name a job directory (the rule of ``run.name``), else a JobError saying why."""
    if not is_plain_name(name):
        raise JobError(f"job name {name!r}: {NAME_RULE}")
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
    # its start time (process_start): the pid is this job's launcher only while the process that holds it started
    # then (None: not recorded, the pid is trusted)
    launcher_start: int | None = None
    pids: dict[str, int] = field(default_factory=dict)  # global rank -> pid (this node's ranks)
    start_time: float = field(default_factory=time.time)
    end_time: float | None = None
    state: str = "starting"  # starting, running, succeeded, failed, stopped
    exit_code: int | None = None
    exit_codes: dict[str, int] = field(default_factory=dict)  # global rank -> exit code (-N: signal N)
    failing_rank: int | None = None
    failure: str = ""
    saved_step: int | None = None  # stopped after every rank saved a checkpoint of this step
    record: str = "job.json"  # node{R}.json for a node of a job another process owns
    heartbeat: float = field(default_factory=time.time)  # when the launcher last saved this record
    max_restarts: int = 0  # times torchrun may restart the ranks after a failure
    # every start of the ranks: number, start_time, end_time, state, failing_rank, exit_code (of that rank)
    attempts: list[dict[str, int | float | str | None]] = field(default_factory=list)
    slurm_job_id: str = field(default_factory=lambda: os.environ.get("SLURM_JOB_ID", ""))
    slurm_restart_count: int = field(default_factory=lambda: _slurm_restart_count(os.environ))

    @property
    def path(self) -> Path:
        return Path(self.dir) / self.record

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def save(self) -> None:
        self.heartbeat = time.time()
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, self.path)

    @classmethod
    def from_file(cls, path: Path) -> "Job":
        """The record in ``path``; an UnreadableRecord if it is not valid UTF-8 JSON with fields of the right types."""
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except OSError as exc:
            raise UnreadableRecord(path, f"cannot read: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise UnreadableRecord(path, f"not UTF-8 text (byte {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise UnreadableRecord(path, f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
        if not isinstance(data, dict):
            raise UnreadableRecord(path, f"a JSON {type(data).__name__}, not an object")
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.name not in data:
                if f.name in ("name", "dir"):
                    raise UnreadableRecord(path, f"no {f.name!r}")
            elif not _has_type(data[f.name], hints[f.name]):
                raise UnreadableRecord(path, f"{f.name!r} is {json.dumps(data[f.name])[:40]}, not {hints[f.name]}")
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def finish(self, state: str, exit_code: int, exit_codes: dict[int, int] | None = None,
               failing_rank: int | None = None, failure: str = "", saved_step: int | None = None) -> None:
        self.state, self.exit_code, self.end_time = state, exit_code, time.time()
        self.exit_codes.update({str(r): c for r, c in (exit_codes or {}).items()})
        self.failing_rank, self.failure, self.saved_step = failing_rank, failure, saved_step
        if self.attempts:  # the last attempt ended as the job did
            self.attempts[-1].update(end_time=self.end_time, state=state, failing_rank=failing_rank,
                                     exit_code=self.exit_codes.get(str(failing_rank)))
        self.save()

    def log_path(self, rank: int) -> Path:
        return Path(self.dir) / f"rank{rank}.log"

    def beat(self) -> None:
        """Save the record if the last save is :data:`HEARTBEAT_S` old: other hosts tell a live launcher so."""
        if time.time() - self.heartbeat >= HEARTBEAT_S:
            self.save()

    def lost_because(self) -> str:
        """Why the launcher is provably gone ('' while it may live): the Slurm job was requeued since (a higher
        ``SLURM_RESTART_COUNT``), its pid on this host is dead, or another host's has not saved the record for
        :data:`LOST_AFTER_S`."""
        was, now = self.slurm_restart_count, _slurm_restart_count(os.environ)
        if self.slurm_job_id and os.environ.get("SLURM_JOB_ID") == self.slurm_job_id and now > was:
            return f"Slurm requeued job {self.slurm_job_id} since (SLURM_RESTART_COUNT {was} -> {now})"
        if self.host == socket.gethostname():
            if not pid_alive(self.launcher_pid):
                return f"its launcher (pid {self.launcher_pid} on this host) is gone"
            if not self.launcher_alive():
                return (f"its launcher (pid {self.launcher_pid} on this host) is gone: another process, started "
                        f"later, holds that pid now")
            return ""
        age = time.time() - self.heartbeat
        if age <= LOST_AFTER_S:
            return ""
        return f"its launcher on {self.host} has not saved it for {age:.0f} s (more than {LOST_AFTER_S:g} s)"

    def launcher_gone(self) -> bool:
        return bool(self.lost_because())

    def launcher_alive(self) -> bool:
        """Whether this host's process with the recorded launcher pid is this job's launcher (alive, and started
        when the recorded one did; a record without that time trusts the pid)."""
        return is_process(self.launcher_pid, self.launcher_start)

    def shown_state(self) -> str:
        """The recorded state, or ``lost`` when an active job's launcher is gone."""
        return "lost" if self.state in ACTIVE and self.launcher_gone() else self.state

    @property
    def is_coordinator(self) -> bool:
        """True for the record of a hostfile/rank-table launch, whose nodes keep their own records."""
        return bool(self.hosts)

    @property
    def outcome(self) -> str:
        """``stopped, saved at step N`` for a job stopped after saving, else its state."""
        if self.state == "stopped" and self.saved_step is not None:
            return f"stopped, saved at step {self.saved_step}"
        return self.state

    def node_records(self) -> tuple[list["Job"], list[UnreadableRecord]]:
        """The ``node{R}.json`` records beside this one, and the problems of those that cannot be read."""
        records, problems = [], []
        for path in sorted(Path(self.dir).glob("node*.json")):
            try:
                records.append(Job.from_file(path))
            except UnreadableRecord as exc:
                problems.append(exc)
        return records, problems

    def last_metrics(self) -> dict:
        """The last ``metrics.jsonl`` record of the run directory ({} if none yet)."""
        path = Path(self.run_dir or self.dir) / "metrics.jsonl"
        last = {}
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            with suppress(json.JSONDecodeError):  # a line being written
                last = json.loads(line)
        return last

    def last_step(self) -> tuple[int | None, float | None]:
        """(step, loss) last logged in ``metrics.jsonl``, else (for a script's ``Model.train``, which writes none)
        rank 0's progress record: its last step and the last loss on the host."""
        metrics = self.last_metrics()
        if metrics:
            return metrics.get("step"), metrics.get("loss")
        rank0 = progress.read(Path(self.dir) / PROGRESS_DIR).get(0)
        return (rank0.step, rank0.loss) if rank0 is not None else (None, None)


def _slurm_restart_count(environ) -> int:
    """How many times Slurm requeued the job this process runs in (``SLURM_RESTART_COUNT``; 0 if not set)."""
    count = environ.get("SLURM_RESTART_COUNT", "")
    return int(count) if count.isdigit() else 0


def _has_type(value, hint) -> bool:
    """Whether a JSON value fits a field's type hint (``int``, ``float | None``, ``dict[str, int]``...)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_has_type(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(_has_type(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_has_type(k, args[0]) and _has_type(v, args[1])
                                               for k, v in value.items())
    if hint is type(None):
        return value is None
    if isinstance(value, bool):
        return hint is bool
    return isinstance(value, (int, float)) if hint is float else isinstance(value, hint)


def load(name: str) -> Job:
    """The job called ``name``; a JobError naming the registry's jobs if there is none."""
    path = jobs_home() / check_name(name) / "job.json"
    if not path.exists():
        known = ", ".join(j.name for j in list_jobs()) or "none"
        raise JobError(f"no job {name!r} in {jobs_home()} (jobs: {known})")
    return Job.from_file(path)


@dataclass
class Unreadable:
    """A job directory whose ``job.json`` cannot be read, as ``paratrain jobs`` lists it."""

    name: str
    reason: str
    start_time: float  # the record's modification time


def list_jobs() -> list[Job | Unreadable]:
    """Every job of the registry, oldest first; a damaged record becomes an :class:`Unreadable` entry."""
    home = jobs_home()
    jobs = []
    for path in home.glob("*/job.json") if home.is_dir() else []:
        if path.parent.is_symlink():  # a second name of a job's directory (make demo's runs/demo-latest)
            continue
        try:
            jobs.append(Job.from_file(path))
        except UnreadableRecord as exc:
            jobs.append(Unreadable(path.parent.name, exc.reason, path.stat().st_mtime))
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


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (field 22 of Linux's ``/proc/PID/stat``): with the
    pid it names one process, whatever holds that pid later. None where it cannot be read."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def is_process(pid: int, start: int | None) -> bool:
    """Whether process ``pid`` is alive and is the one that started at ``start`` (:func:`process_start`; None:
    any)."""
    if not pid_alive(pid):
        return False
    now = process_start(pid)
    return start is None or now is None or now == start


def tail(path: Path, lines: int = 20) -> list[str]:
    """The last ``lines`` lines of a text file ([] if missing)."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
        return f.read().decode(errors="replace").splitlines()[-lines:]


def format_table(jobs: list[Job | Unreadable]) -> str:
    """The ``paratrain jobs`` table, then notes: what went wrong in each failed job, where stopped jobs saved,
    why a record is unreadable."""
    rows = [("NAME", "STATE", "RANKS", "START", "ELAPSED", "STEP", "LOSS", "EXIT")]
    notes = []
    for job in jobs:
        if isinstance(job, Unreadable):
            rows.append((job.name, "unreadable", "", "", "", "", "", ""))
            notes.append(f"{job.name}: unreadable ({job.reason})")
            continue
        state = job.shown_state()
        if state == "lost":
            notes.append(f"{job.name}: lost: {job.lost_because()}")
        if state == "stopped" and job.saved_step is not None:
            notes.append(f"{job.name}: {job.outcome}")
        step, loss = job.last_step()
        end = job.end_time or (time.time() if state in ACTIVE else job.start_time)
        exit_text = "" if job.exit_code is None else str(job.exit_code)
        if job.failing_rank is not None:
            exit_text += f" (rank {job.failing_rank})"
            notes.append(f"{job.name}: {job.failure}")
        if len(job.attempts) > 1:
            notes.append(f"{job.name}: {len(job.attempts)} attempts (max_restarts {job.max_restarts}): "
                         + "; ".join(map(_attempt_text, job.attempts)))
        elapsed = int(end - job.start_time)
        rows.append((job.name, state, str(job.world_size),
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.start_time)),
                     f"{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}", str(step or ""),
                     f"{loss:.4f}" if isinstance(loss, (int, float)) else "", exit_text))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    return "\n\n".join([table, *notes])


def _attempt_text(attempt: dict) -> str:
    """``attempt 0 (started 12:00:01) failed: rank 1 exit -9`` for one entry of a record's attempts."""
    start = attempt.get("start_time")
    started = time.strftime("%H:%M:%S", time.localtime(start)) if isinstance(start, (int, float)) else "?"
    text = f"attempt {attempt.get('number')} (started {started}) {attempt.get('state')}"
    if attempt.get("failing_rank") is not None:
        text += f": rank {attempt['failing_rank']} exit {attempt.get('exit_code')}"
    return text


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
