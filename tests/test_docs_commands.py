"""Every shell command in README.md and docs/*.md runs as its page shows it.

Each page's fenced ``bash``, ``sh`` and ``console`` blocks (in a ``console`` block, the lines starting with
``$ ``) are run in order, as one bash script, in a scratch directory of the page's own that holds links
to ``examples/``, ``tools/``, ``bench/`` and ``tests/``, with this environment's ``paratrain`` and
``python`` first on PATH, ``PARATRAIN_DEVICE=cpu`` and ``PARATRAIN_HOST_ALLOCATOR=system`` (a command run
by hand would restart itself once with tcmalloc: time this test does not need to spend). A fenced block
of any language whose first line is a comment naming a file (``# my.toml``, ``# quickstart.py``) is
written to that file first. A comment on the line before a command tells this test about it:

- ``# needs: gpu`` / ``cluster`` / ``network`` / ``minutes``: it cannot run here and is skipped, counted by
  reason (``minutes``: longer than this test's budget; ``make demo`` is replaced by a 2-step run of the
  demo's config on one process, so the commands after it have a run to read);
- ``# expect: exit N``: it must exit with code N (a refusal shown on purpose).

Any other exit code fails the page, naming the command.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import ROOT

GENERATED = {"configuration.md", "cli.md", "deepspeed-keys.md"}  # written by tools/gen_docs.py
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in GENERATED)]
SHELL_LANGUAGES = {"bash", "sh", "console"}
NEEDS = {"gpu", "cluster", "network", "minutes"}
LINKED = ("examples", "tools", "bench", "tests")
# a skipped command whose output the page's next commands read: what runs in its place
STAND_INS = {
    "make demo": "paratrain train --config examples/demo.toml --parallel.data_parallel=1 "
                 "--parallel.model_parallel=1 --parallel.pipeline_stage=1 --train.steps=2 "
                 "--checkpoint.save_steps=2 --run.dir=runs/demo-docs && ln -sfn demo-docs runs/demo-latest",
}
FILE_NAME = re.compile(r"^(?:#|//)\s*([\w.-]+\.(?:toml|py|json))\s*$")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
NEEDS_MARK = re.compile(r"^#\s*needs:\s*(\S+)\s*$")
EXPECT_MARK = re.compile(r"^#\s*expect:\s*exit\s+(\d+)\s*$")


@dataclass
class Command:
    text: str
    line: int  # 1-based line of the page where it starts
    needs: str = ""
    exit_code: int = 0


@dataclass
class Block:
    language: str
    line: int  # 1-based line of the opening fence
    lines: list[str] = field(default_factory=list)


def fenced_blocks(page: Path) -> list[Block]:
    """The page's fenced blocks in order, their lines without the fence's indentation."""
    blocks, current, indent = [], None, ""
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if current is None and fence:
            current, indent = Block(fence.group(2).lower(), number), fence.group(1)
        elif current is not None and fence and fence.group(2) == "":
            blocks.append(current)
            current = None
        elif current is not None:
            current.lines.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
    assert current is None, f"{page.name}: the fence opened at line {current.line} is never closed"
    return blocks


def commands(block: Block) -> list[Command]:
    """The commands of a shell block, continuation lines joined, with the marks of the comment before each."""
    found, needs, exit_code = [], "", 0
    lines = iter(enumerate(block.lines, block.line + 1))
    for number, line in lines:
        stripped = line.strip()
        if block.language == "console":
            if not stripped.startswith("$ "):
                continue
            stripped = stripped[2:]
        if mark := NEEDS_MARK.match(stripped):
            needs = mark.group(1)
            assert needs in NEEDS, f"line {number}: unknown mark 'needs: {needs}' (known: {sorted(NEEDS)})"
            continue
        if mark := EXPECT_MARK.match(stripped):
            exit_code = int(mark.group(1))
            continue
        if not stripped or stripped.startswith("#"):
            continue
        text = stripped
        while text.endswith("\\"):
            text = text[:-1] + " " + next(lines)[1].strip()
        found.append(Command(text, number, needs, exit_code))
        needs, exit_code = "", 0
    return found


def page_script(page: Path, folder: Path) -> tuple[str, dict[str, int], int]:
    """The bash script that runs the page's commands in ``folder`` (its files written there), the skipped
    commands counted by reason, and the number of commands it runs."""
    lines, skipped, runs = [], {}, 0
    for block in fenced_blocks(page):
        if block.lines and (name := FILE_NAME.match(block.lines[0].strip())):
            (folder / name.group(1)).write_text("\n".join(block.lines) + "\n")
        if block.language not in SHELL_LANGUAGES:
            continue
        for command in commands(block):
            where = f"{page.name}:{command.line}: {command.text}"
            text = command.text
            if command.needs:
                skipped[command.needs] = skipped.get(command.needs, 0) + 1
                if text not in STAND_INS:
                    continue
                text = STAND_INS[text]
            runs += 1
            lines += [f"echo {shlex.quote('+ ' + where)} >&2", text,
                      f"rc=$?; if [ $rc -ne {command.exit_code} ]; then echo {shlex.quote('FAILED: ' + where)}"
                      f"\" (exit $rc, expected {command.exit_code})\" >&2; exit 1; fi"]
    return "\n".join(lines) + "\n", skipped, runs


def scratch(folder: Path) -> dict[str, str]:
    """Links to the repository's folders the commands read, a ``.venv/bin/activate`` that puts this
    environment's commands first, and the environment to run in."""
    for name in LINKED:
        (folder / name).symlink_to(ROOT / name)
    bin_dir = Path(sys.executable).parent
    activate = folder / ".venv" / "bin" / "activate"
    activate.parent.mkdir(parents=True)
    activate.write_text(f'export PATH={shlex.quote(str(bin_dir))}:"$PATH"\n')
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PARATRAIN_DEVICE="cpu",
               PARATRAIN_HOME=str(folder / "runs"), PARATRAIN_HOST_ALLOCATOR="system", MPLBACKEND="Agg")
    return env


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_commands_run(page, tmp_path):
    folder = tmp_path / page.stem
    folder.mkdir()
    env = scratch(folder)
    script, skipped, runs = page_script(page, folder)
    (folder / "commands.sh").write_text(script)
    print(f"{page.name}: {runs} command(s) run, skipped: {skipped or 'none'}")
    if runs == 0:
        pytest.skip(f"{page.name}: every command needs what this machine lacks: {skipped}")
    result = subprocess.run(["bash", "commands.sh"], cwd=folder, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1400)
    assert result.returncode == 0, result.stdout[-6000:]


def test_marks_and_counts():
    """Every mark is one this test knows, most commands run here, and the skips are counted by reason."""
    total, skipped = 0, {}
    for page in PAGES:
        for block in fenced_blocks(page):
            if block.language in SHELL_LANGUAGES:
                for command in commands(block):
                    total += 1
                    if command.needs:
                        skipped[command.needs] = skipped.get(command.needs, 0) + 1
    print(f"{total} commands in {len(PAGES)} pages; skipped here: {skipped}")
    assert total - sum(skipped.values()) > sum(skipped.values()), (total, skipped)


def test_every_page_starts_with_a_command():
    """Each page's first fenced block is a shell block within its first 30 lines (the README's comes after
    what paratrain is and how to install it, also within 30 lines)."""
    for page in PAGES:
        first = fenced_blocks(page)[0]
        assert first.language in SHELL_LANGUAGES and first.line <= 30, (page.name, first.language, first.line)


def test_user_pages_speak_to_users():
    """README.md under 200 lines; no test file or issue named on a user's page (architecture.md is for
    contributors)."""
    assert len((ROOT / "README.md").read_text().splitlines()) < 200
    for page in PAGES:
        if page.name == "architecture.md":
            continue
        text = page.read_text()
        assert not re.search(r"tests/test_\w+|\bissue \d+", text, re.IGNORECASE), page.name


def test_parser_reads_marks_and_continuations(tmp_path):
    """The extraction itself: a continued command is one command, marks apply to the next command only,
    console output lines are not commands, and a file block is written."""
    page = tmp_path / "page.md"
    page.write_text("text\n\n```toml\n# a.toml\nx = 1\n```\n\n```bash\n# needs: gpu\nfoo --a \\\n    --b\n"
                    "bar\n# expect: exit 2\nbaz\n```\n\n```console\n$ qux\noutput line\n```\n")
    blocks = fenced_blocks(page)
    found = [c for b in blocks if b.language in SHELL_LANGUAGES for c in commands(b)]
    assert [(c.text, c.needs, c.exit_code) for c in found] == [
        ("foo --a  --b", "gpu", 0), ("bar", "", 0), ("baz", "", 2), ("qux", "", 0)]
    script, skipped, runs = page_script(page, tmp_path)
    assert (tmp_path / "a.toml").read_text() == "# a.toml\nx = 1\n"
    assert skipped == {"gpu": 1} and runs == 3 and "foo" not in script and "-ne 2 ]" in script
