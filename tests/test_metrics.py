"""Step metrics: record keys and their consistency, MFU's FLOP count, the time breakdown (and that it
adds no synchronization when off), TensorBoard, and the plot / summary commands."""
import json
import math

import pytest
import torch

from conftest import tiny_config
from forked_ranks import run_distributed
from paratrain.trainer import Trainer


def _train(tmp_path, name, steps=2, **metrics):
    cfg = tiny_config(run={"dir": str(tmp_path / name)}, train={"steps": steps}, metrics=metrics)
    return Trainer(cfg).train()


def test_record_keys_are_consistent_and_tensorboard_is_written(tmp_path):
    history = _train(tmp_path, "on", steps=3, breakdown=True, tensorboard=True)
    for r in history:
        for key in ("loss", "lr", "grad_norm", "step_time_s", "tokens", "tokens_per_s", "samples_per_s", "mfu",
                    "tflops", "memory_mb", "skipped_steps", "breakdown"):
            assert key in r, key
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_time_s"], rel=1e-9)
        assert r["samples_per_s"] == pytest.approx(8 / r["step_time_s"], rel=1e-9)
        assert 0 < r["mfu"] < 1 and r["memory_mb"] > 10 and r["skipped_steps"] == 0
        b = r["breakdown"]
        assert sum(b[f"{p}_pct"] for p in ("forward", "backward", "optimizer", "comm", "pipeline_idle",
                                          "other")) == pytest.approx(100, abs=2)
        assert b["forward_s"] > 0 and b["backward_s"] > 0 and b["optimizer_s"] > 0
        assert b["step_s"] == pytest.approx(r["step_time_s"], rel=0.2, abs=0.05)
    logged = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3] and "breakdown" in logged[0]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = list((tmp_path / "on").glob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    acc = EventAccumulator(str(tmp_path / "on"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3]
    assert "breakdown/forward_pct" in acc.Tags()["scalars"]


def test_breakdown_off_adds_no_synchronization(tmp_path, monkeypatch):
    import torch.distributed as dist
    from paratrain.metrics import timer

    calls = {"synchronize": 0, "cuda": 0, "barrier": 0}

    def counting(key, original):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return original(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(timer, "synchronize", counting("synchronize", timer.synchronize))
    monkeypatch.setattr(torch.cuda, "synchronize", counting("cuda", torch.cuda.synchronize))
    monkeypatch.setattr(dist, "barrier", counting("barrier", dist.barrier))
    history = _train(tmp_path, "off", breakdown=False)
    assert calls == {"synchronize": 0, "cuda": 0, "barrier": 0}
    assert all("breakdown" not in r for r in history)
    assert not list((tmp_path / "off").glob("events.out.tfevents.*"))  # tensorboard off: no event file
    _train(tmp_path, "on", breakdown=True)
    assert calls["synchronize"] >= 2 * 2 * 4  # 2 steps, enter + exit of step, forward, backward, optimizer


def test_flops_count_every_matmul_weight():
    from torch import nn

    from paratrain.metrics.flops import model_flops
    from paratrain.models import build_model

    cfg = tiny_config(model={"kind": "gpt", "vocab_size": 50, "hidden_size": 32, "ffn_hidden_size": 48}).model
    weights = sum(m.weight.numel() for m in build_model(cfg).modules() if isinstance(m, nn.Linear))
    b, s, h, layers = 3, 7, cfg.hidden_size, cfg.decoder_layers
    # attention: torch's count of the flash kernel, 4 b s^2 h forward and 2.5 times that backward
    assert model_flops(cfg, b, (s, s)) == 6 * b * s * weights + 14 * b * h * layers * s * s

    # encoder-decoder: encoder weights and the cross-attention K/V projections see source tokens (the
    # memory), the rest of the decoder and the head target ones
    cfg = tiny_config().model
    model = build_model(cfg)
    linears = {name: m.weight.numel() for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    source_side = sum(n for name, n in linears.items() if name.startswith("transformer.encoder.")
                      or name.endswith(("cross_attn.k_proj", "cross_attn.v_proj")))
    target_side = sum(linears.values()) - source_side
    S, T, L = 5, 6, cfg.decoder_layers
    attention = 14 * b * h * (cfg.encoder_layers * S * S + L * (T * T + T * S))
    assert model_flops(cfg, b, (S, T)) == 6 * b * (S * source_side + T * target_side) + attention


def test_gpu_table_and_override():
    from paratrain.metrics.flops import device_peak_tflops, gpu_peak_tflops

    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_peak_tflops("NVIDIA H100 PCIe") == 756.0 and gpu_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_peak_tflops("Some New Accelerator") is None
    assert device_peak_tflops(123.0) == (123.0, "metrics.peak_tflops")


def test_console_formats():
    from paratrain.metrics import format_record

    r = {"step": 1, "loss": 9.90341, "lr": 1e-3, "grad_norm": 1.5, "step_time_s": 0.5, "tokens_per_s": 100.0,
         "mfu": 0.123, "memory_mb": 300.0, "breakdown": {f"{p}_pct": 100 / 6 for p in
                                                         ("forward", "backward", "optimizer", "comm",
                                                          "pipeline_idle", "other")}}
    assert format_record(r, 10, "mindspore") == "epoch: 1 step: 1, loss is 9.9034"
    line = format_record(r, 10)
    assert line.startswith("step      1/10 | loss 9.9034 |") and "mfu 12.30%" in line and "comm 17%" in line


def _fake_run(path, scale):
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(1, 6):
            parts = {"forward": 0.2, "backward": 0.4, "optimizer": 0.1, "comm": 0.2 * scale, "pipeline_idle": 0.0,
                     "other": 0.05}
            total = sum(parts.values())
            b = {"step_s": total, **{f"{k}_s": v for k, v in parts.items()},
                 **{f"{k}_pct": 100 * v / total for k, v in parts.items()}}
            f.write(json.dumps({"step": step, "loss": 4 / step * scale, "lr": 1e-3, "grad_norm": 1.0,
                                "step_time_s": total, "tokens": 100, "tokens_per_s": 100 / total,
                                "samples_per_s": 8 / total, "mfu": 0.01, "tflops": 0.1, "memory_mb": 300.0,
                                "skipped_steps": 0, "breakdown": b}) + "\n")


def test_plot_writes_valid_pngs_and_summary_prints_a_table(tmp_path, capsys):
    import matplotlib.image

    from paratrain.cli import main

    _fake_run(tmp_path / "dp1", 1.0)
    _fake_run(tmp_path / "dp2", 2.0)
    assert main(["plot", str(tmp_path / "dp1"), str(tmp_path / "dp2"), "--out", str(tmp_path / "figs")]) == 0
    for name in ("loss.png", "throughput.png", "breakdown.png"):
        path = tmp_path / "figs" / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300
        assert image[..., :3].std() > 0.05  # not a blank canvas
    capsys.readouterr()
    assert main(["summary", str(tmp_path / "dp2")]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "8.0000 / 1.6000" in out  # first / last loss
    assert "0.4000 s   34.8 %" in out  # communication: 0.4 of 1.15 s
    assert main(["plot", str(tmp_path / "missing")]) == 2


def _pipeline_breakdown(run_dir):
    cfg = tiny_config(run={"dir": run_dir}, train={"steps": 2},
                      parallel={"pipeline_stage": 2, "micro_batch_num": 4}, metrics={"breakdown": True})
    return Trainer(cfg).train()[-1]


@pytest.mark.slow
def test_pipeline_breakdown_on_two_ranks(tmp_path):
    records = run_distributed(_pipeline_breakdown, 2, str(tmp_path / "pp"), timeout=300)
    for r in records:
        b = r["breakdown"]
        assert sum(b[k] for k in b if k.endswith("_pct")) == pytest.approx(100, abs=2)
        assert b["forward_s"] > 0 and b["backward_s"] > 0
        assert b["comm_s"] > 0  # the loss all-reduce over the stages at least
        assert b["pipeline_idle_s"] > 0  # the first stage waits for the last one's backward
        assert math.isfinite(r["mfu"]) and r["mfu"] > 0
