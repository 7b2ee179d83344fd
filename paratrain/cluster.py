"""Where this process is in its job, read from whichever launcher started it (no torch import).

:func:`fill_env` sets ``env://``'s :data:`VARIABLES` from the first launcher that describes this process: torchrun
(nothing to do), SLURM with one task per rank, Open MPI or MPICH/Intel MPI's PMI, or a one-process Kubeflow pod.
A variable already set must agree with it, else a :class:`TopologyError` says which numbers and how to fix it.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import zlib
from dataclasses import dataclass, replace

from paratrain.errors import UserError

DEFAULT_PORT = 29500
VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
MPI = {  # launcher: its rank, size, local rank and local size variables, then those that may name the job
    "Open MPI": (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                  "OMPI_COMM_WORLD_LOCAL_SIZE"), ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")),
    "MPI (PMI)": (("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"), ("PMI_JOBID", "PMIX_NAMESPACE")),
}


class TopologyError(UserError):
    """Launcher variables that contradict each other or leave this process's place in the job unknown."""


@dataclass(frozen=True)
class Place:
    """This process's rank among ``world_size``, its rank among the ``local_world_size`` ranks of its node,
    the rendezvous address, and the launcher these came from."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str

    def variables(self) -> dict[str, str]:
        return dict(zip(VARIABLES, map(str, (self.rank, self.world_size, self.local_rank, self.local_world_size,
                                             self.master_addr, self.master_port))))


def job_port(job_id: str) -> int:
    """A port every task of a job derives alike from its id: 29500 + (the id's digits, or its CRC) mod 1000."""
    digits = re.sub(r"\D", "", job_id)
    return DEFAULT_PORT + (int(digits) if digits else zlib.crc32(job_id.encode())) % 1000


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed node list (``node[01-04,07],gpu-a1``) in order, with ``scontrol show
    hostnames`` where Slurm is installed."""
    if shutil.which("scontrol") and nodelist:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if out.returncode == 0:
            return out.stdout.split()
    names = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]+)(?:\[([^\]]*)\]([^,\[]*))?,?", nodelist):
        if not ranges:
            names.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or not (hi or lo).isdigit():
                raise TopologyError(f"Slurm node list {nodelist!r}: {part!r} is not a number or range like 01-04")
            names += [f"{prefix}{i:0{len(lo)}d}{suffix}" for i in range(int(lo), int(hi or lo) + 1)]
    return names


def tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's tasks per node, ``4(x2),3`` -> [4, 4, 3]."""
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise TopologyError(f"Slurm tasks per node {spec!r}: expected counts like '4(x2),3'")
        if int(match[1]) == 0 or match[2] is not None and int(match[2]) == 0:
            raise TopologyError(f"Slurm tasks per node {spec!r}: {part.strip()!r} counts no task; every node of a "
                                f"step runs one or more")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def _int(env, name: str) -> int:
    value = env[name]
    if not value.strip().isdigit():
        raise TopologyError(f"{name}={value!r} is not a non-negative integer")
    return int(value)


def _count(env, name: str) -> int:
    """A number of ranks or nodes: 1 or more."""
    count = _int(env, name)
    if count == 0:
        raise TopologyError(f"{name}=0: a job runs at least one rank on at least one node; start it with a "
                            f"positive count")
    return count


def slurm_tasks(env) -> Place:
    """The place of this SLURM task (``SLURM_PROCID`` set) among the tasks of its job step."""
    rank, world = _int(env, "SLURM_PROCID"), _count(env, "SLURM_NTASKS" if "SLURM_NTASKS" in env else "SLURM_NPROCS")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    nodes = expand_nodelist(nodelist)
    spec_name = next((n for n in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
                      if env.get(n)), None)
    if spec_name is not None:
        counts = tasks_per_node(env[spec_name])
        if len(counts) == 1 and len(nodes) > 1:  # --ntasks-per-node: the same on every node
            counts *= len(nodes)
        if nodes and len(counts) != len(nodes):
            raise TopologyError(f"{spec_name}={env[spec_name]} gives {len(counts)} node(s) but the node list "
                                f"{nodelist} has {len(nodes)}")
        if sum(counts) != world:
            raise TopologyError(
                f"SLURM_NTASKS={world} but {spec_name}={env[spec_name]} on {len(counts)} node(s) makes "
                f"{sum(counts)} tasks: give srun --ntasks equal to the nodes times --ntasks-per-node, or only one")
    elif len(nodes) <= 1:
        counts = [world]
    else:
        raise TopologyError(f"SLURM_NTASKS={world} on {len(nodes)} nodes ({nodelist}) without a tasks-per-node "
                            f"count: how many ranks each node runs is unknown; start srun --ntasks-per-node=G")
    if not rank < world:
        raise TopologyError(f"SLURM_PROCID={rank} is not below SLURM_NTASKS={world}")
    starts = [sum(counts[:i]) for i in range(len(counts))]
    node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else max(
        i for i, start in enumerate(starts) if start <= rank)
    if not node < len(counts):
        raise TopologyError(f"SLURM_NODEID={node} but the step has {len(counts)} node(s)")
    local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else rank - starts[node]
    if not local < counts[node]:
        raise TopologyError(f"SLURM_LOCALID={local} but node {node} runs {counts[node]} task(s)")
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID", "")
    return Place(rank, world, local, counts[node], nodes[0] if nodes else "localhost",
                 job_port(job) if job else DEFAULT_PORT, f"SLURM job {job or '?'} (SLURM_PROCID, SLURM_NTASKS, "
                 f"SLURM_LOCALID, {spec_name or 'one node'})")


def _mpi(env, launcher: str) -> Place:
    names, job_names = MPI[launcher]
    job = next((env[name] for name in job_names if env.get(name)), "")
    rank, world = _int(env, names[0]), _count(env, names[1])
    if not rank < world:
        raise TopologyError(f"{names[0]}={rank} is not below {names[1]}={world}")
    if names[2] in env and names[3] in env:
        local, local_world = _int(env, names[2]), _count(env, names[3])
    elif "LOCAL_RANK" in env and "LOCAL_WORLD_SIZE" in env:
        local, local_world = _int(env, "LOCAL_RANK"), _count(env, "LOCAL_WORLD_SIZE")
    elif "MASTER_ADDR" not in env:  # no address of rank 0 either: every rank is on this machine
        local, local_world = rank, world
    else:
        raise TopologyError(f"{launcher} sets no {names[2]}/{names[3]}: export LOCAL_RANK and LOCAL_WORLD_SIZE "
                            f"to every rank")
    if local_world < world and "MASTER_ADDR" not in env:
        raise TopologyError(f"{launcher} runs {world} ranks on several nodes ({local_world} on this one) but does "
                            f"not say where rank 0 is: export MASTER_ADDR=<host of rank 0> to every rank "
                            f"(mpirun -x MASTER_ADDR=...)")
    return Place(rank, world, local, local_world, "localhost", job_port(job) if job else DEFAULT_PORT,
                 f"{launcher} ({names[0]}, {names[1]})")


def _kubeflow(env) -> Place:
    nnodes = env["PET_NNODES"]
    if not nnodes.isdigit():
        raise TopologyError(f"PET_NNODES={nnodes!r}: an elastic PyTorchJob (a range of nodes) needs "
                            f"'paratrain launch', which runs torchrun's rendezvous")
    nproc = env.get("PET_NPROC_PER_NODE", "1")
    if nproc.isdigit() and int(nproc) > 1:
        raise TopologyError(f"this Kubeflow pod is to run {nproc} processes (PET_NPROC_PER_NODE={nproc}) but one "
                            f"was started alone: run 'paratrain launch -- train ...' in the pod, or nprocPerNode: 1")
    rank_name = "PET_NODE_RANK" if "PET_NODE_RANK" in env else "RANK"
    if rank_name not in env:
        raise TopologyError("a Kubeflow pod (PET_NNODES set) without PET_NODE_RANK or RANK: which pod is this?")
    rank, world = _int(env, rank_name), _count(env, "PET_NNODES")
    if not rank < world:
        raise TopologyError(f"{rank_name}={rank} is not below PET_NNODES={world}")
    port = env.get("PET_MASTER_PORT") or env.get("MASTER_PORT") or str(DEFAULT_PORT)
    return Place(rank, world, 0, 1, env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR") or "localhost",
                 int(port), f"a Kubeflow PyTorchJob pod ({rank_name}, PET_NNODES, one process per pod)")


def locate(env=None) -> Place | None:
    """This process's place from the first launcher that describes it, variables already set taken over;
    None when torchrun set them already or no launcher did (one process)."""
    env = os.environ if env is None else env
    if all(name in env for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    if "SLURM_PROCID" in env and ("SLURM_NTASKS" in env or "SLURM_NPROCS" in env):
        place = slurm_tasks(env)
    elif (mpi := next((name for name, (names, _) in MPI.items() if names[0] in env and names[1] in env), None)):
        place = _mpi(env, mpi)
    elif "PET_NNODES" in env:
        place = _kubeflow(env)
    else:
        return None
    given = place.variables()
    for name in VARIABLES[:4]:
        if name in env and env[name] != given[name]:
            raise TopologyError(f"{name}={env[name]} but {place.source} says {given[name]}: unset {name} or "
                                f"start the job so that they agree")
    return replace(place, master_addr=env.get("MASTER_ADDR") or place.master_addr,
                   master_port=int(env.get("MASTER_PORT") or place.master_port))


def fill_env(env=None, report=lambda line: print(line, flush=True)) -> Place | None:
    """Set the torch.distributed variables this process lacks from its launcher (:func:`locate`); rank 0
    ``report``\\ s where they came from. Returns the place, None when there was nothing to fill."""
    env = os.environ if env is None else env
    place = locate(env)
    if place is None:
        return None
    env.update(place.variables())
    if place.rank == 0 and report is not None:
        report(f"paratrain: {place.world_size} rank(s), {place.local_world_size} on this node, from {place.source}; "
               f"rendezvous at {place.master_addr}:{place.master_port}")
    return place
