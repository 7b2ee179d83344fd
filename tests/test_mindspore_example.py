"""examples/mindspore_transformer: MindSpore's distributed Transformer tutorial (model.py, dataset.py, train.py)
written with paratrain's imports. Run as a user runs it, in its own processes, in a working directory where
ModelCheckpoint(prefix="test") writes: on one process and on dp2 x mp2 x pp2 with 4 micro-batches on 8 ranks, the
LossMonitor lines give the same losses."""
import os
import re
import subprocess

import pytest

from conftest import PYTHON, ROOT

SCRIPT = ROOT / "examples" / "mindspore_transformer" / "train.py"
# tiny sizes; 120 sample pairs keep 32 to 39 sources longer than src_len + 1 words: 4 batches of 8
TINY = ["--sample_pairs", "120", "--src_len", "6", "--tgt_len", "6", "--batch_size", "8", "--d_model", "32",
        "--vocab_size", "400", "--lr", "3e-3", "--dropout_rate", "0"]
LOSS_LINE = re.compile(r"epoch: (\d+) step: (\d+), loss is (\S+)")


def run_tutorial(cwd, *command: str, timeout: int) -> list[float]:
    """``command`` run in ``cwd``; the losses of its LossMonitor lines, checked to be steps 1, 2, ... of epoch 1."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PARATRAIN_DEVICE": "cpu"}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = [(int(e), int(s), float(loss)) for e, s, loss in LOSS_LINE.findall(done.stdout)]
    assert [(e, s) for e, s, _ in found] == [(1, step) for step in range(1, len(found) + 1)], done.stdout[-3000:]
    return [loss for _, _, loss in found]


@pytest.mark.slow
def test_the_tutorial_on_eight_ranks_prints_the_one_process_losses(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "eight").mkdir()
    one = run_tutorial(tmp_path / "one", PYTHON, str(SCRIPT), *TINY, timeout=240)
    eight = run_tutorial(tmp_path / "eight", PYTHON, "-m", "paratrain", "launch", "--nproc-per-node", "8", "--name",
                         "tutorial", "--", str(SCRIPT), "--distribute", "true", "--mp", "2", "--pipeline_stage", "2",
                         "--micro_batch_num", "4", *TINY, timeout=400)
    assert len(one) == 4 and one[-1] < one[0]
    assert eight == pytest.approx(one, rel=1e-4)
    # ModelCheckpoint(prefix="test") in the working directory, one per step (keep_checkpoint_max=4)
    for run in ("one", "eight"):
        assert sorted(p.name for p in (tmp_path / run).glob("test-*")) == [f"test-1_{s}" for s in range(1, 5)]
