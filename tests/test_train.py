import json
import math
import subprocess

import pytest
import torch

from conftest import PYTHON, ROOT, tiny_config
from paratrain import host_memory
from paratrain.trainer import Trainer, TrainingDiverged

USER_CONFIG = """
[run]
name = "first-try"
seed = 7

[model]
kind = "transformer"
vocab_size = 32
hidden_size = 64
num_heads = 4
ffn_hidden_size = 128
encoder_layers = 2
decoder_layers = 2
src_seq_length = 10
tgt_seq_length = 10
hidden_dropout = 0.0
attention_dropout = 0.0

[train]
global_batch_size = 32
steps = 80
lr = 2e-3
warmup_steps = 10

[data]
kind = "synthetic"
task = "copy"

[metrics]
log_steps = 10
"""


def run_cli(*args, cwd=ROOT):
    return subprocess.run([PYTHON, "-m", "paratrain", *args], capture_output=True, text=True, cwd=cwd, timeout=240)


def test_user_config_learns_through_cli(tmp_path):
    config = tmp_path / "first.toml"
    config.write_text(USER_CONFIG)
    run_dir = tmp_path / "run"
    result = run_cli("train", "--config", str(config), f"--run.dir={run_dir}")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(10, 81, 10))
    for key in ("step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s"):
        assert all(isinstance(r[key], (int, float)) for r in records), key
    first, last = records[0]["loss"], records[-1]["loss"]
    assert first < math.log(32) * 1.1 and last <= 0.6 * first, (first, last)
    assert "num_heads = 4" in (run_dir / "config.toml").read_text()
    # on the CPU a hand-run train restarts itself once with tcmalloc preloaded, when there is one
    found = host_memory.allocator_library()
    expected = "host memory: libtcmalloc" if found else "host memory: glibc malloc"
    assert expected in result.stdout, result.stdout
    assert "step     80/80 | loss" in result.stdout


def test_refused_config_names_both_fields(tmp_path):
    config = tmp_path / "first.toml"
    config.write_text(USER_CONFIG)
    result = run_cli("train", "--config", str(config), f"--run.dir={tmp_path / 'run'}", "--model.num_heads=6",
                     "--parallel.model_parallel=4")
    assert result.returncode == 2
    assert "model.num_heads=6" in result.stderr and "parallel.model_parallel=4" in result.stderr
    assert "world size 1" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_micro_batches_give_the_global_batch_loss(tmp_path):
    losses = {}
    for micro in (1, 2, 4):
        cfg = tiny_config(run={"dir": str(tmp_path / f"m{micro}")}, parallel={"micro_batch_num": micro},
                          train={"steps": 4})
        losses[micro] = [r["loss"] for r in Trainer(cfg).train()]
    for micro in (2, 4):
        assert losses[micro] == pytest.approx(losses[1], rel=1e-5)
    assert losses[1][-1] < losses[1][0]


def test_gpt_trains_on_markov_data(tmp_path):
    cfg = tiny_config(run={"dir": str(tmp_path)}, model={"kind": "gpt"}, train={"steps": 30, "lr": 1e-2})
    history = Trainer(cfg).train()
    assert history[-1]["loss"] < 0.8 * history[0]["loss"]


def test_nan_loss_stops_naming_the_step(tmp_path):
    cfg = tiny_config(run={"dir": str(tmp_path)}, train={"steps": 5})
    trainer = Trainer(cfg)
    trainer.train_step()
    trainer.step = 1
    with torch.no_grad():
        trainer.model.head.weight.fill_(float("nan"))
    with pytest.raises(TrainingDiverged, match="at step 2"):
        trainer.train_step()


def test_weight_decay_skips_biases_and_norms():
    from paratrain.models import build_model
    from paratrain.optim import decay_groups

    model = build_model(tiny_config().model)
    decay, no_decay = decay_groups(model, 0.1)  # one process: plain tensors, two groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(names[id(p)].endswith("weight") and ".norm." not in names[id(p)] for p in decay["params"])
    assert any(names[id(p)].endswith("norm.weight") for p in no_decay["params"])
