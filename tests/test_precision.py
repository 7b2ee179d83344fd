import pytest

from conftest import host_reads, tiny_config
from forked_ranks import run_distributed
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


@pytest.mark.parametrize("fused", [True, False])
def test_the_optimizer_step_divides_the_gradients_as_a_division_before_it_would(fused):
    """``step_dividing``: a fused AdamW divides in its own kernel (GradScaler's grad_scale) and skips on found_inf;
    another optimizer gets one division first; either way the update of the divided gradients, to the bit."""
    import torch

    from paratrain.optim import step_dividing

    def run(divide_first: bool, found_inf: float | None = None, divisor: float = 3.0) -> list[torch.Tensor]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(5, 3, device="cpu")), torch.nn.Parameter(torch.randn(7, device="cpu"))]
        # eps 1: an update that depends on the gradients' scale (Adam's would hardly otherwise)
        optimizer = torch.optim.AdamW(params, lr=0.1, eps=1.0, fused=fused, foreach=None if fused else False)
        divisor = torch.tensor(divisor, device="cpu")
        for step in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step), device="cpu")
            if divide_first:
                for p in params:
                    p.grad /= divisor
                optimizer.step()
            else:
                skip = None if found_inf is None else torch.tensor(found_inf, device="cpu")
                step_dividing(optimizer, divisor, skip)
        assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")
        return [p.detach().clone() for p in params]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))
    assert not all(torch.equal(a, b) for a, b in zip(run(False), run(True, divisor=1.0)))  # the division counts
    if fused:
        assert all(torch.equal(a, b) for a, b in zip(run(False, found_inf=0.0), run(True)))
        torch.manual_seed(0)
        initial = [torch.randn(5, 3, device="cpu"), torch.randn(7, device="cpu")]
        assert all(torch.equal(a, b) for a, b in zip(run(False, found_inf=1.0), initial))  # every update skipped
    else:
        with pytest.raises(ValueError, match="cannot skip its update on the device"):
            run(False, found_inf=0.0)
