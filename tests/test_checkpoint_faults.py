"""Checkpoints under faults: a disk that fills at any byte of a save, two runs on one directory, and what a load
trusts.

- Disk full: every write of a save goes through a file whose disk fills after N more bytes, for N swept over the
  whole save (each file's first and last byte, and points between): the save ends in one CheckpointError line
  "cannot write checkpoint ... No space left on device" naming the checkpoint, the unfinished directory is
  removed, every complete checkpoint still verifies; ``paratrain train`` exits 2 with that line; a rank whose
  disk fills ends the save on every rank; a real small tmpfs where one can be mounted.
- One run per directory: a second ``paratrain train`` (or ``Model.train``) on a run or checkpoint directory in
  use is refused in one line naming the holder, writing nothing there; the first run's losses are those of a
  run alone; the lock of a killed run does not block.
- Format 1 (no checksums) loads only when trusted.
"""
from __future__ import annotations

import builtins
import errno
import io
import json
import os
import random
import shutil
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

from conftest import PYTHON
from paratrain import cli
from test_faults import BASE as FAULTS_BASE

# the model of test_faults, logging every step and saving every step
BASE = FAULTS_BASE.replace("log_steps = 100", "log_steps = 1") + "[checkpoint]\nsave_steps = 1\n"


def trainer_for(run_dir: Path, *overrides: str):
    from paratrain import config_file
    from paratrain.trainer import Trainer

    return Trainer(config_file.from_dict(tomllib.loads(BASE), [f"run.dir={run_dir}", *overrides]))


# --- a disk that fills ------------------------------------------------------------------------------------------

class FullDisk:
    """Binary files opened for writing under ``root`` share ``budget`` bytes (None: no limit); a write past it writes
    what fits and raises ENOSPC, as a full disk does. ``written`` counts the bytes written, by file name."""

    def __init__(self, monkeypatch, root: Path, budget: int | None = None):
        self.root, self.budget, self.used, self.written = str(root), budget, 0, {}
        real_open = builtins.open
        disk = self

        class LimitedFile:
            def __init__(self, raw, name):
                self.raw, self.name = raw, name

            def write(self, data):
                size = memoryview(data).nbytes
                fits = size if disk.budget is None else max(0, min(size, disk.budget - disk.used))
                if fits:
                    self.raw.write(bytes(memoryview(data).cast("B")[:fits]))
                disk.used += fits
                disk.written[self.name] = disk.written.get(self.name, 0) + fits
                if fits < size:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return size

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.raw.close()

            def __getattr__(self, name):
                return getattr(self.raw, name)

        def limited_open(file, mode="r", *args, **kwargs):
            raw = real_open(file, mode, *args, **kwargs)
            if isinstance(file, (str, os.PathLike)) and "b" in mode and set(mode) & set("wax+") and \
                    os.path.abspath(file).startswith(self.root):
                return LimitedFile(raw, Path(file).name)
            return raw

        monkeypatch.setattr(builtins, "open", limited_open)
        monkeypatch.setattr(io, "open", limited_open)


def fill_points(sizes: list[int], extra: int = 24) -> list[int]:
    """Budgets that fill the disk at each file's first and last byte, and at ``extra`` points between."""
    total, points, at = sum(sizes), {0}, 0
    for size in sizes:
        points |= {at, at + 1, at + size - 1}
        at += size
    points |= set(random.Random(0).sample(range(total), min(extra, total)))
    return sorted(p for p in points if 0 <= p < total)


def assert_clean_failure(message: str, root: Path, name: str, before: list[str]) -> None:
    """One line naming the checkpoint and the full disk; nothing unfinished left; what was complete still is."""
    from paratrain.checkpoint.storage import META_FILE, verify

    assert message.splitlines() == [message] and "Traceback" not in message
    assert f"cannot write checkpoint {root / name}: No space left on device" in message, message
    assert not list(root.glob(".tmp-*")) and not list(root.glob("*.tmp")), sorted(p.name for p in root.iterdir())
    complete = sorted(p.name for p in root.iterdir() if (p / META_FILE).is_file())
    assert set(before) <= set(complete) <= set(before) | {name}
    for checkpoint in complete:
        verify(root / checkpoint)


def test_a_disk_filling_at_any_byte_of_a_save_ends_in_one_line_and_leaves_the_last_checkpoint(tmp_path,
                                                                                                 monkeypatch):
    from paratrain.checkpoint import CheckpointError
    from paratrain.checkpoint.storage import LATEST, verify

    trainer = trainer_for(tmp_path / "run", "checkpoint.keep_max=0")
    trainer.train()
    root = trainer.checkpointer.root
    before = ["step_00000001", "step_00000002"]
    disk = FullDisk(monkeypatch, root)
    trainer.checkpointer.save(3)  # the bytes of a whole save, file by file
    sizes = list(disk.written.values())
    shutil.rmtree(root / "step_00000003")
    (root / LATEST).write_text("step_00000002\n")
    points = fill_points(sizes)
    assert len(points) > 20
    for budget in points:
        disk.budget, disk.used = budget, 0
        with pytest.raises(CheckpointError) as failed:
            trainer.checkpointer.save(3)
        assert_clean_failure(str(failed.value), root, "step_00000003", before)
        if (root / "step_00000003").is_dir():  # renamed, then `latest` could not be replaced: complete
            shutil.rmtree(root / "step_00000003")
        assert (root / LATEST).read_text() == "step_00000002\n"
    disk.budget = None
    assert trainer.checkpointer.save(3) == root / "step_00000003"
    verify(root / "step_00000003")


@pytest.mark.parametrize("share", [0.0, 0.3, 0.77, 0.999])
def test_paratrain_train_on_a_full_disk_exits_2_with_one_line(tmp_path, monkeypatch, capsys, share):
    """The disk fills during the second save (at ``share`` of its bytes): exit 2, one line, step 1 intact."""
    config = tmp_path / "base.toml"
    config.write_text(BASE)
    argv = ["train", "--config", str(config), f"--run.dir={tmp_path / 'run'}"]
    root = tmp_path / "run" / "checkpoints"
    disk = FullDisk(monkeypatch, root)
    assert cli.main(argv) == 0
    saves = disk.used
    shutil.rmtree(tmp_path / "run")
    capsys.readouterr()
    disk.budget, disk.used = int(saves / 2 + share * saves / 2), 0
    assert cli.main(argv + ["--checkpoint.resume=none"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("paratrain: ")
    assert_clean_failure(err, root, "step_00000002", ["step_00000001"])


@pytest.mark.parametrize("share", [0.0, 0.5, 0.9])
def test_model_train_on_a_full_disk_raises_a_checkpoint_error(tmp_path, monkeypatch, share):
    """``Model.train`` saving every 2 steps; the disk fills during the second save: a named CheckpointError, the
    first checkpoint intact."""
    import torch

    from paratrain.train import CheckpointConfig, CheckpointError, Model, ModelCheckpoint

    namespace: dict = {}
    exec(MODEL_TRAIN_SCRIPT.split("torch.manual_seed(0)")[0], namespace)  # the script's Net

    def train(directory: Path) -> None:
        torch.manual_seed(0)
        net = namespace["Net"]()
        data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(4)]
        Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.05)).train(
            1, data, callbacks=[ModelCheckpoint(prefix="ck", directory=directory,
                                                config=CheckpointConfig(save_checkpoint_steps=2))])

    disk = FullDisk(monkeypatch, tmp_path / "measure")
    train(tmp_path / "measure")
    disk.root, disk.used, disk.budget = str(tmp_path / "ck"), 0, int(disk.used / 2 * (1 + share))
    with pytest.raises(CheckpointError) as failed:
        train(tmp_path / "ck")
    assert_clean_failure(str(failed.value), tmp_path / "ck", "ck-1_4", ["ck-1_2"])


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs under the test's folder, or a skip where mounting is not permitted."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                                                       capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_real_small_file_system_filling_during_a_save(small_tmpfs, tmp_path):
    """On a real 2 MiB tmpfs, with the whole model written too (``integrated_save``: safetensors' own writer):
    free space left at many points of a save."""
    from paratrain.checkpoint import CheckpointError
    from paratrain.checkpoint.storage import LATEST

    trainer = trainer_for(small_tmpfs / "run", "checkpoint.keep_max=0", "checkpoint.integrated_save=true")
    trainer.train()
    root = trainer.checkpointer.root
    size = sum(f.stat().st_size for f in (root / "step_00000002").iterdir())
    filler = small_tmpfs / "filler"
    failures = 0
    for left in range(0, size + 3 * 4096, 4096):
        filler.unlink(missing_ok=True)
        stat = os.statvfs(small_tmpfs)
        with open(filler, "wb") as f:
            f.write(b"\0" * max(0, stat.f_bavail * stat.f_frsize - left))
        try:
            trainer.checkpointer.save(3)
        except CheckpointError as exc:
            failures += 1
            assert_clean_failure(str(exc), root, "step_00000003", ["step_00000001", "step_00000002"])
        shutil.rmtree(root / "step_00000003", ignore_errors=True)
        (root / LATEST).unlink(missing_ok=True)
    assert failures >= 3


def _rank_1_disk_fills(root: str, budget: int):
    """dp2, steps 1 and 2 saved; then rank 1's disk has ``budget`` bytes left for the save of step 3."""
    import pytest as _pytest

    from paratrain.checkpoint import CheckpointError

    trainer = trainer_for(Path(root) / "run", "parallel.data_parallel=2", "checkpoint.keep_max=0")
    trainer.train()
    with _pytest.MonkeyPatch.context() as mp:
        if trainer.layout.dp_rank == 1:
            FullDisk(mp, trainer.checkpointer.root, budget)
        try:
            trainer.checkpointer.save(3)
            return None
        except CheckpointError as exc:
            return str(exc)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0, 700, 5000])
def test_a_rank_whose_disk_fills_ends_the_save_on_every_rank(tmp_path, budget):
    from forked_ranks import run_distributed

    messages = run_distributed(_rank_1_disk_fills, 2, str(tmp_path), budget, timeout=240)
    root = tmp_path / "run" / "checkpoints"
    assert messages[0] == messages[1] and messages[0] is not None
    assert_clean_failure(messages[0], root, "step_00000003", ["step_00000001", "step_00000002"])


# --- one run per directory -------------------------------------------------------------------------------------

MODEL_TRAIN_SCRIPT = """
import sys

import torch
from torch import nn
from paratrain.train import CheckpointConfig, LossMonitor, Model, ModelCheckpoint

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x, y):
        return ((self.fc(x) - y) ** 2).mean()

torch.manual_seed(0)
generator = torch.Generator().manual_seed(1)
data = [(torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator))
        for _ in range(int(sys.argv[2]))]
net = Net()
Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.05)).train(
    1, data, callbacks=[LossMonitor(), ModelCheckpoint(prefix="ck", directory=sys.argv[1],
                                                       config=CheckpointConfig(save_checkpoint_steps=50))])
"""


def started(argv: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, *argv], cwd=cwd, env={**os.environ, "PARATRAIN_DEVICE": "cpu"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def paused_once_locked(proc: subprocess.Popen, directory: Path) -> None:
    """Wait until ``proc`` holds the lock of ``directory``, then stop it there (SIGSTOP): it is mid-run."""
    from paratrain.run_lock import LOCK_FILE

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads((directory / LOCK_FILE).read_text())["pid"] == proc.pid:
                os.kill(proc.pid, 19)  # SIGSTOP
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    raise AssertionError(f"the first run never took the lock of {directory}: {proc.communicate()}")


def snapshot(directory: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(directory.rglob("*"))
            if p.is_file()}


def finished(proc: subprocess.Popen) -> str:
    os.kill(proc.pid, 18)  # SIGCONT
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return out


def metrics_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.slow
@pytest.mark.parametrize("shared", ["run.dir", "checkpoint.dir"])
def test_a_second_paratrain_train_on_a_directory_in_use_is_refused_and_the_first_goes_on(tmp_path, capsys, shared):
    config = tmp_path / "base.toml"
    config.write_text(BASE)
    steps = ["--train.steps=30", "--checkpoint.save_steps=10"]
    common = tmp_path / "common"

    def argv(run: str) -> list[str]:
        dirs = [f"--run.dir={common}"] if shared == "run.dir" else \
            [f"--run.dir={tmp_path / run}", f"--checkpoint.dir={common}"]
        return ["train", "--config", str(config), *dirs, *steps]

    solo = started(["-m", "paratrain", "train", "--config", str(config), f"--run.dir={tmp_path / 'solo'}", *steps],
                   tmp_path)
    solo.communicate(timeout=300)
    first = started(["-m", "paratrain", *argv("first")], tmp_path)
    paused_once_locked(first, common)
    before = snapshot(common)
    assert cli.main(argv("second")) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and f"{shared}={common} is in use by another run: pid {first.pid} on " in err
    assert snapshot(common) == before  # the second wrote nothing there
    finished(first)
    first_dir = common if shared == "run.dir" else tmp_path / "first"
    assert metrics_losses(first_dir) == metrics_losses(tmp_path / "solo")
    assert [p.name for p in sorted((common if shared == "checkpoint.dir" else common / "checkpoints").glob("step_*"))] \
        == ["step_00000010", "step_00000020", "step_00000030"]


@pytest.mark.slow
def test_a_second_model_train_on_a_model_checkpoint_directory_in_use_is_refused(tmp_path):
    script = tmp_path / "train_net.py"
    script.write_text(MODEL_TRAIN_SCRIPT)
    solo = started([str(script), str(tmp_path / "solo"), "120"], tmp_path)
    solo_out, _ = solo.communicate(timeout=300)
    directory = tmp_path / "ck"
    first = started([str(script), str(directory), "120"], tmp_path)
    paused_once_locked(first, directory)
    before = snapshot(tmp_path)
    second = subprocess.run([PYTHON, str(script), str(directory), "120"], cwd=tmp_path, capture_output=True,
                            text=True, env={**os.environ, "PARATRAIN_DEVICE": "cpu"}, timeout=300)
    assert second.returncode != 0 and "UserError" in second.stderr
    assert f"ModelCheckpoint directory={directory} is in use by another run: pid {first.pid} on " in second.stderr
    assert snapshot(tmp_path) == before
    assert finished(first) == solo_out  # the losses of a run alone
    assert sorted(p.name for p in directory.glob("ck-*")) == ["ck-1_100", "ck-1_120", "ck-1_50"]


def test_the_lock_of_a_killed_run_does_not_block(tmp_path, capsys):
    from paratrain.run_lock import LOCK_FILE

    run = tmp_path / "run"
    killed = subprocess.run([PYTHON, "-c", "import os, pathlib, sys; from paratrain import run_lock; "
                             "run_lock.hold([('run.dir', pathlib.Path(sys.argv[1]))]); os.kill(os.getpid(), 9)",
                             str(run)], cwd=tmp_path, timeout=120)
    assert killed.returncode == -9
    assert json.loads((run / LOCK_FILE).read_text())["pid"] != os.getpid()  # the killed process's details stay
    config = tmp_path / "base.toml"
    config.write_text(BASE)
    assert cli.main(["train", "--config", str(config), f"--run.dir={run}"]) == 0, capsys.readouterr().err
    assert [step for step, _ in metrics_losses(run)] == [1, 2]


# --- what a load trusts --------------------------------------------------------------------------------------------

def claim_format_1(path: Path, keep_checksums: bool) -> None:
    """Edit checkpoint ``path`` to claim format 1 (no checksum of paratrain.json; with ``keep_checksums`` its files
    keep theirs, else sizes only, as format 1 wrote them)."""
    meta = json.loads((path / "paratrain.json").read_text())
    meta.pop("checksum")
    files = meta["files"] if keep_checksums else {name: entry["bytes"] for name, entry in meta["files"].items()}
    meta.update(format=1, files=files)
    (path / "paratrain.json").write_text(json.dumps(meta))


def flipped(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 1
    file.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A 2-step run saving both steps (integrated model too): its checkpoints directory."""
    from conftest import one_thread

    root = tmp_path_factory.mktemp("saved")
    with one_thread():
        trainer = trainer_for(root / "run", "checkpoint.integrated_save=true")
        trainer.train()
    return trainer.checkpointer.root


@pytest.mark.parametrize("keep_checksums", [False, True])
def test_a_checkpoint_claiming_format_1_is_refused_without_trust_everywhere(tmp_path, saved_run, capsys,
                                                                           keep_checksums):
    from paratrain.checkpoint import CheckpointError
    from paratrain.train import load_checkpoint

    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.copytree(saved_run, checkpoints)
    step = checkpoints / "step_00000002"
    claim_format_1(step, keep_checksums)
    config = tmp_path / "base.toml"
    config.write_text(BASE)
    train = ["train", "--config", str(config), f"--run.dir={tmp_path / 'run'}", "--train.steps=3"]
    refusals = {"train": cli.main(train),
                "export": cli.main(["export", str(step), str(tmp_path / "out.safetensors")])}
    for source in (step, step / "model.safetensors"):
        with pytest.raises(CheckpointError, match="has format 1, which records no checksums") as refused:
            load_checkpoint(source)
        assert str(refused.value).splitlines() == [str(refused.value)]
    err = capsys.readouterr().err.strip().splitlines()
    assert refusals == {"train": 2, "export": 2} and len(err) == 2
    assert all(f"checkpoint {step} has format 1, which records no checksums" in line for line in err)
    assert not (tmp_path / "out.safetensors").exists() and not (checkpoints / "step_00000003").exists()

    trusted = load_checkpoint(step, trust_unverified=True)
    assert trusted.keys() == load_checkpoint(saved_run / "step_00000002").keys()
    assert cli.main(["export", "--trust-unverified", str(step), str(tmp_path / "out.safetensors")]) == 0
    assert cli.main([*train, "--checkpoint.trust_unverified=true"]) == 0
    assert (checkpoints / "step_00000003" / "paratrain.json").is_file()


def test_a_trusted_checkpoint_claiming_format_1_still_checks_the_checksums_it_holds(tmp_path, saved_run):
    """Edited to claim format 1 but its files' checksums kept: a flipped shard byte is found even when trusted."""
    from paratrain.checkpoint import CheckpointError
    from paratrain.train import load_checkpoint

    step = tmp_path / "step_00000002"
    shutil.copytree(saved_run / "step_00000002", step)
    claim_format_1(step, keep_checksums=True)
    flipped(step / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="__0_0.distcp fails its checksum"):
        load_checkpoint(step, trust_unverified=True)
