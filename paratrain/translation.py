"""``paratrain translate --checkpoint CKPT --input FILE [--output FILE]``: greedy translation, one line per line.

Imports nothing heavy until run, so ``paratrain --help`` stays fast.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paratrain.errors import UserError


def cmd_translate(args) -> int:
    try:
        lines = Path(args.input).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read --input {args.input}: {getattr(exc, 'strerror', None) or exc}") from None
    from paratrain.device import device
    from paratrain.evaluate import load_translation_model, translate

    model, cfg, tokenizer = load_translation_model(args.checkpoint, args.config, args.overrides, device(args.device))
    hypotheses = iter(translate(model, tokenizer, [line.strip() for line in lines if line.strip()],
                                cfg.model.src_seq_length, cfg.model.tgt_seq_length, args.batch_size))
    out = [next(hypotheses) if line.strip() else "" for line in lines]  # blank lines stay blank
    text = "".join(line + "\n" for line in out)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {len(out)} translations to {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Register ``translate`` on the ``paratrain`` command."""
    p = sub.add_parser("translate", help="translate a file line by line with a trained encoder-decoder checkpoint "
                                         "(greedy decoding with a key/value cache, one process)")
    p.add_argument("--checkpoint", required=True,
                   help="a checkpoint directory (step_*), or a checkpoints/run directory: the newest")
    p.add_argument("--input", required=True, help="UTF-8 text file, one source sentence per line")
    p.add_argument("--output", help="write the translations here, one per line (default: stdout)")
    p.add_argument("--config", help="TOML config to use instead of the one stored with the checkpoint; "
                                    "either can be overridden as --section.key=value (e.g. --data.tokenizer=PATH)")
    p.add_argument("--batch-size", type=int, default=64, help="sentences decoded together (default 64)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help="where to decode (default: $PARATRAIN_DEVICE, else auto: the GPU when there is one)")
    p.set_defaults(func=cmd_translate, overrides=True)
