"""The TOML face of the settings: config files, ``section.key=value`` overrides and hints for misnamed keys.

``from_dict`` builds a :class:`paratrain.config.Config` from nested tables (a TOML file's, a checkpoint's record, a
script's dicts), converting each value to its key's type and naming, for every unknown key, what to write instead.
The rules a config must meet are :mod:`paratrain.config_rules`.
"""
from __future__ import annotations

import dataclasses
import difflib
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib
import tomli_w

from paratrain.config import Config, ConfigError, ModelConfig, Section, TransformerRecomputeConfig

# MindSpore names that are no key here, and what to do instead
MINDSPORE_HINTS = {
    "parallel_mode": "paratrain has no parallel mode: it follows from data_parallel, model_parallel and "
                     "pipeline_stage; a Python script may call paratrain.set_auto_parallel_context(parallel_mode=...)",
    "device_num": "the device count is the number of launched processes (paratrain launch --nproc-per-node); "
                  "parallel.data_parallel defaults to it divided by model_parallel x pipeline_stage",
    "full_batch": "always on: every rank reads the whole global batch and keeps its own rows",
    "gradients_mean": "always on: the gradients are those of one device on the whole global batch",
    "loss_repeated_mean": "always on: the loss is the mean over the global batch's tokens",
    "batch_size": "did you mean train.global_batch_size?",
    "learning_rate": "did you mean train.lr?",
    "epoch_size": "paratrain counts optimizer steps: did you mean train.steps?",
}


def load(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """The config of TOML file ``path`` (none: the defaults) with ``overrides`` (``section.key=value``). A file naming
    a DeepSpeed config (``deepspeed = "ds.json"``) is read by ``paratrain.deepspeed_config.load_config``."""
    return from_dict(read_toml(path) if path is not None else {}, overrides)


def read_toml(path: str | Path) -> dict[str, Any]:
    """The tables of TOML file ``path``; ConfigError naming the file when it cannot be read as TOML."""
    if Path(path).exists() and not Path(path).is_dir() and not Path(path).is_file():  # /dev/zero, a fifo
        raise ConfigError([f"config file {path} is not a regular file: give a .toml file"])
    try:
        data = tomllib.loads(Path(path).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError([f"config file {path} does not exist"]) from None
    except IsADirectoryError:
        raise ConfigError([f"config file {path} is a directory: give the .toml file in it"]) from None
    except OSError as exc:
        raise ConfigError([f"config file {path} cannot be read ({exc.strerror})"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([f"config file {path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
                           f"offset {exc.start}): give a TOML file"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"config file {path} is not valid TOML: {exc}"]) from None
    return data


def to_toml(cfg: Config) -> str:
    """``cfg`` as the text of a TOML file (``load`` reads it back)."""
    return tomli_w.dumps(cfg.to_dict())


def save(cfg: Config, path: str | Path) -> None:
    """Write ``cfg`` to the TOML file ``path``."""
    Path(path).write_text(to_toml(cfg))


def from_dict(data: dict[str, Any], overrides: list[str] = ()) -> Config:
    """Build from nested dicts plus ``section.key=value`` overrides; raise ConfigError on any bad key."""
    problems: list[str] = []
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for item in overrides:
        key_path, sep, value = item.partition("=")
        section, dot, key = key_path.partition(".")
        if not sep or not dot:
            problems.append(f"override {item!r} is not of the form section.key=value")
            continue
        data.setdefault(section, {})[key] = value
    built = {}
    for name, values in data.items():
        if name not in Config.sections():
            close = difflib.get_close_matches(name, list(Config.sections()), n=1)
            hint = (" (a DeepSpeed config is read by paratrain train/launch/plan, or "
                    "paratrain.deepspeed_config.load_config)" if name == "deepspeed" else
                    f" (did you mean [{close[0]}]?)" if close else "")
            problems.append(f"unknown section [{name}]{hint}")
        elif not isinstance(values, dict):
            problems.append(f"[{name}] must be a table of keys, got {values!r}")
        else:
            built[name] = _section_from_dict(Config.sections()[name], values, problems)
    model = built.get("model")
    if not problems and model is not None and model.from_hf:
        given = {ModelConfig.ALIASES.get(key, key) for key in data["model"]}
        problems += model.take_hf(given - {"from_hf"})
    ConfigError.raise_any(problems)
    return Config(**built)


def _section_from_dict(cls: type[Section], values: dict[str, Any], problems: list[str]) -> Section:
    """Section ``cls`` with ``values`` set (keys or their aliases), each converted to its field's type; a
    problem for every unknown key and every value of the wrong type."""
    section, known = cls(), {f.name: f for f in fields(cls)}
    for key, value in values.items():
        name = cls.ALIASES.get(key, key)
        if name not in known:
            problems.append(f"unknown key {cls.SECTION}.{name}{_hint(cls, name)}")
            continue
        try:
            setattr(section, name, _coerce(value, getattr(section, name), known[name]))
        except (TypeError, ValueError) as exc:
            problems.append(f"{cls.SECTION}.{name}={value!r}: {exc}")
    return section


def _hint(cls: type[Section], key: str) -> str:
    """What to write instead of the unknown ``key`` of section ``cls``: a MindSpore name's counterpart, the key
    (or an alias) in the section it belongs to, else the closest key here."""
    if key in MINDSPORE_HINTS:
        return f" ({MINDSPORE_HINTS[key]})"
    for name, section in Config.sections().items():
        if section is not cls and key in section.key_names():
            return f" (did you mean {name}.{section.ALIASES.get(key, key)}?)"
    close = difflib.get_close_matches(key, cls.key_names(), n=1)
    if close:
        return f" (did you mean {cls.SECTION}.{close[0]}?)"
    return f" (known: {', '.join(sorted(cls.key_names()))})"


def _coerce(value: Any, current: Any, f: dataclasses.Field) -> Any:
    """Convert ``value`` (from TOML or the command line) to the type of the field it sets."""
    kind = next((t for t in (bool, int, float, str) if isinstance(current, t)), None)
    if isinstance(value, str) and (kind in (int, float, bool) or isinstance(current, dict)
                                   or f.name in ("layer_stages", "recompute")):
        value = _parse_literal(value)  # from the command line: --parallel.layer_stages=[0,0,1,1], --model.moe='{...}'
    if f.name == "layer_stages":
        if isinstance(value, list) or callable(value):
            return value
        raise TypeError("expected a list with the stage of each layer, or a function")
    if f.name == "recompute":
        if isinstance(value, (bool, str, dict, list, TransformerRecomputeConfig)) or callable(value):
            return value
        raise TypeError("expected none/full/selective, true/false, a per-layer list, a function "
                        "or a TransformerRecomputeConfig")
    if kind is bool:
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise TypeError(f"expected an integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"expected a number, got {value!r}")
        return float(value)
    if kind is str and not isinstance(value, str):
        if isinstance(value, (bool, list, dict)):  # str() would make a name or path of it
            raise TypeError(f"expected a string, got {value!r}")
        return str(value)
    return value


def _parse_literal(text: str) -> Any:
    """``text`` read as a TOML value (``2``, ``true``, ``[0, 1]``), else the text itself."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: list[str]) -> list[str]:
    """Command-line overrides ``--section.key=value`` or ``--section.key value`` -> ``section.key=value``."""
    overrides, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ConfigError([f"unexpected argument {arg!r}: overrides look like --section.key=value"])
        if "=" in arg:
            overrides.append(arg[2:])
        elif i + 1 < len(args):
            overrides.append(f"{arg[2:]}={args[i + 1]}")
            i += 1
        else:
            raise ConfigError([f"override {arg} has no value: write {arg}=VALUE"])
        i += 1
    return overrides
