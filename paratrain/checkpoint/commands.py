"""``paratrain export CKPT OUT.safetensors`` and ``paratrain checkpoint info CKPT``."""
from __future__ import annotations

import argparse
import json


def cmd_export(args) -> int:
    from paratrain.checkpoint import export
    from paratrain.device import DTYPES

    print(f"wrote {export(args.checkpoint, args.out, dtype=DTYPES[args.dtype] if args.dtype else None)}")
    return 0


def cmd_info(args) -> int:
    from paratrain.checkpoint import format_info, info

    summary = info(args.checkpoint)
    print(json.dumps(summary, indent=1) if args.json else format_info(summary, all_tensors=args.all))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Register ``export`` and ``checkpoint info`` on the ``paratrain`` command."""
    exp = sub.add_parser("export", help="write a checkpoint's model to one .safetensors file (plain parameter names)")
    exp.add_argument("checkpoint", help="a checkpoint directory (step_*), or a checkpoints/run directory: the newest")
    exp.add_argument("out", help="output .safetensors file")
    exp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast floating tensors")
    exp.set_defaults(func=cmd_export)
    ckpt = sub.add_parser("checkpoint", help="inspect checkpoints")
    actions = ckpt.add_subparsers(dest="action", required=True)
    inf = actions.add_parser("info", help="step, layout, tensors and sizes of a checkpoint")
    inf.add_argument("checkpoint", help="a checkpoint directory (step_*), or a checkpoints/run directory: the newest")
    inf.add_argument("--all", action="store_true", help="list the optimizer tensors too")
    inf.add_argument("--json", action="store_true", help="print JSON")
    inf.set_defaults(func=cmd_info)
