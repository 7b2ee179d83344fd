"""``paratrain launch | jobs | logs | stop``: named jobs started with torchrun on one or many nodes (the modules:
``hosts`` where, ``jobs`` the records, ``launcher`` torchrun or ssh, ``stop``, ``failure`` and ``rendezvous`` what
went wrong, ``emit`` a cluster's job file, ``msrun`` MindSpore's msrun flags)."""
from __future__ import annotations

import argparse
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

from paratrain import host_memory
from paratrain.launch import jobs as joblib
from paratrain.launch import stop as stoplib
from paratrain.cluster import slurm_tasks
from paratrain.launch.hosts import (HostError, Topology, check_host, kubeflow_from_env, parse_hostfile,
                                    parse_rank_table, select_hosts, slurm_from_env)
from paratrain.launch.jobs import Job, JobError


def is_script(words: list[str]) -> bool:
    """Whether ``paratrain launch -- <words>`` runs a user script (first word ``*.py``), not a subcommand."""
    return bool(words) and words[0].endswith(".py")


def _check_train_config(words: list[str], world_size: int, local_world_size: int, rules_only: bool):
    """Refuse a ``train`` command whose config fails a check for ``world_size`` ranks (``local_world_size`` on this
    host), before any rank starts: every check of :func:`paratrain.preflight.check`, or with ``rules_only`` (a dry
    run or a job file, which start nothing here) the config rules, and none for a config file that only the nodes
    may have. Returns the config and the digest of the check for the ranks
    (:func:`paratrain.preflight.launcher_checked`); None for another command."""
    if words[:1] != ["train"]:
        return None
    from paratrain import config_rules, preflight
    from paratrain.deepspeed_config import load_config

    args, overrides = preflight.train_args(words[1:])
    if rules_only and any(path is not None and not Path(path).is_file() for path in (args.config, args.deepspeed)):
        return None
    cfg = load_config(args.config, overrides, args.deepspeed, world_size)
    digest = preflight.check_digest(cfg, world_size, local_world_size)  # of the config as each rank loads it
    if rules_only:
        config_rules.check(cfg, world_size)
    else:
        preflight.check(cfg, world_size, local_world_size)
    return cfg, digest


def _launch_flags(args, name: str | None, **overrides) -> list[str]:
    """The ``paratrain launch`` options that repeat this launch (for --detach, for each node and for a job file);
    without ``--name`` when ``name`` is None."""
    values = {"nproc_per_node": args.nproc_per_node, "nnodes": args.nnodes, "node_rank": args.node_rank,
              "master_addr": args.master_addr, "master_port": args.master_port,
              "collective_timeout": args.collective_timeout, "join_timeout": args.join_timeout,
              "max_restarts": args.max_restarts, **overrides}
    argv = [f"--{key.replace('_', '-')}={value}" for key, value in values.items() if value is not None]
    return argv if name is None else [*argv, f"--name={name}"]


def _topology(args):
    """Nodes and rendezvous from the flags, else from a Slurm allocation or a Kubeflow pod, else this machine
    alone."""
    slurm = slurm_from_env() if args.nnodes is None else None
    if args.nnodes is None:
        if "SLURM_STEP_ID" in os.environ and "SLURM_PROCID" in os.environ:  # srun may start it on each node's tasks
            tasks = slurm_tasks(os.environ)
            if tasks.local_world_size > 1:
                raise HostError(f"srun started {tasks.local_world_size} tasks on this node, each a 'paratrain launch' "
                                f"with the same node rank: run one per node (srun --ntasks-per-node=1 paratrain "
                                f"launch ...), or the ranks themselves (srun --ntasks-per-node="
                                f"{tasks.local_world_size} python -m paratrain train ...)")
        if slurm is not None and slurm.nnodes > 1:
            return Topology(args.nproc_per_node or slurm.gpus_per_node or 1, slurm.nnodes, slurm.node_rank,
                            args.master_addr or slurm.master_addr, args.master_port or slurm.master_port)
        pod = kubeflow_from_env()
        if pod is not None:
            return Topology(args.nproc_per_node or pod.nproc_per_node, pod.nnodes, pod.node_rank,
                            args.master_addr or pod.master_addr, args.master_port or pod.master_port)
    nproc = args.nproc_per_node or (slurm.gpus_per_node if slurm is not None else None) or 1  # Slurm: one node's GPUs
    nnodes = args.nnodes or 1
    if nnodes > 1 and not args.master_addr:
        raise HostError("--nnodes > 1 needs --master-addr (the address of node 0) and --node-rank")
    if not 0 <= (args.node_rank or 0) < nnodes:
        raise HostError(f"--node-rank {args.node_rank} is not in 0..{nnodes - 1}")
    return Topology(nproc, nnodes, args.node_rank or 0, args.master_addr, args.master_port or 29500)


def _check_numbers(args) -> None:
    """Refuse counts, durations, a port and an address that cannot work, before anything starts."""
    for flag in ("nproc_per_node", "nnodes", "master_port", "collective_timeout", "join_timeout"):
        value = getattr(args, flag)
        if value is not None and not 0 < value < math.inf:
            finite = " and finite" if value > 0 else ""
            raise JobError(f"--{flag.replace('_', '-')} must be positive{finite}, got {value:g}")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise JobError(f"--max-restarts must be 0 (no restart) or the number of times a failed job restarts from "
                       f"its newest checkpoint, got {args.max_restarts}")
    if args.master_port is not None and args.master_port > 65535:
        raise JobError(f"--master-port {args.master_port} is not a TCP port: use one in 1..65535 (default 29500)")
    if args.master_addr is not None:
        check_host(args.master_addr, "--master-addr")


def cmd_launch(args) -> int:
    args.words = args.words[1:] if args.words[:1] == ["--"] else args.words
    if not args.words:
        raise JobError("give the command to run after '--', e.g. -- train --config c.toml")
    _check_numbers(args)
    host_memory.allocator_library()  # a PARATRAIN_HOST_ALLOCATOR that names no file is refused here
    if is_script(args.words) and not Path(args.words[0]).is_file():
        raise JobError(f"script {args.words[0]} does not exist (a first word ending in .py is a script that "
                       f"every rank runs with python)")
    slurm = slurm_from_env()
    named_by = [Path(args.words[0]).stem] if is_script(args.words) else args.words
    name = args.name
    if name is None:
        name = (f"slurm-{slurm.job_id}" if slurm and slurm.nnodes > 1 and args.nnodes is None
                else joblib.new_name(named_by))
    name = joblib.check_name(name)
    job_dir = joblib.jobs_home() / name
    words = args.words
    if words[:1] == ["train"] and not any(w == "--run.dir" or w.startswith("--run.dir=") for w in words):
        words = [*words, f"--run.dir={job_dir}"]
    if args.emit is not None:
        from paratrain.launch import emit

        return emit.emit(args, name, job_dir, words)
    if args.image or args.emit_out:
        raise JobError("--image and --emit-out go with --emit sbatch|pytorchjob")
    hosts = None
    if (args.include or args.exclude) and not (args.hostfile or args.rank_table):
        raise HostError("--include and --exclude pick hosts of a --hostfile or --rank-table: give one, or leave "
                        "them out")
    if args.hostfile or args.rank_table:
        hosts = parse_rank_table(args.rank_table) if args.rank_table else parse_hostfile(args.hostfile)
        hosts = select_hosts(hosts, args.include, args.exclude)
    topo = None if hosts else _topology(args)
    if topo is not None:  # a hostfile's nodes each check their own when their launch starts
        from paratrain.device import check_local_ranks

        check_local_ranks(topo.nproc_per_node)
    world, local = ((sum(h.slots for h in hosts), max(h.slots for h in hosts)) if hosts
                    else (topo.nnodes * topo.nproc_per_node, topo.nproc_per_node))
    checked = _check_train_config(words, world, local, args.dry_run)  # once, before any rank starts
    if args.max_restarts is None:  # the flag wins over the config's launch.max_restarts
        args.max_restarts = checked[0].launch.max_restarts if checked is not None else 0
    if args.dry_run:
        return _dry_run(args, name, job_dir, words, hosts, topo)
    # nodes other than the first record themselves in node{R}.json beside the first node's job.json
    other_node = bool(os.environ.get("PARATRAIN_COORDINATED") or (topo and topo.node_rank > 0))
    if not other_node and not os.environ.get("PARATRAIN_JOB_PREPARED") and (job_dir / "job.json").exists():
        try:
            old = Job.from_file(job_dir / "job.json")
        except joblib.UnreadableRecord:
            old = None  # a damaged record is replaced
        if old is not None and old.state in joblib.ACTIVE:
            if not old.launcher_gone():
                raise JobError(f"job {name!r} is {old.state} (pid {old.launcher_pid} on {old.host}): stop it or "
                               f"pick another --name")
            print(f"paratrain launch: job {name}: taking over the record of an earlier launch, {old.state} on "
                  f"{old.host}: {old.lost_because()}", file=sys.stderr, flush=True)
    job_dir.mkdir(parents=True, exist_ok=True)
    job = Job(name=name, dir=str(job_dir), command=words, argv=_argv(args, name), run_dir=_run_dir(words, job_dir),
              hosts=[h.name for h in hosts] if hosts else [], nnodes=len(hosts) if hosts else topo.nnodes,
              node_rank=0 if hosts else topo.node_rank,
              nproc_per_node=hosts[0].slots if hosts else topo.nproc_per_node, max_restarts=args.max_restarts,
              launcher_start=joblib.process_start(os.getpid()))
    if other_node:
        job.record = f"node{job.node_rank}.json"
    elif os.environ.get("PARATRAIN_JOB_PREPARED") and job.path.exists():
        job.start_time = Job.from_file(job.path).start_time  # when --detach was asked
    if args.collective_timeout:
        os.environ["PARATRAIN_COLLECTIVE_TIMEOUT"] = str(args.collective_timeout)
    if args.detach:
        return _detach(args, job)
    print(f"paratrain launch: job {name} ({job.world_size} ranks), logs in {job_dir}", file=sys.stderr, flush=True)
    from paratrain.launch import launcher  # imports torch: not before a --detach

    if hosts:
        env = launcher.forwarded_env(joblib.jobs_home())
        return launcher.run_hosts(job, [launcher.node_command(host, argv, os.getcwd(), env)
                                        for host, argv in _node_argvs(args, name, hosts, words)])
    from paratrain.device import device

    if device().type == "cpu":  # before torchrun starts the ranks: the allocator is preloaded
        os.environ.update(host_memory.rank_env())
    if checked is not None:  # the ranks on this node need not check again (a hostfile's nodes check their own)
        from paratrain.preflight import CHECKED_ENV

        os.environ[CHECKED_ENV] = checked[1]
    return launcher.run_node(job, topo, launcher.rank_command(words),
                             console=not os.environ.get("PARATRAIN_JOB_PREPARED"), join_timeout_s=args.join_timeout)


def _argv(args, name: str) -> list[str]:
    """``paratrain launch ...`` with everything this launch was given except --detach and --dry-run."""
    hosts = [f"--{flag.replace('_', '-')}={getattr(args, flag)}"
             for flag in ("hostfile", "rank_table", "include", "exclude") if getattr(args, flag)]
    return ["paratrain", "launch", *_launch_flags(args, name), *hosts, "--", *args.words]


def _node_argvs(args, name: str, hosts, words: list[str]):
    """(host, the ``paratrain launch`` arguments of its node) for every host of a hostfile or rank table."""
    for i, host in enumerate(hosts):
        flags = _launch_flags(args, name, nproc_per_node=host.slots, nnodes=len(hosts), node_rank=i,
                              master_addr=hosts[0].address, master_port=args.master_port or 29500)
        yield host, [*flags, "--", *words]


def _run_dir(words: list[str], job_dir: Path) -> str:
    """Where the command writes ``metrics.jsonl``: its ``--run.dir`` if given."""
    for i, w in enumerate(words):
        if w.startswith("--run.dir="):
            return str(Path(w.split("=", 1)[1]).absolute())
        if w == "--run.dir" and i + 1 < len(words):
            return str(Path(words[i + 1]).absolute())
    return str(job_dir)


def _dry_run(args, name, job_dir, words, hosts, topo) -> int:
    from paratrain.launch import launcher
    from paratrain.launch.emit import line_safe

    print(f"# job {name}: run directory {line_safe(str(job_dir), 'the run directory')}")
    if not hosts:
        print(shlex.join(["torchrun", *launcher.torchrun_args(topo, name, launcher.rank_command(words),
                                                              args.join_timeout, args.max_restarts)]))
        return 0
    env = launcher.forwarded_env(joblib.jobs_home())
    for i, (host, argv) in enumerate(_node_argvs(args, name, hosts, words)):
        print(f"# node {i}: {host.name} ({host.slots} ranks)")
        print(shlex.join(launcher.node_command(host, argv, os.getcwd(), env)))
    return 0


def _detach(args, job: Job) -> int:
    """Start this launch again in a new session (it survives the terminal) and return at once."""
    argv = [sys.executable, "-m", *_argv(args, job.name)]
    with open(Path(job.dir) / "launcher.log", "w") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PARATRAIN_JOB_PREPARED": "1"})
    job.launcher_pid, job.launcher_start = proc.pid, joblib.process_start(proc.pid)
    job.save()
    print(f"job {job.name} started in the background (pid {proc.pid}); "
          f"see 'paratrain jobs', 'paratrain logs {job.name}', 'paratrain stop {job.name}'")
    return 0


def cmd_jobs(args) -> int:
    names = [joblib.check_name(name) for name in args.name]
    jobs = [j for j in joblib.list_jobs() if not names or j.name in names]
    print(joblib.format_table(jobs) if jobs else f"no jobs in {joblib.jobs_home()}")
    return 0


def cmd_logs(args) -> int:
    if args.tail < 1:
        raise JobError(f"--tail must be a number of lines, 1 or more, got {args.tail}")
    job = joblib.load(args.name)
    if not 0 <= args.rank < job.world_size:
        raise JobError(f"job {job.name} has ranks 0..{job.world_size - 1}, not {args.rank}")
    if args.follow:
        joblib.follow(job, args.rank)
    else:
        print("\n".join(joblib.tail(job.log_path(args.rank), args.tail)))
    return 0


def cmd_stop(args) -> int:
    if not 0 <= args.grace < math.inf:
        raise JobError(f"--grace must be 0 or more seconds, got {args.grace:g}")
    stoplib.stop(joblib.load(args.name), grace_s=args.grace, now=args.now)
    return 0


def register(sub) -> None:
    """Add ``launch``, ``jobs``, ``logs`` and ``stop`` to the ``paratrain`` subcommand parser."""
    p = sub.add_parser("launch", help="start a job: one process per rank with torchrun, on one or many nodes",
                       description="Start NAME: every rank runs 'python -m paratrain COMMAND...', or "
                                   "'python SCRIPT.py ARGS...' when the first word after -- ends in .py.")
    p.add_argument("--nproc-per-node", type=int, help="ranks on each node (default: hostfile slots, Slurm GPUs, 1)")
    p.add_argument("--nnodes", type=int, help="number of nodes (start the launcher on each with its --node-rank)")
    p.add_argument("--node-rank", type=int, help="this node's index, 0..nnodes-1")
    p.add_argument("--master-addr", help="address of node 0, where the rendezvous runs")
    p.add_argument("--master-port", type=int, help="rendezvous port on node 0 (default 29500)")
    p.add_argument("--hostfile", help="DeepSpeed hostfile ('host slots=N' lines): ssh to each host")
    p.add_argument("--include", default="", help="hosts (and slots) to use from the hostfile: host1@host2:0,1")
    p.add_argument("--exclude", default="", help="hosts (or slots) to leave out: host1@host2:3")
    p.add_argument("--rank-table", help="MindSpore rank table JSON: ssh to each server, ranks by rank_id")
    p.add_argument("--name", help="job name = run directory under $PARATRAIN_HOME (default runs/); generated if absent")
    p.add_argument("--detach", action="store_true", help="run in the background, surviving the terminal")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun / per-node ssh commands, start nothing")
    p.add_argument("--emit", choices=("sbatch", "pytorchjob"),
                   help="start nothing: print this launch as a Slurm batch script (one 'paratrain launch' per node) "
                        "or a Kubeflow PyTorchJob (JSON, for kubectl apply -f); GPUs unless PARATRAIN_DEVICE=cpu")
    p.add_argument("--emit-out", metavar="FILE", help="write the --emit job file to FILE instead of stdout")
    p.add_argument("--image", help="--emit pytorchjob: the container image of its pods (paratrain and your files)")
    p.add_argument("--collective-timeout", type=float, help="seconds before a stuck collective fails (default 600)")
    p.add_argument("--join-timeout", type=float, default=600.0,
                   help="seconds a multi-node launch waits for every node to join before it gives up (default 600)")
    p.add_argument("--max-restarts", type=int,
                   help="times a failed job restarts, resuming from its newest checkpoint (default: the config's "
                        "launch.max_restarts, else 0)")
    p.add_argument("words", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="the paratrain subcommand each rank runs, e.g. -- train --config c.toml, "
                        "or a Python script and its arguments, e.g. -- train.py --epochs 2")
    p.set_defaults(func=cmd_launch)
    from paratrain.launch import msrun

    msrun.register(sub, launch_parser=p)

    p = sub.add_parser("jobs", help="list jobs: state, ranks, elapsed time, last step and loss")
    p.add_argument("name", nargs="*", help="only these jobs")
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("logs", help="print a rank's log of a job")
    p.add_argument("name")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--tail", type=int, default=100, help="number of last lines to print (default 100)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("stop", help="stop a job on every node: SIGTERM to every rank (which may save), "
                                    "SIGKILL after a grace period")
    p.add_argument("name")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL (default 10)")
    p.add_argument("--now", action="store_true", help="SIGKILL at once, without the graceful save")
    p.set_defaults(func=cmd_stop)
