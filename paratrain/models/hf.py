"""The llama kind to and from Hugging Face: its settings from a ``config.json``, its parameter names against
``transformers``' (the state-dict adapter), and its initial weights from a directory's safetensors, read by DCP's
``HuggingFaceStorageReader`` straight into whatever layout the model has (each rank reads its own shards only).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from paratrain.errors import UserError

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
RENAMED = (("o_proj", "out_proj"), ("lm_head", "head"))  # (HF's, paratrain's) name parts that differ
# config.json name -> model key, for the keys both have under their own names
SAME_KEYS = ("vocab_size", "hidden_size", "rms_norm_eps", "attention_dropout")
HF_KEYS = {"num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
           "intermediate_size": "ffn_hidden_size", "num_hidden_layers": "decoder_layers",
           "tie_word_embeddings": "tie_embeddings", **{key: key for key in SAME_KEYS}}


def read_config(directory: str | Path) -> dict:
    """The ``config.json`` of an HF model directory; a missing or unreadable one refused naming it."""
    path = Path(directory) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"model.from_hf={str(directory)!r}: cannot read {path}: {err}") from err


def model_settings(hf: dict) -> dict:
    """The llama kind's ``[model]`` keys an HF ``config.json`` (``hf``) sets; an architecture or option paratrain
    does not implement refused naming it."""
    architectures = hf.get("architectures") or [None]
    if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
        raise UserError(f"config.json's architectures={architectures} is not supported: use one of "
                        f"{', '.join(ARCHITECTURES)}")
    architecture = architectures[0]
    unsupported = []
    if hf.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={hf['hidden_act']!r} (only 'silu')")
    if hf.get("attention_bias") and architecture != "Qwen2ForCausalLM":
        unsupported.append("attention_bias=true (a bias on the output projection as well)")
    if hf.get("mlp_bias"):
        unsupported.append("mlp_bias=true")
    if hf.get("use_sliding_window") or (architecture == "MistralForCausalLM" and hf.get("sliding_window")):
        unsupported.append(f"sliding_window={hf.get('sliding_window')} (attention over a window)")
    if unsupported:
        raise UserError(f"config.json of {architecture}: {'; '.join(unsupported)} is not supported by paratrain's "
                        f"llama kind")
    settings = {key: hf[name] for name, key in HF_KEYS.items() if hf.get(name) is not None}
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})  # transformers 5's, or 4's
    settings["rope_theta"] = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    settings["rope_scaling"] = {} if kind == "default" else {"rope_type": kind, **{
        key: value for key, value in rope.items() if key not in ("rope_type", "type")}}
    settings["qkv_bias"] = architecture == "Qwen2ForCausalLM"
    settings["qk_norm"] = architecture == "Qwen3ForCausalLM"
    return settings


def to_hf(name: str) -> str:
    """A paratrain parameter name -> its HF name (``layers.0.self_attn.out_proj.weight`` ->
    ``model.layers.0.self_attn.o_proj.weight``)."""
    for theirs, ours in RENAMED:
        name = ".".join(theirs if part == ours else part for part in name.split("."))
    return name if name.startswith("lm_head.") else f"model.{name}"


def stored_tensors(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor of a directory's ``model.safetensors`` or the shards its
    ``model.safetensors.index.json`` names; a missing file or broken header refused naming it."""
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
            "model.safetensors"]
        shapes = {}
        for file in files:
            with safe_open(str(directory / file), framework="pt") as f:
                shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
        return shapes
    except Exception as err:  # safetensors raises its own error types
        raise UserError(f"model.from_hf={str(directory)!r}: cannot read its safetensors: {err}") from err


def load_hf_weights(model: nn.Module, directory: str | Path) -> None:
    """Set ``model``'s parameters (plain, tensor-parallel or FSDP-sharded) to the HF weights in ``directory``,
    each rank reading only its shards. Missing, unexpected and mis-shaped tensors are refused first, each named
    (a tied head has no tensor of its own)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    state = get_model_state_dict(model)
    ours = {to_hf(name): tensor for name, tensor in state.items()}
    stored = stored_tensors(directory)
    if model.head is not None and model.embed_tokens is not None and model.head.weight is model.embed_tokens.weight:
        ours.pop("lm_head.weight", None)
        stored.pop("lm_head.weight", None)  # saved by some exports of tied models
    problems = [f"missing {name} {tuple(tensor.shape)}" for name, tensor in ours.items() if name not in stored]
    problems += [f"unexpected {name} {shape}" for name, shape in stored.items() if name not in ours]
    problems += [f"{name} is {stored[name]}, the model's is {tuple(tensor.shape)}" for name, tensor in ours.items()
                 if name in stored and stored[name] != tuple(tensor.shape)]
    if problems:
        raise UserError(f"model.from_hf={str(directory)!r} does not fit the model:\n" +
                        "\n".join(f"  - {p}" for p in problems))
    dcp.load(ours, storage_reader=HuggingFaceStorageReader(str(directory)))
    loaded = {name: ours[to_hf(name)] for name in state if to_hf(name) in ours}
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))
