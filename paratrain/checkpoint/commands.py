"""``paratrain export CKPT OUT.safetensors`` (``--format hf``: a Hugging Face directory), ``paratrain checkpoint
info CKPT`` and ``checkpoint verify``."""
from __future__ import annotations

import argparse
import json
import time


def cmd_export(args) -> int:
    from paratrain.checkpoint import export
    from paratrain.device import DTYPES
    from paratrain.errors import UserError

    if args.format == "hf":
        from paratrain.models.hf import export_hf as export
    elif args.format == "peft":
        from paratrain.models.hf import export_peft as export
    try:
        out = export(args.checkpoint, args.out, dtype=DTYPES[args.dtype] if args.dtype else None,
                     trust_unverified=args.trust_unverified)
    except OSError as exc:
        raise UserError(f"export: cannot write {exc.filename or args.out}: {exc.strerror or exc}: free space or "
                        f"choose another output file") from None
    print(f"wrote {out}")
    return 0


def cmd_info(args) -> int:
    from paratrain.checkpoint import format_info, info

    summary = info(args.checkpoint)
    print(json.dumps(summary, indent=1) if args.json else format_info(summary, all_tensors=args.all))
    return 0


def cmd_verify(args) -> int:
    """Check every file of one checkpoint, or of every checkpoint of a run, against its recorded size and
    checksum; exit 1 when one is damaged or incomplete."""
    from paratrain.checkpoint.storage import META_FILE, CheckpointError, checkpoints_in, recorded_bytes, verify

    paths = checkpoints_in(args.checkpoint)
    damaged = incomplete = 0
    for path in paths:
        if not (path / META_FILE).is_file():
            incomplete += 1
            print(f"incomplete  {path}: {META_FILE} is missing, its save did not finish (resume = \"auto\" skips it)")
            continue
        start = time.perf_counter()
        try:
            meta, _ = verify(path)
        except CheckpointError as exc:
            damaged += 1
            print(f"DAMAGED     {exc}")
            continue
        files = meta["files"]
        size = sum(recorded_bytes(e) for e in files.values())
        how = "checksums" if meta["format"] >= 2 else ("sizes only (format 1 records no checksums: loading it "
                                                        "needs trusting it)")
        print(f"ok          {path}: {len(files)} files, {size / 2**20:.1f} MiB, {how}, "
              f"{time.perf_counter() - start:.2f} s")
    if len(paths) > 1:
        print(f"{len(paths) - damaged - incomplete} intact, {damaged} damaged, {incomplete} incomplete")
    return 1 if damaged or incomplete else 0


def register(sub: argparse._SubParsersAction) -> None:
    """Register ``export`` and ``checkpoint info`` on the ``paratrain`` command."""
    exp = sub.add_parser("export", help="write a checkpoint's model to one .safetensors file (plain parameter names)")
    exp.add_argument("checkpoint", help="a checkpoint directory (step_*), or a checkpoints/run directory: the newest")
    exp.add_argument("out", help="output .safetensors file (--format hf, peft: a directory)")
    exp.add_argument("--format", choices=["safetensors", "hf", "peft"], default="safetensors",
                     help="safetensors: one file, paratrain's names; hf: a Hugging Face model directory of a "
                          "llama-kind run (config.json, safetensors shards and index, the from_hf tokenizer; LoRA "
                          "adapters merged into the weights); peft: a LoRA run's adapters as peft saves them "
                          "(adapter_config.json, adapter_model.safetensors)")
    exp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast floating tensors")
    exp.add_argument("--trust-unverified", action="store_true",
                     help="read a checkpoint of format 1, which records no checksums (only one you trust)")
    exp.set_defaults(func=cmd_export)
    ckpt = sub.add_parser("checkpoint", help="inspect checkpoints")
    actions = ckpt.add_subparsers(dest="action", required=True)
    inf = actions.add_parser("info", help="step, layout, tensors and sizes of a checkpoint")
    inf.add_argument("checkpoint", help="a checkpoint directory (step_*), or a checkpoints/run directory: the newest")
    inf.add_argument("--all", action="store_true", help="list the optimizer tensors too")
    inf.add_argument("--json", action="store_true", help="print JSON")
    inf.set_defaults(func=cmd_info)
    ver = actions.add_parser("verify", help="check every file of a checkpoint (or of all of a run's) against its "
                                            "recorded size and checksum; exit 1 if one is damaged or incomplete")
    ver.add_argument("checkpoint", help="a checkpoint directory (step_*), or a checkpoints/run directory: all of them")
    ver.set_defaults(func=cmd_verify)
