"""Hostfiles, rank tables, Slurm, host-name checks and the per-node commands (no processes started)."""
import json
import shlex

import pytest

from paratrain import cli
from paratrain.launch import hosts as H
from paratrain.launch.hosts import Host, HostError

HOSTILE = ["a;rm -rf ~", "$(reboot)", "`id`", "a b", "a|b", "a&&b", "-oProxyCommand=touch x", "host\nother",
           "../etc", "a>b", "", "user;x@host", "x" * 300]


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("PARATRAIN_HOME", str(tmp_path / "runs"))
    for var in ("SLURM_JOB_ID", "SLURM_NODEID", "PARATRAIN_COORDINATED", "PARATRAIN_JOB_PREPARED"):
        monkeypatch.delenv(var, raising=False)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", ["node-1", "gpu7.cluster.example.com", "10.0.0.12", "::1", "fe80::1",
                                  "alice@node1", "a"])
def test_valid_host_names(name):
    assert H.is_valid_host(name)


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_host_names_are_refused(name):
    assert not H.is_valid_host(name)


def test_hostfile(tmp_path):
    path = write(tmp_path, "hostfile", "# cluster\nworker-0 slots=4\n\n10.1.0.2   slots=2  # second\n")
    assert H.parse_hostfile(path) == [Host("worker-0", 4), Host("10.1.0.2", 2)]


@pytest.mark.parametrize("bad, line, words", [
    ("n1 slots=2\nn2 slots=x\n", 2, "positive integer"),
    ("n1 slots=2\n\n# c\nn2\n", 4, "expected 'HOST slots=N'"),
    ("n1 slots=0\n", 1, "positive integer"),
    ("n1 slots=2\nn1 slots=2\n", 2, "listed twice"),
    ("n1 slots=2\nn2;touch pwned slots=1\n", 2, "not a valid host name"),
    ("n1 slots=2 gpus=3\n", 1, "expected"),
])
def test_hostfile_errors_name_the_line(tmp_path, bad, line, words):
    path = write(tmp_path, "hostfile", bad)
    with pytest.raises(HostError, match=words) as err:
        H.parse_hostfile(path)
    assert str(err.value).startswith(f"{path}:{line}:")


def test_empty_or_missing_hostfile(tmp_path):
    with pytest.raises(HostError, match="no hosts"):
        H.parse_hostfile(write(tmp_path, "hostfile", "# nothing\n"))
    with pytest.raises(HostError, match="cannot read"):
        H.parse_hostfile(tmp_path / "missing")


def test_include_exclude():
    hosts = [Host("a", 4), Host("b", 4), Host("c", 2)]
    assert H.select_hosts(hosts, include="a@c:1") == [Host("a", 4), Host("c", 1, (1,))]
    assert H.select_hosts(hosts, exclude="b@a:0,3") == [Host("a", 2, (1, 2)), Host("c", 2)]
    for include, words in (("z", "not in the hostfile"), ("a:9", "slots 0..3"), ("a:x", "integers")):
        with pytest.raises(HostError, match=words):
            H.select_hosts(hosts, include=include)


def rank_table(servers):
    return json.dumps({"version": "1.0", "server_count": str(len(servers)), "status": "completed",
                       "server_list": [{"server_id": s, "host_nic_ip": "reserve",
                                        "device": [{"device_id": str(d), "device_ip": f"192.1.0.{d}",
                                                    "rank_id": str(r)} for d, r in devs]}
                                       for s, devs in servers]}, indent=2)


def test_rank_table(tmp_path):
    path = write(tmp_path, "rank_table.json",
                 rank_table([("10.0.0.1", [(1, 1), (0, 0)]), ("10.0.0.2", [(0, 3), (1, 2)])]))
    assert H.parse_rank_table(path) == [Host("10.0.0.1", 2, (0, 1)), Host("10.0.0.2", 2, (1, 0))]


@pytest.mark.parametrize("servers, words", [
    ([("10.0.0.1", [(0, 0), (1, 1)]), ("10.0.0.2", [(0, 2), (1, 4)])], r"rank_id \[2, 4\] should be \[2, 3\]"),
    ([("10.0.0.1", [(0, 0), (1, 0)])], r"rank_id \[0, 0\] should be \[0, 1\]"),
    ([("10.0.0.1", [(0, 0), (1, 1)]), ("10.0.0.2", [(0, 2)])], "different numbers of devices"),
    ([("10.0.0.1", [(0, 0)]), ("bad;host", [(0, 1)])], "not a valid host name"),
])
def test_rank_table_errors(tmp_path, servers, words):
    with pytest.raises(HostError, match=words):
        H.parse_rank_table(write(tmp_path, "rt.json", rank_table(servers)))


def test_rank_table_errors_name_the_line(tmp_path):
    text = rank_table([("10.0.0.1", [(0, 0)]), ("10.0.0.2", [(0, 1)])]).replace('"rank_id": "1"', '"rank": "1"')
    path = write(tmp_path, "rt.json", text)
    line = text[:text.index('"10.0.0.2"')].count("\n") + 1
    with pytest.raises(HostError, match=r"server_list\[1\]\.device\[0\]: needs integer 'rank_id'") as err:
        H.parse_rank_table(path)
    assert str(err.value).startswith(f"{path}:{line}:")
    broken = write(tmp_path, "broken.json", '{\n  "server_list": [\n    {"server_id": "a",,}\n  ]\n}\n')
    with pytest.raises(HostError, match=r"broken.json:3:\d+: invalid JSON"):
        H.parse_rank_table(broken)


def test_slurm(monkeypatch):
    monkeypatch.setenv("PATH", "")  # no scontrol: our own node-list expansion
    assert H.expand_nodelist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07", "gpu5"]
    env = {"SLURM_JOB_ID": "4242", "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_GPUS_ON_NODE": "8"}
    alloc = H.slurm_from_env(env)
    assert (alloc.nnodes, alloc.node_rank, alloc.master_addr, alloc.gpus_per_node) == (2, 1, "gpu1", 8)
    assert alloc.master_port == 29500 + 4242 % 1000
    assert H.slurm_from_env({}) is None


def test_slurm_sets_topology_and_name(tmp_path, monkeypatch, capsys):
    for key, value in {"SLURM_JOB_ID": "77", "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2",
                       "SLURM_JOB_NODELIST": "cn[3-4]", "PATH": ""}.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["launch", "--nproc-per-node", "2", "--dry-run", "--", "doctor"]) == 0
    out = capsys.readouterr().out
    assert "# job slurm-77" in out
    for flag in ("--nnodes 2", "--node-rank 1", "--master-addr cn3", "--master-port 29577"):
        assert flag in out


def dry_run(capsys, *args):
    code = cli.main(["launch", *args])
    return code, capsys.readouterr()


def test_dry_run_quotes_every_word_per_node(tmp_path, capsys, monkeypatch):
    hostfile = write(tmp_path, "hostfile", "alice@node-a slots=2\nnode-b slots=2\n")
    monkeypatch.chdir(tmp_path)
    evil = "cfg $(touch pwned); `id` 'q'.toml"
    code, out = dry_run(capsys, "--hostfile", str(hostfile), "--dry-run", "--name", "j1", "--master-port", "6000",
                        "--", "train", "--config", evil)
    assert code == 0, out.err
    lines = [line for line in out.out.splitlines() if not line.startswith("#")]
    assert len(lines) == 2
    for node, (line, host) in enumerate(zip(lines, ["alice@node-a", "node-b"])):
        ssh = shlex.split(line)
        assert ssh[-3:-1] == ["--", host]
        remote = shlex.split(ssh[-1])  # what the remote shell sees, word by word
        assert remote[:3] == ["cd", str(tmp_path), "&&"]
        assert "PARATRAIN_COORDINATED=1" in remote
        command = remote[remote.index("--", remote.index("launch")) + 1:]
        assert command == ["train", "--config", evil, f"--run.dir={tmp_path / 'runs' / 'j1'}"]
        for flag in (f"--node-rank={node}", "--nnodes=2", "--master-addr=node-a", "--master-port=6000",
                     "--nproc-per-node=2", "--name=j1"):
            assert flag in remote
    assert not (tmp_path / "pwned").exists()


def test_dry_run_single_node_uses_a_free_port(capsys):
    code, out = dry_run(capsys, "--nproc-per-node", "4", "--dry-run", "--name", "one", "--", "train",
                        "--run.dir", "elsewhere")  # 4: the default config's batch of 16 splits over 4 ranks
    assert code == 0, out.err
    words = shlex.split(out.out.splitlines()[-1])
    assert words[words.index("--rdzv-endpoint") + 1] == "localhost:0"
    assert "--master-port" not in words and words[words.index("--nproc-per-node") + 1] == "4"
    assert words[-3:] == ["train", "--run.dir", "elsewhere"]  # the user's run dir is kept


@pytest.mark.parametrize("content", ["bad;host slots=1\n", "-oProxyCommand=sh slots=1\n"])
def test_hostile_hostfile_never_reaches_a_shell(tmp_path, capsys, monkeypatch, content):
    started = []
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: started.append(a))
    hostfile = write(tmp_path, "hostfile", "good slots=1\n" + content)
    code, out = dry_run(capsys, "--hostfile", str(hostfile), "--", "doctor")
    assert code == 2 and f"{hostfile}:2:" in out.err and "not a valid host name" in out.err
    assert started == [] and not (tmp_path / "runs").exists()


def test_launch_argument_errors(capsys):
    assert dry_run(capsys, "--nproc-per-node", "2")[0] == 2
    code, out = dry_run(capsys, "--nnodes", "2", "--", "doctor")
    assert code == 2 and "--master-addr" in out.err
    code, out = dry_run(capsys, "--name", "a/b", "--", "doctor")
    assert code == 2 and "job name" in out.err
