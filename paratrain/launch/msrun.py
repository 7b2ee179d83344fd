"""``paratrain msrun``: MindSpore 2.x's ``msrun`` flags as they are, run as ``paratrain launch`` (``--log_dir``:
the job directory); msrun's flags with no counterpart here are refused, each with the reason.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from paratrain.launch.jobs import JobError

# msrun flags with no paratrain counterpart: the value that does nothing, and why any other is refused
UNMAPPED = {
    "bind_core": (False, "paratrain does not pin ranks to CPU cores; leave it out (or pin inside the script)"),
    "sim_level": (-1, "paratrain has no simulated (one process, compile only) run; 'paratrain plan' sizes a "
                      "layout without the devices"),
    "sim_rank_id": (0, "paratrain has no simulated (one process, compile only) run"),
    "rank_table_file": ("", "msrun's rank table only helps other features; to start ranks from a MindSpore rank "
                            "table use 'paratrain launch --rank-table FILE -- script.py'"),
    "worker_log_name": ("", "paratrain names the logs rank{R}.log in the log directory"),
    "tail_worker_log": ("-1", "paratrain shows local rank 0's output while it waits (--join=True); read the others "
                              "with 'paratrain logs NAME --rank R'"),
}


def _flag(value: str) -> bool:
    """msrun's True/False, any capitalisation (it reads the capitalised word with ``ast.literal_eval``)."""
    word = value.strip().capitalize()
    if word not in ("True", "False"):
        raise argparse.ArgumentTypeError(f"expected True or False, got {value!r}")
    return word == "True"


def launch_argv(args) -> list[str]:
    """The ``paratrain launch`` arguments that run what the msrun flags in ``args`` ask for."""
    for name, (default, why) in UNMAPPED.items():
        if getattr(args, name) not in (None, default):
            raise JobError(f"msrun --{name}={getattr(args, name)}: {why}")
    if not args.task_script.endswith(".py"):
        raise JobError(f"msrun runs a Python script on every worker: {args.task_script!r} does not end in .py")
    workers, local = args.worker_num, args.local_worker_num
    if workers < 1:
        raise JobError(f"msrun --worker_num={workers}: the number of workers on all nodes is 1 or more, e.g. "
                       f"--worker_num=8")
    if not 0 < args.master_port < 65536:
        raise JobError(f"msrun --master_port={args.master_port} is not a TCP port: use one in 1..65535 "
                       f"(default 8118)")
    if not 0 < local <= workers:
        raise JobError(f"msrun --local_worker_num={local} --worker_num={workers}: each node runs 1 to {workers} "
                       f"workers")
    if workers % local:
        raise JobError(f"msrun --worker_num={workers} is not a multiple of --local_worker_num={local}: paratrain "
                       f"runs as many workers on every node (torchrun's --nproc-per-node)")
    if args.cluster_time_out <= 0:
        raise JobError(f"msrun --cluster_time_out={args.cluster_time_out}: paratrain waits a bounded time for the "
                       f"nodes to join; give the seconds, e.g. --cluster_time_out=600")
    nnodes = workers // local
    argv = [f"--nproc-per-node={local}", f"--join-timeout={args.cluster_time_out}"]
    if nnodes > 1:  # on one node msrun ignores --node_rank; paratrain also picks a free port there
        if not 0 <= args.node_rank < nnodes:
            raise JobError(f"msrun --node_rank={args.node_rank}: with --worker_num={workers} over "
                           f"--local_worker_num={local} there are {nnodes} nodes; give each its index 0..{nnodes - 1}"
                           f" (paratrain does not number nodes in the order they join)")
        argv += [f"--nnodes={nnodes}", f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr}",
                 f"--master-port={args.master_port}"]
    if args.log_dir:
        argv.append(f"--name={Path(os.path.abspath(args.log_dir)).name}")
    if not args.join:  # msrun's default: start the workers and return
        argv.append("--detach")
    return [*argv, "--", args.task_script, *args.task_script_args]


def cmd_msrun(args, launch_parser: argparse.ArgumentParser) -> int:
    argv = launch_argv(args)
    if args.log_dir:  # the job directory is the log directory: the registry is its parent
        os.environ["PARATRAIN_HOME"] = str(Path(os.path.abspath(args.log_dir)).parent)
    print(f"paratrain msrun: paratrain launch {shlex.join(argv)}", file=sys.stderr, flush=True)
    from paratrain.launch import cmd_launch

    return cmd_launch(launch_parser.parse_args(argv))


def register(sub, launch_parser: argparse.ArgumentParser) -> None:
    """Add ``msrun`` to the ``paratrain`` subcommands; it runs ``launch_parser``'s command."""
    p = sub.add_parser("msrun", help="MindSpore's msrun flags, run as 'paratrain launch -- SCRIPT.py ARGS'",
                       usage="paratrain msrun [--worker_num N] [--local_worker_num N] [--master_addr A] "
                             "[--master_port P] [--node_rank R] [--log_dir D] [--join True|False] "
                             "[--cluster_time_out S] SCRIPT.py [ARGS]",
                       description="MindSpore 2.x's msrun: start WORKER_NUM workers of SCRIPT.py, LOCAL_WORKER_NUM on "
                                   "this node, as 'paratrain launch' does (torchrun underneath).")
    p.add_argument("--worker_num", type=int, default=8, help="workers on all nodes (default 8)")
    p.add_argument("--local_worker_num", type=int, default=8, help="workers on this node (default 8)")
    p.add_argument("--master_addr", default="127.0.0.1", help="address of node 0 (several nodes only)")
    p.add_argument("--master_port", type=int, default=8118,
                   help="rendezvous port on node 0 (default 8118; several nodes only: one node picks a free port)")
    p.add_argument("--node_rank", type=int, default=-1, help="this node's index, needed on several nodes")
    p.add_argument("--log_dir", default="", help="the job's directory: job.json, rank{R}.log (default: as launch)")
    p.add_argument("--join", type=_flag, default=False,
                   help="True: wait for the workers and exit with their outcome; False (default): start them in "
                        "the background (paratrain launch --detach)")
    p.add_argument("--cluster_time_out", type=int, default=600,
                   help="seconds to wait for every node to join (default 600; launch's --join-timeout)")
    for name, (default, why) in UNMAPPED.items():
        p.add_argument(f"--{name}", type=_flag if isinstance(default, bool) else type(default),
                       help=f"refused unless {default!r}: {why}")
    p.add_argument("task_script", help="the Python script every worker runs")
    p.add_argument("task_script_args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(func=lambda args: cmd_msrun(args, launch_parser))
