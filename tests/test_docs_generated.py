"""The reference pages generated from the code (tools/gen_docs.py, ``make docs``): committed as generated, and
naming every config key, command and DeepSpeed key there is."""
import argparse
import re
import sys
from dataclasses import dataclass, fields

import pytest

from conftest import ROOT
from paratrain import config
from paratrain.cli import build_parser
from paratrain.deepspeed_keys import KNOWN

sys.path.insert(0, str(ROOT / "tools"))
import gen_docs  # noqa: E402


def page(name: str) -> str:
    return (ROOT / "docs" / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("name", sorted(gen_docs.PAGES))
def test_committed_page_is_what_the_generator_writes(name):
    committed = (ROOT / name).read_text(encoding="utf-8") if (ROOT / name).is_file() else ""
    assert committed == gen_docs.PAGES[name](), f"{name} is out of date with the code: run `make docs` and commit it"


def test_every_config_key_is_in_its_section_of_configuration_md():
    text = page("configuration.md")
    parts = dict(zip(re.findall(r"^## \[(\w+)\]$", text, re.M), re.split(r"^## \[\w+\]$", text, flags=re.M)[1:]))
    assert set(parts) == set(config.Config.sections())
    missing = []
    for name, cls in config.Config.sections().items():
        keys = [f.name for f in fields(cls)] + [f"moe.{f.name}" for f in fields(config.MoEConfig)
                                                 if cls is config.ModelConfig]
        missing += [f"{name}.{key}" for key in keys if f"\n| `{key}` |" not in parts[name]]
        missing += [f"{name}.{alias} (alias)" for alias in cls.ALIASES if f"`{alias}`" not in parts[name]]
    assert missing == []


def test_parallel_aliases_sit_on_their_keys_rows():
    rows = {line.split(" | ")[0][3:-1]: line for line in page("configuration.md").splitlines()
            if line.startswith("| `")}
    for alias, key in {"dp": "data_parallel", "mp": "model_parallel", "tp": "model_parallel",
                       "pp": "pipeline_stage"}.items():
        assert f"`{alias}`" in rows[key].split(" | ")[3]


def test_every_command_and_option_is_in_cli_md():
    text = page("cli.md")
    missing = []

    def walk(parser: argparse.ArgumentParser, words: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    if f"\n## paratrain {' '.join([*words, name])}\n" not in text:
                        missing.append(" ".join([*words, name]))
                    walk(sub, [*words, name])
            for option in [] if isinstance(action, argparse._HelpAction) else action.option_strings:
                if f"`{option}`" not in text:
                    missing.append(f"{' '.join(words)} {option}")

    walk(build_parser(), [])
    assert missing == []


def test_every_deepspeed_key_is_in_deepspeed_keys_md():
    text = page("deepspeed-keys.md")
    assert sorted(key for key in KNOWN if f"`{key}`" not in text) == []


def test_a_key_without_a_comment_stops_the_generator():
    @dataclass
    class Undocumented:
        said: int = 1  # a key with its meaning
        unsaid: int = 2

    with pytest.raises(SystemExit, match="Undocumented.unsaid has no comment"):
        gen_docs.key_rows(Undocumented, "")


def test_comments_are_read_from_the_line_or_above_it():
    @dataclass
    class Commented:
        inline: int = 1  # on its line
        # above it,
        # on two lines
        above: str = "x"
        # not this one
        both: str = "#"  # its own line's comment wins
        bare: bool = False

    assert gen_docs.field_comments(Commented) == {"inline": "on its line", "above": "above it, on two lines",
                                                  "both": "its own line's comment wins"}
