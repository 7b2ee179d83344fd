"""Start a job: torchrun (``torch.distributed.run`` as a library) on this node, or ssh to every node.

Each rank runs ``python -u -m paratrain <words>``; its stdout and stderr go to
``rank{R}.log`` and its environment to ``env{R}.log`` in the job directory
(a torchrun :class:`LogsSpecs`). torchrun's agent stops the other ranks as soon
as one fails (``--max-restarts 0``); the launcher then names the rank, its exit
code and the end of its log, records them in ``job.json`` and exits non-zero.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, get_args_parser

from paratrain.launch.hosts import Host, Topology
from paratrain.launch.jobs import Job, tail

# Merges stderr into stdout (one log per rank) and execs the rank's command with
# its arguments passed as "$@", so nothing in them is ever parsed by the shell.
RANK_WRAPPER = ["/bin/sh", "-c", 'exec "$@" 2>&1', "paratrain-rank"]
SHUTDOWN_TIMEOUT_S = 15  # SIGTERM -> SIGKILL for the ranks left when one fails
FORWARDED_ENV = ("PYTHONPATH", "PARATRAIN_COLLECTIVE_TIMEOUT")
FORWARDED_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_")


class RankLogs(LogsSpecs):
    """torchrun log destinations: ``rank{R}.log`` (stdout+stderr) and ``env{R}.log`` per global rank.

    With ``console`` the output of local rank 0 is also shown on the launcher's stdout.
    """

    def __init__(self, job_dir: Path, console: bool):
        super().__init__(log_dir=str(job_dir), redirects=Std.OUT, tee=Std.NONE)
        self.job_dir, self.console = Path(job_dir), console

    @property
    def root_log_dir(self) -> str:
        return str(self.job_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        stdouts, errors = {}, {}
        for local_rank, env in envs.items():
            rank = int(env["RANK"])
            merged = {**os.environ, **env}
            (self.job_dir / f"env{rank}.log").write_text("".join(f"{k}={merged[k]}\n" for k in sorted(merged)))
            stdouts[local_rank] = str(self.job_dir / f"rank{rank}.log")
            errors[local_rank] = str(self.job_dir / f"error{rank}.json")
        tee = {0: stdouts[0]} if self.console and 0 in stdouts else {}
        return LogsDest(stdouts=stdouts, stderrs=dict.fromkeys(envs, ""), tee_stdouts=tee,
                        tee_stderrs={}, error_files=errors)


def torchrun_args(topo: Topology, name: str, words: list[str]) -> list[str]:
    """The torchrun command line (without ``torchrun``) that runs ``python -m paratrain <words>`` per rank."""
    if topo.master_addr is None:  # one machine: a c10d store on a free port, like --standalone
        where = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-id", name]
    else:
        where = ["--nnodes", str(topo.nnodes), "--node-rank", str(topo.node_rank),
                 "--master-addr", topo.master_addr, "--master-port", str(topo.master_port)]
    return [*where, "--nproc-per-node", str(topo.nproc_per_node), "--max-restarts", "0",
            "--log-dir", os.devnull, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
            "--no-python", *RANK_WRAPPER, sys.executable, "-u", "-m", "paratrain", *words]


def _child_ranks() -> dict[str, int]:
    """Global rank -> pid of this process's children that carry a RANK (Linux /proc; {} elsewhere)."""
    ranks, me = {}, str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[1] != me:  # fields after the name: state, ppid
                continue
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue  # exited meanwhile
        rank = next((e[5:].decode() for e in environ if e.startswith(b"RANK=")), None)
        if rank is not None:
            ranks[rank] = int(stat.parent.name)
    return ranks


def _record_pids(job: Job, done: threading.Event) -> None:
    """Keep ``job.pids`` equal to the running ranks until ``done`` (workers start after the rendezvous)."""
    while not done.wait(0.3):
        pids = {**job.pids, **_child_ranks()}  # ranks that already exited keep their pid
        if pids != job.pids:
            job.pids, job.state = pids, "running"
            job.save()


def describe_failure(job: Job, rank: int, exitcode: int, lines: int = 20) -> str:
    """``rank R (pid P on HOST) exited with code C (SIGNAL)`` and the last lines of its log."""
    cause = f"exited with code {exitcode}"
    if exitcode < 0:
        cause = f"was killed by {signal.Signals(-exitcode).name} (exit code {exitcode})"
    log = job.log_path(rank)
    last = "\n".join(f"    {line}" for line in tail(log, lines)) or "    (empty)"
    return f"rank {rank} (pid {job.pids.get(str(rank), '?')} on {job.host}) {cause}; last lines of {log}:\n{last}"


def run_node(job: Job, topo: Topology, words: list[str], console: bool) -> int:
    """Run this node's ranks under torchrun until they end; record the outcome in ``job``. Returns the exit code."""
    parser = get_args_parser()
    config, cmd, cmd_args = config_from_args(parser.parse_args(torchrun_args(topo, job.name, words)))
    config.logs_specs = RankLogs(Path(job.dir), console)
    config.log_line_prefix_template = "[rank${rank}]: "
    job.state = "starting"
    job.save()
    done = threading.Event()
    watcher = threading.Thread(target=_record_pids, args=(job, done), daemon=True)
    watcher.start()
    outcome: tuple = ("succeeded", 0, {int(r): 0 for r in range(topo.node_rank * topo.nproc_per_node,
                                                               (topo.node_rank + 1) * topo.nproc_per_node)})
    try:
        elastic_launch(config, cmd)(*cmd_args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        codes = {r: f.exitcode for r, f in exc.failures.items()}
        outcome = ("failed", 1, codes, rank, failure.exitcode)
    except SignalException as exc:
        outcome = ("stopped", 128 + exc.sigval, {})
    finally:
        done.set()
        watcher.join()
    state, code, codes, *failed = outcome
    if failed:
        rank, exitcode = failed
        message = describe_failure(job, rank, exitcode)
        print(f"paratrain launch: job {job.name} failed: {message}", file=sys.stderr, flush=True)
        job.finish(state, code, codes, failing_rank=rank, failure=message)
    else:
        job.finish(state, code, codes)
        print(f"paratrain launch: job {job.name} {state}; logs in {job.dir}", file=sys.stderr, flush=True)
    return code


def node_command(host: Host, argv: list[str], cwd: str, env: dict[str, str]) -> list[str]:
    """The ssh command that starts one node's launcher; every word is shell-quoted for the remote shell."""
    exports = {**env, **({"CUDA_VISIBLE_DEVICES": ",".join(map(str, host.devices))} if host.devices else {})}
    remote = (f"cd {shlex.quote(cwd)} && exec env {' '.join(shlex.quote(f'{k}={v}') for k, v in exports.items())} "
              f"{shlex.join([sys.executable, '-u', '-m', 'paratrain', 'launch', *argv])}")
    ssh = shlex.split(os.environ.get("PARATRAIN_SSH", "ssh -o BatchMode=yes"))
    return [*ssh, "--", host.name, remote]


def forwarded_env(home: Path) -> dict[str, str]:
    """Variables each node's launcher needs: the job registry and the communication settings."""
    env = {k: v for k, v in os.environ.items() if k in FORWARDED_ENV or k.startswith(FORWARDED_ENV_PREFIXES)}
    return {**env, "PARATRAIN_HOME": str(home), "PARATRAIN_COORDINATED": "1", "PARATRAIN_JOB_PREPARED": "1"}


def run_hosts(job: Job, commands: list[list[str]], poll_s: float = 0.5) -> int:
    """Start every node's ssh command; when one fails, terminate the others. Returns the exit code."""
    procs = [subprocess.Popen(cmd, stdin=subprocess.DEVNULL) for cmd in commands]
    job.state = "running"
    job.save()
    stopping = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    while any(p.poll() is None for p in procs) and not stopping and all(p.returncode in (None, 0) for p in procs):
        time.sleep(poll_s)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
    nodes = [Job.from_file(p) for p in sorted(Path(job.dir).glob("node*.json"))]
    job.pids = {r: pid for node in nodes for r, pid in node.pids.items()}
    codes = {int(r): c for node in nodes for r, c in node.exit_codes.items()}
    failed = next((n for n in nodes if n.failing_rank is not None), None)
    if stopping:
        job.finish("stopped", 128 + stopping[0], codes)
        return 128 + stopping[0]
    bad = [f"node {i} ({job.hosts[i]}) exited with code {p.returncode}" for i, p in enumerate(procs) if p.returncode]
    if failed is not None or bad:
        message = failed.failure if failed else bad[0]
        print(f"paratrain launch: job {job.name} failed: {message}", file=sys.stderr, flush=True)
        job.finish("failed", 1, codes, failing_rank=failed.failing_rank if failed else None, failure=message)
        return 1
    job.finish("succeeded", 0, codes)
    return 0

