"""The ``paratrain`` command."""
from __future__ import annotations

import argparse
import sys

from paratrain.config import Config, ConfigError


def _split_overrides(rest: list[str]) -> list[str]:
    """``--section.key=value`` or ``--section.key value`` -> ``section.key=value``."""
    overrides, i = [], 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ConfigError([f"unexpected argument {arg!r}: overrides look like --section.key=value"])
        if "=" in arg:
            overrides.append(arg[2:])
        elif i + 1 < len(rest):
            overrides.append(f"{arg[2:]}={rest[i + 1]}")
            i += 1
        else:
            raise ConfigError([f"override {arg} has no value: write {arg}=VALUE"])
        i += 1
    return overrides


def cmd_train(args, rest: list[str]) -> int:
    from paratrain.trainer import Trainer, TrainingDiverged

    cfg = Config.load(args.config, _split_overrides(rest))
    try:
        Trainer(cfg).train()
    except TrainingDiverged as exc:
        print(f"paratrain: training stopped: {exc}", file=sys.stderr)
        return 3
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paratrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train in this process group (one process unless launched)")
    train.add_argument("--config", help="TOML config file; any key can be overridden as --section.key=value")
    train.set_defaults(func=cmd_train)
    from paratrain import doctor, launch
    launch.add_subcommands(sub)
    doctor.add_subcommand(sub)
    from paratrain.data import commands as data_commands
    data_commands.add_subcommands(sub)
    from paratrain.metrics import report
    report.add_subcommands(sub)  # plot, summary
    from paratrain.checkpoint import commands as checkpoint_commands
    checkpoint_commands.add_subcommands(sub)
    from paratrain.plan import commands as plan_commands
    plan_commands.add_subcommand(sub)
    from paratrain import translation
    translation.add_subcommand(sub)  # translate
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        return args.func(args, rest)
    except ConfigError as exc:
        print(f"paratrain: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
