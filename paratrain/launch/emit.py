"""``paratrain launch --emit sbatch|pytorchjob``: print a launch as the job file of a cluster's scheduler.

``sbatch``: a requeueable Slurm batch script whose one task per node runs ``paratrain launch``; ``pytorchjob``:
a Kubeflow PyTorchJob (JSON) of one pod per node. Both ask for ``nproc_per_node`` GPUs a node, or as many CPUs
when written with ``PARATRAIN_DEVICE=cpu``.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import string
import sys
from importlib.resources import files as resources_files
from pathlib import Path

from paratrain.launch import _check_train_config, _launch_flags, _run_dir
from paratrain.launch.jobs import JobError, jobs_home

KUBEFLOW_PORT = 23456  # the training operator's default for the master's "pytorchjob-port"
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# C0 and C1 control characters but the tab, and DEL: a newline or carriage return in a comment or an #SBATCH line
# would end it and start a command of the script
CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
NOT_WITH_EMIT = {"node_rank": "each node's rank", "master_addr": "node 0's address", "hostfile": "the nodes",
                 "rank_table": "the nodes", "include": "the nodes", "exclude": "the nodes"}


def emit(args, name: str, job_dir: Path, words: list[str]) -> int:
    """Write the ``args.emit`` job file of this launch (``job_dir``: its directory; ``words``: the command, with
    its run directory) to ``args.emit_out`` or stdout; refuse arguments a cluster's scheduler decides itself."""
    for flag, what in NOT_WITH_EMIT.items():
        if getattr(args, flag) not in (None, ""):
            raise JobError(f"--emit {args.emit} with --{flag.replace('_', '-')}: the cluster's scheduler chooses "
                           f"{what} when the job starts; leave it out")
    for flag in ("detach", "dry_run"):
        if getattr(args, flag):
            raise JobError(f"--emit writes a job file and starts nothing: --{flag.replace('_', '-')} does not apply")
    if args.emit == "pytorchjob" and not args.image:
        raise JobError("--emit pytorchjob needs --image IMAGE: the container image every pod runs, with paratrain "
                       "and the files the command reads")
    if args.emit != "pytorchjob" and args.image:
        raise JobError(f"--image names the container image of --emit pytorchjob; --emit {args.emit} has none")
    nnodes, nproc = args.nnodes or 1, args.nproc_per_node or 1
    if args.emit == "pytorchjob":
        name = _kubernetes_name(name, args.name is not None, nnodes)
    _check_train_config(words, nnodes * nproc, nproc, rules_only=True)
    gpus = os.environ.get("PARATRAIN_DEVICE", "auto") != "cpu"
    run_dir = Path(_run_dir(words, job_dir))
    if args.emit == "sbatch":
        text = sbatch_script(args, name, run_dir, words, nnodes, nproc, gpus)
    else:
        text = json.dumps(pytorchjob(args, name, words, nnodes, nproc, gpus), indent=2) + "\n"
    where = "every pod mounts at that path (a ReadWriteMany volume in the pod template)" \
        if args.emit == "pytorchjob" else "every node shares"
    try:
        data = text.encode()
    except UnicodeEncodeError as exc:  # a path or argument of bytes that are not UTF-8 (Python keeps them as such)
        line = text[text.rfind("\n", 0, exc.start) + 1:text.find("\n", exc.start)]
        raise JobError(f"--emit {args.emit}: a path or argument is not UTF-8 text, which the job file is: {line!r}; "
                       f"rename it") from None
    if args.emit == "sbatch":
        run_dir.mkdir(parents=True, exist_ok=True)  # Slurm opens the output file there before the script runs
    if args.emit_out:
        try:
            Path(args.emit_out).write_bytes(data)
        except OSError as exc:
            raise JobError(f"--emit-out {args.emit_out}: cannot write: {exc.strerror}") from None
        print(f"paratrain launch: wrote {args.emit_out} ({args.emit}, {nnodes} node(s) x {nproc} rank(s))",
              file=sys.stderr)
    else:
        sys.stdout.write(text)
    print(f"paratrain launch: the run directory {run_dir} must be storage {where}", file=sys.stderr)
    return 0


def sbatch_script(args, name: str, run_dir: Path, words: list[str], nnodes: int, nproc: int, gpus: bool) -> str:
    """A Slurm batch script: ``nnodes`` nodes, one task each running ``paratrain launch`` for ``nproc`` ranks."""
    python, chdir = sys.executable, os.getcwd()
    for what, value in (("the run directory", str(run_dir)), ("the working directory", chdir),
                        ("this Python", python)):
        line_safe(value, what)
    resources = f"--gpus-per-node={nproc}" if gpus else f"--cpus-per-task={nproc}"
    device = "" if gpus else "export PARATRAIN_DEVICE=cpu\n"
    launch = shlex.join([sys.executable, "-m", "paratrain", "launch"])
    flags = shlex.join([*_launch_flags(args, None, nnodes=None, nproc_per_node=nproc), "--", *words])
    template = string.Template(resources_files("paratrain.launch").joinpath("sbatch.template").read_text())
    # sbatch fills in %j (the job id) and %% ('%') unless the name holds a backslash
    output = f"{run_dir}/slurm.out" if "\\" in str(run_dir) else str(run_dir).replace("%", "%%") + "/slurm-%j.out"
    return template.substitute(name=name, nnodes=nnodes, nproc=nproc, resources=resources, python=python,
                               output=directive_quote(output), chdir=directive_quote(chdir), run_dir=run_dir,
                               home=shlex.quote(str(jobs_home())), device=device, launch=launch, flags=flags)


def line_safe(value: str, what: str) -> str:
    """``value`` if it holds no control character, else a JobError naming it: ``what`` goes into a comment or an
    ``#SBATCH`` line of a script, where a newline would start a command."""
    found = CONTROL.search(value)
    if found is not None:
        raise JobError(f"{what} {value!r} holds the control character {found.group()!r}, which a job script cannot "
                       f"carry in a comment or #SBATCH line: use a path without it")
    return value


def directive_quote(value: str) -> str:
    """``value`` as one argument of an ``#SBATCH`` line, which sbatch reads with its own rules (not the shell's):
    in double quotes, with a backslash before each quote, backslash and ``#`` (a comment otherwise)."""
    return '"' + re.sub(r"([\\\"'#])", r"\\\1", value) + '"'


def pytorchjob(args, name: str, words: list[str], nnodes: int, nproc: int, gpus: bool) -> dict:
    """A Kubeflow PyTorchJob: one pod per node, each with ``nproc`` ranks, restarted on failure."""
    if nproc == 1 and words[:1] == ["train"]:  # the pod is the rank: paratrain.cluster reads PET_NODE_RANK
        command = ["python", "-m", "paratrain", *words]
    else:  # records and rank logs stay in the container: a restarted one must not find its own as running
        command = ["python", "-m", "paratrain", "launch", *_launch_flags(args, name, nnodes=None, nproc_per_node=nproc,
                                                                        master_port=None), "--", *words]
    container = {"name": "pytorch", "image": args.image, "command": command,
                 "ports": [{"name": "pytorchjob-port", "containerPort": args.master_port or KUBEFLOW_PORT}]}
    if not gpus:
        container["env"] = [{"name": "PARATRAIN_DEVICE", "value": "cpu"}]
    container["resources"] = {"limits": {"nvidia.com/gpu": nproc} if gpus else {"cpu": nproc}}

    def replicas(count: int) -> dict:
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": {"containers": [container]}}}

    specs = {"Master": replicas(1), **({"Worker": replicas(nnodes - 1)} if nnodes > 1 else {})}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name},
            "spec": {"nprocPerNode": str(nproc), "pytorchReplicaSpecs": specs}}


def _kubernetes_name(name: str, given: bool, nnodes: int) -> str:
    """``name`` as a PyTorchJob's name: a DNS label (the operator's rule) short enough for its pods' services,
    ``<name>-worker-<i>``; a generated name is lower-cased, a given one that breaks the rule refused."""
    if not given:
        name = name.lower()
    longest = len(f"-worker-{nnodes - 2}" if nnodes > 1 else "-master-0")
    if _DNS_LABEL.fullmatch(name) is None or len(name) + longest > 63:
        fixed = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:63 - longest].rstrip("-")
        raise JobError(f"--name {name!r}: a PyTorchJob's name must be lowercase letters, digits and '-', start "
                       f"with a letter and be at most {63 - longest} characters (its pods' services are "
                       f"{name}-master-0, ...): e.g. --name {fixed or 'job'}")
    return name
