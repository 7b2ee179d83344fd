"""The llama kind to and from Hugging Face: its parameter names against ``transformers``' (the state-dict
adapter) and its initial weights from a directory's safetensors, read by DCP's ``HuggingFaceStorageReader`` straight
into whatever layout the model has (each rank reads its own shards only). Its settings from a ``config.json``:
``paratrain.config.hf_model_settings``.
"""
from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from paratrain.config import LoraConfig, ModelConfig, hf_config_json
from paratrain.errors import UserError
from paratrain.lora import is_adapter, merged, peft_config, peft_name

RENAMED = (("o_proj", "out_proj"), ("lm_head", "head"))  # (HF's, paratrain's) name parts that differ


def to_hf(name: str) -> str:
    """A paratrain parameter name -> its HF name (``layers.0.self_attn.out_proj.weight`` ->
    ``model.layers.0.self_attn.o_proj.weight``; ``...q_proj.base_layer.weight`` -> ``...q_proj.weight``)."""
    for theirs, ours in RENAMED:
        name = ".".join(theirs if part == ours else part for part in name.split("."))
    name = name.replace(".base_layer.", ".")  # a LoRA-adapted Linear's own weight (paratrain.lora)
    return name if name.startswith("lm_head.") else f"model.{name}"


def safetensors_files(directory: str | Path) -> list[Path]:
    """A directory's ``model.safetensors``, or the shards its ``model.safetensors.index.json`` names."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if not index.exists():
        return [directory / "model.safetensors"]
    return [directory / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]


def stored_tensors(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor of a directory's ``model.safetensors`` or the shards its
    ``model.safetensors.index.json`` names; a missing file or broken header refused naming it."""
    try:
        shapes = {}
        for file in safetensors_files(directory):
            with safe_open(str(file), framework="pt") as f:
                shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
        return shapes
    except Exception as err:  # safetensors raises its own error types
        raise UserError(f"model.from_hf={str(directory)!r}: cannot read its safetensors: {err}") from err


@contextlib.contextmanager
def quiet_single_process():
    """DCP without a process group, which it reads as one process (what is meant here), without its warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


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
        with torch.device("cpu"), quiet_single_process():  # the reader's tensors (file reads) are host tensors
            dcp.load(hf_state, storage_reader=HuggingFaceStorageReader(str(directory)))
        set_model_state_dict(part, {name: hf_state[to_hf(name)] for name in state},
                             options=StateDictOptions(strict=False))


def hf_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory's safetensors, whole, by HF name (one process: an export)."""
    tensors = {}
    for file in safetensors_files(directory):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def _llama_run(checkpoint: str | Path, fmt: str) -> tuple[Path, ModelConfig, LoraConfig]:
    """(checkpoint path, model config, lora config) of a llama-kind run's checkpoint; another kind refused."""
    from paratrain.checkpoint.storage import read_meta, resolve

    path = resolve(checkpoint)
    saved = read_meta(path)["config"]
    m, lora = ModelConfig(**saved["model"]), LoraConfig(**saved.get("lora", {}))
    if m.kind != "llama":
        raise UserError(f"export --format {fmt}: {path} holds a model.kind={m.kind!r} model; only 'llama' has a "
                        f"Hugging Face counterpart (export it as one .safetensors file instead)")
    return path, m, lora


def export_hf(checkpoint: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None,
              trust_unverified: bool = False) -> Path:
    """Write the llama-kind model of ``checkpoint`` (saved under any layout) as a Hugging Face directory that
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads: ``config.json``, safetensors shards (one per
    layer, and one for the embedding, norm and head) with their index written by DCP's
    ``HuggingFaceStorageWriter``, and the tokenizer files of the run's ``model.from_hf`` if it had one. A LoRA
    run's adapters are merged into the weights they adapt (its base read from ``model.from_hf`` when the
    checkpoint holds only the adapters)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from paratrain.checkpoint.full import load_full_tensors

    path, m, lora = _llama_run(checkpoint, "hf")
    saved = load_full_tensors(path, trust_unverified=trust_unverified)
    tensors = {to_hf(name): tensor for name, tensor in saved.items()}
    if lora.enabled:
        base = hf_tensors(m.from_hf) if m.from_hf and all(map(is_adapter, saved)) else {}
        tensors = merged({**base, **tensors}, lora.scaling)
    if dtype is not None:
        tensors = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor for name, tensor in tensors.items()}
    if m.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    shards = {name: int(name.split(".")[2]) + 2 if name.startswith("model.layers.") else 1 for name in tensors}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with quiet_single_process():
        dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(out), fqn_to_index_mapping=shards), no_dist=True)
    written = dict(hf_config_json(m), dtype=str(dtype or next(iter(tensors.values())).dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        source = Path(m.from_hf) / name if m.from_hf else None
        if source is not None and source.is_file():
            (out / name).write_bytes(source.read_bytes())
    return out


def export_peft(checkpoint: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None,
                trust_unverified: bool = False) -> Path:
    """Write the LoRA adapters of a llama-kind run's ``checkpoint`` (any layout) as ``peft`` saves them:
    ``adapter_config.json`` (naming the run's ``model.from_hf`` as the base) and ``adapter_model.safetensors``,
    which ``peft.PeftModel.from_pretrained(base, out_dir)`` loads on the HF base model."""
    from safetensors.torch import save_file

    from paratrain.checkpoint.full import load_full_tensors

    path, m, lora = _llama_run(checkpoint, "peft")
    if not lora.enabled:
        raise UserError(f"export --format peft: {path} was trained without [lora] (lora.rank=0): it has no adapters; "
                        f"export it with --format hf")
    adapters = {peft_name(to_hf(name)): tensor if dtype is None else tensor.to(dtype)
                for name, tensor in load_full_tensors(path, trust_unverified=trust_unverified).items()
                if is_adapter(name)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in adapters.items()}, str(out / "adapter_model.safetensors"))
    written = peft_config(lora, str(Path(m.from_hf).resolve()) if m.from_hf else "")
    (out / "adapter_config.json").write_text(json.dumps(written, indent=2) + "\n")
    return out
