"""Write the reference pages that are generated from the code, never edited by hand (``make docs``):

- ``docs/configuration.md`` from the config dataclasses of ``paratrain/config.py`` (each key's meaning is the
  comment on or above its field),
- ``docs/cli.md`` from the ``paratrain`` command's argparse parsers,
- ``docs/deepspeed-keys.md`` from ``paratrain/deepspeed_keys.toml``.

``python tools/gen_docs.py`` writes them; ``--check`` writes nothing and exits 1 naming each page that differs.
The output depends on nothing but the code: no dates, no paths of this machine, no terminal width.
"""
from __future__ import annotations

import argparse
import collections.abc
import inspect
import io
import os
import sys
import textwrap
import tokenize
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paratrain import config  # noqa: E402  (the checkout's paratrain, installed or not)
from paratrain.deepspeed_keys import _TABLES as DEEPSPEED_TABLES  # noqa: E402

COMMAND = "make docs"
EXAMPLE = ("# one process: the demo's 2 x 2 x 2 layout set to 1 x 1 x 1 on the command line\n"
           "paratrain train --config examples/demo.toml --train.steps=2 --parallel.dp=1 --parallel.mp=1 --parallel.pp=1")
USAGE_WIDTH = "100"  # argparse wraps usage lines at $COLUMNS


def header(title: str, source: str, example: str) -> list[str]:
    return [f"<!-- Generated from {source} by `{COMMAND}` (tools/gen_docs.py): do not edit by hand. -->",
            f"# {title}", "", "```sh", example, "```", ""]


def markdown(text: str) -> str:
    """Docstring or help ``text`` as Markdown: code marked with single backticks, ``<`` outside code escaped (or
    ``<name>`` would read as an HTML tag)."""
    parts = str(text).replace("``", "`").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def cell(text: str) -> str:
    """``text`` as one Markdown table cell."""
    return markdown(" ".join(str(text).split())).replace("|", "\\|")


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(cell(c) for c in row) + " |" for row in rows), ""]


# configuration.md

def field_comments(cls: type) -> dict[str, str]:
    """Each field of dataclass ``cls`` -> its comment: the one at the end of its line, else the comment lines
    right above it."""
    lines = textwrap.dedent(inspect.getsource(cls)).splitlines(keepends=True)
    comments = {}  # line number in the class source -> comment text
    for token in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    names = {f.name for f in fields(cls)}
    out = {}
    for number, line in enumerate(lines, 1):
        name = line.strip().split(":")[0]
        if name not in names or line[:len(line) - len(line.lstrip())] != " " * 4 or name in out:
            continue
        if number in comments and not line.lstrip().startswith("#"):
            out[name] = comments[number]
            continue
        above = []
        while number - 1 - len(above) in comments and lines[number - 2 - len(above)].lstrip().startswith("#"):
            above.insert(0, comments[number - 1 - len(above)])
        if above:
            out[name] = " ".join(above)
    return out


def type_name(hint) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in typing.get_args(hint))
    if origin is collections.abc.Callable:
        return "function"
    if hint is type(None):
        return "None"
    return getattr(hint, "__name__", str(hint))


def default_text(f) -> str:
    value = f.default_factory() if f.default is MISSING else f.default
    if value is config.DERIVED:
        return "derived"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def key_rows(cls: type, prefix: str) -> list[list[str]]:
    """One row per field of ``cls``: key, type, default, aliases, meaning."""
    hints = typing.get_type_hints(cls, vars(config))
    comments = field_comments(cls)
    aliases = getattr(cls, "ALIASES", {})
    rows = []
    for f in fields(cls):
        if f.name not in comments:
            raise SystemExit(f"tools/gen_docs.py: {cls.__name__}.{f.name} has no comment in paratrain/config.py: "
                             f"add one (on its line or above it) saying what it means")
        names = ", ".join(f"`{alias}`" for alias, name in aliases.items() if name == f.name)
        rows.append([f"`{prefix}{f.name}`", f"`{type_name(hints[f.name])}`", f"`{default_text(f)}`", names,
                     comments[f.name]])
    return rows


def configuration_page() -> str:
    out = header("Configuration", "paratrain/config.py", EXAMPLE)
    out += ["A run's settings are a TOML file of the sections below; every key can also be set on the command line "
            "as `--section.key=value` (which wins over the file), and an alias works wherever its key does. "
            "`paratrain train` writes the resolved settings of a run to `config.toml` in its run directory.", ""]
    out += ["| section | what it sets |", "|---|---|"]
    sections = config.Config.sections()
    out += [f"| [`[{name}]`](#{name}) | {cell(inspect.getdoc(cls).splitlines()[0])} |" for name, cls in sections.items()]
    out.append("")
    head = ["key", "type", "default", "aliases", "meaning"]
    for name, cls in sections.items():
        out += [f"## [{name}]", "", markdown(inspect.getdoc(cls)), ""]
        out += table(head, key_rows(cls, ""))
        if cls is config.ModelConfig:
            out += ["### model.moe", "", markdown(inspect.getdoc(config.MoEConfig)), "",
                    "Written as a table: `moe = {expert_num = 8, num_experts_chosen = 2}`.", ""]
            out += table(head, key_rows(config.MoEConfig, "moe."))
    return "\n".join(out)


# cli.md

def arguments(parser: argparse.ArgumentParser) -> list[list[str]]:
    """One row per argument of ``parser`` except --help and subcommands: argument, value, default, help."""
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.metavar or action.dest}`"
        value = ""
        if action.option_strings and action.nargs != 0:
            value = "{" + ",".join(map(str, action.choices)) + "}" if action.choices else (
                action.metavar or action.dest.upper())
        elif not action.option_strings and action.choices:
            value = "{" + ",".join(map(str, action.choices)) + "}"
        default = action.default
        shown = "" if default is None or default is False or default in ("", argparse.SUPPRESS) \
            or action.nargs == argparse.REMAINDER else f"`{default}`"
        rows.append([name, value, shown, formatter._expand_help(action) if action.help else ""])
    return rows


def commands(parser: argparse.ArgumentParser, words: list[str]) -> list[tuple[list[str], str, argparse.ArgumentParser]]:
    """Every (sub)command under ``parser``, depth first: (its words, its one-line help, its parser)."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                if sub.prog.split()[-1] != name:  # an alias of a command listed already
                    continue
                out.append(([*words, name], helps.get(name) or "", sub))
                out += commands(sub, [*words, name])
    return out


def cli_page() -> str:
    from paratrain.cli import build_parser

    os.environ["COLUMNS"] = USAGE_WIDTH
    parser = build_parser()
    parser.prog = "paratrain"
    every = commands(parser, [])
    out = header("Command line", "the argparse parsers of paratrain/cli.py and the modules it lists",
                 "paratrain --help\n" + EXAMPLE)
    out += ["Every command prints its own help with `--help`, e.g. `paratrain launch --help`. "
            "A refused command prints one line starting with `paratrain:` and exits with code 2.", ""]
    out += table(["option of `paratrain`", "value", "default", "meaning"], arguments(parser))
    out += table(["command", "what it does"],
                 [[f"[`paratrain {' '.join(w)}`](#{'-'.join(['paratrain', *w])})", help_] for w, help_, _ in every])
    for words, help_, sub in every:
        out += [f"## paratrain {' '.join(words)}", "", markdown(help_) + ("." if help_ and not help_.endswith(".")
                                                                            else ""), ""]
        if sub.description:
            out += [markdown(sub.description), ""]
        out += ["```text", sub.format_usage().strip(), "```", ""]
        rows = arguments(sub)
        if rows:
            out += table(["argument", "value", "default", "meaning"], rows)
        if words == ["train"]:
            out += ["Any config key is also an option of `train`: `--section.key=value` "
                    "(see [configuration.md](configuration.md)).", ""]
    return "\n".join(out)


# deepspeed-keys.md

def deepspeed_page() -> str:
    tables = DEEPSPEED_TABLES
    out = header("DeepSpeed config keys", "paratrain/deepspeed_keys.toml",
                 "paratrain train --config examples/deepspeed/gpt.toml --deepspeed examples/deepspeed/ds_config.json "
                 "--train.steps=2")
    out += ["`paratrain train --deepspeed ds_config.json` reads a DeepSpeed JSON config onto paratrain's keys and "
            "prints one line per key saying what it became. Command-line overrides win over the JSON. A key in none "
            "of the tables below is refused, with the closest known key.", ""]
    out += ["## Mapped by rule", "", "These keys take code to translate (batch sizes, precision, optimizer, "
            "scheduler).", ""]
    out += table(["DeepSpeed key", "becomes"], [[f"`{k}`", v] for k, v in tables["special"].items()])
    out += ["## Copied onto a paratrain key", "", "The value is copied as it is, checked against the type of the "
            "paratrain key (see [configuration.md](configuration.md)).", ""]
    out += table(["DeepSpeed key", "paratrain key"], [[f"`{k}`", f"`{v}`"] for k, v in tables["direct"].items()])
    out += ["## Scheduler types", ""]
    out += table(["`scheduler.type`", "`train.lr_schedule`"], [[f"`{k}`", f'`"{v}"`'] for k, v in
                                                                tables["schedules"].items()])
    out += ["## Honoured with one value only", "", "Any other value is refused, with the reason.", ""]
    out += table(["DeepSpeed key", "the value paratrain honours", "why"],
                 [[f"`{k}`", f"`{value!r}`".replace("True", "true").replace("False", "false"), why]
                  for k, (value, why) in tables["required"].items()])
    out += ["## Accepted, no effect", "", "These keys are accepted and change nothing; a name ending in `.` stands "
            "for every key of that block.", ""]
    out += table(["DeepSpeed keys", "why they change nothing"],
                 [[", ".join(f"`{group.get('prefix', '')}{name}`" for name in group["names"].split()), group["why"]]
                  for group in tables["no_effect"]])
    out += ["## DeepSpeed's defaults", "", "A block that is given but leaves a parameter out takes DeepSpeed's value "
            "for it:", ""]
    out += table(["block", "defaults"], [[f"`{k}`", ", ".join(f"`{p} = {v!r}`" for p, v in params.items())]
                                         for k, params in tables["defaults"].items()])
    return "\n".join(out)


PAGES = {"docs/configuration.md": configuration_page, "docs/cli.md": cli_page,
         "docs/deepspeed-keys.md": deepspeed_page}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is out of date")
    args = parser.parse_args()
    stale = []
    for name, page in PAGES.items():
        path, text = ROOT / name, page()
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(name)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {name}")
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}: run `{COMMAND}`", file=sys.stderr)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
