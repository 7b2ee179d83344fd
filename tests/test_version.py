"""``paratrain --version``: the package's version, from its metadata or, run from a checkout, from pyproject.toml."""
import importlib.metadata
import subprocess

import pytest

from conftest import PYTHON, ROOT
from paratrain import cli
from paratrain.config_file import tomllib

PYPROJECT_VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]


def test_version_is_printed_and_exits_0():
    out = subprocess.run([PYTHON, "-m", "paratrain", "--version"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == (0, f"paratrain {PYPROJECT_VERSION}\n", "")


def test_version_without_package_metadata_comes_from_pyproject(monkeypatch, capsys):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert (exit_.value.code, capsys.readouterr().out) == (0, f"paratrain {PYPROJECT_VERSION}\n")
