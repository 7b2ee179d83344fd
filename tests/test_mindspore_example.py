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


def checkpoints(folder) -> list[str]:
    return sorted(p.name for p in folder.glob("test-*"))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The losses of the tutorial on one process, as a user runs it (``--distribute false``)."""
    folder = tmp_path_factory.mktemp("one")
    losses = run_tutorial(folder, PYTHON, str(SCRIPT), *TINY, timeout=240)
    assert len(losses) == 4 and losses[-1] < losses[0]
    # ModelCheckpoint(prefix="test") in the working directory, one per step (keep_checkpoint_max=4)
    assert checkpoints(folder) == [f"test-1_{s}" for s in range(1, 5)]
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("ranks, layout", [
    (8, ["--mp", "2", "--pipeline_stage", "2", "--micro_batch_num", "4"]),  # the tutorial's run
    (4, ["--mp", "2"]), (2, ["--pipeline_stage", "2", "--micro_batch_num", "2"]), (2, []),
], ids=["dp2_mp2_pp2_micro4", "dp2_mp2", "pp2_micro2", "dp2"])
def test_the_tutorial_launched_prints_the_one_process_losses(tmp_path, one_process, ranks, layout):
    losses = run_tutorial(tmp_path, PYTHON, "-m", "paratrain", "launch", "--nproc-per-node", str(ranks), "--name",
                          "tutorial", "--", str(SCRIPT), "--distribute", "true", *layout, *TINY, timeout=400)
    assert losses == pytest.approx(one_process, rel=1e-4)
    assert checkpoints(tmp_path) == [f"test-1_{s}" for s in range(1, 5)]
