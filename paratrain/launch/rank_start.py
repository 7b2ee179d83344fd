"""How torchrun starts every rank of ``paratrain launch``: ``python rank_start.py COMMAND...`` merges the rank's
stderr into its stdout (one log per rank) and asks Linux to send it SIGTERM when its launcher dies (even by
SIGKILL), then becomes ``COMMAND``; the arguments are never parsed by a shell.

SIGTERM is the stop request of ``paratrain stop``: a rank of ``paratrain train`` or ``Model.train`` saves and
exits with every other rank of the job (a stuck collective ends at the collective timeout), any other process ends.
Run as a file, not imported: it starts before, and without, the paratrain package.
"""
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LAUNCHER_PID_ENV = "PARATRAIN_LAUNCHER_PID"


def watch_launcher(launcher_pid: int) -> None:
    """SIGTERM to this process when the thread that started it exits; it exits at once if the launcher
    ``launcher_pid`` is gone already (this process then has another parent)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != launcher_pid:
        print(f"paratrain: the launcher of this rank (pid {launcher_pid}) is gone: the rank does not start",
              file=sys.stderr, flush=True)
        raise SystemExit(1)


def main(command: list[str]) -> None:
    os.dup2(1, 2)
    if sys.platform == "linux" and os.environ.get(LAUNCHER_PID_ENV, "").isdigit():
        watch_launcher(int(os.environ[LAUNCHER_PID_ENV]))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
