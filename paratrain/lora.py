"""LoRA (``[lora]``): low-rank adapters added to a built model's Linears from outside, the model file left plain.

Each targeted Linear becomes a ``LoRALinear`` holding it as ``base_layer`` (peft's name), frozen, and two adapter
Linears: y = base_layer(x) + (alpha / rank) * lora_B(lora_A(dropout(x))), A (rank, in) initialised as peft's
default (``kaiming_uniform_(a=sqrt(5))``), B (out, rank) zeros, so training starts from the base's outputs. Every
other parameter of the model is frozen too. Under tensor parallelism each adapter splits as its base Linear
(``split_as``): a colwise base keeps A whole and splits B colwise; a rowwise base splits A rowwise and keeps B whole.

Names: ``layers.0.self_attn.q_proj.base_layer.weight`` (``paratrain.models.hf.to_hf`` drops ``base_layer``),
``...q_proj.lora_A.weight`` and ``...q_proj.lora_B.weight``; ``peft_name`` gives peft's.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from paratrain.config import LORA_RENAMED, LoraConfig

ADAPTERS = ("lora_A", "lora_B")
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the names of the model it wraps


class LoRALinear(nn.Module):
    """A frozen Linear plus its low-rank adapter: x (..., in) -> base_layer(x) + scaling * lora_B(lora_A(
    dropout(x))) (..., out), the adapter computed in its own dtype (the base may be held in bf16)."""

    def __init__(self, base_layer: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        weight = base_layer.weight
        self.base_layer = base_layer
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.lora_A = nn.Linear(base_layer.in_features, rank, bias=False, device=weight.device, dtype=weight.dtype)
        self.lora_B = nn.Linear(rank, base_layer.out_features, bias=False, device=weight.device, dtype=weight.dtype)
        self.scaling = alpha / rank
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # peft's init_lora_weights=True
        nn.init.zeros_(self.lora_B.weight)

    def split_as(self, kind: str) -> dict[str, str]:
        """How the children split when the module is declared ``kind`` (``paratrain.parallel.tensor``): the base
        as declared, one adapter matrix with it, the other whole (colwise: B's output features split, A whole on
        the gathered input; rowwise: A's input features split, its rank outputs summed, B whole)."""
        if kind == "colwise":
            return {"base_layer": kind, "lora_A": "replicate", "lora_B": kind}
        # with sequence parallel B runs on this rank's tokens: its gradient summed over the ranks
        return {"base_layer": kind, "lora_A": kind, "lora_B": "tokens"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        low_rank = self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype)))
        # B takes the tokens in one dim (the ``tokens`` split): torch 2.11's DTensor cannot flatten a sequence shard
        update = self.lora_B(low_rank.flatten(0, -2)).unflatten(0, low_rank.shape[:-1])
        return out + (self.scaling * update).to(out.dtype)


def add_adapters(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Freeze ``model`` and wrap each Linear ``cfg.targets`` names (by its last name part, HF's) in a
    ``LoRALinear`` (in place; returned). Nothing changes when LoRA is off."""
    if not cfg.enabled:
        return model
    model.requires_grad_(False)
    for name, module in list(model.named_modules()):
        parent, _, child = name.rpartition(".")
        if isinstance(module, nn.Linear) and LORA_RENAMED.get(child, child) in cfg.targets:
            model.get_submodule(parent).register_module(child, LoRALinear(module, cfg.rank, cfg.alpha, cfg.dropout))
    return model


def hold_base_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the frozen parameters of ``model`` to ``dtype`` (``lora.base_dtype``; tied ones stay one tensor);
    the adapters keep theirs."""
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and not param.requires_grad and param.dtype != dtype:
                if id(param) not in cast:
                    cast[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
                module._parameters[name] = cast[id(param)]


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (``...q_proj.lora_A.weight``)."""
    return any(part in ADAPTERS for part in name.split("."))


def merged(tensors: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """Whole tensors by HF name, adapters included, with each adapted weight merged: W + scaling * B @ A (in
    fp32, then W's dtype) and the adapters left out (what ``transformers`` loads as a plain model)."""
    out = {name: tensor for name, tensor in tensors.items() if not is_adapter(name)}
    for name, a in tensors.items():
        if name.endswith(".lora_A.weight"):
            module = name.removesuffix(".lora_A.weight")
            b, weight = tensors[f"{module}.lora_B.weight"], out[f"{module}.weight"]
            out[f"{module}.weight"] = (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)
    return out


def peft_config(cfg: LoraConfig, base_model: str) -> dict:
    """peft's ``adapter_config.json`` of these adapters on the HF model in ``base_model``."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": cfg.rank,
            "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": sorted(cfg.targets),
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
            "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}}


def peft_name(hf_name: str) -> str:
    """An adapter's HF name -> its key in peft's ``adapter_model.safetensors``."""
    return PEFT_PREFIX + hf_name
