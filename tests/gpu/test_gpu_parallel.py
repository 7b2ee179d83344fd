"""Two GPUs (NCCL), or two ranks sharing one (gloo: conftest): every layout trains like one GPU, and a
checkpointed run resumes where it stopped.

All runs are bf16 mixed precision, the precision the GPU path is for. Tolerances:

- Initial weights: identical to the one-GPU run (same seed; sharded materialisation must not change the init).
- Loss 2e-2 and gradient norm 5e-2 relative over 8 steps. A layout changes the order of sums and where
  activations are rounded to bf16 (8-bit mantissa, one rounding ~4e-3): tensor-parallel partial sums are
  reduced in bf16, FSDP2 casts parameters to bf16 for compute. Single ops then differ by about one bf16
  rounding; the loss averages them over 4096 tokens, Adam carries them through 8 steps. What these tests
  look for moves the numbers by far more: a gradient scaled by the data-parallel or micro-batch count
  (grad norm x2 or more), a missing or doubled reduction, a shard in the wrong place.
- Resume 1e-3 relative: a GPU run is not bit-reproducible (flash attention's backward accumulates with
  atomics), so "the same losses" means within that noise, expected far below 1e-3 over 4 steps from
  the same state; a lost optimizer state, LR schedule or data position changes the next losses by ~1e-2.

Each run is a fresh group of spawned processes (rank r on cuda:r, or both on cuda:0) with a time limit.
"""
import pytest
import torch
from torch.distributed.tensor import DTensor

from gpu.gpt import devices, gpt_config, numbers
from gpu.spawn import rank_devices, run_spawned
from paratrain.trainer import Trainer

pytestmark = pytest.mark.gpu(2)

STEPS, SAVE = 8, 4
LOSS_RTOL, NORM_RTOL, RESUME_RTOL = 2e-2, 5e-2, 1e-3
LAYOUTS = {
    "dp2_zero0": {"dp": 2},
    "dp2_zero3": {"dp": 2, "zero_stage": 3},
    "mp2": {"mp": 2},
    "mp2_sequence_parallel": {"mp": 2, "sequence_parallel": True},
    "pp2_1f1b": {"pp": 2, "micro_batch_num": 4, "pipeline_schedule": "1f1b"},
}


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter this rank holds, whole (gathered from its shards), on the CPU, by name."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().to("cpu", torch.float32, copy=True)
            for name, p in model.named_parameters()}


def train_layout(cfg):
    """Worker: this rank's initial weights, then every step's loss and gradient norm, and its devices."""
    trainer = Trainer(cfg)
    initial = full_weights(trainer.model)
    history = numbers(trainer.train())
    return {"initial": initial, "history": history, "devices": devices(trainer.model.parameters())}


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    root = tmp_path_factory.mktemp("one_gpu")
    (result,) = run_spawned(train_layout, 1, gpt_config(root / "run", STEPS), root=root, timeout=240)
    losses = [h["loss"] for h in result["history"]]
    assert losses[-1] < losses[0] - 0.5, losses  # it trains, so equal trajectories mean something
    return result


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory):
    """name -> the ranks' results of that layout, each trained once for the tests that read it."""
    runs = {}

    def run(name):
        if name not in runs:
            root = tmp_path_factory.mktemp(name)
            runs[name] = run_spawned(train_layout, 2, gpt_config(root / "run", STEPS, LAYOUTS[name]), root=root,
                                     timeout=300)
        return runs[name]
    return run


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_starts_from_one_gpu_weights(name, one_gpu, two_gpus):
    ranks = two_gpus(name)
    assert [r["devices"] for r in ranks] == [{device} for device in rank_devices(2)]  # each rank on its GPU
    initial = {k: v for r in ranks for k, v in r["initial"].items()}  # pipeline stages hold different layers
    assert initial.keys() == one_gpu["initial"].keys()
    for key, want in one_gpu["initial"].items():
        assert torch.equal(initial[key], want), \
            f"{name}: initial {key} differs from the one-GPU run by up to {(initial[key] - want).abs().max():.3g}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_follows_one_gpu_losses(name, one_gpu, two_gpus):
    for step, (got, want) in enumerate(zip(two_gpus(name)[0]["history"], one_gpu["history"], strict=True), 1):
        assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_RTOL), f"{name}: loss at step {step}"
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=NORM_RTOL), f"{name}: grad norm at step {step}"


class Stop(Exception):
    """Ends a run right after a checkpoint, as a killed job would."""


def stop_after(trainer: Trainer, step: int) -> None:
    """Make ``trainer.train()`` stop once it has finished (and checkpointed) ``step``."""
    train_step = trainer.train_step

    def stop_or_step():
        if trainer.step == step:
            raise Stop
        return train_step()
    trainer.train_step = stop_or_step


def train_stop_resume(root, parallel):
    """Worker: 8 uninterrupted steps; the same run stopped after its step-4 checkpoint; that run resumed."""
    def config(run_dir):
        return gpt_config(run_dir, STEPS, parallel, checkpoint={"save_steps": SAVE, "resume": "auto"})

    full = numbers(Trainer(config(root / "full")).train())
    stopped = Trainer(config(root / "stopped"))
    stop_after(stopped, SAVE)
    try:
        stopped.train()
    except Stop:
        pass
    resumed = Trainer(config(root / "stopped"))
    start = resumed.step
    return {"full": full, "start": start, "resumed": numbers(resumed.train())}


@pytest.mark.timeout(420)
def test_save_and_resume_dp2_zero3(tmp_path):
    ranks = run_spawned(train_stop_resume, 2, tmp_path, {"dp": 2, "zero_stage": 3}, root=tmp_path, timeout=360)
    r = ranks[0]
    assert (tmp_path / "stopped" / "checkpoints" / f"step_{SAVE:08d}").is_dir()
    assert r["start"] == SAVE
    assert [int(h["step"]) for h in r["resumed"]] == list(range(SAVE + 1, STEPS + 1))
    for got, want in zip(r["resumed"], r["full"][SAVE:], strict=True):
        step = int(got["step"])
        assert got["loss"] == pytest.approx(want["loss"], rel=RESUME_RTOL), f"loss at step {step}"
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RESUME_RTOL), f"grad norm at step {step}"
