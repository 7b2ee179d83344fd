"""ZeRO-Offload on GPUs (FSDP2's CPUOffloadPolicy): the run trains like the same run without offload, keeps its
parameters, gradients and AdamW state in pinned host memory, and peaks at less device memory.

The model is the GPU tests' GPT made wider with a larger vocabulary (21 M parameters: 0.3 GiB of fp32
weights, gradients and AdamW moments) and a small batch, so that the model state, not the activations,
is what offload takes off the device. Tolerances are those of ``test_gpu_parallel``: offload changes where
the optimizer runs (host AdamW on fp32 shards) and FSDP2 computes with bf16 parameters, so losses follow
within 2e-2 and gradient norms within 5e-2 over 8 steps.
"""
import pytest
import torch

from gpu.gpt import devices, gpt_config, local, numbers
from gpu.spawn import run_spawned
from paratrain.trainer import Trainer

STEPS = 8
LOSS_RTOL, NORM_RTOL = 2e-2, 5e-2
OFFLOAD = {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}


def wide_config(run_dir, parallel: dict | None = None):
    cfg = gpt_config(run_dir, STEPS, parallel)
    cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.model.vocab_size = 512, 2048, 8192
    cfg.train.global_batch_size = 4
    cfg.metrics.log_steps = 1
    return cfg


def train_and_locate(cfg):
    """Worker: every step's loss, gradient norm and CUDA peak, where parameters, gradients and optimizer state
    were at the optimizer steps, whether the host copies are pinned, and the model state's bytes."""
    trainer = Trainer(cfg)
    seen = {"grad_devices": set()}

    def before_optimizer_step(optimizer, args, kwargs):
        seen["grad_devices"] |= devices(p.grad for group in optimizer.param_groups for p in group["params"]
                                        if p.grad is not None)

    trainer.optimizer.register_step_pre_hook(before_optimizer_step)
    history = numbers(trainer.train())
    params = list(trainer.model.parameters())
    state = [v for s in trainer.optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {**seen, "history": history, "param_devices": devices(params), "state_devices": devices(state),
            "pinned": all(local(p).is_pinned() for p in params if local(p).device.type == "cpu"),
            "state_mb": 4 * sum(local(p).numel() * 4 for p in params) / 2**20}


def assert_follows(got: list[dict], want: list[dict]) -> None:
    assert [h["loss"] for h in got] == pytest.approx([h["loss"] for h in want], rel=LOSS_RTOL)
    assert [h["grad_norm"] for h in got] == pytest.approx([h["grad_norm"] for h in want], rel=NORM_RTOL)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    (result,) = run_spawned(train_and_locate, 1, wide_config(root / "run"), root=root, timeout=240)
    losses = [h["loss"] for h in result["history"]]
    assert losses[-1] < losses[0], losses  # it trains, so equal trajectories mean something
    return result


@pytest.mark.timeout(600)
def test_offload_trains_like_no_offload_with_less_device_memory(tmp_path, plain):
    (r,) = run_spawned(train_and_locate, 1, wide_config(tmp_path / "run", OFFLOAD), root=tmp_path, timeout=300)
    assert r["param_devices"] == {"cpu"} and r["pinned"], (r["param_devices"], r["pinned"])
    assert r["grad_devices"] == {"cpu"} and r["state_devices"] == {"cpu"}  # the optimizer step runs on the host
    assert plain["param_devices"] == plain["state_devices"] == {"cuda:0"}
    assert_follows(r["history"], plain["history"])
    peak, plain_peak = max(h["memory_mb"] for h in r["history"]), max(h["memory_mb"] for h in plain["history"])
    # weights, gradients and both AdamW moments leave the device; gathered layers and activations stay
    assert plain_peak - peak > 0.5 * plain["state_mb"], (plain_peak, peak, plain["state_mb"])


@pytest.mark.gpu(2)
@pytest.mark.timeout(600)
def test_two_gpus_stage3_with_both_offloads(tmp_path, plain):
    ranks = run_spawned(train_and_locate, 2, wide_config(tmp_path / "run", {"dp": 2, **OFFLOAD}), root=tmp_path,
                        timeout=300)
    for r in ranks:
        assert r["param_devices"] == r["state_devices"] == r["grad_devices"] == {"cpu"} and r["pinned"]
        assert_follows(r["history"], plain["history"])
