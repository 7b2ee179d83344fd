"""The ``paratrain`` command: each module in ``COMMAND_MODULES`` adds its subcommands with ``register(sub)``.

A subcommand's function takes the parsed arguments and returns the exit code; one that accepts config
overrides (``--section.key=value``) sets ``overrides=True`` and finds them in ``args.overrides``, any other
leftover argument is refused with its usage. A ``UserError`` is reported here once: exit code 2, no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
from pathlib import Path

from paratrain import host_memory, progress, stopping
from paratrain.config_file import parse_overrides, tomllib
from paratrain.deepspeed_config import load_config
from paratrain.errors import UserError

COMMAND_MODULES = ("paratrain.launch", "paratrain.doctor", "paratrain.data.commands", "paratrain.metrics.report",
                   "paratrain.checkpoint.commands", "paratrain.plan.commands", "paratrain.translation",
                   "paratrain.generation")


def cmd_train(args) -> int:
    from paratrain import loop
    from paratrain.plan import resolve_auto
    from paratrain.trainer import Trainer, start

    started = start(lambda world_size: load_config(args.config, args.overrides, args.deepspeed, world_size,
                                                   _on_rank_0),
                    plan=lambda cfg, world_size: resolve_auto(cfg, world_size, _on_rank_0))
    return loop.exit_code(Trainer(started).run, started.rank)


def _on_rank_0(line: str) -> None:
    """Print ``line`` on rank 0 (``$RANK``, which ``start`` fills from srun, mpirun or a pod)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``train`` to the ``paratrain`` subcommands."""
    train = sub.add_parser("train", help="train in this process group (one process unless launched)")
    train.add_argument("--config", help="TOML config file; any key can be overridden as --section.key=value")
    train.add_argument("--deepspeed", help="DeepSpeed JSON config (ds_config.json), mapped onto the TOML's keys; "
                                           "the run prints what each key became")
    train.set_defaults(func=cmd_train, overrides=True)


def version() -> str:
    """paratrain's version: the installed package's, else (run from a checkout on PYTHONPATH) pyproject.toml's."""
    try:
        return importlib.metadata.version("paratrain")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paratrain", description="Train Transformer models on many devices "
                                                                    "with one parallel config.")
    parser.add_argument("--version", action="version", version=f"paratrain {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for command in sub.choices.values():  # each keeps its own parser for its usage line
        command.set_defaults(command_parser=command)
    return parser


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if argv is None:  # the command line of this process (`paratrain ...` or `python -m paratrain ...`)
        host_memory.restart_with_allocator(words)
    if words[:1] == ["train"]:
        stopping.catch()
    try:
        parser = build_parser()
        args, rest = parser.parse_known_args(argv)
        if getattr(args, "overrides", False):
            args.overrides = parse_overrides(rest)
        elif rest:
            usage = args.command_parser.format_usage().strip().removeprefix("usage: ")
            raise UserError(f"{args.command}: unexpected {' '.join(rest)}; usage: {usage}")
        return args.func(args)
    except UserError as exc:
        print(f"paratrain: {exc}", file=sys.stderr)
        return 2
    except stopping.StopRequested as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"paratrain: stopped on request ({exc}) while starting, before this run's first step: "
                  f"nothing to save", file=sys.stderr, flush=True)
        return progress.stopped(None)


if __name__ == "__main__":
    sys.exit(main())
