import pytest

from conftest import host_reads, tiny_config
from multiprocess import run_distributed
from paratrain.trainer import Trainer


def run(tmp_path, **train):
    cfg = tiny_config(run={"dir": str(tmp_path)}, train={"steps": 10, **train})
    return Trainer(cfg).train()


def test_bf16_trains_close_to_fp32(tmp_path):
    fp32 = [r["loss"] for r in run(tmp_path / "fp32")]
    bf16 = [r["loss"] for r in run(tmp_path / "bf16", mixed_precision="bf16")]
    assert bf16[-1] < bf16[0]
    assert bf16 == pytest.approx(fp32, rel=3e-2)
    assert bf16 != pytest.approx(fp32, rel=1e-7)  # the compute really ran in bf16


def test_fp16_overflow_skips_steps_and_lowers_the_scale(tmp_path):
    records = run(tmp_path, mixed_precision="fp16", initial_loss_scale=2.0 ** 24, steps=14)
    skipped = records[-1]["skipped_steps"]
    assert 0 < skipped < 10 and records[-1]["loss_scale"] == 2.0 ** (24 - skipped)
    assert records[-1]["loss"] < records[skipped]["loss"]  # training went on once the scale fitted


def bf16_losses(cfg):
    return [r["loss"] for r in Trainer(cfg).train()]


@pytest.mark.slow
def test_bf16_data_parallel_matches_one_process(tmp_path):
    cfg = tiny_config(run={"dir": str(tmp_path / "dp")}, parallel={"dp": 2}, train={"steps": 10, "mixed_precision": "bf16"})
    got = run_distributed(bf16_losses, 2, cfg)[0]
    want = [r["loss"] for r in run(tmp_path / "one", mixed_precision="bf16")]
    assert got == pytest.approx(want, rel=1e-2)


def test_fp16_steps_that_are_not_logged_do_not_wait_for_the_device(tmp_path, monkeypatch):
    """The overflow check, the skip and the new scale are decided on the device: a step reads nothing back
    until a logged one, which brings the scale and the skip count with the loss."""
    trainer = Trainer(tiny_config(run={"dir": str(tmp_path)}, train={"steps": 4, "mixed_precision": "fp16",
                                                                     "initial_loss_scale": 2.0 ** 40},
                                  metrics={"log_steps": 4, "progress": False}))
    reads = host_reads(monkeypatch)
    records = [trainer.train_step()]
    trainer.step += 1
    assert reads == []
    for _ in range(3):
        records.append(trainer.train_step())
        trainer.step += 1
    assert reads == ["tolist", "tolist"]  # the records' values, then the scaler's floor check
    assert [r["skipped_steps"] for r in records] == list(range(1, 5))  # 2^40 overflows fp16's gradients
    assert [r["loss_scale"] for r in records] == [2.0 ** (40 - s) for s in range(1, 5)]
