"""Issue 17 C: a multi-node launch whose other node never comes says who is missing while it waits, then gives
up after --join-timeout naming the node, with a non-zero exit code."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
from forked_ranks import free_port

PYTHON = sys.executable


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_node_0_alone_gives_up_after_the_join_timeout_naming_node_1(tmp_path):
    env = {**os.environ, "PARATRAIN_HOME": str(tmp_path / "runs")}
    start = time.monotonic()
    out = subprocess.run([PYTHON, "-m", "paratrain", "launch", "--nnodes", "2", "--node-rank", "0",
                          "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                          "--join-timeout", "3", "--name", "alone", "--", "doctor"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=80)
    elapsed = time.monotonic() - start
    assert out.returncode == 1, out.stderr
    assert elapsed < 3 + 60  # start-up, the timeout, the process exit (a loaded machine); the default is minutes
    job_dir = tmp_path / "runs" / "alone"
    assert re.search(r"waited \d+ s of 3 s \(--join-timeout\) for node 1 \(no launcher record", out.stderr), out.stderr
    failure = "node 1 did not join the rendezvous at 127.0.0.1:"
    assert f"job alone failed: {failure}" in out.stderr and "within 3 s (--join-timeout)" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    job = json.loads((job_dir / "job.json").read_text())
    assert job["state"] == "failed" and job["failure"].startswith(failure) and job["pids"] == {}
