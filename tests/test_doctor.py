"""`paratrain doctor`: environment report and the all-reduce checks (one gloo process; 2 ranks in test_launch)."""
import datetime

import pytest
import torch
import torch.distributed as dist

from paratrain import cli, distributed, doctor


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def test_single_process_report(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"torch: {torch.__version__}" in out and "backend: gloo" in out and "no collectives" in out


def test_all_reduce_check_finds_wrong_results(group, monkeypatch):
    assert doctor.check_all_reduce(1, 0) == []
    real = dist.all_reduce

    def off_by_one(tensor, *args, **kwargs):
        real(tensor, *args, **kwargs)
        tensor[7] += 1

    monkeypatch.setattr(dist, "all_reduce", off_by_one)
    problems = doctor.check_all_reduce(1, 0)
    assert len(problems) == 3 and all("max error 1" in p and "rank 0" in p for p in problems)


def test_bandwidth_is_measured(group):
    seconds, busbw = doctor.bus_bandwidth(0.25, torch.device("cpu"), min_time_s=0.05)
    assert 0 < seconds < 5 and busbw == 0.0  # one rank moves nothing over the network: 2(n-1)/n = 0


def test_collective_timeout_from_env(monkeypatch):
    monkeypatch.setenv("PARATRAIN_COLLECTIVE_TIMEOUT", "42")
    assert distributed.collective_timeout() == 42.0
    monkeypatch.setenv("PARATRAIN_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="PARATRAIN_COLLECTIVE_TIMEOUT"):
        distributed.collective_timeout()
    monkeypatch.delenv("PARATRAIN_COLLECTIVE_TIMEOUT")
    assert distributed.collective_timeout(600.0) == 600.0


def test_bandwidth_agrees_once_per_size_not_at_every_all_reduce(group, monkeypatch):
    """The ranks agree on how many all-reduces to time once, then run them back to back (a GPU waits once)."""
    calls = {"all_reduce": 0, "broadcast": 0}
    for name in calls:
        real = getattr(dist, name)
        monkeypatch.setattr(dist, name, lambda *a, _real=real, _name=name, **k: calls.update(
            {_name: calls[_name] + 1}) or _real(*a, **k))
    doctor.bus_bandwidth(0.01, torch.device("cpu"), min_time_s=0.05)
    assert calls["broadcast"] == 1 and calls["all_reduce"] > 10, calls
