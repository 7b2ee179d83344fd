"""The llama kind to and from Hugging Face: its parameter names against ``transformers``' (the state-dict
adapter) and its initial weights from a directory's safetensors, read by DCP's ``HuggingFaceStorageReader`` straight
into whatever layout the model has (each rank reads its own shards only). Its settings from a ``config.json``:
``paratrain.config.hf_model_settings``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from paratrain.errors import UserError

RENAMED = (("o_proj", "out_proj"), ("lm_head", "head"))  # (HF's, paratrain's) name parts that differ


def to_hf(name: str) -> str:
    """A paratrain parameter name -> its HF name (``layers.0.self_attn.out_proj.weight`` ->
    ``model.layers.0.self_attn.o_proj.weight``)."""
    for theirs, ours in RENAMED:
        name = ".".join(theirs if part == ours else part for part in name.split("."))
    return name if name.startswith("lm_head.") else f"model.{name}"


def stored_tensors(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor of a directory's ``model.safetensors`` or the shards its
    ``model.safetensors.index.json`` names; a missing file or broken header refused naming it."""
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


def load_hf_weights(parts: list[nn.Module], whole: nn.Module, directory: str | Path) -> None:
    """Set the parameters of ``parts`` (this rank's model chunks: plain, tensor-parallel or FSDP-sharded) to the
    HF weights in ``directory``, each rank reading only its shards. ``whole``: the model all ranks hold together
    (built on the meta device), whose tensors the directory must hold: missing, unexpected and mis-shaped ones
    are refused first, each named (a tied head has no tensor of its own)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    wanted = {to_hf(name): tuple(tensor.shape) for name, tensor in whole.state_dict().items()}
    stored = stored_tensors(directory)
    if whole.head.weight is whole.embed_tokens.weight:
        wanted.pop("lm_head.weight", None)
        stored.pop("lm_head.weight", None)  # saved by some exports of tied models
    problems = [f"missing {name} {shape}" for name, shape in wanted.items() if name not in stored]
    problems += [f"unexpected {name} {shape}" for name, shape in stored.items() if name not in wanted]
    problems += [f"{name} is {stored[name]}, the model's is {shape}" for name, shape in wanted.items()
                 if name in stored and stored[name] != shape]
    if problems:
        raise UserError(f"model.from_hf={str(directory)!r} does not fit the model:\n" +
                        "\n".join(f"  - {p}" for p in problems))
    for part in parts:
        state = {name: tensor for name, tensor in get_model_state_dict(part).items() if to_hf(name) in wanted}
        hf_state = {to_hf(name): tensor for name, tensor in state.items()}
        dcp.load(hf_state, storage_reader=HuggingFaceStorageReader(str(directory)))
        set_model_state_dict(part, {name: hf_state[to_hf(name)] for name in state},
                             options=StateDictOptions(strict=False))
