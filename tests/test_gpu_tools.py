"""tools/gpu_check.sh and tools/gpu_python.sh, the GPU machine's scripts, checked here: they parse, and without a
GPU the check stops before any part with one line saying why, writing nothing."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPTS = ("tools/gpu_check.sh", "tools/gpu_python.sh")


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_script_parses(script):
    out = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stderr == "", out.stderr


def run_check(tmp_path, *parts, python=None):
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    if python:
        env["GPU_PYTHON"] = python
    return subprocess.run(["bash", str(ROOT / "tools/gpu_check.sh"), *parts], capture_output=True, text=True,
                          env=env, timeout=120)


def test_gpu_check_with_a_cpu_only_python_stops_in_one_line(tmp_path):
    fake = tmp_path / "python-cpu"  # this python with every GPU hidden: a CPU-only build, or one that sees none
    fake.write_text(f'#!/bin/sh\nCUDA_VISIBLE_DEVICES= exec "{sys.executable}" "$@"\n')
    fake.chmod(0o755)
    out = run_check(tmp_path, python=str(fake))
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout == "" and out.stderr.count("\n") == 1, out.stdout + out.stderr
    assert out.stderr.startswith(f"gpu: {fake}: torch "), out.stderr
    assert "a CPU-only build" in out.stderr or "no GPU visible" in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()  # stopped before any part


def test_gpu_check_refuses_an_unknown_part_before_looking_for_a_gpu(tmp_path):
    out = run_check(tmp_path, "suite", "benchmark", python=str(tmp_path / "no-such-python"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("gpu_check: unknown part 'benchmark': the parts are bench suite refusals fp8"), \
        out.stderr
