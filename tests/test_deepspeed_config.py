"""A DeepSpeed JSON config read onto paratrain's keys (``--deepspeed`` / ``deepspeed = "path"``): a seed-shaped
config trains exactly as the TOML it stands for, every refusal, DeepSpeed's LR schedules, offload refused on CPU."""
import json
import math

import pytest

from conftest import ROOT
from paratrain import cli
from paratrain import config_file
from paratrain.config import ConfigError
from paratrain.config_rules import check
from paratrain.deepspeed_config import load_config
from paratrain.optim import lr_at
from paratrain.precision import LossScaler

EXAMPLE = ROOT / "examples" / "deepspeed"
TINY = ["--model.hidden_size=32", "--model.ffn_hidden_size=64", "--model.seq_length=16", "--model.vocab_size=48",
        "--model.decoder_layers=1", "--train.steps=4", "--metrics.log_steps=1", "--metrics.progress=false"]
# what examples/deepspeed/ds_config.json says, in TOML, for one process
EQUIVALENT_TOML = """
[model]
kind = "gpt"
vocab_size = 64
hidden_size = 64
num_heads = 4
ffn_hidden_size = 256
decoder_layers = 2
seq_length = 32
hidden_dropout = 0.0
attention_dropout = 0.0

[parallel]
micro_batch_num = 2
zero_stage = 2

[train]
steps = 40
global_batch_size = 16
grad_clip = 1.0
mixed_precision = "fp16"
initial_loss_scale = 4096.0
loss_scale_window = 1000
loss_scale_hysteresis = 2
min_loss_scale = 1.0
lr = 2e-3
beta1 = 0.9
beta2 = 0.98
eps = 1e-8
weight_decay = 0.01
lr_schedule = "warmup_decay_lr"
warmup_min_lr = 0.0
warmup_steps = 5
warmup_type = "log"

[data]
kind = "synthetic"

[metrics]
log_steps = 10
"""


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(120)
def test_seed_shaped_config_trains_like_its_toml(tmp_path, capsys):
    assert cli.main(["train", "--config", str(EXAMPLE / "gpt.toml"), f"--run.dir={tmp_path / 'ds'}", *TINY]) == 0
    out = capsys.readouterr().out
    assert "zero_optimization.stage=2 -> parallel.zero_stage=2" in out
    assert "fp16.initial_scale_power=12 -> train.initial_loss_scale=4096.0" in out
    assert "steps_per_print=10 -> metrics.log_steps=10 (the command line sets it again)" in out
    assert out.count("accepted, no effect:") == 1 and "zero_optimization.overlap_comm=True" in out
    toml = tmp_path / "equivalent.toml"
    toml.write_text(EQUIVALENT_TOML)
    assert cli.main(["train", "--config", str(toml), f"--run.dir={tmp_path / 'toml'}", *TINY]) == 0
    ds, plain = records(tmp_path / "ds"), records(tmp_path / "toml")
    assert [r["loss"] for r in ds] == [r["loss"] for r in plain] and len(ds) == 4
    assert [r["loss_scale"] for r in ds] == [r["loss_scale"] for r in plain]
    saved = config_file.load(tmp_path / "ds" / "config.toml").to_dict()  # resolved: DeepSpeed's values in it
    toml_saved = config_file.load(tmp_path / "toml" / "config.toml").to_dict()
    assert {k: v for k, v in saved.items() if k != "run"} == {k: v for k, v in toml_saved.items() if k != "run"}
    cfg = config_file.from_dict(saved).train  # WarmupDecayLR as DeepSpeed runs it: step s at scheduler iteration s - 1
    assert [r["lr"] for r in ds] == pytest.approx([lr_at(s, cfg) for s in range(4)], rel=1e-12, abs=1e-15)
    assert [r["lr"] for r in ds][:2] == [0.0, 0.0] and ds[2]["lr"] == pytest.approx(2e-3 * math.log(2) / math.log(5))


def write(tmp_path, ds: dict):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    return path


def test_batch_rule_and_auto(tmp_path):
    def batch(ds, world_size=2, overrides=()):
        cfg = load_config(None, list(overrides), str(write(tmp_path, ds)), world_size)
        return cfg.train.global_batch_size, cfg.parallel.micro_batch_num

    assert batch({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}) == (24, 3)
    assert batch({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}) == (32, 4)
    assert batch({"train_batch_size": 32, "gradient_accumulation_steps": 2}) == (32, 2)
    assert batch({"train_batch_size": 32}) == (32, 1)
    assert batch({"train_micro_batch_size_per_gpu": 4}, world_size=4) == (16, 1)
    assert batch({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
                 overrides=["parallel.model_parallel=2"], world_size=8) == (16, 2)  # data_parallel = 8 / 2
    # nothing to go on: paratrain's own values stay
    assert batch({"train_batch_size": "auto", "gradient_accumulation_steps": "auto"},
                 overrides=["train.global_batch_size=12", "parallel.micro_batch_num=3"]) == (12, 3)


def test_auto_keeps_paratrains_values_and_block_defaults_are_deepspeeds(tmp_path):
    ds = {"optimizer": {"type": "Adam", "params": {"lr": "auto"}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}, "gradient_clipping": "auto",
          "fp16": {"enabled": True}}
    lines = []
    cfg = load_config(None, ["train.lr=5e-4", "train.grad_clip=0.5"], str(write(tmp_path, ds)), 1, lines.append)
    t = cfg.train
    assert (t.lr, t.grad_clip, t.lr_schedule) == (5e-4, 0.5, "warmup_lr")
    # left out of a given block: DeepSpeed's defaults (FusedAdam, WarmupLR, DynamicLossScaler)
    assert (t.beta1, t.beta2, t.eps, t.weight_decay) == (0.9, 0.999, 1e-8, 0.0)
    assert (t.warmup_steps, t.warmup_min_lr, t.warmup_type) == (1000, 0.0, "log")
    assert (t.initial_loss_scale, t.loss_scale_window, t.loss_scale_hysteresis, t.min_loss_scale) == (
        65536.0, 1000, 2, 1.0)
    assert "  gradient_clipping='auto' -> train.grad_clip=0.5 (paratrain's value)" in lines


def test_hugging_face_zero3_offload_config_maps(tmp_path):
    """The ZeRO-3 offload config of DeepSpeed's and Hugging Face's docs, "auto" everywhere it may be."""
    auto4 = dict.fromkeys(("lr", "betas", "eps", "weight_decay"), "auto")
    ds = {"fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                   "hysteresis": 2, "min_loss_scale": 1},
          "bf16": {"enabled": "auto"}, "optimizer": {"type": "AdamW", "params": auto4},
          "scheduler": {"type": "WarmupLR", "params": dict.fromkeys(("warmup_min_lr", "warmup_max_lr",
                                                                      "warmup_num_steps"), "auto")},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                                "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                                "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                                "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                                "stage3_gather_16bit_weights_on_model_save": True},
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
          "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}
    lines = []
    cfg = load_config(None, ["train.mixed_precision=fp16", "train.lr=4e-4", "train.global_batch_size=24"],
                      str(write(tmp_path, ds)), 2, lines.append)
    p, t = cfg.parallel, cfg.train
    assert (p.zero_stage, p.offload_optimizer, p.offload_param) == (3, "cpu", "cpu")
    assert (t.mixed_precision, t.lr, t.global_batch_size, t.lr_schedule, t.loss_scale_hysteresis) == (
        "fp16", 4e-4, 24, "warmup_lr", 2)  # fp16 "auto" and on: DeepSpeed's loss-scale settings apply
    assert sum(line.startswith("  accepted, no effect:") for line in lines) == 3
    assert "stage3_max_live_parameters=1000000000.0" in "".join(lines)


def test_deepspeed_key_in_toml_and_command_line_wins(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub", {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})
    toml = tmp_path / "sub" / "run.toml"
    toml.write_text('deepspeed = "ds_config.json"\n[parallel]\nenable_parallel_optimizer = true\n')
    cfg = load_config(toml, ["train.mixed_precision=none"])
    assert cfg.parallel.zero_stage == 3 and not cfg.parallel.optimizer_shard
    assert cfg.train.mixed_precision == "none"
    with pytest.raises(ConfigError, match="must be the path of a DeepSpeed JSON config"):
        toml.write_text("deepspeed = 3\n")
        load_config(toml)


REFUSALS = {  # DeepSpeed config -> what the one-line refusal says
    "batch-mismatch": ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
                       "train_batch_size=30 is not train_micro_batch_size_per_gpu=4 x gradient_accumulation_steps=2 x "
                       "data_parallel=2 = 16: set train_batch_size to 16"),
    "batch-type": ({"train_batch_size": "lots"}, "train_batch_size='lots' must be a positive integer or 'auto'"),
    "batch-zero": ({"train_micro_batch_size_per_gpu": 0}, "must be a positive integer"),
    "unknown-top": ({"gradient_cliping": 1.0}, "gradient_cliping is not a DeepSpeed key paratrain knows: did you mean "
                                              "gradient_clipping?"),
    "unknown-zero": ({"zero_optimization": {"stge": 2}}, "did you mean zero_optimization.stage?"),
    "unknown-optimizer": ({"optimizer": {"type": "AdamW", "params": {"lrr": 1e-3}}},
                          "did you mean optimizer.params.lr?"),
    "unknown-scheduler": ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 5}}},
                          "did you mean scheduler.params.warmup_num_steps?"),
    "type": ({"steps_per_print": "often"}, "steps_per_print='often': expected an integer"),
    "optimizer": ({"optimizer": {"type": "Lamb"}},
                  "optimizer.type='Lamb' is not supported: paratrain trains with AdamW"),
    "adam-l2": ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}},
                "Adam's L2 penalty"),
    "amsgrad": ({"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}, "paratrain's AdamW has no AMSGrad"),
    "betas": ({"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}}, "must be a list of two numbers"),
    "scheduler": ({"scheduler": {"type": "OneCycle"}},
                  "scheduler.type='OneCycle' is not supported: use one of WarmupLR"),
    "total-steps": ({"scheduler": {"type": "WarmupDecayLR", "params": {}}},
                    "scheduler.params.total_num_steps=None is required by WarmupDecayLR"),
    "wrong-param": ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "warmup_max_lr": 1.0}}},
                    "scheduler.params.warmup_max_lr=1.0 is not a parameter of WarmupCosineLR"),
    "cosine-too-short": ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5,
                                                                             "warmup_num_steps": 5}}},
                         "raise lr_decay_steps or lower warmup_steps"),
    "both-precisions": ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "are both true: enable one of them"),
    "static-scale": ({"fp16": {"enabled": True, "loss_scale": 128}}, "fp16.loss_scale=128 is a static scale"),
    "scale-power": ({"fp16": {"enabled": True, "initial_scale_power": 200}}, "must be an integer in [0, 128)"),
    "nvme": ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local"}}},
             "parallel.offload_param='nvme' is refused: paratrain has no NVMe offload"),
    "offload-stage0": ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
                       "offload_optimizer='cpu' needs the optimizer state sharded: set parallel.zero_stage to 1, "
                       "2 or 3"),
    "offload-param-stage2": ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
                             "offload_param='cpu' needs parameters sharded and freed after use: set "
                             "parallel.zero_stage=3"),
    "partial-offload": ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
                        "FSDP2 offloads the whole optimizer state or none"),
    "mics": ({"zero_optimization": {"mics_shard_size": 4}}, "no MiCS"),
    "stage": ({"zero_optimization": {"stage": 4}}, "parallel.zero_stage=4 is not one of 0, 1, 2, 3"),
    "apex-amp": ({"amp": {"enabled": True, "opt_level": "O1"}}, "amp.enabled=True is not supported: paratrain has no "
                                                                "apex AMP"),
    "scheduler-resume": ({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 99}}},
                         "resumes at its checkpoint's step"),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_refused_with_one_line(tmp_path, name):
    ds, message = REFUSALS[name]
    with pytest.raises(ConfigError) as caught:
        check(load_config(None, ["parallel.data_parallel=2"], str(write(tmp_path, ds)), 2), 2)
    assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"), ("{", "is not valid JSON"), ("[1, 2]", "must hold one JSON object, got list"),
    (b"\xff\xfe{}", "cannot be read"),
])
def test_unreadable_files_refused(tmp_path, content, message):
    path = tmp_path / "ds.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_config(None, [], str(path))


def test_offload_refused_on_cpu_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PARATRAIN_HOME", str(tmp_path / "jobs"))
    path = str(EXAMPLE / "ds_config_offload.json")
    assert cli.main(["train", "--config", str(EXAMPLE / "gpt.toml"), "--deepspeed", path,
                     f"--run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "parallel.offload_optimizer='cpu' needs an accelerator: FSDP2's CPUOffloadPolicy" in err
    assert err.count("\n") == 1 and not (tmp_path / "run" / "metrics.jsonl").exists()
    assert cli.main(["launch", "--nproc-per-node", "2", "--name", "offload", "--", "train", "--config",
                     str(EXAMPLE / "gpt.toml"), "--deepspeed", path]) == 2
    assert "needs an accelerator" in capsys.readouterr().err
    assert not (tmp_path / "jobs" / "offload" / "job.json").exists()
    bad = write(tmp_path, {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2})  # 10 != 2 x 1 x dp 2
    assert cli.main(["launch", "--nproc-per-node", "2", "--name", "batch", "--", "train", "--deepspeed", str(bad)]) == 2
    assert "train_batch_size=10 is not train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=2 x " \
        "data_parallel=2 = 8" in \
        capsys.readouterr().err


# --- DeepSpeed's LR schedules (deepspeed/runtime/lr_schedules.py) -----------------------------------

def deepspeed_reference(kind: str, p: dict, iteration: int) -> float:
    """The LR DeepSpeed's scheduler sets after ``iteration`` + 1 calls of step() (-1: as constructed)."""
    w, t = max(2, p["warmup_num_steps"]), p.get("total_num_steps")
    warm = (math.log(iteration + 1) / math.log(w) if p["warmup_type"] == "log" else iteration / w) \
        if 0 <= iteration < w else None
    if kind == "WarmupCosineLR":
        if iteration < 0:
            return 0.0
        if warm is not None:
            return p["lr"] * (p["warmup_min_ratio"] + warm * (1 - p["warmup_min_ratio"]))
        cosine = (1 + math.cos(math.pi * (iteration - w + 1) / (t - w))) / 2
        return p["lr"] * max(0.0, p["cos_min_ratio"] + (1 - p["cos_min_ratio"]) * cosine)
    gamma = 0.0 if iteration < 0 else warm if warm is not None else 1.0 if kind == "WarmupLR" else \
        max(0.0, (t - iteration) / max(1, t - w))
    return p["warmup_min_lr"] + (p["warmup_max_lr"] - p["warmup_min_lr"]) * gamma


SCHEDULES = [
    ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 10, "warmup_type": "log"}),
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 4, "total_num_steps": 10,
                       "warmup_type": "linear"}),
    ("WarmupDecayLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3, "warmup_num_steps": 6, "total_num_steps": 30,
                       "warmup_type": "log"}),
    ("WarmupCosineLR", {"lr": 1.0, "warmup_min_ratio": 0.0, "warmup_num_steps": 4, "total_num_steps": 10,
                        "cos_min_ratio": 0.1, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"lr": 3e-3, "warmup_min_ratio": 0.2, "warmup_num_steps": 5, "total_num_steps": 25,
                        "cos_min_ratio": 1e-4, "warmup_type": "log"}),
]


@pytest.mark.parametrize("kind, params", SCHEDULES)
def test_schedules_follow_deepspeeds_formulas(tmp_path, kind, params):
    sched = {k: v for k, v in params.items() if k != "lr"}
    ds = {"scheduler": {"type": kind, "params": sched}, "optimizer": {"type": "AdamW", "params": {"lr": params.get(
        "lr", 1e-3)}}}
    cfg = load_config(None, ["train.steps=40"], str(write(tmp_path, ds)), 1).train
    for step in (0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 20, 29, 30, 31, 39):  # warmup, its end, decay, past total_num_steps
        assert lr_at(step, cfg) == pytest.approx(deepspeed_reference(kind, params, step - 1), rel=1e-12, abs=1e-15)


def test_schedule_values_by_hand():
    def lr(kind, step, **train):
        return lr_at(step, config_file.from_dict({"train": {"lr_schedule": kind, "steps": 10, **train}}).train)

    log10 = dict(lr=1.0, warmup_steps=10, warmup_type="log")
    assert [lr("warmup_lr", s, **log10) for s in (0, 1, 5, 11, 30)] == pytest.approx([0, 0, math.log10(5), 1, 1])
    linear = dict(lr=1.0, warmup_steps=4, warmup_type="linear", lr_decay_steps=10)
    assert [lr("warmup_decay_lr", s, **linear) for s in (1, 3, 5, 8, 11, 13)] == pytest.approx(
        [0, 0.5, 1, 0.5, 0, 0])
    cosine = dict(linear, min_lr=0.1)
    assert [lr("warmup_cosine_lr", s, **cosine) for s in (0, 1, 4, 5, 10)] == pytest.approx(
        [0, 0, 0.75, 0.1 + 0.9 * (1 + math.cos(math.pi / 6)) / 2, 0.1])


def test_fp16_hysteresis_as_deepspeed():
    import torch

    inf, ok = torch.tensor(math.inf, device="cpu"), torch.tensor(1.0, device="cpu")
    scaler = LossScaler(True, 1024.0, growth_interval=3, hysteresis=2)
    assert scaler.update(inf) and scaler.scale == 1024  # the first overflow only spends the hysteresis
    assert scaler.update(inf) and scaler.scale == 512
    assert not scaler.update(ok) and not scaler.update(ok) and scaler.scale == 512
    assert scaler.update(inf) and scaler.scale == 256  # no refill without consecutive_hysteresis
    assert [scaler.update(ok) for _ in range(3)] == [False] * 3 and scaler.scale == 512  # doubled: refilled
    assert scaler.update(inf) and scaler.scale == 512
    consecutive = LossScaler(True, 1024.0, hysteresis=2, consecutive_hysteresis=True)
    assert consecutive.update(inf) and not consecutive.update(ok) and consecutive.update(inf)
    assert consecutive.scale == 1024


def test_preflight_counts_offloaded_state_against_host_memory(monkeypatch):
    """On a (pretend) 16 GiB GPU a 1.4 B-parameter GPT's 21 GiB of weights, gradients and AdamW state is refused
    without offload and accepted with it, unless the host cannot hold them either."""
    import torch

    from paratrain import device, preflight

    monkeypatch.setattr(device, "device", lambda choice=None: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: type("P", (), {"total_memory": 16 * 2**30}))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev: "Pretend GPU")
    monkeypatch.setattr(preflight, "host_memory", lambda: 256 * 2**30)
    model = {"kind": "gpt", "vocab_size": 50000, "hidden_size": 2048, "num_heads": 16, "ffn_hidden_size": 8192,
             "decoder_layers": 24, "seq_length": 1024}
    plain = config_file.from_dict({"model": model, "train": {"global_batch_size": 1}})
    (problem,) = preflight.memory_problems(plain, 1, 1)
    assert "is more than the 16 GiB of one Pretend GPU" in problem
    offload = config_file.from_dict({"model": model, "train": {"global_batch_size": 1},
                                     "parallel": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}})
    assert preflight.memory_problems(offload, 1, 1) == []
    monkeypatch.setattr(preflight, "host_memory", lambda: 8 * 2**30)
    (problem,) = preflight.memory_problems(offload, 1, 1)
    assert "this host's 8 GiB of memory for its 1 rank(s)" in problem


def test_plan_reads_the_deepspeed_config(capsys):
    assert cli.main(["plan", "--config", str(EXAMPLE / "gpt.toml"), "--devices", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)  # the example's batch: 8 per rank x 2 accumulation x 2 ranks
    assert rows and all(r["micro_batch_size"] * r["micro_batch_num"] * r["data_parallel"] == 32 for r in rows)
    offload = str(EXAMPLE / "ds_config_offload.json")
    assert cli.main(["plan", "--config", str(EXAMPLE / "gpt.toml"), "--deepspeed", offload, "--devices", "1",
                     "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)  # 8 per rank x 1 x 1
    assert rows and all(r["micro_batch_size"] * r["micro_batch_num"] * r["data_parallel"] == 8 for r in rows)
