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
from forked_ranks import run_distributed  # noqa: E402

TINY = ["--vocab", "97", "--hidden", "32", "--heads", "4", "--ffn", "64", "--layers", "2", "--length", "16",
        "--batch", "8", "--quick", "--systems", "torch_ddp,paratrain_zero0", "--terms", "equal"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    a = peers.parse_args(TINY + ["--profile", "--out", str(tmp_path_factory.mktemp("peers"))])
    names = peers.selected(a)
    common = peers.prepare(a)
    runs = peers.run_all(a, names, common, lambda name, job: run_distributed(peers.run_worker, 2, job, timeout=40))
    return names, runs["equal"], common, a.tolerance


@pytest.mark.slow
@pytest.mark.timeout(90)  # ~10 s on an idle machine, the workers included
def test_same_losses_bytes_and_report(measured):
    names, runs, common, tolerance = measured
    report = json.loads(json.dumps(peers.build_reports(names, {"equal": runs}, common, tolerance)))  # as written
    assert {"systems", "ratios", "max_loss_rel_diff", "diagnosis", "params"} <= set(report)
    ddp, ours = report["systems"]["torch_ddp"], report["systems"]["paratrain_zero0"]
    assert ours["errors"] == [] and ddp["errors"] == []
    assert ours["losses_agree"] and ours["max_loss_rel_diff"] <= tolerance
    assert len(ours["losses"]) == common["warmup"] + common["steps"] + 2  # the counted step, the profiled one
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
    assert report["terms"] == "equal" and report["own_launcher"] is None
    # the counted step's ops: the same model's forward and backward in both, so the same order of magnitude;
    # the copy-like ops write at least DDP's flattening... and no system copies nothing
    for s in (ddp, ours):
        assert 0 < s["copy_ops"] <= s["kernels"] <= s["ops"] and s["copy_bytes"] > 0
        assert s["ops_by_op"]["aten.mm"][0] > 0 and s["ops_by_op"]["aten.mm"][1] == 0  # compute: no copy bytes
    assert 0.5 < ours["ops"] / ddp["ops"] < 2
    for s in (ddp, ours):  # the profiled step: self CPU time by op, matmuls among the largest
        mm_ms, mm_calls = s["profile"]["by_op"]["aten::mm"]
        assert 0 < mm_ms < s["profile"]["total_ms"] and mm_calls > 0


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


def test_op_counter_counts_a_known_sequence():
    import torch

    counter = peers._op_counter_class()()
    with counter:
        x = torch.ones(4, 4)  # a kernel (fill), not a copy
        y = x.t().contiguous()  # a view, then a clone: 64 bytes
        z = torch.cat([x, y])  # 128 bytes
        z.add_(1)  # compute
        x.copy_(y)  # 64 bytes written into x
        torch._foreach_copy_([x, y], [y, x])  # 2 x 64 bytes
        torch.empty(8)  # an allocation: an op, no kernel
    got = counter.summary()
    by = got["by_op"]
    assert by["aten.clone"] == [1, 64] and by["aten.cat"] == [1, 128] and by["aten.copy_"] == [1, 64]
    assert by["aten._foreach_copy_"] == [1, 128] and by["aten.add_"] == [1, 0] and by["aten.t"] == [1, 0]
    assert got["copy_ops"] == 4 and got["copy_bytes"] == 64 + 128 + 64 + 128
    assert got["kernels"] == 6 and got["ops"] == 8  # ones, clone, cat, add_, copy_, _foreach_copy_; + t, empty
    assert peers.is_copy("split_with_sizes_copy") and peers.is_copy("_to_copy") and not peers.is_copy("mm")


def test_equal_terms_preload_one_allocator_for_every_system(tmp_path):
    library = tmp_path / "libtcmalloc_minimal.so.4"
    library.write_bytes(b"")
    env = {"PATH": "/usr/bin", host_memory.CHOICE_ENV: str(library)}
    venv = tmp_path / "venv"
    equal = {name: peers.rank_env(name, "equal", env, venv) for name in peers.SYSTEMS}
    own = {name: peers.rank_env(name, "own", env, venv) for name in peers.SYSTEMS}
    assert {e.get("LD_PRELOAD") for e in equal.values()} == {str(library)}  # the same for all, DeepSpeed's too
    rate = host_memory.TCMALLOC_SETTINGS["TCMALLOC_RELEASE_RATE"]
    assert {e["TCMALLOC_RELEASE_RATE"] for e in equal.values()} == {rate}
    for name, e in own.items():  # as each launcher starts it: only paratrain's ranks get the preload
        assert (e.get("LD_PRELOAD") == str(library)) == (peers.SYSTEMS[name]["runner"] == "paratrain")
    for name in ("deepspeed_zero3", "deepspeed_pp2"):
        assert equal[name]["DS_ACCELERATOR"] == own[name]["DS_ACCELERATOR"] == "cpu"
    assert "DS_ACCELERATOR" not in equal["torch_fsdp2"]
    # glibc chosen: nobody preloads anything, under either terms
    env[host_memory.CHOICE_ENV] = "system"
    assert all("LD_PRELOAD" not in peers.rank_env(name, t, env, venv) for name in peers.SYSTEMS for t in peers.TERMS)
    assert peers.parse_args([]).terms == ["equal", "own"]
    with pytest.raises(SystemExit):
        peers.parse_args(["--terms", "mine"])


def test_deepspeed_pipeline_layers_chain_to_the_gpt(measured):
    """The DeepSpeed pipeline side's layers (embeddings, blocks, norm + head), run in turn without DeepSpeed,
    give the whole GPT's logits: each passes the next one a tensor."""
    import torch

    _, _, job, _ = measured  # the saved weights every system starts from
    embed, block, head = peers._pipe_classes()
    layers = [embed(job), *(block(job, i) for i in range(job["model"]["layers"])), head(job)]
    ids = torch.randint(0, job["model"]["vocab"], (2, job["model"]["length"]))
    x = ids
    for layer in layers:
        x = layer(x)
    (gpt,) = peers._gpt_part(job, "")
    expected = gpt(ids)
    expected = expected[0] if isinstance(expected, tuple) else expected
    torch.testing.assert_close(x, expected)
