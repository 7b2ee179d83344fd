"""Which nodes a multi-node launch is still waiting for, told from the launcher records in the shared run
directory: a node whose launcher has no active record there has not started (or cannot see the directory)."""
from __future__ import annotations

from pathlib import Path

from paratrain.launch.jobs import ACTIVE, Job, JobError

REPORT_EVERY_S = 30.0  # how often a waiting launcher says who is missing
MARGIN_S = 15.0  # past --join-timeout, when the launcher gives up even if torchrun has not


def missing_nodes(job: Job) -> str:
    """``node 1 (host b)`` / ``nodes 1, 3``: the other nodes with no active launcher record ('' if none)."""
    main = Path(job.dir) / "job.json"
    try:
        first = Job.from_file(main) if main.exists() else None
    except JobError:
        first = None
    hosts = first.hosts if first is not None and first.is_coordinator else []  # a hostfile launch's record
    records = [first] if first is not None and not hosts else []
    present = {r.node_rank for r in [*records, *job.node_records()[0]] if r.state in ACTIVE}
    missing = [rank for rank in range(job.nnodes) if rank != job.node_rank and rank not in present]
    if not missing:
        return ""
    names = [f"{rank} ({hosts[rank]})" if rank < len(hosts) else str(rank) for rank in missing]
    return ("node " if len(names) == 1 else "nodes ") + ", ".join(names)


def still_waiting(job: Job, master: str, waited_s: float, timeout_s: float) -> str:
    """The line a launcher prints while the rendezvous at ``master`` (``addr:port``) waits for other nodes."""
    missing = missing_nodes(job)
    who = f"{missing} (no launcher record in {job.dir})" if missing else "the other nodes (their launchers are up)"
    return f"waited {waited_s:.0f} s of {timeout_s:g} s (--join-timeout) for {who} to join the rendezvous at {master}"


def not_joined(job: Job, master: str, timeout_s: float) -> str:
    """Why a launch gave up waiting for the other nodes, naming them where the records tell."""
    missing = missing_nodes(job)
    if missing:
        return (f"{missing} did not join the rendezvous at {master} within {timeout_s:g} s (--join-timeout): "
                f"no launcher record in {job.dir}")
    return (f"not every node reached the rendezvous at {master} within {timeout_s:g} s (--join-timeout), "
            "though every node's launcher is up: is the address reachable from every node?")
