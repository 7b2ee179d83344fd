"""``paratrain generate --checkpoint RUN_OR_HF_DIR --prompt TEXT --max-new-tokens N``: text continued by a
decoder-only model (``model.kind`` gpt or llama), in one process, with a key/value cache: the prompt fills each
layer's cache in one forward, then each new token is one forward of that token alone. Greedy by default, as
``transformers``' ``generate(do_sample=False)``; ``--temperature`` and ``--top-p`` sample.

The checkpoint is a paratrain checkpoint (or a run or checkpoints directory: its newest) of any layout, or a
Hugging Face model directory (``config.json``, safetensors, ``tokenizer.json``) of an architecture
``model.from_hf`` takes. Imports nothing heavy until run, so ``paratrain --help`` stays fast.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from paratrain.errors import UserError

DECODER_KINDS = ("gpt", "llama")


@dataclass
class Generator:
    """A decoder-only model in eval mode with what decoding it needs: ``model`` (ids (B, S) -> logits (B, S, V),
    taking ``caches``), ``tokenizer`` (a ``tokenizers.Tokenizer``, None when the run had none), the ids that end a
    text (``eos_ids``), its ``vocab_size`` and the most positions it can hold (``max_length``; None: no limit of
    its own)."""

    model: object
    tokenizer: object | None
    eos_ids: tuple[int, ...]
    vocab_size: int
    max_length: int | None


def sample(logits, temperature: float = 0.0, top_p: float = 1.0, generator=None):
    """The next token of each row of ``logits`` (B, V) -> (B,): the most likely one when ``temperature`` is 0,
    else one drawn from softmax(logits / temperature) cut to the smallest set of most likely tokens whose
    probabilities reach ``top_p`` (nucleus sampling; the most likely token always stays in)."""
    import torch

    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # the mass of the tokens more likely than each
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    choice = torch.multinomial(sorted_probs, 1, generator=generator)
    return order.gather(-1, choice)[:, 0]


def generate(model, input_ids, max_new_tokens: int, eos_ids: tuple[int, ...] = (), temperature: float = 0.0,
             top_p: float = 1.0, generator=None):
    """``input_ids`` (B, S) followed by up to ``max_new_tokens`` tokens of ``model`` -> (B, S + n): rows that
    reached one of ``eos_ids`` go on with it until every row has (or n reaches ``max_new_tokens``)."""
    import torch

    with torch.no_grad():
        caches: dict = {}
        logits = model(input_ids, caches=caches)[:, -1]
        tokens, done = input_ids, torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device)
        eos = torch.tensor(eos_ids, dtype=input_ids.dtype, device=input_ids.device)
        for step in range(max_new_tokens):
            next_token = sample(logits, temperature, top_p, generator)
            next_token = torch.where(done, eos[:1].expand_as(next_token), next_token) if len(eos) else next_token
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            done |= torch.isin(next_token, eos)
            if step + 1 == max_new_tokens or bool(done.all()):
                return tokens
            logits = model(next_token[:, None], caches=caches)[:, -1]
    return tokens


def hf_tokenizer(path: Path):
    """The ``tokenizers.Tokenizer`` of a ``tokenizer.json`` file, None where there is none."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)) if path.is_file() else None
    except Exception as exc:  # the tokenizers library raises a bare Exception for a file it cannot parse
        raise UserError(f"generate: {path} is not a readable tokenizer.json ({exc})") from None


def load_generator(checkpoint: str | Path, device) -> Generator:
    """The ``Generator`` of a paratrain checkpoint (a run or checkpoints directory: its newest; a LoRA run's
    adapters on its base) or of a Hugging Face model directory, its weights on ``device``."""
    import torch

    from paratrain.config import ConfigError, ModelConfig
    from paratrain.data.tokenizer import eos_ids
    from paratrain.models import build_model

    path = Path(checkpoint)
    if (path / "config.json").is_file():
        from paratrain.models.hf import load_hf_weights

        cfg = ModelConfig(from_hf=str(path))
        try:
            cfg.take_hf(set())
        except ConfigError as exc:
            raise UserError(f"generate: {exc}") from None
        with torch.device(device):
            model = build_model(cfg)
        load_hf_weights([model], model, path)
        return Generator(model.eval(), hf_tokenizer(path / "tokenizer.json"), eos_ids(path), cfg.vocab_size, None)
    from paratrain import config_file
    from paratrain.checkpoint.full import load_full_tensors
    from paratrain.checkpoint.storage import read_meta, resolve
    from paratrain.data.synthetic import EOS
    from paratrain.lora import add_adapters, is_adapter

    path = resolve(checkpoint)
    run = config_file.from_dict(read_meta(path)["config"], [])
    cfg = run.model
    if cfg.kind not in DECODER_KINDS:
        raise UserError(f"generate: checkpoint {path} holds a model.kind={cfg.kind!r} model; generate continues "
                        f"the text of a decoder-only one ({' or '.join(DECODER_KINDS)}); an encoder-decoder "
                        f"translates with `paratrain translate`")
    with torch.device(device):
        model = add_adapters(build_model(cfg), run.lora)
    tensors = load_full_tensors(path, trust_unverified=run.checkpoint.trust_unverified)
    if run.lora.enabled and cfg.from_hf and all(map(is_adapter, tensors)):  # the base is in from_hf
        from paratrain.models.hf import load_hf_weights

        with torch.device("meta"):
            whole = build_model(cfg)
        load_hf_weights([model], whole, cfg.from_hf)
        tensors = {**{name: t for name, t in model.state_dict().items() if not is_adapter(name)}, **tensors}
    model.load_state_dict(tensors)
    if cfg.from_hf:
        tokenizer, ends = hf_tokenizer(Path(cfg.from_hf) / "tokenizer.json"), eos_ids(Path(cfg.from_hf))
    else:  # paratrain's own tokenizer (data.kind = "text"), whose EOS ends every document
        tokenizer, ends = hf_tokenizer(Path(run.data.tokenizer)) if run.data.tokenizer else None, (EOS,)
    return Generator(model.eval(), tokenizer, ends, cfg.vocab_size, cfg.seq_length if cfg.kind == "gpt" else None)


def cmd_generate(args) -> int:
    import torch

    from paratrain.device import device

    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UserError(f"generate: --max-new-tokens={args.max_new_tokens} (>= 1), --temperature="
                        f"{args.temperature} (>= 0) and --top-p={args.top_p} (in (0, 1]) are out of range")
    if (args.prompt is None) == (args.prompt_ids is None):
        raise UserError("generate: give the prompt as --prompt TEXT or as --prompt-ids 'ID ID ...' (not both)")
    try:
        ids = None if args.prompt_ids is None else [int(word) for word in args.prompt_ids.split()]
    except ValueError:
        raise UserError(f"generate: --prompt-ids={args.prompt_ids!r}: expected token ids separated by spaces") from None
    where = device(args.device)
    gen = load_generator(args.checkpoint, where)
    if ids is None:
        if gen.tokenizer is None:
            raise UserError(f"generate: {args.checkpoint} has no tokenizer (the run trained on token ids): give "
                            f"the prompt as --prompt-ids 'ID ID ...'")
        ids = gen.tokenizer.encode(args.prompt).ids
    if not ids or max(ids) >= gen.vocab_size or min(ids) < 0:
        raise UserError(f"generate: the prompt's ids {ids} must be 1 or more, each in 0..{gen.vocab_size - 1}")
    if gen.max_length is not None and len(ids) + args.max_new_tokens > gen.max_length:
        raise UserError(f"generate: {len(ids)} prompt tokens + --max-new-tokens={args.max_new_tokens} is more than "
                        f"the model's {gen.max_length} positions (model.seq_length): ask for at most "
                        f"{gen.max_length - len(ids)} new tokens")
    random = torch.Generator(where).manual_seed(args.seed)
    prompt = torch.tensor([ids], dtype=torch.long, device="cpu").to(where, non_blocking=True)
    tokens = generate(gen.model, prompt, args.max_new_tokens, gen.eos_ids, args.temperature, args.top_p, random)
    new = tokens[0, len(ids):].tolist()
    if args.ids or gen.tokenizer is None:
        print(" ".join(map(str, new)))
    else:
        sys.stdout.write(gen.tokenizer.decode(new, skip_special_tokens=True) + "\n")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Register ``generate`` on the ``paratrain`` command."""
    p = sub.add_parser("generate", help="continue a prompt with a decoder-only checkpoint or Hugging Face model "
                                        "(one process, key/value cache; greedy unless --temperature)")
    p.add_argument("--checkpoint", required=True,
                   help="a checkpoint directory (step_*), a checkpoints/run directory (the newest), or a Hugging "
                        "Face model directory (config.json, safetensors, tokenizer.json)")
    p.add_argument("--prompt", help="the text to continue (encoded with the model's tokenizer)")
    p.add_argument("--prompt-ids", help="the prompt as token ids separated by spaces (a model without tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to add at most (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; else sample at it")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the most likely tokens of this mass")
    p.add_argument("--seed", type=int, default=0, help="the sampling's random seed (default 0)")
    p.add_argument("--ids", action="store_true", help="print the new token ids instead of their text")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help="where to run (default: $PARATRAIN_DEVICE, else auto: the GPU when there is one)")
    p.set_defaults(func=cmd_generate)
