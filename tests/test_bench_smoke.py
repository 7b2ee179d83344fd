"""bench/step_time.py runs end to end at a tiny size and writes its JSON (no timing assertions)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_step_time_bench_tiny(tmp_path):
    out = tmp_path / "step_time.json"
    cmd = [sys.executable, str(ROOT / "bench" / "step_time.py"), "--json", str(out),
           "--layers", "1", "--hidden", "32", "--ffn", "64", "--heads", "4", "--vocab", "97",
           "--batch", "2", "--length", "8", "--steps", "2", "--warmup", "1", "--peak-size", "128", "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ratio" in proc.stdout
    result = json.loads(out.read_text())
    for key in ("paratrain_s", "torch_s", "ratio", "gflops", "peak_gflops", "params", "torch_params"):
        assert result[key] > 0, key
    # same model size on both sides, so the FLOP count applies to both
    assert result["params"] == result["torch_params"]
    assert len(result["paratrain_times_s"]) == len(result["torch_times_s"]) == 2


@pytest.mark.timeout(120)
def test_checkpoint_io_bench_tiny(tmp_path):
    """bench/checkpoint_io.py saves and loads with and without checksums and reports both."""
    out = tmp_path / "checkpoint_io.json"
    cmd = [sys.executable, str(ROOT / "bench" / "checkpoint_io.py"), "--json", str(out), "--hidden", "32",
           "--layers", "1", "--vocab", "64", "--seq", "8", "--repeats", "1", "--dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "checksums: save" in proc.stdout
    result = json.loads(out.read_text())
    for key in ("save_s", "load_s", "save_without_checksums_s", "load_without_checksums_s", "hash_s"):
        assert len(result[key]) == 1 and result[key][0] > 0, key
