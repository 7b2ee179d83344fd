"""Start a job: torchrun (``torch.distributed.run`` as a library) on this node, or ssh to every node.

Each rank's output goes to ``rank{R}.log``, its environment to ``env{R}.log``. torchrun's agent runs in a thread,
so that this process keeps its signals: SIGTERM, SIGINT, SIGHUP or a ``stop.json`` reach the ranks as SIGTERM
(SIGKILL with ``--now``, or after the grace period). A failed job restarts while ``--max-restarts`` allows, a
stopped one (:data:`paratrain.progress.EXIT_STOPPED`: saved) never does.
"""
from __future__ import annotations

import functools
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import torch.distributed.launcher.api as launcher_api
from torch.distributed import DistError
from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, get_args_parser
from torch.torch_version import __version__ as TORCH_VERSION

from paratrain import progress
from paratrain.launch import is_script, rank_start, rendezvous
from paratrain.launch import stop as stoplib
from paratrain.launch.failure import TIMED_OUT, describe_failure, describe_laggards, first_failure, timed_out
from paratrain.launch.hosts import Host, Topology
from paratrain.launch.jobs import PROGRESS_DIR, Job
from paratrain.launch.stop import StopRequest

# Merges stderr into stdout and makes the rank end with its launcher, then execs the rank's command (-S: stdlib only)
RANK_WRAPPER = [sys.executable, "-S", str(Path(rank_start.__file__))]
SHUTDOWN_TIMEOUT_S = 15  # SIGTERM -> SIGKILL for the ranks left when one fails, or when the launcher is signalled
# torchrun takes that wait from torch 2.12 on; 2.11's is a fixed 30 s
SHUTDOWN_FLAGS = ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)] if TORCH_VERSION >= (2, 12) else []
SSH_MARGIN_S = 5.0  # past a node's grace period, how long the coordinator waits for its ssh session to end
POLL_S = 0.3
FORWARDED_ENV = ("PYTHONPATH", "PARATRAIN_COLLECTIVE_TIMEOUT", "PARATRAIN_HOST_ALLOCATOR")
FORWARDED_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "TCMALLOC_")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class RankLogs(LogsSpecs):
    """torchrun log destinations: ``rank{R}.log`` (stdout+stderr) and ``env{R}.log`` per global rank, local
    rank 0's output also on the launcher's stdout with ``console``; a restart keeps the last attempt's logs."""

    def __init__(self, job_dir: Path, console: bool):
        super().__init__(log_dir=str(job_dir), redirects=Std.OUT, tee=Std.NONE)
        self.job_dir, self.console = Path(job_dir), console
        self.starts = 0

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
            if self.starts and Path(stdouts[local_rank]).exists():
                Path(stdouts[local_rank]).replace(self.job_dir / f"rank{rank}.attempt{self.starts - 1}.log")
            errors[local_rank] = str(self.job_dir / f"error{rank}.json")
        tee = {0: stdouts[0]} if self.console and 0 in stdouts else {}
        self.starts += 1
        return LogsDest(stdouts=stdouts, stderrs=dict.fromkeys(envs, ""), tee_stdouts=tee,
                        tee_stderrs={}, error_files=errors)


def rank_command(words: list[str]) -> list[str]:
    """What every rank runs for ``paratrain launch -- <words>``: a paratrain subcommand, or a user script."""
    return [sys.executable, "-u", *words] if is_script(words) else [sys.executable, "-u", "-m", "paratrain", *words]


def torchrun_args(topo: Topology, name: str, command: list[str], join_timeout_s: float,
                  max_restarts: int = 0) -> list[str]:
    """The torchrun command line (without ``torchrun``) that runs ``command`` once per rank."""
    join_s = max(1, round(join_timeout_s))
    if topo.master_addr is None:  # one machine: a c10d store on a free port, like --standalone
        where = ["--nnodes", "1", "--node-rank", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
                 "--rdzv-id", name]
    elif max_restarts:  # c10d rendezvous: the store on node 0 holds rounds, one per (re)start of every node
        where = ["--nnodes", str(topo.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                 f"{topo.master_addr}:{topo.master_port}", "--rdzv-id", name, "--rdzv-conf", f"join_timeout={join_s}"]
    else:  # static rendezvous: node 0's store waits for the others, theirs retry connecting, both give up then
        where = ["--nnodes", str(topo.nnodes), "--node-rank", str(topo.node_rank), "--master-addr", topo.master_addr,
                 "--master-port", str(topo.master_port), "--rdzv-conf", f"timeout={join_s}"]
    return [*where, "--nproc-per-node", str(topo.nproc_per_node), "--max-restarts", str(max_restarts),
            "--log-dir", os.devnull, *SHUTDOWN_FLAGS, "--no-python", *RANK_WRAPPER, *command]


def _torchrun_config(argv: list[str]):
    """torchrun's (config, command, arguments) for ``argv``. Its parser takes the defaults of options not given
    from ``PET_*`` variables, which a Kubeflow pod sets for its own torchrun (``PET_RDZV_BACKEND``,
    ``PET_MAX_RESTARTS``, ...): they are hidden from it, so that only this launch's options count."""
    hidden = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("PET_")}
    try:
        parser = get_args_parser()
    finally:
        os.environ.update(hidden)
    return config_from_args(parser.parse_args(argv))


def _node_ranks(topo: Topology) -> range:
    """The global ranks this node runs."""
    return range(topo.node_rank * topo.nproc_per_node, (topo.node_rank + 1) * topo.nproc_per_node)


def _child_ranks() -> dict[str, int]:
    """Global rank -> pid of this process's live children that carry a RANK (Linux /proc; {} elsewhere)."""
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


def _signal_ranks(pids, sig: int) -> None:
    """Send ``sig`` to each rank's process group (torchrun starts every rank in a session of its own)."""
    for pid in pids:
        with suppress(ProcessLookupError):
            os.killpg(pid, sig)


class _StopSignals:
    """While active, SIGTERM/SIGINT/SIGHUP are recorded in ``received`` instead of ending the process."""

    def __enter__(self) -> "_StopSignals":
        self.received: list[int] = []
        self.previous = {sig: signal.signal(sig, lambda signum, frame: self.received.append(signum))
                         for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def request(self, job: Job) -> StopRequest | None:
        """The stop asked of this launcher: a ``stop.json`` made since the job started, or a signal it got."""
        asked = stoplib.pending(job.dir, since=job.start_time)
        if asked is None and self.received:
            name = signal.Signals(self.received[0]).name
            asked = StopRequest(grace_s=SHUTDOWN_TIMEOUT_S, reason=f"the launcher got {name}")
        return asked


class _NodeAgent(LocalElasticAgent):
    """torchrun's agent of this node, telling ``watcher`` each start of the ranks and how each restarted attempt
    ended. A failed attempt is not restarted once the job is stopping, nor when a rank exited with
    :data:`~paratrain.progress.EXIT_STOPPED` (stopped and saved: never a crash)."""

    def __init__(self, *args, watcher: "_Agent", **kwargs):
        super().__init__(*args, **kwargs)
        self.watcher = watcher

    def _start_workers(self, worker_group):
        pids = super()._start_workers(worker_group)
        self.watcher.started([worker.global_rank for worker in worker_group.workers])
        return pids

    def _monitor_workers(self, worker_group):
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            saved = any(f.exitcode == progress.EXIT_STOPPED for f in result.failures.values())
            if saved or self.watcher.stopping.is_set():
                self._remaining_restarts = 0  # torchrun's agent ends rather than restart with none left
            if self._remaining_restarts > 0:
                self.watcher.restarting(result.failures)
        return result


class _Agent(threading.Thread):
    """torchrun's elastic agent, run in a thread; ``error`` is what it raised (None: every rank exited 0),
    ``attempts`` every start of this node's ranks (as ``job.json`` keeps them), ``ranks`` the last start's."""

    def __init__(self, config, cmd, cmd_args):
        super().__init__(name="torchrun-agent", daemon=True)  # a daemon: a rendezvous wait must not keep us alive
        self.config, self.cmd, self.cmd_args = config, cmd, cmd_args
        self.error: BaseException | None = None
        self.stopping = threading.Event()
        self.attempts: list[dict] = []
        self.ranks: list[int] = []

    def run(self) -> None:
        # torchrun builds its agent inside launch_agent and takes none from its caller: ours is put in its place
        launcher_api.LocalElasticAgent = functools.partial(_NodeAgent, watcher=self)
        try:
            elastic_launch(self.config, self.cmd)(*self.cmd_args)
        except BaseException as exc:  # handed to the main thread, which reports it
            self.error = exc
        finally:
            launcher_api.LocalElasticAgent = LocalElasticAgent

    def started(self, ranks: list[int]) -> None:
        """The agent started the ranks ``ranks`` of this node: a new attempt."""
        if self.attempts and self.attempts[-1]["state"] == "running":  # another node's failure restarted it
            self.attempts[-1].update(end_time=time.time(), state="restarted")
        self.ranks = ranks
        self.attempts.append({"number": len(self.attempts), "start_time": time.time(), "end_time": None,
                              "state": "running", "failing_rank": None, "exit_code": None})

    def restarting(self, failures: dict) -> None:
        """The agent restarts the ranks after the ``failures`` (rank -> torchrun's ProcessFailure) of this attempt."""
        rank, failure = first_failure(failures) if failures else (None, None)
        self.attempts[-1].update(end_time=time.time(), state="failed", failing_rank=rank,
                                 exit_code=failure.exitcode if failure else None)


@dataclass
class _Watched:
    """What the launcher saw while its ranks ran."""

    stop: StopRequest | None = None
    progress_at_first_exit: tuple[dict[int, progress.Progress], float] | None = None  # (records, when)
    join_expired: bool = False


def _watch(job: Job, topo: Topology, agent: _Agent, signals: _StopSignals, progress_dir: Path,
           join_timeout_s: float) -> _Watched:
    """Until the agent ends: record the rank pids and the attempts, act on stop requests, snapshot the progress
    records when the first rank of an attempt ends, and report (then give up on) nodes that do not join."""
    seen, started = _Watched(), time.monotonic()
    report_every = min(rendezvous.REPORT_EVERY_S, join_timeout_s / 2)
    next_report, kill_at, signalled = started + report_every, 0.0, set()
    master = f"{topo.master_addr}:{topo.master_port}"
    while agent.is_alive():
        agent.join(POLL_S)
        job.beat()
        ranks = _child_ranks()
        if {**job.pids, **ranks} != job.pids:  # ranks that already exited keep their pid
            job.pids, job.state = {**job.pids, **ranks}, "running"
            job.save()
        if agent.attempts != job.attempts:
            if len(agent.attempts) != len(job.attempts):  # a new attempt: its own first exit
                seen.progress_at_first_exit = None
            job.attempts = [dict(attempt) for attempt in agent.attempts]
            job.save()
        if job.pids and seen.progress_at_first_exit is None and len(ranks) < len(job.pids):
            seen.progress_at_first_exit = (progress.read(progress_dir), time.time())
            _signal_ranks(ranks.values(), signal.SIGCONT)  # a stopped rank acts on the agent's SIGTERM only then
        if seen.stop is None and (stop := signals.request(job)) is not None:
            agent.stopping.set()  # before any rank is signalled: a rank that ends now must not restart the job
            seen.stop, kill_at = stop, time.monotonic() + (0 if stop.now else stop.grace_s)
            print(f"paratrain launch: job {job.name}: stopping ({stop.reason}"
                  f"{', now' if stop.now else f', grace {stop.grace_s:g} s'})", file=sys.stderr, flush=True)
        if seen.stop is not None:
            if not job.pids and topo.nnodes > 1:
                break  # still waiting for the other nodes: nothing to stop
            new = [pid for pid in ranks.values() if pid not in signalled]  # ranks may start while stopping
            _signal_ranks(new, signal.SIGKILL if seen.stop.now else signal.SIGTERM)
            _signal_ranks(new, signal.SIGCONT)
            signalled.update(new)
            if time.monotonic() > kill_at:
                _signal_ranks(ranks.values(), signal.SIGKILL)
        if not job.pids and topo.nnodes > 1:
            if time.monotonic() - started > join_timeout_s + rendezvous.MARGIN_S:
                seen.join_expired = True
                break
            if time.monotonic() >= next_report:
                waited = rendezvous.still_waiting(job, master, time.monotonic() - started, join_timeout_s)
                print(f"paratrain launch: job {job.name}: {waited}", file=sys.stderr, flush=True)
                next_report += report_every
    return seen


def run_node(job: Job, topo: Topology, command: list[str], console: bool, join_timeout_s: float) -> int:
    """Run ``command`` on this node's ranks under torchrun (restarted up to ``job.max_restarts`` times), record
    the outcome in ``job``; returns 0, :data:`~paratrain.progress.EXIT_STOPPED` (every rank stopped after saving),
    128 + signal (stopped otherwise) or 1 (a rank of the last attempt failed, or nodes did not join)."""
    config, cmd, cmd_args = _torchrun_config(torchrun_args(topo, job.name, command, join_timeout_s, job.max_restarts))
    config.logs_specs = RankLogs(Path(job.dir), console)
    config.log_line_prefix_template = "[rank${rank}]: "
    my_ranks = _node_ranks(topo)
    progress_dir = Path(job.dir) / PROGRESS_DIR
    progress.clear(progress_dir, my_ranks)
    os.environ[progress.DIR_ENV] = str(progress_dir)
    os.environ[rank_start.LAUNCHER_PID_ENV] = str(os.getpid())
    if job.max_restarts:
        # the ranks of a restart would otherwise share the agent's store with the failed attempt's and can read
        # its stale addresses ("Gloo connectFullMesh failed", NCCL "connection refused"; pytorch#135712): rank 0
        # then hosts a store of each attempt's own, as torchrun did before torch 2.5
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    job.state = "starting"
    job.save()
    agent = _Agent(config, cmd, cmd_args)
    def quiet(record: logging.LogRecord) -> bool:  # torchrun cannot handle signals in a thread: this process does
        return "running on a child thread" not in record.getMessage()

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(quiet)
    try:
        with _StopSignals() as signals:
            agent.start()
            seen = _watch(job, topo, agent, signals, progress_dir, join_timeout_s)
    finally:
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").removeFilter(quiet)
    state, code, codes, failing_rank, message = _outcome(job, topo, agent, seen, join_timeout_s)
    stopped_saved = state == "stopped" and code == progress.EXIT_STOPPED
    records = progress.read(progress_dir)
    steps = [records[r].saved_step if r in records else None for r in agent.ranks or my_ranks]
    saved = min(steps) if stopped_saved and None not in steps else None  # the step every rank saved
    job.attempts = [dict(attempt) for attempt in agent.attempts]
    job.finish(state, code, codes, failing_rank=failing_rank, failure=message if state == "failed" else "",
               saved_step=saved)
    attempts = f" (attempt {len(job.attempts)} of {job.max_restarts + 1})" if len(job.attempts) > 1 else ""
    said = f"failed{attempts}: {message}" if state == "failed" else f"{job.outcome}{attempts}; logs in {job.dir}"
    print(f"paratrain launch: job {job.name} {said}", file=sys.stderr, flush=True)
    return code


def _outcome(job: Job, topo: Topology, agent: _Agent, seen: _Watched, join_timeout_s: float) -> tuple:
    """(state, exit code, rank -> exit code, failing rank, failure message) of a finished watch: of its last
    attempt, since torchrun restarts the ranks after the failures of the others."""
    my_ranks = agent.ranks or _node_ranks(topo)  # a c10d rendezvous gives nodes their ranks in its own order
    stop_code = 128 + (signal.SIGKILL if seen.stop and seen.stop.now else signal.SIGTERM)
    master = f"{topo.master_addr}:{topo.master_port}"
    error = str(agent.error).strip().splitlines()[0] if agent.error is not None and str(agent.error).strip() else ""
    if not job.pids and (seen.join_expired or (isinstance(agent.error, (DistError, RendezvousError))
                                               and TIMED_OUT.search(error))):
        cause = f" (torchrun: {error})" if error else ""
        return "failed", 1, {}, None, rendezvous.not_joined(job, master, join_timeout_s) + cause
    if not job.pids and isinstance(agent.error, (DistError, RendezvousError)):
        return "failed", 1, {}, None, f"the rendezvous at {master} failed: {error}"
    if seen.stop is not None and not job.pids:  # before any rank started: nothing to save
        return "stopped", stop_code if seen.stop.now else progress.EXIT_STOPPED, {}, None, ""
    if isinstance(agent.error, ChildFailedError):
        failures = agent.error.failures
        codes = {rank: 0 for rank in my_ranks} | {r: f.exitcode for r, f in failures.items()}
        rank, failure = first_failure(failures)
        # `paratrain train` handles SIGTERM from its first line on. A rank of it that had not finished a step
        # when the job was asked to stop was still starting: whether it died of the signal or of a peer that
        # stopped first (a broken rendezvous or collective), it lost nothing and counts as stopped.
        records = progress.read(Path(job.dir) / PROGRESS_DIR) if job.command[:1] == ["train"] else {}
        starting = {r for r in failures if job.command[:1] == ["train"] and (
            r not in records or records[r].step is None)} if seen.stop is not None else set()
        # a crash (a positive code but the stopped one) fails the job, stopping or not; ranks killed by a
        # signal while stopping make it stopped without a save
        crashed = {r: f for r, f in failures.items() if f.exitcode not in (0, progress.EXIT_STOPPED)
                   and not (seen.stop is not None and f.exitcode < 0) and r not in starting}
        if crashed:
            rank, failure = first_failure(crashed)
        elif seen.stop is not None or failure.exitcode == progress.EXIT_STOPPED:
            saved = all(c == progress.EXIT_STOPPED or r in starting for r, c in codes.items())
            return "stopped", progress.EXIT_STOPPED if saved else stop_code, codes, None, ""
        message = describe_failure(job, rank, failure.exitcode)
        if timed_out(job, rank) and seen.progress_at_first_exit is not None:
            hung = describe_laggards(*seen.progress_at_first_exit, failed_rank=rank)
            message = f"{hung}\n{message}" if hung else message
        return "failed", 1, codes, rank, message
    if agent.error is not None:
        return "failed", 1, {}, None, f"{type(agent.error).__name__}: {error}"
    return "succeeded", 0, dict.fromkeys(my_ranks, 0), None, ""


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
    """Start every node's ssh command and wait for them; returns the exit code (as :func:`run_node`'s). A stop or
    a failed node reaches every node through ``stop.json``: ending an ssh client does not end what it started."""
    procs = [subprocess.Popen(cmd, stdin=subprocess.DEVNULL) for cmd in commands]
    job.state = "running"
    job.save()
    stop, first_failed, give_up_at = None, None, None
    with _StopSignals() as signals:
        while any(p.poll() is None for p in procs) and (give_up_at is None or time.monotonic() < give_up_at):
            if give_up_at is None:
                stop = signals.request(job)
                first_failed = next((i for i, p in enumerate(procs) if p.returncode not in (None, 0)), None)
                if stop is not None or first_failed is not None:
                    stoplib.request(job.dir, stop or StopRequest(grace_s=SHUTDOWN_TIMEOUT_S, reason="a node failed"))
                    grace = 0 if stop is not None and stop.now else (stop or StopRequest()).grace_s
                    give_up_at = time.monotonic() + grace + SSH_MARGIN_S
            job.beat()
            time.sleep(poll_s)
    for p in procs:
        if p.poll() is None:
            p.terminate()
            p.wait()
    nodes, _ = job.node_records()
    job.attempts = nodes[0].attempts if nodes else []  # node 0's, as on one node
    codes = {int(r): c for node in nodes for r, c in node.exit_codes.items()}
    failed = next((n for n in nodes if n.state == "failed"), None)
    if stop is None and first_failed is None:
        first_failed = next((i for i, p in enumerate(procs) if p.returncode not in (0, progress.EXIT_STOPPED)), None)
    if stop is not None or (failed is None and nodes and all(n.state == "stopped" for n in nodes)):
        saved = [n.saved_step for n in nodes]
        if len(nodes) == len(procs) and None not in saved:
            job.finish("stopped", progress.EXIT_STOPPED, codes, saved_step=min(saved))
        else:
            job.finish("stopped", 128 + (signal.SIGKILL if stop is not None and stop.now else signal.SIGTERM), codes)
        print(f"paratrain launch: job {job.name} {job.outcome}", file=sys.stderr, flush=True)
        return job.exit_code
    if failed is not None or first_failed is not None:
        message = (f"node {failed.node_rank} ({job.hosts[failed.node_rank]}): {failed.failure}" if failed else
                   f"node {first_failed} ({job.hosts[first_failed]}) exited with code {procs[first_failed].returncode}")
        print(f"paratrain launch: job {job.name} failed: {message}", file=sys.stderr, flush=True)
        job.finish("failed", 1, codes, failing_rank=failed.failing_rank if failed else None, failure=message)
        return 1
    job.finish("succeeded", 0, codes)
    return 0
