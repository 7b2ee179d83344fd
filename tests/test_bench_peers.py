"""bench/peers.py at a tiny size, without DeepSpeed: torch DDP and paratrain zero 0 in forked gloo workers.

Checks the pieces the benchmark relies on (same losses from the same saved weights and batches, bytes
counted per collective, the report's keys, a loss mismatch caught), not timings.
"""
import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

import paratrain.trainer  # noqa: E402,F401  imported once here: the forked workers inherit it
import peers  # noqa: E402
from paratrain import host_memory  # noqa: E402
from multiprocess import run_distributed  # noqa: E402

TINY = ["--vocab", "97", "--hidden", "32", "--heads", "4", "--ffn", "64", "--layers", "2", "--length", "16",
        "--batch", "8", "--quick", "--systems", "torch_ddp,paratrain_zero0"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    a = peers.parse_args(TINY + ["--out", str(tmp_path_factory.mktemp("peers"))])
    names = peers.selected(a)
    common = peers.prepare(a)
    runs = peers.run_all(a, names, common, lambda name, job: run_distributed(peers.run_worker, 2, job, timeout=40))
    return names, runs, common, a.tolerance


@pytest.mark.slow
@pytest.mark.timeout(90)  # ~10 s on an idle machine, the workers included
def test_same_losses_bytes_and_report(measured):
    names, runs, common, tolerance = measured
    report = json.loads(json.dumps(peers.build_report(names, runs, common, tolerance)))  # JSON as written
    assert {"systems", "ratios", "max_loss_rel_diff", "diagnosis", "params"} <= set(report)
    ddp, ours = report["systems"]["torch_ddp"], report["systems"]["paratrain_zero0"]
    assert ours["errors"] == [] and ddp["errors"] == []
    assert ours["losses_agree"] and ours["max_loss_rel_diff"] <= tolerance
    assert len(ours["losses"]) == common["warmup"] + common["steps"] + 1
    param_bytes = common["params"] * 4
    # ring all-reduce over 2 ranks sends the gradient bytes once; paratrain adds a few scalars
    assert ddp["bytes_per_step"]["all_reduce"]["bytes"] == param_bytes
    assert param_bytes < ours["bytes_per_step"]["all_reduce"]["bytes"] < param_bytes + 1024
    for s in (ddp, ours):
        assert s["step_time_s"] > 0 and len(s["peak_rss_mb"]) == 2 and min(s["peak_rss_mb"]) > 0
    assert set(report["ratios"]["ddp"]) >= {"time", "memory", "bytes", "time_peer", "memory_peer"}
    assert report["ratios"]["ddp"]["time_peer"] == "torch_ddp"
    assert "ddp" in report["diagnosis"]
    # forked from this process: the allocator this process has
    assert ddp["allocator"] == ours["allocator"] == (host_memory.loaded_allocator() or "glibc")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_loss_mismatch_is_reported_not_timed(measured):
    names, runs, common, tolerance = measured
    runs = copy.deepcopy(runs)
    for rank in runs["paratrain_zero0"][0]:
        rank["losses"][-1] *= 1 + 10 * tolerance
    report = peers.build_report(names, runs, common, tolerance)
    assert not report["systems"]["paratrain_zero0"]["losses_agree"]
    assert "ddp" not in report["ratios"]
