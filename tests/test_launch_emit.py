"""``paratrain launch --emit``: the PyTorchJob validates against the Kubeflow Training Operator's CRD schema and
its pods, given the operator's variables, form one job; the sbatch script run under stub ``srun``/``scontrol``
(two "nodes" on this machine) trains with the losses of one process; arguments are refused as for a launch."""
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import jsonschema
import pytest

from conftest import PYTHON
from paratrain import cli
from test_cluster import CONFIG, _free_slurm_job_id, _train

CRD = Path(__file__).parent / "data" / "kubeflow" / "kubeflow.org_pytorchjobs.json"
DNS_1035 = r"[a-z]([-a-z0-9]*[a-z0-9])?"


def _strict(schema):
    """The CRD's schema as ``kubectl apply`` checks it (strict field validation): an object that lists its
    properties takes no others."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        strict["additionalProperties"] = False
    return strict


@pytest.fixture(scope="module")
def validator():
    crd = json.loads(CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


def _emit(monkeypatch, capsys, home: Path, *flags: str, device: str = "cpu"):
    monkeypatch.setenv("PARATRAIN_HOME", str(home))
    monkeypatch.setenv("PARATRAIN_DEVICE", device)
    code = cli.main(["launch", *flags])
    return code, capsys.readouterr()


def _operator_checks(job: dict) -> None:
    """The rules the operator's admission webhook adds to the schema (pkg/webhooks/pytorch, v1.9.0)."""
    assert re.fullmatch(DNS_1035, job["metadata"]["name"]) and len(job["metadata"]["name"]) <= 63
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) <= {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    assert specs.get("Worker", {"replicas": 1})["replicas"] >= 1
    for spec in specs.values():
        containers = spec["template"]["spec"]["containers"]
        assert all(c["image"] for c in containers) and any(c["name"] == "pytorch" for c in containers)


@pytest.mark.parametrize("nnodes, nproc, device, words", [
    (3, 4, "cuda", ["train", "--config", "c.toml"]),
    (2, 1, "cpu", ["train", "--config", "c.toml"]),
    (1, 2, "auto", ["script.py", "--epochs", "2"]),
])
def test_pytorchjob_validates_against_the_operators_crd(tmp_path, monkeypatch, capsys, validator, nnodes, nproc,
                                                         device, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "script.py").write_text("")
    code, out = _emit(monkeypatch, capsys, tmp_path / "runs", "--emit", "pytorchjob", "--image", "reg/img:1",
                      f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--name", "gpt", "--", *words,
                      device=device)
    assert code == 0, out.err
    job = json.loads(out.out)
    validator.validate(job)
    _operator_checks(job)
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert sum(s["replicas"] for s in specs.values()) == nnodes and job["spec"]["nprocPerNode"] == str(nproc)
    container = specs["Master"]["template"]["spec"]["containers"][0]
    gpus = container["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus == (nproc if device != "cpu" else None)
    assert specs["Master"]["restartPolicy"] == "OnFailure"
    launched = container["command"][3] == "launch"  # one rank per pod runs train itself
    assert launched == (nproc > 1 or words[0] != "train")
    command = container["command"]
    assert command[command.index(words[0]):][:len(words)] == words
    assert not (tmp_path / "runs" / "gpt" / "job.json").exists()  # nothing launched
    # the validator catches what kubectl would refuse: an unknown field, a wrong type
    for broken in ({**job, "spec": {**job["spec"], "nprocsPerNode": "2"}},
                   {**job, "spec": {**job["spec"], "pytorchReplicaSpecs": {"Master": {**specs["Master"],
                                                                                     "replicas": "1"}}}}):
        with pytest.raises(jsonschema.ValidationError):
            validator.validate(broken)


@pytest.mark.parametrize("flags, message", [
    (["--emit", "pytorchjob"], "--emit pytorchjob needs --image IMAGE"),
    (["--emit", "sbatch", "--image", "x"], "--emit sbatch has none"),
    (["--image", "x"], "--image and --emit-out go with --emit"),
    (["--emit", "sbatch", "--master-addr", "n1"], "chooses node 0's address when the job starts"),
    (["--emit", "sbatch", "--node-rank", "1"], "chooses each node's rank"),
    (["--emit", "sbatch", "--dry-run"], "starts nothing: --dry-run does not apply"),
    (["--emit", "pytorchjob", "--image", "x", "--name", "My_Job"], "e.g. --name my-job"),
    (["--emit", "sbatch", "--nproc-per-node", "3"], "does not divide the world size 3"),
    (["--emit", "sbatch", "--nnodes", "0"], "--nnodes must be positive"),
])
def test_emit_refuses_what_a_launch_refuses_and_what_the_scheduler_decides(tmp_path, monkeypatch, capsys, flags,
                                                                           message):
    code, out = _emit(monkeypatch, capsys, tmp_path / "runs", *flags, "--", "train", "--parallel.model_parallel=2")
    assert code == 2 and message in out.err and len(out.err.strip().splitlines()) == 1, out.err
    assert out.out == ""


STUB_SRUN = """#!/bin/bash
# srun for the tests: run the step's command once per node of the allocation, as local processes
echo "$@" > "$STUB_LOG"
while [[ $1 == -* ]]; do shift; done
n=$SLURM_JOB_NUM_NODES pids=()
for ((i = 0; i < n; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_NTASKS=$n SLURM_STEP_ID=0 \\
    SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST SLURM_STEP_TASKS_PER_NODE="1(x$n)" "$@" &
  pids+=($!)
done
code=0
for pid in "${pids[@]}"; do wait "$pid" || code=$?; done
exit $code
"""
STUB_SCONTROL = """#!/bin/bash
# every node of the allocation is this machine
[[ $1 == show && $2 == hostnames ]] || exit 1
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do echo localhost; done
"""


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The losses of test_cluster's config trained by one process, the reference of the 2-node runs."""
    losses, _ = _train(tmp_path_factory.mktemp("alone"), "alone", [{}])
    return losses


def _sbatch_words(text: str) -> list[str]:
    """The arguments of an ``#SBATCH`` line (after the magic word) as sbatch splits them (Slurm's
    src/sbatch/opt.c, _get_argument): whitespace separates, single or double quotes group, a backslash escapes the
    next character, an unquoted ``#`` ends the line; an unmatched quote is fatal."""
    words, i = [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return words
        word, quote, escape = "", "", False
        while i < len(text) and (quote or not text[i].isspace()):
            char, i = text[i], i + 1
            if escape:
                escape = False
            elif char == "\\":
                escape = True
                continue
            elif quote:
                if char == quote:
                    quote = ""
                    continue
            elif char in "\"'":
                quote = char
                continue
            elif char == "#":
                return [*words, word] if word else words
            word += char
        assert not quote, f"sbatch: unmatched {quote} in {text!r}"
        words.append(word)


def _sbatch_options(script: Path, job_id: str) -> dict[str, str]:
    """The ``--key=value`` options of the ``#SBATCH`` lines of ``script`` as sbatch reads them, the output file's
    pattern filled in (``%j``: the job id, ``%%``: '%'; none when the name holds a backslash)."""
    options = {}
    for line in script.read_text().split("\n"):
        if line.startswith("#SBATCH"):
            for word in _sbatch_words(line[len("#SBATCH"):]):
                key, _, value = word.removeprefix("--").partition("=")
                options[key] = value
    if "\\" not in options["output"]:
        options["output"] = re.sub(r"%([%j])", lambda m: job_id if m[1] == "j" else "%", options["output"])
    return options


def _sbatch(script: Path, env: dict[str, str], job_id: str) -> subprocess.CompletedProcess:
    """Run ``script`` as sbatch would: in its --chdir, output to its --output."""
    options = _sbatch_options(script, job_id)
    with open(options["output"], "a") as log:
        return subprocess.run(["bash", str(script)], cwd=options["chdir"], env=env, stdout=log,
                              stderr=subprocess.STDOUT, timeout=240)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("home_name", ["runs", "runs $(touch pwned) `touch pwned`; 'q\" #x %j \\b*"],
                         ids=["plain", "hostile"])
def test_sbatch_script_under_stub_srun_trains_as_one_process(tmp_path, monkeypatch, capsys, one_process, home_name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.toml").write_text(CONFIG)
    home, script = tmp_path / home_name, tmp_path / "job.sbatch"
    code, out = _emit(monkeypatch, capsys, home, "--emit", "sbatch", "--emit-out", str(script), "--nnodes=2",
                      "--nproc-per-node=1", "--name", "tiny", "--", "train", "--config", "tiny.toml")
    assert code == 0 and out.out == "", out.err
    text = script.read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=1",
                 "#SBATCH --requeue", "#SBATCH --job-name=tiny"):
        assert line in text.splitlines()
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name, body in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL)):
        (stubs / name).write_text(body)
        (stubs / name).chmod(0o755)
    job_id = _free_slurm_job_id()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PARATRAIN_"))}
    env = {**base, "PATH": f"{stubs}:{os.environ['PATH']}", "STUB_LOG": str(tmp_path / "srun"),
           "SLURM_JOB_ID": job_id, "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "cn[1-2]"}
    run = _sbatch(script, env, job_id)
    log = Path(_sbatch_options(script, job_id)["output"]).read_text()
    assert Path(_sbatch_options(script, job_id)["output"]).parent == home / "tiny"
    assert run.returncode == 0, log
    assert not list(tmp_path.rglob("pwned"))
    assert (tmp_path / "srun").read_text().startswith("--ntasks-per-node=1 ")
    records = [json.loads(line) for line in (home / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records] == pytest.approx(one_process, rel=1e-5)
    job = json.loads((home / f"slurm-{job_id}" / "job.json").read_text())
    assert (job["state"], job["nnodes"], job["nproc_per_node"]) == ("succeeded", 2, 1)


def _pod_env(job: dict, replica: str, index: int) -> dict[str, str]:
    """What the operator sets in a pod (pkg/controller.v1/pytorch/envvar.go, master.go, v1.9.0), with this
    machine as the master pod's address."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    container = specs[replica]["template"]["spec"]["containers"][0]
    port = str(next(p["containerPort"] for p in specs["Master"]["template"]["spec"]["containers"][0]["ports"]
                    if p["name"] == "pytorchjob-port"))
    rank = str(index + (replica == "Worker"))
    nodes = sum(s["replicas"] for s in specs.values())
    return {**{e["name"]: e["value"] for e in container.get("env", [])}, "PYTHONUNBUFFERED": "1",
            "MASTER_PORT": port, "PET_MASTER_PORT": port, "MASTER_ADDR": "localhost", "PET_MASTER_ADDR": "localhost",
            "WORLD_SIZE": str(nodes * int(job["spec"]["nprocPerNode"])), "RANK": rank, "PET_NODE_RANK": rank,
            "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"], "PET_NNODES": str(nodes)}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pytorchjob_pods_given_the_operators_variables_train_as_one_process(tmp_path, monkeypatch, capsys,
                                                                            one_process):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.toml").write_text(CONFIG)
    port = str(29500 + int(_free_slurm_job_id()) % 1000)
    code, out = _emit(monkeypatch, capsys, tmp_path / "runs", "--emit", "pytorchjob", "--image", "img", "--nnodes=2",
                      f"--master-port={port}", "--name", "tiny", "--", "train", "--config", "tiny.toml")
    assert code == 0, out.err
    job = json.loads(out.out)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "PARATRAIN_"))}
    pods = []
    for replica, index in (("Master", 0), ("Worker", 0)):
        container = job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"][0]
        command = [PYTHON if word == "python" else word for word in container["command"]]
        pods.append(subprocess.Popen(command, cwd=tmp_path, env={**base, **_pod_env(job, replica, index)},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=240)[0] for p in pods]
    finally:
        for p in pods:
            p.kill()
    assert [p.returncode for p in pods] == [0, 0], outputs
    records = [json.loads(line) for line in (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records] == pytest.approx(one_process, rel=1e-5)


# srun for the hostile-path tests: records where it runs, PARATRAIN_HOME and its arguments (NUL-separated)
RECORDING_SRUN = """#!/bin/bash
printf '%s\\0' "$PWD" "$PARATRAIN_HOME" "$@" > "$STUB_LOG"
"""
# each runs a command if anything of the script's lines passes it to the shell unquoted, or ends a line with it
HOSTILE = ["$(touch pwned)", "`touch pwned`", "a; touch pwned; b", "a && touch pwned", "it's \"quoted\"; touch pwned",
           "two  spaces\ttab", "g*l?b[ab]{c,d}~", "# hash", "100%j %% %x", "back\\slash\\", "-dash", "!bang|pipe>gt<lt&"]


def _stub(tmp_path: Path, body: str) -> dict[str, str]:
    """An environment whose ``srun`` is ``body``, with no Slurm or paratrain variables of this session."""
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    (stubs / "srun").write_text(body)
    (stubs / "srun").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PARATRAIN_"))}
    return {**base, "PATH": f"{stubs}:{os.environ['PATH']}", "STUB_LOG": str(tmp_path / "srun.log"),
            "SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "cn[1-2]"}


@pytest.mark.parametrize("hostile", HOSTILE)
@pytest.mark.parametrize("run_dir_given", [False, True])
def test_sbatch_script_passes_hostile_paths_verbatim_and_runs_nothing_else(tmp_path, monkeypatch, capsys, hostile,
                                                                          run_dir_given):
    """The working directory, PARATRAIN_HOME and the run directory (given, or the job's under PARATRAIN_HOME) are
    hostile: the script, run by bash as sbatch would run it, reaches srun in that directory with those exact
    values and runs no other command."""
    cwd, home, run_dir = (tmp_path / "top" / f"{what}{hostile}" for what in ("cwd", "home", "run"))
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    (cwd / "c.toml").write_text(CONFIG)
    words = ["train", "--config", "c.toml", *([f"--run.dir={run_dir}"] if run_dir_given else [])]
    script = tmp_path / "job.sbatch"
    code, out = _emit(monkeypatch, capsys, home, "--emit", "sbatch", "--emit-out", str(script), "--nnodes=2",
                      "--name", "hostile", "--", *words)
    assert code == 0, out.err
    run = _sbatch(script, _stub(tmp_path, RECORDING_SRUN), "77")
    assert run.returncode == 0
    assert not list(tmp_path.rglob("pwned")) and not list(Path("/tmp").glob("pwned"))
    where, exported, *argv = (tmp_path / "srun.log").read_bytes().decode().split("\0")[:-1]
    assert (where, exported) == (str(cwd), str(home))
    assert argv[argv.index("--") + 1:] == [*words, *([] if run_dir_given else [f"--run.dir={home / 'hostile'}"])]
    assert "--name=slurm-77" in argv and "--nproc-per-node=1" in argv
    options = _sbatch_options(script, "77")
    expected_run_dir = run_dir if run_dir_given else home / "hostile"
    assert options["chdir"] == str(cwd) and options["job-name"] == "hostile"
    output = "slurm.out" if "\\" in str(expected_run_dir) else "slurm-77.out"  # sbatch fills in no %j then
    assert options["output"] == f"{expected_run_dir}/{output}" and (expected_run_dir / output).exists()


@pytest.mark.parametrize("char", ["\n", "\r", "\x1b", "\x7f", "\x85", "\x0b"])
@pytest.mark.parametrize("where", ["cwd", "home", "run_dir"])
def test_sbatch_refuses_control_characters_in_its_comment_and_directive_lines(tmp_path, monkeypatch, capsys, char,
                                                                               where):
    """A newline (or another control character) in a path that a comment or an #SBATCH line holds is refused
    in one line naming the path, before any file is written; in PARATRAIN_HOME with the run directory given it
    is only in a quoted shell word, which carries it."""
    hostile = f"x{char}touch pwned{char}"
    cwd = tmp_path / (f"cwd{hostile}" if where == "cwd" else "cwd")
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    (cwd / "c.toml").write_text(CONFIG)
    home = tmp_path / (f"home{hostile}" if where == "home" else "home")
    run_dir = tmp_path / (f"run{hostile}" if where == "run_dir" else "run")
    script = tmp_path / "job.sbatch"
    code, out = _emit(monkeypatch, capsys, home, "--emit", "sbatch", "--emit-out", str(script), "--name", "j", "--",
                      "train", "--config", "c.toml", *([] if where == "home" else [f"--run.dir={run_dir}"]))
    what = {"cwd": "the working directory", "home": "the run directory", "run_dir": "the run directory"}[where]
    assert code == 2 and out.err.startswith(f"paratrain: {what} ") and repr(char)[1:-1] in out.err, out.err
    assert len(out.err.strip().splitlines()) == 1 and not script.exists() and not home.exists()
    assert not (tmp_path / f"run{hostile}").exists()


def test_sbatch_carries_a_newline_of_paratrain_home_in_a_quoted_word(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(CONFIG)
    home, script = tmp_path / "home\ntouch pwned\n", tmp_path / "job.sbatch"
    code, out = _emit(monkeypatch, capsys, home, "--emit", "sbatch", "--emit-out", str(script), "--name", "j", "--",
                      "train", "--config", "c.toml", f"--run.dir={tmp_path / 'run'}")
    assert code == 0, out.err
    assert _sbatch(script, _stub(tmp_path, RECORDING_SRUN), "77").returncode == 0
    assert not list(tmp_path.rglob("pwned"))
    assert (tmp_path / "srun.log").read_bytes().decode().split("\0")[1] == str(home)


def test_dry_run_refuses_a_control_character_in_its_comment_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PARATRAIN_HOME", str(tmp_path / "home\ntouch pwned"))
    assert cli.main(["launch", "--dry-run", "--name", "j", "--", "train"]) == 2
    err = capsys.readouterr().err
    assert "the run directory" in err and "'\\n'" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("where", ["cwd", "home", "run_dir"])
def test_sbatch_refuses_paths_that_are_not_utf8_in_one_line(tmp_path, monkeypatch, capsys, where):
    odd = os.fsdecode(b"x\xff")  # Python's stand-in for a byte that is not UTF-8
    cwd = tmp_path / (f"cwd{odd}" if where == "cwd" else "cwd")
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    (cwd / "c.toml").write_text(CONFIG)
    home, run_dir, script = tmp_path / (f"home{odd}" if where == "home" else "home"), tmp_path / f"run{odd}", \
        tmp_path / "job.sbatch"
    code, out = _emit(monkeypatch, capsys, home, "--emit", "sbatch", "--emit-out", str(script), "--name", "j", "--",
                      "train", "--config", "c.toml", *([f"--run.dir={run_dir}"] if where == "run_dir" else []))
    assert code == 2 and "not UTF-8 text" in out.err and len(out.err.strip().splitlines()) == 1, out.err
    assert not script.exists() and not run_dir.exists() and not home.exists()
