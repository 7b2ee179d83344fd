"""Issue 17 E: bad input to launch/jobs/logs/stop ends in one line and exit code 2, never a traceback,
and one damaged job record never hides the other jobs."""
import pytest
from test_launch import use_registry

from paratrain import cli
from paratrain.launch.jobs import Job


@pytest.fixture
def home(tmp_path, monkeypatch):
    return use_registry(tmp_path, monkeypatch)


def refused(capsys, *argv) -> str:
    """Run ``paratrain argv``; assert exit code 2 and a single-line message; return it."""
    code = cli.main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flag, value", [("--nproc-per-node", "0"), ("--nproc-per-node", "-2"), ("--nnodes", "0"),
                                         ("--join-timeout", "0"), ("--collective-timeout", "-1")])
def test_launch_refuses_counts_and_durations_that_cannot_work(home, capsys, flag, value):
    err = refused(capsys, "launch", flag, value, "--name", "n", "--", "doctor")
    assert f"{flag} must be positive, got {value}" in err
    assert not home.exists()  # nothing was started or recorded


def test_stop_refuses_a_negative_grace(home, capsys):
    assert "--grace" in refused(capsys, "stop", "x", "--grace", "-1")


DAMAGED = {
    "not-json": b'{"name": "x", ',
    "not-utf8": b'{"name": "\xff\xfe"}',
    "a-list": b"[1, 2]",
    "no-name": b'{"dir": "/tmp"}',
    "bad-pids": b'{"name": "bad-pids", "dir": "/tmp", "pids": {"0": "twelve"}}',
    "bad-start": b'{"name": "bad-start", "dir": "/tmp", "start_time": "yesterday"}',
}


@pytest.mark.parametrize("name", DAMAGED)
def test_a_damaged_record_is_listed_as_unreadable_and_refused_by_logs_and_stop(home, capsys, name):
    (home / "good").mkdir(parents=True)
    Job(name="good", dir=str(home / "good"), state="succeeded", exit_code=0).save()
    (home / name).mkdir()
    (home / name / "job.json").write_bytes(DAMAGED[name])
    assert cli.main(["jobs"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["good"][1] == "succeeded"
    assert rows[name][1] == "unreadable"
    assert f"{name}: unreadable (" in out
    for command in ("logs", "stop"):
        err = refused(capsys, command, name)
        assert f"{home / name / 'job.json'}: unreadable (" in err


def test_unknown_jobs_and_bad_names(home, capsys):
    (home / "good").mkdir(parents=True)
    Job(name="good", dir=str(home / "good"), state="succeeded").save()
    for command in ("logs", "stop"):
        assert "no job 'nope'" in refused(capsys, command, "nope")
    assert "unexpected --all" in refused(capsys, "jobs", "--all")
    for bad in ("../etc", "a;rm -rf ~", "$(id)", "a/b"):
        assert "job name" in refused(capsys, "jobs", "good", bad)
        assert "job name" in refused(capsys, "logs", bad)


@pytest.mark.parametrize("flag", ["--hostfile", "--rank-table"])
def test_a_hosts_file_that_is_not_utf8_names_the_file(home, tmp_path, capsys, flag):
    path = tmp_path / "hosts.bin"
    path.write_bytes(b"node1 slots=2\n\xff\xfe\x00garbage\n")
    err = refused(capsys, "launch", flag, str(path), "--dry-run", "--", "doctor")
    assert f"{path}: not UTF-8 text" in err


def test_a_link_to_a_job_directory_is_not_listed_again(home, capsys):
    (home / "demo-1").mkdir(parents=True)
    Job(name="demo-1", dir=str(home / "demo-1"), state="succeeded", exit_code=0).save()
    (home / "demo-latest").symlink_to("demo-1")
    assert cli.main(["jobs"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:] if line.strip()]
    assert names == ["demo-1"]
