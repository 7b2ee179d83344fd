"""CPU ranks' host allocator (paratrain/host_memory.py): the choice, the preload a launch gives its ranks,
the refusal of a bad choice (a hand-run `train` restarting with it: tests/test_train.py). Speed and memory
are bench/peers.py's."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain import host_memory as H
from paratrain.errors import UserError

PYTHON = sys.executable
FOUND = H.allocator_library({})
needs_tcmalloc = pytest.mark.skipif(FOUND is None, reason="no tcmalloc on this machine (make install fetches it)")


def fake_library(tmp_path, name="libtcmalloc_minimal.so.4") -> Path:
    path = tmp_path / name
    path.write_bytes(b"")
    return path


def test_a_named_library_goes_first_in_ld_preload_with_tcmalloc_settings(tmp_path):
    lib = fake_library(tmp_path)
    env = {H.CHOICE_ENV: str(lib), "LD_PRELOAD": f"/x/other.so:{lib}"}
    assert H.rank_env(env) == {"LD_PRELOAD": f"{lib}:/x/other.so", **H.TCMALLOC_SETTINGS}
    env["TCMALLOC_RELEASE_RATE"] = "3"  # the user's setting stays
    assert "TCMALLOC_RELEASE_RATE" not in H.rank_env(env)
    other = fake_library(tmp_path, "libjemalloc.so.2")
    assert H.rank_env({H.CHOICE_ENV: str(other)}) == {"LD_PRELOAD": str(other)}


def test_system_keeps_glibc_and_auto_finds_what_the_search_path_has(tmp_path, monkeypatch):
    assert H.rank_env({H.CHOICE_ENV: "system"}) == {}
    lib = fake_library(tmp_path)
    monkeypatch.setattr(H, "SEARCH", (tmp_path / "none", tmp_path))
    assert H.allocator_library({}) == lib
    monkeypatch.setattr(H, "SEARCH", (tmp_path / "none",))
    assert H.allocator_library({H.CHOICE_ENV: "auto"}) is None and H.rank_env({}) == {}


def test_a_library_that_is_not_a_file_is_refused_before_any_rank_starts(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        H.allocator_library({H.CHOICE_ENV: str(tmp_path / "missing.so")})
    env = {**os.environ, H.CHOICE_ENV: str(tmp_path / "missing.so"), "PARATRAIN_HOME": str(tmp_path)}
    out = subprocess.run([PYTHON, "-m", "paratrain", "launch", "--nproc-per-node", "2", "--", "doctor"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "missing.so: no such file" in out.stderr
    assert not (tmp_path / "runs").exists() and "rank" not in out.stderr


REPORT = "from paratrain import host_memory; print('ALLOCATOR', host_memory.loaded_allocator())"


@needs_tcmalloc
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_launched_cpu_ranks_run_with_tcmalloc_and_without_it_when_asked(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT + "\n")
    for choice, expected in (("auto", "libtcmalloc"), ("system", "None")):
        env = {**os.environ, H.CHOICE_ENV: choice, "PARATRAIN_HOME": str(tmp_path / "runs"), "PARATRAIN_DEVICE": "cpu"}
        env.pop("LD_PRELOAD", None)
        out = subprocess.run([PYTHON, "-m", "paratrain", "launch", "--nproc-per-node", "2", "--name", choice, "--",
                              str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
        assert out.returncode == 0, out.stderr
        for rank in (0, 1):
            assert f"ALLOCATOR {expected}" in (tmp_path / "runs" / choice / f"rank{rank}.log").read_text()
