"""One GPU: a bf16 GPT trains with every tensor on CUDA, and its causal attention runs flash attention.

Each test runs in a spawned process, so this pytest process never initialises CUDA.
"""
import pytest
import torch

from gpu.gpt import GPT, devices, gpt_config, local, numbers
from gpu.spawn import run_spawned
from paratrain.config import ModelConfig
from paratrain.data.synthetic import NUM_SPECIAL
from paratrain.models import build_model
from paratrain.trainer import Trainer

FUSED_SDPA = {"aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_cudnn_attention"}
UNFUSED_SDPA = {"aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_attention_math"}


def bf16_training(run_dir):
    """Worker: 20 steps at the default train.mixed_precision ("auto": bf16 on a GPU); the devices and dtypes the
    optimizer saw at every step, those of a layer's matmul and the head's output, and those left after."""
    cfg = gpt_config(run_dir, steps=20)
    cfg.train.mixed_precision = "auto"
    trainer = Trainer(cfg)
    seen = {"grad_devices": set(), "grad_dtypes": set(), "missing_grads": set(), "layer_dtypes": set(),
            "head_outputs": set()}
    names = {p: name for name, p in trainer.model.named_parameters()}

    def before_optimizer_step(optimizer, args, kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        seen["missing_grads"] |= {names.get(p, "?") for p in params if p.grad is None}
        grads = [p.grad for p in params if p.grad is not None]
        seen["grad_devices"] |= devices(grads)
        seen["grad_dtypes"] |= {str(local(g).dtype) for g in grads}

    trainer.optimizer.register_step_pre_hook(before_optimizer_step)
    trainer.model.get_submodule("layers.0.ffn.fc1").register_forward_hook(
        lambda module, inputs, output: seen["layer_dtypes"].add(str(output.dtype)))
    trainer.model.get_submodule("head").register_forward_hook(
        lambda module, inputs, output: seen["head_outputs"].add((str(output.dtype), tuple(output.shape))))
    history = trainer.train()
    params = list(trainer.model.parameters())
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {**seen, "precision": trainer.cfg.train.mixed_precision, "history": numbers(history),
            "param_devices": devices(params),
            "param_dtypes": {str(local(p).dtype) for p in params},
            "param_mb": sum(local(p).numel() * local(p).element_size() for p in params) / 2**20,
            "buffer_devices": devices(trainer.model.buffers()), "state_devices": devices(state)}


@pytest.mark.timeout(300)
def test_bf16_gpt_trains_on_one_gpu(tmp_path):
    (r,) = run_spawned(bf16_training, 1, tmp_path / "run", root=tmp_path, timeout=240)
    assert r["param_devices"] == {"cuda:0"}, r["param_devices"]
    assert r["buffer_devices"] <= {"cuda:0"}, r["buffer_devices"]
    assert r["state_devices"] == {"cuda:0"}, r["state_devices"]  # AdamW moments and (fused) step counts
    assert not r["missing_grads"], f"parameters without a gradient at an optimizer step: {r['missing_grads']}"
    assert r["grad_devices"] == {"cuda:0"}, r["grad_devices"]
    # bf16 mixed precision by default: fp32 master weights and gradients, bf16 compute
    assert r["precision"] == "bf16", r["precision"]
    assert r["param_dtypes"] == {"torch.float32"} and r["grad_dtypes"] == {"torch.float32"}
    assert r["layer_dtypes"] == {"torch.bfloat16"}, r["layer_dtypes"]
    # given the labels, the head returns the summed token loss in fp32, its matmuls having run in bf16
    # (linear_cross_entropy; the matmuls' dtypes are checked on the CPU in tests/test_device_path.py)
    assert r["head_outputs"] == {("torch.float32", ())}, r["head_outputs"]
    history = r["history"]
    assert [int(h["step"]) for h in history] == list(range(1, 21))
    for h in history:  # CUDA max allocated: at least the weights themselves
        assert h["memory_mb"] >= r["param_mb"] > 0, (h["step"], h["memory_mb"], r["param_mb"])
    losses = [h["loss"] for h in history]
    assert all(loss == loss for loss in losses), losses  # no NaN
    assert max(losses[-3:]) < min(losses[:3]) - 1.0, losses  # ln 512 = 6.2 at start; the chain is learnable


def attention_ops(prof) -> tuple[set[str], set[str]]:
    """(aten scaled-dot-product ops, CUDA kernel names) recorded by a torch.profiler run."""
    events = prof.events()
    ops = {e.name for e in events if e.name.startswith("aten::_scaled_dot_product")}
    kernels = {e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA}
    return ops, kernels


def forced_flash_attention(cfg: ModelConfig):
    """Worker: forward and backward of the GPT in bf16 with only the flash kernel allowed, profiled."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    with device:
        model = build_model(cfg)
    ids = torch.randint(NUM_SPECIAL, cfg.vocab_size, (4, cfg.seq_length), device=device)  # no padding
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(ids)
                logits.float().logsumexp(-1).mean().backward()
        except RuntimeError as exc:  # "No available kernel": e.g. an explicit mask reached SDPA
            raise AssertionError(f"flash attention cannot run the GPT's causal attention: {exc}") from None
        torch.cuda.synchronize(device)
    return attention_ops(prof)


def trainer_attention(run_dir):
    """Worker: the attention ops and kernels of two ordinary bf16 training steps (default SDPA dispatch)."""
    from torch.profiler import ProfilerActivity, profile

    trainer = Trainer(gpt_config(run_dir, steps=2))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.train()
    return attention_ops(prof)


@pytest.mark.timeout(300)
def test_flash_attention_runs_the_causal_path(tmp_path):
    (ops, kernels) = run_spawned(forced_flash_attention, 1, ModelConfig(**GPT), root=tmp_path, timeout=240)[0]
    assert "aten::_scaled_dot_product_flash_attention" in ops, ops
    assert any("flash_attention_backward" in op for op in ops), ops
    assert any("flash" in k.lower() for k in kernels), sorted(kernels)[:40]


@pytest.mark.timeout(300)
def test_training_uses_a_fused_attention_kernel(tmp_path):
    """Flash (or cuDNN, which recent PyTorch may prefer on Hopper) without forcing; a memory-efficient or math
    kernel on this path means SDPA was given an explicit mask."""
    (ops, _kernels) = run_spawned(trainer_attention, 1, tmp_path / "run", root=tmp_path, timeout=240)[0]
    assert ops & FUSED_SDPA, ops
    assert not ops & UNFUSED_SDPA, ops


def padded_mask_attention():
    """Worker: the attention ops of a paratrain.nn encoder's forward and backward in bf16 under a causal x key
    padding mask whose shortest sequence is 3/4 of the length."""
    from torch.profiler import ProfilerActivity, profile

    from paratrain.nn import TransformerEncoder

    device, rows, length, hidden = torch.device("cuda", 0), 4, 256, 256
    torch.manual_seed(0)
    with device:
        encoder = TransformerEncoder(batch_size=rows, num_layers=2, hidden_size=hidden, ffn_hidden_size=4 * hidden,
                                     seq_length=length, num_heads=4, attention_dropout_rate=0.0,
                                     hidden_dropout_rate=0.0)
        keep = (torch.arange(length)[None] < torch.tensor([length, length, length * 3 // 4, length])[:, None])
        mask = torch.ones(length, length).tril().expand(rows, length, length) * keep[:, None, :]
        x = torch.randn(rows, length, hidden, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = encoder(x, mask)[0]
        out.float().square().mean().backward()
        torch.cuda.synchronize(device)
    return attention_ops(prof)


@pytest.mark.timeout(300)
def test_a_padded_causal_mask_runs_its_first_rows_in_a_fused_kernel(tmp_path):
    """The rows up to the shortest sequence's length run as is_causal (flash or cuDNN); the others with the
    mask, in a kernel that takes one."""
    (ops, _kernels) = run_spawned(padded_mask_attention, 1, root=tmp_path, timeout=240)[0]
    assert ops & FUSED_SDPA, ops
    assert ops & (UNFUSED_SDPA | {"aten::_scaled_dot_product_cudnn_attention"}), ops


def host_batch_to_the_gpu():
    """Worker: a pageable host tensor through ``to_device``: its values and device on arrival, and whether the
    caller's tensor was left pageable (the pinned copy is the function's own)."""
    from paratrain.device import to_device

    host = torch.arange(12).reshape(3, 4)
    arrived = to_device(host, torch.device("cuda", 0))
    return {"device": str(arrived.device), "values": arrived.cpu().tolist(), "caller_pinned": host.is_pinned()}


@pytest.mark.timeout(120)
def test_a_host_batch_reaches_the_gpu_through_pinned_memory(tmp_path):
    (r,) = run_spawned(host_batch_to_the_gpu, 1, root=tmp_path, timeout=60)
    assert r == {"device": "cuda:0", "values": torch.arange(12).reshape(3, 4).tolist(), "caller_pinned": False}
