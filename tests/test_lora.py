"""LoRA (``[lora]``) against ``peft`` itself on tiny random HF Llama models made here: the same adapters train with
the same losses as a plain loop over ``get_peft_model``, every layout equals one process, only the adapters train,
and the exports load in ``peft`` and ``transformers`` with the same logits."""
from __future__ import annotations

import json

import pytest
import torch

from multiprocess import run_distributed
from test_llama import STEPS, hf_model, ids, plain_hf_losses, relative, run_config

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
}


def layouts_losses(configs: list) -> list[tuple[list[float], bool]]:
    """Each run's losses, and whether AdamW's state is the adapters' only (this rank's)."""
    from paratrain.lora import is_adapter
    from paratrain.trainer import Trainer

    out = []
    for cfg in configs:
        trainer = Trainer(cfg)
        losses = [record["loss"] for record in trainer.train()]
        adapters = {id(p) for name, p in trainer.placed.named_parameters() if is_adapter(name)}
        frozen = all(not p.requires_grad for name, p in trainer.placed.named_parameters() if not is_adapter(name))
        out.append((losses, frozen and 0 < len(trainer.optimizer.state) and
                    {id(p) for p in trainer.optimizer.state} <= adapters))
    return out


@pytest.mark.timeout(300)
def test_every_layout_equals_one_process(hf_dir, tmp_path):
    """tp2 (with and without sequence parallel), dp2 x ZeRO 3, dp2 x ZeRO 1 with selective recompute and a 1F1B
    pp2 with full recompute, all in one launch of 2 ranks, clipping on (it clips every step here): the losses of
    one process (fp32, <= 1e-4 relative)."""
    def config(name, parallel):
        cfg = lora_config(hf_dir, tmp_path / name, parallel)
        cfg.train.grad_clip = 0.05
        return cfg

    want = layouts_losses([config("one", {})])[0][0]
    results = run_distributed(layouts_losses, 2, [config(name, p) for name, p in LAYOUTS.items()], timeout=280)
    for i, (name, (losses, _)) in enumerate(zip(LAYOUTS, results[0])):
        assert all(rank[i][1] for rank in results), name
        assert len(losses) == STEPS and max(abs(a - b) / b for a, b in zip(losses, want)) <= 1e-4, (name, losses,
                                                                                                    want)
