"""Where a job runs: DeepSpeed hostfiles, MindSpore rank tables, Slurm allocations and Kubeflow pods, each as
a list of :class:`Host` in node-rank order. Host names are checked first: ``a;rm -rf ~`` never reaches ssh."""
from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from paratrain.cluster import expand_nodelist, job_port
from paratrain.errors import UserError

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9._-]{0,31}")


class HostError(UserError, ValueError):
    """A hostfile, rank table or host list that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Host:
    """One node of a job: its (ssh) name, how many ranks it runs, and optionally which devices."""

    name: str
    slots: int
    devices: tuple[int, ...] | None = None  # CUDA_VISIBLE_DEVICES for the node's ranks, None = all

    @property
    def address(self) -> str:
        """The host without its ``user@`` part (what other nodes connect to)."""
        return self.name.rsplit("@", 1)[-1]


def is_valid_host(name: str) -> bool:
    """True for ``[user@]host`` where host is a DNS name or an IPv4/IPv6 address."""
    user, _, host = name.rpartition("@")
    if user and not _USER.fullmatch(user):
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return len(host) <= 253 and _HOSTNAME.fullmatch(host) is not None


def check_host(name: str, where: str) -> str:
    """Return ``name`` or raise a HostError naming ``where`` it came from."""
    if not is_valid_host(name):
        raise HostError(f"{where}: {name!r} is not a valid host name "
                        "(letters, digits, '-' and '.', or an IP address, optionally user@)")
    return name


def parse_hostfile(path: str | Path) -> list[Host]:
    """Read a DeepSpeed hostfile: one ``host slots=N`` per line, ``#`` comments, blank lines ignored."""
    hosts: dict[str, Host] = {}
    text = _read(path)
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{lineno}"
        words = line.split()
        name = check_host(words[0], where)
        if len(words) != 2 or not words[1].startswith("slots="):
            raise HostError(f"{where}: expected 'HOST slots=N', got {raw.strip()!r}")
        count = words[1][len("slots="):]
        if not count.isdigit() or int(count) < 1:
            raise HostError(f"{where}: slots must be a positive integer, got {count!r}")
        if name in hosts:
            raise HostError(f"{where}: host {name!r} is listed twice")
        hosts[name] = Host(name, int(count))
    if not hosts:
        raise HostError(f"{path}: no hosts (expected lines like 'node1 slots=8')")
    return list(hosts.values())


def _selection(spec: str, hosts: list[Host], flag: str) -> dict[str, list[int] | None]:
    """``host1@host2:0,1`` -> {host1: None (all slots), host2: [0, 1]}."""
    known = {h.name: h for h in hosts}
    chosen: dict[str, list[int] | None] = {}
    for part in filter(None, spec.split("@")):
        name, _, slots = part.partition(":")
        if name not in known:
            raise HostError(f"{flag} {spec!r}: host {name!r} is not in the hostfile ({', '.join(known)})")
        if not slots:
            chosen[name] = None
            continue
        try:
            indices = sorted({int(s) for s in slots.split(",")})
        except ValueError:
            raise HostError(f"{flag} {spec!r}: slots of {name!r} must be integers like {name}:0,1") from None
        bad = [i for i in indices if not 0 <= i < known[name].slots]
        if bad:
            raise HostError(f"{flag} {spec!r}: {name!r} has slots 0..{known[name].slots - 1}, not {bad}")
        chosen[name] = indices
    return chosen


def select_hosts(hosts: list[Host], include: str = "", exclude: str = "") -> list[Host]:
    """Apply DeepSpeed-style ``--include``/``--exclude`` (``host[:slot,slot]@host...``)."""
    if include and exclude:
        raise HostError("--include and --exclude cannot be used together")
    if not include and not exclude:
        return hosts
    chosen = _selection(include or exclude, hosts, "--include" if include else "--exclude")
    result = []
    for host in hosts:
        everything = list(range(host.slots))
        picked = (chosen[host.name] or everything) if host.name in chosen else []  # None: every slot
        kept = picked if include else [i for i in everything if i not in picked]
        if kept:
            result.append(Host(host.name, len(kept), None if kept == everything else tuple(kept)))
    if not result:
        raise HostError("no hosts left after --include/--exclude")
    return result


def parse_rank_table(path: str | Path) -> list[Host]:
    """Turn a MindSpore rank table (``server_list`` / ``device`` / ``rank_id``) into hosts: each server a node
    whose ranks are its devices by ``rank_id``, numbered server by server without gaps, every server holding
    as many devices (one ``nproc_per_node``)."""
    text = _read(path)
    try:
        table = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HostError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    servers = table.get("server_list") if isinstance(table, dict) else None
    if not isinstance(servers, list) or not servers:
        raise HostError(f"{path}: no 'server_list' array (is this a MindSpore rank table?)")
    hosts, next_rank = [], 0
    for i, server in enumerate(servers):
        where = f"{path}:{_line_of(text, server)}: server_list[{i}]"
        if not isinstance(server, dict) or not isinstance(server.get("device"), list) or not server["device"]:
            raise HostError(f"{where}: expected an object with 'server_id' and a non-empty 'device' list")
        name = check_host(str(server.get("server_id", "")), where)
        devices = []
        for j, device in enumerate(server["device"]):
            try:
                devices.append((int(device["rank_id"]), int(device["device_id"])))
            except (KeyError, TypeError, ValueError):
                raise HostError(f"{where}.device[{j}]: needs integer 'rank_id' and 'device_id', "
                                f"got {json.dumps(device)}") from None
        devices.sort()
        ranks = [r for r, _ in devices]
        expected = list(range(next_rank, next_rank + len(devices)))
        if ranks != expected:
            raise HostError(f"{where}: rank_id {ranks} should be {expected} "
                            "(ranks numbered server by server, without gaps or repeats)")
        next_rank += len(devices)
        hosts.append(Host(name, len(devices), tuple(d for _, d in devices)))
    if len({h.slots for h in hosts}) > 1:
        raise HostError(f"{path}: servers hold different numbers of devices "
                        f"({', '.join(f'{h.name}: {h.slots}' for h in hosts)}); every node must run as many ranks")
    return hosts


@dataclass
class Topology:
    """How many nodes, which one this is, and where the rendezvous lives (None: this machine only)."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = 29500


@dataclass(frozen=True)
class SlurmAllocation:
    """The part of a Slurm allocation the launcher needs, read from ``SLURM_*`` variables."""

    job_id: str
    nnodes: int
    node_rank: int
    master_addr: str
    gpus_per_node: int | None
    master_port: int  # every node derives it alike from the job id


def slurm_from_env(env: dict[str, str] | None = None) -> SlurmAllocation | None:
    """The Slurm allocation this process runs in, or None outside Slurm."""
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env or "SLURM_NODEID" not in env:
        return None
    nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""))
    if not nodes:
        raise HostError("Slurm: SLURM_JOB_NODELIST is empty")
    gpus = (env.get("SLURM_GPUS_ON_NODE") or env.get("SLURM_GPUS_PER_NODE") or "").rpartition(":")[2]  # [type:]N
    count_name = next((name for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES") if env.get(name)), None)
    nnodes = env_number("Slurm", count_name, env[count_name], 1) if count_name else len(nodes)
    return SlurmAllocation(job_id=env["SLURM_JOB_ID"], nnodes=nnodes,
                           node_rank=env_number("Slurm", "SLURM_NODEID", env["SLURM_NODEID"], 0, nnodes - 1),
                           master_addr=check_host(nodes[0], "Slurm SLURM_JOB_NODELIST"),
                           gpus_per_node=int(gpus) if gpus and gpus.isdigit() else None,
                           master_port=job_port(env["SLURM_JOB_ID"]))


def kubeflow_from_env(env: dict[str, str] | None = None) -> Topology | None:
    """The nodes of the Kubeflow PyTorchJob whose pod this is (``PET_NNODES``, ``PET_NODE_RANK``,
    ``PET_NPROC_PER_NODE``, ``PET_MASTER_ADDR``/``PORT``), or None outside one."""
    env = os.environ if env is None else env
    if "PET_NNODES" not in env:
        return None
    numbers = {name: env.get(name, "") for name in ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_PORT")}
    numbers["PET_NODE_RANK"] = numbers["PET_NODE_RANK"] or env.get("RANK", "0")
    bad = [f"{name}={value!r}" for name, value in numbers.items() if value and not value.isdigit()]
    if bad:
        raise HostError(f"Kubeflow: {', '.join(bad)} should be a number (an elastic range of nodes is not "
                        f"supported: give the PyTorchJob a fixed number of replicas)")
    nnodes = env_number("Kubeflow", "PET_NNODES", numbers["PET_NNODES"], 1)
    node_rank = env_number("Kubeflow", "PET_NODE_RANK", numbers["PET_NODE_RANK"], 0, nnodes - 1)
    nproc = env.get("PET_NPROC_PER_NODE", "")
    master = env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR")
    if nnodes > 1 and not master:
        raise HostError(f"Kubeflow: PET_NNODES={nnodes} without PET_MASTER_ADDR (the master pod's address)")
    port_name = "PET_MASTER_PORT" if numbers["PET_MASTER_PORT"] else "MASTER_PORT"
    port = env.get(port_name)
    counted = nproc.lstrip("+-").isdigit()  # else torchrun's words (auto, gpu, cpu): one rank here
    return Topology(env_number("Kubeflow", "PET_NPROC_PER_NODE", nproc, 1) if counted else 1, nnodes,
                    node_rank, check_host(master, "Kubeflow PET_MASTER_ADDR") if nnodes > 1 else None,
                    env_number("Kubeflow", port_name, port, 1, 65535) if port else 29500)


def env_number(source: str, name: str, value: str, lowest: int, highest: int | None = None) -> int:
    """The value of the launcher variable ``name`` as a number in ``lowest..highest``, else a HostError naming
    it and ``source`` (the launcher that set it)."""
    span = f"from {lowest} to {highest}" if highest is not None else f"of {lowest} or more"
    if not value.strip().isdigit() or not lowest <= int(value) <= (int(value) if highest is None else highest):
        raise HostError(f"{source}: {name}={value!r} is not a whole number {span}: start paratrain in the job "
                        f"that sets it, or unset it")
    return int(value)


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise HostError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise HostError(f"{path}: not UTF-8 text (byte {exc.start}); is this a hostfile or rank table?") from None


def _line_of(text: str, server) -> int | str:
    """Line of the first ``"server_id": "<id>"`` of this server in ``text`` ("?" if not found)."""
    value = server.get("server_id") if isinstance(server, dict) else None
    match = re.search(r'"server_id"\s*:\s*"?' + re.escape(str(value)), text) if value is not None else None
    return text.count("\n", 0, match.start()) + 1 if match else "?"
