"""LoRA (``[lora]``) against ``peft`` itself on tiny random HF Llama models made here: the same adapters train with
the same losses as a plain loop over ``get_peft_model``, every layout equals one process, only the adapters train,
and the exports load in ``peft`` and ``transformers`` with the same logits."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from forked_ranks import run_distributed
from paratrain.checkpoint.storage import CheckpointError
from test_llama import STEPS, hf_model, ids, plain_hf_losses, relative, run_config, trainer_losses

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

CASE, RANK, ALPHA, LR = "llama_gqa2", 4, 8.0, 2e-2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    hf_model(CASE).save_pretrained(directory, max_shard_size="40KB")
    return directory


def lora_config(hf_dir, run_dir, parallel: dict, **lora):
    cfg = run_config(hf_dir, run_dir, parallel)
    cfg.train.lr = cfg.train.min_lr = LR  # adapters starting at zero need a larger step to move the loss in 5
    cfg.lora.rank, cfg.lora.alpha = RANK, ALPHA
    for key, value in lora.items():
        setattr(cfg.lora, key, value)
    return cfg


def peft_model(cfg, adapters: dict[str, torch.Tensor]):
    """``get_peft_model`` over the case's HF model with ``cfg``'s adapters, initialised to ``adapters`` (peft's
    names, as ``export --format peft`` writes them)."""
    model = peft.get_peft_model(hf_model(CASE), peft.LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha,
                                                                 lora_dropout=0.0, target_modules=TARGETS))
    params = dict(model.named_parameters())
    assert len(adapters) == len([p for p in params.values() if p.requires_grad]) > 0
    with torch.no_grad():
        for name, tensor in adapters.items():
            params[name.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")].copy_(tensor)
    return model


def our_adapters(model) -> dict[str, torch.Tensor]:
    """The adapters of a (one-process) paratrain model by peft's names."""
    from paratrain.lora import peft_name
    from paratrain.models.hf import to_hf

    return {peft_name(to_hf(name)): p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.timeout(60)
def test_five_steps_equal_a_plain_loop_over_get_peft_model_and_only_the_adapters_train(hf_dir, tmp_path):
    """Same adapters (ours copied into peft's, B zero, A peft's kaiming-uniform), same AdamW: the same losses; the
    base after training is bit-identical to the HF weights, and AdamW holds state for the adapters only."""
    from safetensors.torch import load_file

    from paratrain.models.hf import to_hf
    from paratrain.trainer import Trainer

    cfg = lora_config(hf_dir, tmp_path / "run", {})
    trainer = Trainer(cfg)
    adapters = our_adapters(trainer.model)
    a = {n: t for n, t in adapters.items() if ".lora_A." in n}
    assert all(t.abs().max() > 0 for t in a.values()) and not any(
        t.any() for n, t in adapters.items() if ".lora_B." in n)
    bound = 1 / 32 ** 0.5  # kaiming_uniform_(a=sqrt(5)) of fan_in 32 (hidden) or 48 (the FFN's)
    assert all(t.abs().max() <= bound for t in a.values())
    got = [record["loss"] for record in trainer.train()]
    want = plain_hf_losses(CASE, cfg, peft_model(cfg, adapters))
    assert want[-1] < want[0] and got == pytest.approx(want, rel=1e-5)

    stored = {}
    for file in hf_dir.glob("*.safetensors"):
        stored.update(load_file(file))
    base = {to_hf(n): p for n, p in trainer.model.named_parameters() if not p.requires_grad}
    assert base.keys() == stored.keys() - {"lm_head.weight"} | {"lm_head.weight"} & base.keys()
    assert all(torch.equal(p, stored[n]) for n, p in base.items())
    trained = {id(p) for p in trainer.model.parameters() if p.requires_grad}
    assert {id(p) for p in trainer.optimizer.state} == trained and len(trained) == 2 * 7 * 2


LAYOUTS = {
    "tp2": {"mp": 2},
    "tp2_sequence_parallel": {"mp": 2, "sequence_parallel": True},
    "dp2_zero3": {"dp": 2, "zero_stage": 3},
    "dp2_zero1_recompute_selective": {"dp": 2, "zero_stage": 1, "recompute": "selective"},
    "pp2_1f1b_recompute_full": {"pp": 2, "micro_batch_num": 2, "pipeline_schedule": "1f1b", "recompute": "full"},
    "cp2_ulysses": {"cp": 2, "cp_method": "ulysses"},
    "cp2_ring": {"cp": 2, "cp_method": "ring"},
}

BF16_BASE_LAYOUTS = {f"{name}_bf16_base": parallel for name, parallel in
                     {"dp2_zero3": {"dp": 2, "zero_stage": 3}, "tp2": {"mp": 2},
                      "pp2_gpipe": {"pp": 2, "micro_batch_num": 2, "pipeline_schedule": "gpipe"}}.items()}


def layouts_losses(configs: list) -> list[tuple[list[float], bool]]:
    """Each run's losses, and whether (on this rank) only the adapters train and hold AdamW state, the frozen
    base in ``lora.base_dtype`` and the adapters in fp32."""
    from paratrain.device import DTYPES
    from paratrain.lora import is_adapter
    from paratrain.trainer import Trainer

    out = []
    for cfg in configs:
        trainer = Trainer(cfg)
        losses = [record["loss"] for record in trainer.train()]
        params = dict(trainer.placed.named_parameters())
        adapters = {id(p) for name, p in params.items() if is_adapter(name)}
        frozen = all(not p.requires_grad and p.dtype == DTYPES[cfg.lora.base_dtype] for name, p in params.items()
                     if not is_adapter(name))
        out.append((losses, frozen and 0 < len(trainer.optimizer.state) and
                    {id(p) for p in trainer.optimizer.state} <= adapters and
                    all(params[name].dtype == torch.float32 for name in params if is_adapter(name))))
    return out


@pytest.fixture(scope="module")
def layout_runs(hf_dir, tmp_path_factory):
    """(configs, losses of one process, [(losses, adapters only) per layout] of every rank) of the layouts, run in
    one launch of 2 ranks with clipping on (it clips every step here); the dp2 x ZeRO 3 run saves its last step."""
    root = tmp_path_factory.mktemp("runs")

    def config(name, parallel):
        cfg = lora_config(hf_dir, root / name, parallel)
        cfg.train.grad_clip = 0.05
        return cfg

    configs = {name: config(name, parallel) for name, parallel in {"one": {}, "one_bf16_base": {}, **LAYOUTS,
                                                                   **BF16_BASE_LAYOUTS}.items()}
    for name in ("one_bf16_base", *BF16_BASE_LAYOUTS):
        configs[name].lora.base_dtype = "bfloat16"
    configs["dp2_zero3"].checkpoint.save_steps = STEPS
    ones = layouts_losses([configs["one"], configs["one_bf16_base"]])
    assert all(ok for _, ok in ones)
    layouts = [configs[name] for name in (*LAYOUTS, *BF16_BASE_LAYOUTS)]
    return configs, [losses for losses, _ in ones], run_distributed(layouts_losses, 2, layouts, timeout=280)


@pytest.mark.timeout(300)
def test_every_layout_equals_one_process(layout_runs):
    """tp2 (with and without sequence parallel), dp2 x ZeRO 3, dp2 x ZeRO 1 with selective recompute, a 1F1B
    pp2 with full recompute and cp2 (Ulysses and ring attention): the losses of one process (fp32, <= 1e-4
    relative), AdamW's state the adapters'."""
    _, (want, _), results = layout_runs
    for i, (name, (losses, _)) in enumerate(zip(LAYOUTS, results[0])):
        assert all(rank[i][1] for rank in results), name
        assert len(losses) == STEPS and max(abs(a - b) / b for a, b in zip(losses, want)) <= 1e-4, (name, losses,
                                                                                                    want)


@pytest.mark.timeout(60)
def test_a_bf16_base_trains_near_the_fp32_one_on_every_layout(layout_runs):
    """``lora.base_dtype = "bfloat16"``: the frozen base held in bf16, the adapters in fp32, on one process and on
    dp2 x ZeRO 3 (FSDP2 gathering the two dtypes), tp2 and pp2; their losses near one process's in bf16 and near
    the fp32 base's, but not equal to it (the base really ran in bf16)."""
    _, (fp32, one), results = layout_runs
    assert one == pytest.approx(fp32, rel=1e-2) and one != pytest.approx(fp32, rel=1e-6)
    for i, name in enumerate(BF16_BASE_LAYOUTS, start=len(LAYOUTS)):
        assert all(rank[i][1] for rank in results), name
        assert results[0][i][0] == pytest.approx(one, rel=2e-3), name


@pytest.mark.timeout(120)
def test_exports_load_in_peft_and_transformers_with_the_logits_of_the_checkpoint(layout_runs, hf_dir, tmp_path):
    """The dp2 x ZeRO 3 checkpoint (adapters only, the base named by model.from_hf) resumed in one process gives
    the adapted model's logits; ``--format peft`` loaded by ``PeftModel.from_pretrained`` on the HF base and
    ``--format hf`` (merged) loaded by ``transformers`` give the same; ``generate`` continues a prompt from the
    checkpoint as from the merged export."""
    from paratrain.checkpoint.full import load_full_tensors
    from paratrain.cli import main
    from paratrain.generation import generate, load_generator
    from paratrain.lora import is_adapter
    from paratrain.trainer import Trainer

    saved = layout_runs[0]["dp2_zero3"].checkpoint_path
    assert all(map(is_adapter, load_full_tensors(saved)))
    cfg = copy.deepcopy(layout_runs[0]["one"])  # one process resumed at the last step: nothing trained
    cfg.run.dir, cfg.checkpoint.dir = str(tmp_path / "resumed"), str(saved)
    trainer = Trainer(cfg)
    assert trainer.step == STEPS
    with torch.no_grad():
        want = trainer.model.eval()(ids())
    assert main(["export", cfg.checkpoint.dir, str(tmp_path / "peft"), "--format", "peft"]) == 0
    assert main(["export", cfg.checkpoint.dir, str(tmp_path / "hf"), "--format", "hf"]) == 0
    adapter_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert adapter_config["r"] == RANK and adapter_config["base_model_name_or_path"] == str(hf_dir.resolve())
    adapted = peft.PeftModel.from_pretrained(hf_model(CASE), tmp_path / "peft").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="sdpa").eval()
    with torch.no_grad():
        assert relative(adapted(ids()).logits, want) <= 1e-5
        assert relative(merged(ids()).logits, want) <= 1e-5
        assert relative(hf_model(CASE)(ids()).logits, want) > 1e-4  # the adapters changed the logits
    prompt = ids()[:1, :6]
    tokens = [generate(load_generator(run, "cpu").model, prompt, 6) for run in (saved, tmp_path / "hf")]
    assert torch.equal(*tokens) and tokens[0].shape[-1] > 6


@pytest.mark.timeout(60)
def test_a_resumed_run_equals_one_uninterrupted(hf_dir, tmp_path, layout_runs):
    """3 steps saved (adapters and their AdamW state), then resumed to 5, with the base read again from
    model.from_hf: the losses of the uninterrupted run."""
    from paratrain.trainer import Trainer

    cfg = lora_config(hf_dir, tmp_path, {})
    cfg.train.grad_clip = 0.05
    cfg.train.steps, cfg.checkpoint.save_steps = 3, 3
    first = [record["loss"] for record in Trainer(cfg).train()]
    cfg.train.steps = STEPS
    resumed = [record["loss"] for record in Trainer(cfg).train()]
    assert len(resumed) == STEPS - 3
    assert first + resumed == pytest.approx(layout_runs[1][0], rel=1e-6)
    cfg.lora.rank, cfg.train.steps = 2 * RANK, STEPS + 1
    with pytest.raises(CheckpointError, match=f"lora.rank: {RANK} → {2 * RANK}"):
        Trainer(cfg)


@pytest.mark.timeout(60)
def test_refusals_name_the_values_and_a_fix(tmp_path):
    """Bad [lora] keys are refused before start, each with its values and the ones that work; a run without
    adapters has no peft export."""
    from paratrain import config_file
    from paratrain.config import ConfigError
    from paratrain.config_rules import validate
    from paratrain.errors import UserError
    from paratrain.models.hf import export_peft

    cfg = config_file.from_dict({"model": {"kind": "llama"}, "lora": {
        "r": -2, "lora_alpha": 0, "dropout": 1.5, "target_modules": ["q_proj", "qkv", "fc1"], "base_dtype": "fp8"}})
    problems = "\n".join(validate(cfg))
    assert "lora.rank=-2 must be at least 1" in problems and "lora.alpha=0" in problems
    assert "lora.dropout=1.5 is outside [0, 1)" in problems and "lora.base_dtype='fp8'" in problems
    assert "'qkv', 'fc1', not a Linear of the llama kind: use some of q_proj, k_proj, v_proj, o_proj" in problems
    with pytest.raises(ConfigError, match="not to model.kind='gpt': set model.kind='llama'"):
        ConfigError.raise_any(validate(config_file.from_dict({"model": {"kind": "gpt"}, "lora": {"rank": 8}})))
    fp8 = config_file.from_dict({"model": {"kind": "llama"}, "lora": {"rank": 8}, "train": {"mixed_precision": "fp8"}})
    assert any("mixed_precision='fp8'" in p and "use mixed_precision='bf16'" in p for p in validate(fp8))
    plain = config_file.from_dict({"model": {"kind": "llama", "seq_length": 8, "hidden_size": 32,
                                             "ffn_hidden_size": 32, "decoder_layers": 1},
                                   "run": {"dir": str(tmp_path)}, "train": {"steps": 1, "global_batch_size": 2},
                                   "checkpoint": {"save_steps": 1}})
    trainer_losses(plain)
    with pytest.raises(UserError, match="trained without \\[lora\\].*export it with --format hf"):
        export_peft(plain.checkpoint_path, tmp_path / "peft")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("base_dtype,parallel", [("float32", {"dp": 2, "mp": 2, "pp": 2, "zero_stage": 1,
                                                              "micro_batch_num": 2}),
                                                 ("bfloat16", {"dp": 4, "mp": 2, "zero_stage": 3})])
def test_the_planner_gives_a_frozen_base_no_gradients_and_no_optimizer_state(base_dtype, parallel):
    """The cost model's bytes per rank equal those the dry run counts on the real sharding (meta device, fake
    ranks) with adapters; gradients and AdamW state are the adapters' only, so the estimate falls."""
    from paratrain import config_file
    from paratrain.plan import cost
    from paratrain.plan.dryrun import dry_run
    from paratrain.plan.search import evaluate

    cfg = config_file.from_dict({
        "model": {"kind": "llama", "vocab_size": 64, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
                  "ffn_hidden_size": 96, "decoder_layers": 4, "seq_length": 16},
        "parallel": parallel, "train": {"global_batch_size": 8}, "lora": {"rank": 2, "base_dtype": base_dtype}})
    full, lora = cost.stage_states(cfg.model, cfg.parallel), cost.stage_states(cfg.model, cfg.parallel, lora=cfg.lora)
    for c, p in zip(dry_run(cfg), lora, strict=True):
        assert (c["params"], c["grads"], c["optimizer"], c["tensors"]) == (p.params, p.grads, p.optimizer, p.tensors)
    for f, p in zip(full, lora):
        assert 0 < p.grads < f.grads / 4 and 0 < p.optimizer < f.optimizer / 4
        assert (p.params > f.params) if base_dtype == "float32" else (p.params < f.params)
    adapters = cost.model_params(cfg.model, cfg.lora, trainable=True)
    # 4 layers of rank 2: A (r, in) and B (out, r) of q, k, v, o (64 <-> 64, 32 kv features), gate, up, down (96)
    assert adapters == 4 * 2 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 96))
    hardware = cost.Hardware.default(cfg.parallel.world_size, cfg.parallel.world_size)
    without = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=0))
    assert evaluate(cfg, cfg.parallel, hardware)["memory_gib"] < evaluate(without, cfg.parallel, hardware)["memory_gib"]
