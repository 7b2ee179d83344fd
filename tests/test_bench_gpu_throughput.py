"""bench/gpu_throughput.py: without CUDA it says why and exits 1; on the CPU (--device cpu --quick) every side
runs (fp8 reported skipped with its reason), the ratios are theirs (no timing thresholds), the losses of the
sides that train the same model agree, and --profile accounts for each side's profiled step."""
import json
import os
import subprocess
import sys

import pytest

from conftest import PYTHON, ROOT


def bench(tmp_path, *args, **env) -> subprocess.CompletedProcess:
    cmd = [PYTHON, str(ROOT / "bench" / "gpu_throughput.py"), "--json", str(tmp_path / "out.json"), *args]
    return subprocess.run(cmd, cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=220)


@pytest.mark.timeout(240)
def test_without_cuda_says_why_and_exits_1(tmp_path):
    proc = bench(tmp_path, CUDA_VISIBLE_DEVICES="")  # no GPU, also on a machine that has some
    assert proc.returncode == 1, proc.stderr
    assert "not run: CUDA is not available" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["ran"] is False and "CUDA is not available" in result["reason"]


@pytest.mark.timeout(240)
def test_cpu_quick_runs_every_side(tmp_path):
    proc = bench(tmp_path, "--device", "cpu", "--quick", "--steps", "2", "--warmup", "2", "--profile")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["ran"] is True and result["precision"] == "fp32" and result["steps"] == 2
    assert "paratrain_offload" not in result and "offload" not in result  # refused on the CPU: no offload row
    assert result["paratrain_fp8"] == {"skipped": "fp8 needs a CUDA GPU"}
    assert "paratrain_fp8      skipped: fp8 needs a CUDA GPU" in proc.stdout
    ran = ("scratch", "torch", "paratrain", "ms_model", "ms_loop", "ms_loop_padded", "llama", "llama_hf_loop")
    for side in ran:
        for key in ("tokens_per_s", "tflops", "mfu", "peak_memory_mb", "step_time_s"):
            assert result[side][key] > 0, (side, key)
        assert len(result[side]["losses"]) == 4, side
        profile = result[side]["profile"]
        assert 0 < profile["busy_ms"] and 0 < profile["busy_share"] <= 1, (side, profile)
        assert sum(profile["kinds_ms"].values()) == pytest.approx(profile["busy_ms"])
        assert sum(profile["ops_ms"].values()) == pytest.approx(profile["busy_ms"])
        assert profile["kinds_ms"]["matmul"] > 0 and profile["kinds_ms"]["attention"] > 0, side
        assert [op["ms"] for op in profile["top"]] == sorted(profile["ops_ms"].values(), reverse=True)[:12]
        assert any(line.startswith(side + " ") for line in proc.stdout.splitlines()), side
    p, t = result["paratrain"], result["torch"]
    assert p["params"] == t["params"] == result["params"]  # the same model on both sides
    assert result["ms_model"]["params"] == result["ms_loop"]["params"]
    assert p["loss_first"] == pytest.approx(t["loss_first"], rel=1e-2)  # same model and seed, same first batch
    assert result["losses"]["agree"] and set(result["losses"]["worst"]) == {"paratrain", "ms_model", "llama"}
    assert result["llama"]["params"] == result["llama_hf_loop"]["params"] != p["params"]  # the same Llama
    assert result["llama"]["loss_first"] == pytest.approx(result["llama_hf_loop"]["loss_first"], rel=1e-5)
    ratios = result["ratios"]
    assert ratios["fp8_vs_bf16"] is None
    assert ratios["ms_vs_plain_loop"] == pytest.approx(result["ms_model"]["tokens_per_s"]
                                                       / result["ms_loop"]["tokens_per_s"])
    assert ratios["cli_vs_scratch"] == pytest.approx(p["tokens_per_s"] / result["scratch"]["tokens_per_s"])
    for name in ("cli_vs_scratch", "cli_vs_gptmodel_loop", "ms_vs_plain_loop", "ms_vs_cli", "causal_mask_vs_padded",
                 "llama_vs_hf_loop"):
        assert f"ratio {name} " in proc.stdout
    assert "losses: every step within" in proc.stdout
    differences = result["profile_differences"]
    assert set(differences) == set(ratios) - {"fp8_vs_bf16"}  # every pair of sides that both ran
    ops, reference = result["ms_model"]["profile"]["ops_ms"], result["ms_loop"]["profile"]["ops_ms"]
    for op, ms in differences["ms_vs_plain_loop"].items():
        assert ms == pytest.approx(ops.get(op, 0.0) - reference.get(op, 0.0))
    assert "ops that differ most, ms_model - ms_loop (ms): aten::" in proc.stdout


def test_profile_needs_a_warm_up_step_before_the_profiled_one(tmp_path):
    proc = bench(tmp_path, "--device", "cpu", "--quick", "--warmup", "1", "--profile")
    assert proc.returncode == 2 and "give --warmup 2 or more" in proc.stderr, proc.stderr


def test_op_kinds():
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_throughput import op_kind

    kinds = {name: op_kind(name) for name in (
        "aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm", "aten::_flash_attention_forward",
        "aten::_scaled_dot_product_cudnn_attention_backward", "aten::_fused_adamw_",
        "aten::_foreach_norm", "c10d::allreduce_", "nccl:all_reduce", "aten::native_layer_norm", "aten::copy_",
        "aten::gelu_backward")}
    assert kinds == {"aten::mm": "matmul", "aten::addmm": "matmul", "aten::bmm": "matmul",
                     "aten::_scaled_mm": "matmul", "aten::_flash_attention_forward": "attention",
                     "aten::_scaled_dot_product_cudnn_attention_backward": "attention",
                     "aten::_fused_adamw_": "optimizer", "aten::_foreach_norm": "optimizer",
                     "c10d::allreduce_": "collectives", "nccl:all_reduce": "collectives",
                     "aten::native_layer_norm": "other", "aten::copy_": "other", "aten::gelu_backward": "other"}


def test_a_step_whose_losses_differ_beyond_the_tolerance_disagrees():
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_throughput import loss_agreement

    sides = {"paratrain": {"losses": [4.0, 3.0]}, "paratrain_offload": {"losses": [4.0, 3.03]},
             "torch": {"losses": [4.0, 3.0]}, "ms_model": {"losses": [5.0, 4.0]}, "ms_loop": {"losses": [5.0, 4.0]},
             "paratrain_fp8": {"skipped": "fp8 needs a CUDA GPU"}}
    assert loss_agreement(sides, 2e-2) == {"rtol": 2e-2, "worst": {"paratrain": 0.0, "paratrain_offload":
                                                                   pytest.approx(0.01), "ms_model": 0.0},
                                           "agree": True}
    assert loss_agreement(sides, 5e-3)["agree"] is False  # the offload row's last step
    sides["ms_loop"]["losses"] = [5.0, 4.2]
    assert loss_agreement(sides, 2e-2)["worst"]["ms_model"] == pytest.approx(0.2 / 4.2)


@pytest.mark.timeout(240)
def test_sides_runs_those_named_only(tmp_path):
    proc = bench(tmp_path, "--device", "cpu", "--quick", "--steps", "1", "--warmup", "1", "--sides", "ms_loop,scratch")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "out.json").read_text())
    assert [side for side in ("scratch", "torch", "paratrain", "paratrain_fp8", "ms_model", "ms_loop",
                              "ms_loop_padded") if side in result] == ["scratch", "ms_loop"]
    assert result["params"] == result["scratch"]["params"]  # the GPT's, from the GPT side that ran
    assert set(result["ratios"].values()) == {None}  # no ratio has both its sides
    proc = bench(tmp_path, "--device", "cpu", "--quick", "--sides", "ms_loop,cli")
    assert proc.returncode == 2 and "--sides: unknown 'cli'" in proc.stderr, proc.stderr


def test_a_run_cut_short_leaves_the_sides_it_measured(tmp_path, monkeypatch):
    """After each side but the last the JSON holds what was measured so far, marked partial: a run stopped by a
    time limit (tools/gpu_check.sh) keeps its figures. In this process: the plain loops start no process group."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_throughput

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # as a time limit's signal would stop it

    monkeypatch.setenv("PARATRAIN_DEVICE", "cpu")
    monkeypatch.setattr(gpu_throughput, "run_mindspore_loop", stopped)
    with pytest.raises(KeyboardInterrupt):
        gpu_throughput.main(["--device", "cpu", "--quick", "--steps", "1", "--warmup", "1", "--sides",
                             "scratch,ms_loop", "--json", str(tmp_path / "out.json")])
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["ran"] == "partial" and "ms_loop" not in result
    assert result["scratch"]["tokens_per_s"] > 0 and result["params"] == result["scratch"]["params"]
