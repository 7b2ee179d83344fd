"""What each DeepSpeed config key is to paratrain (``paratrain.deepspeed_config`` reads a config with them):
the tables of ``deepspeed_keys.toml``, which says what each one holds."""
from __future__ import annotations

from importlib.resources import files

from paratrain.config_file import tomllib

_TABLES = tomllib.loads(files("paratrain").joinpath("deepspeed_keys.toml").read_text(encoding="utf-8"))
DIRECT: dict[str, str] = _TABLES["direct"]
SPECIAL = tuple(_TABLES["special"])
NO_EFFECT = {f"{group.get('prefix', '')}{name}": group["why"] for group in _TABLES["no_effect"]
             for name in group["names"].split()}
REQUIRED = {key: tuple(rule) for key, rule in _TABLES["required"].items()}
DEFAULTS: dict[str, dict] = _TABLES["defaults"]
SCHEDULES: dict[str, str] = _TABLES["schedules"]
KNOWN = set(DIRECT) | set(SPECIAL) | set(NO_EFFECT) | set(REQUIRED)
