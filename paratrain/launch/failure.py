"""What went wrong in a failed job: the rank that failed first, its exit and log, and after a collective
timeout the rank that stopped making progress (from the ranks' progress records)."""
from __future__ import annotations

import re
import signal
from typing import TYPE_CHECKING

from paratrain.launch.jobs import Job, tail
from paratrain.progress import HEARTBEAT_S, Progress

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

STALE_HEARTBEATS = 4  # a rank that missed this many heartbeats has stopped
TIMED_OUT = re.compile(r"timed?[ _-]?out", re.IGNORECASE)  # gloo "Timed out waiting", NCCL "timeout", store errors


def first_failure(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """(rank, failure) of torchrun's failures that came first; torchrun's own choice ties whole seconds on the
    lowest rank, which blames a rank its agent SIGTERMed in the same second as the real failure."""
    return min(failures.items(), key=lambda kv: (kv[1].timestamp, kv[1].exitcode == -signal.SIGTERM, kv[0]))


def describe_failure(job: Job, rank: int, exitcode: int, lines: int = 20) -> str:
    """``rank R (pid P on HOST) exited with code C (SIGNAL)`` and the last lines of its log."""
    cause = f"exited with code {exitcode}"
    if exitcode < 0:
        cause = f"was killed by {signal.Signals(-exitcode).name} (exit code {exitcode})"
    log = job.log_path(rank)
    last = "\n".join(f"    {line}" for line in tail(log, lines)) or "    (empty)"
    return f"rank {rank} (pid {job.pids.get(str(rank), '?')} on {job.host}) {cause}; last lines of {log}:\n{last}"


def timed_out(job: Job, rank: int, lines: int = 40) -> bool:
    """Whether the end of the rank's log reports a timeout (gloo's "Timed out waiting", NCCL's watchdog)."""
    return any(TIMED_OUT.search(line) for line in tail(job.log_path(rank), lines))


def describe_laggards(records: dict[int, Progress], at: float, failed_rank: int) -> str | None:
    """``rank R stopped making progress at step S (...); rank F timed out waiting for it``, or None when the
    records (as they were at time ``at``) single out no rank: the laggards are the ranks that got least far
    (step, then collectives) when others got further, else those whose heartbeat stopped."""
    if len(records) < 2:
        return None
    reached = {rank: (r.step if r.step is not None else -1, r.collectives or 0) for rank, r in records.items()}
    lowest = min(reached.values())
    laggards = [rank for rank, key in reached.items() if key == lowest] if lowest < max(reached.values()) else []
    if not laggards:
        laggards = [rank for rank, r in records.items() if at - r.heartbeat > STALE_HEARTBEATS * HEARTBEAT_S]
    laggards = sorted(set(laggards) - {failed_rank})
    if not laggards:
        return None
    first = records[laggards[0]]
    where = f"at step {first.step}" if first.step is not None else "before its first step"
    if first.collectives is not None:
        where += f", collective {first.collectives}"
    ages = ", ".join(f"{at - records[rank].heartbeat:.0f} s" for rank in laggards)
    who = f"rank {laggards[0]}" if len(laggards) == 1 else "ranks " + ", ".join(map(str, laggards))
    them = "it" if len(laggards) == 1 else "them"
    return (f"{who} stopped making progress {where} (last heartbeat {ages} before rank {failed_rank} failed); "
            f"rank {failed_rank} timed out waiting for {them}")
