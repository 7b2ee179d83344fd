"""A DeepSpeed JSON config read onto paratrain's keys: ``paratrain train --deepspeed ds_config.json``.

:func:`apply` maps each key of the JSON (``paratrain.deepspeed_keys``) onto the TOML tables of a run, before the
command-line overrides (which win), and returns one line per key saying what it became: mapped, accepted with no
effect (with the reason) or refused (with the reason; an unknown key with the closest known one). Values are as
DeepSpeed defines them: the batch sizes follow its rule
``train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x data_parallel``, a block's
parameter left out takes DeepSpeed's default, and ``"auto"`` (as the HF Trainer fills it) keeps paratrain's value,
or derives a batch size from the others.
"""
from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Callable

from paratrain.config import Config, ConfigError, dotted
from paratrain.config_file import from_dict, read_toml
from paratrain.deepspeed_keys import DEFAULTS, DIRECT, KNOWN, NO_EFFECT, REQUIRED, SCHEDULES, SPECIAL

AUTO = "auto"


def read(path: str | Path) -> dict[str, Any]:
    """The JSON object of DeepSpeed config ``path``; ConfigError naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError([f"DeepSpeed config {path} does not exist"]) from None
    except IsADirectoryError:
        raise ConfigError([f"DeepSpeed config {path} is a directory: give the ds_config.json in it"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"DeepSpeed config {path} cannot be read ({exc}): give a UTF-8 JSON file"]) from None
    except json.JSONDecodeError as exc:
        raise ConfigError([f"DeepSpeed config {path} is not valid JSON: {exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"DeepSpeed config {path} must hold one JSON object, got {type(data).__name__}"])
    return data


class Mapping:
    """What one DeepSpeed config becomes: the paratrain values it sets, a line per key, the refusals."""

    def __init__(self, ds: dict[str, Any], base: Config, overridden: set[str]):
        self.ds, self.base, self.overridden = ds, base, overridden
        self.values: dict[str, Any] = {}  # "section.key" -> value
        self.lines: list[str] = []
        self.problems: list[str] = []
        self.no_effect: dict[str, list[str]] = {}  # reason -> the keys it covers

    def accept(self, key: str, value: Any, why: str) -> None:
        """``key`` changes nothing here, because ``why``: reported once per reason, at the end."""
        self.no_effect.setdefault(why, []).append(f"{key}={value!r}")

    def report(self) -> list[str]:
        return self.lines + [f"accepted, no effect: {', '.join(keys)}: {why}" for why, keys in self.no_effect.items()]

    def current(self, target: str) -> Any:
        section, key = target.split(".")
        return self.values.get(target, getattr(getattr(self.base, section), key))

    def set(self, source: str, value: Any, target: str, note: str = "", given: Any = None) -> None:
        """Set ``target`` to ``value`` from DeepSpeed key ``source`` (whose value was ``given``, default
        ``value``); ``"auto"`` keeps paratrain's value."""
        given = value if given is None else given
        if value == AUTO:
            self.lines.append(f"{source}='auto' -> {target}={self.current(target)!r} (paratrain's value)")
            return
        section, key = target.split(".")
        kind = type(getattr(getattr(Config(), section), key))
        if kind is bool and not isinstance(value, bool) or kind in (int, float) and (
                isinstance(value, bool) or not isinstance(value, (int, float))
                or kind is int and not float(value).is_integer()) or kind is str and not isinstance(value, str):
            self.problems.append(f"{source}={given!r}: expected {'an integer' if kind is int else kind.__name__}")
            return
        self.values[target] = kind(value)
        later = " (the command line sets it again)" if target in self.overridden else ""
        self.lines.append(f"{source}={given!r} -> {target}={kind(value)!r}{note}{later}")

    def refuse(self, key: str, value: Any, why: str) -> None:
        self.problems.append(f"{key}={value!r} {why}")

    def flags(self, *keys: str) -> bool:
        """Whether each of the switches ``keys`` is absent, a JSON boolean or ``"auto"`` (each other value
        refused: ``"yes"`` or ``1`` would be read as false or true silently)."""
        bad = [key for key in keys if key in self.ds and not isinstance(self.ds[key], bool) and self.ds[key] != AUTO]
        for key in bad:
            self.refuse(key, self.ds[key], "must be true or false (a JSON boolean, not a string or a number), "
                                           "or 'auto'")
        return not bad

    def batch(self, dp: int) -> None:
        """DeepSpeed's batch rule with ``dp`` data-parallel ranks (``"auto"``: not given)."""
        given = {k: self.ds.get(k) for k in SPECIAL[:3]}
        for key, value in given.items():
            if value == AUTO:
                given[key] = None
            elif value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                self.refuse(key, value, "must be a positive integer or 'auto'")
                return
        total, micro, steps = given.values()
        derived = {k for k, v in given.items() if v is None}
        if total is None and micro is None:
            if steps is not None:
                self.set("gradient_accumulation_steps", steps, "parallel.micro_batch_num")
            return
        if total is not None and micro is not None and steps is None:
            steps = max(1, total // micro // dp)
        elif total is not None and micro is None:
            steps = steps or 1
            micro = max(1, total // dp // steps)
        elif total is None:
            steps = steps or 1
            total = micro * steps * dp
        if total != micro * steps * dp:
            self.problems.append(f"train_batch_size={total} is not train_micro_batch_size_per_gpu={micro} x "
                                 f"gradient_accumulation_steps={steps} x data_parallel={dp} = {micro * steps * dp}"
                                 f": set train_batch_size to {micro * steps * dp}, or one of the three to 'auto'")
            return
        rule = (f" (= train_micro_batch_size_per_gpu={micro} x gradient_accumulation_steps={steps} x "
                f"data_parallel={dp})")
        for key, value, target, note in (("train_batch_size", total, "train.global_batch_size", rule),
                                         ("gradient_accumulation_steps", steps, "parallel.micro_batch_num", "")):
            self.set(key, value, target, note, given=self.ds.get(key, "not given") if key in derived else None)

    def precision(self) -> None:
        if not self.flags("fp16.enabled", "bf16.enabled", "bfloat16.enabled"):
            return
        fp16, bf16 = self.ds.get("fp16.enabled"), self.ds.get("bf16.enabled", self.ds.get("bfloat16.enabled"))
        if fp16 is True and bf16 is True:
            self.problems.append("fp16.enabled and bf16.enabled are both true: enable one of them")
            return
        if fp16 is not None or bf16 is not None:
            source, given = ("bf16.enabled", bf16) if bf16 is True or fp16 is None else ("fp16.enabled", fp16)
            mode = "fp16" if fp16 is True else "bf16" if bf16 is True else AUTO if AUTO in (fp16, bf16) else "none"
            self.set(source, mode, "train.mixed_precision", given=given)
        block = {k[5:]: v for k, v in self.ds.items() if k.startswith("fp16.") and k != "fp16.enabled"}
        if fp16 is not True and not (fp16 == AUTO and self.current("train.mixed_precision") == "fp16"):
            for key, value in block.items():
                self.accept(f"fp16.{key}", value, "fp16.enabled is not true")
            return
        block = {**DEFAULTS["fp16"], **block}
        scale = block.pop("loss_scale", 0)
        if scale in (0, AUTO) and "fp16.loss_scale" in self.ds:
            self.lines.append(f"fp16.loss_scale={scale!r} -> a dynamic loss scale, as paratrain's")
        elif scale not in (0, AUTO):
            self.refuse("fp16.loss_scale", scale, "is a static scale: paratrain's fp16 scale is dynamic; set "
                                                  "loss_scale to 0 and initial_scale_power to start from a power of 2")
        power = block.pop("initial_scale_power")
        if power == AUTO or isinstance(power, int) and not isinstance(power, bool) and 0 <= power < 128:
            self.set("fp16.initial_scale_power", power if power == AUTO else 2.0 ** power, "train.initial_loss_scale",
                     given=power)
        else:
            self.refuse("fp16.initial_scale_power", power, "must be an integer in [0, 128): the scale starts at 2**it")
        for key, value in block.items():
            if f"fp16.{key}" in DIRECT:
                self.set(f"fp16.{key}", value, DIRECT[f"fp16.{key}"])
            else:
                self.leaf(f"fp16.{key}", value)

    def optimizer(self) -> None:
        kind = self.ds.get("optimizer.type")
        if kind is None and not any(k.startswith("optimizer.") for k in self.ds):
            return
        if not self.flags("optimizer.params.adam_w_mode"):
            return
        given = {k[17:]: v for k, v in self.ds.items() if k.startswith("optimizer.params.")}
        params = {**DEFAULTS["optimizer"], **given}
        if str(kind).lower() not in ("adam", "adamw"):
            return self.refuse("optimizer.type", kind, "is not supported: paratrain trains with AdamW; use AdamW "
                                                       "or Adam")
        decoupled = str(kind).lower() == "adamw" or params.get("adam_w_mode", True)
        if not decoupled and params["weight_decay"] not in (0, AUTO):
            return self.refuse("optimizer.params.adam_w_mode", False, "with weight_decay is Adam's L2 penalty: "
                                                                      "paratrain's AdamW decays decoupled; use AdamW")
        self.lines.append(f"optimizer.type={kind!r} -> torch.optim.AdamW (fused; weight decay on matrices only, "
                          f"not on biases and LayerNorms)")
        for key in ("lr", "eps", "weight_decay"):
            self.set(f"optimizer.params.{key}", params[key], DIRECT[f"optimizer.params.{key}"])
        betas = params["betas"]
        if betas == AUTO:
            return self.set("optimizer.params.betas", AUTO, "train.beta1")
        if not isinstance(betas, list) or len(betas) != 2:
            return self.refuse("optimizer.params.betas", betas, "must be a list of two numbers, e.g. [0.9, 0.999]")
        self.set("optimizer.params.betas[0]", betas[0], "train.beta1")
        self.set("optimizer.params.betas[1]", betas[1], "train.beta2")

    def scheduler(self) -> None:
        kind = self.ds.get("scheduler.type")
        if kind is None and not any(k.startswith("scheduler.") for k in self.ds):
            return
        if kind not in SCHEDULES:
            return self.refuse("scheduler.type", kind, f"is not supported: use one of {', '.join(SCHEDULES)}")
        self.set("scheduler.type", SCHEDULES[kind], "train.lr_schedule", given=kind)
        params = {**DEFAULTS[kind], **{k[17:]: v for k, v in self.ds.items() if k.startswith("scheduler.params.")}}
        if kind != "WarmupLR" and "total_num_steps" not in params:
            return self.refuse("scheduler.params.total_num_steps", None,
                               f"is required by {kind}: give the step where the decay ends, or 'auto' (train.steps)")
        lr = self.current("train.lr")
        for key, value in params.items():
            source = f"scheduler.params.{key}"
            if source in REQUIRED:
                self.leaf(source, value)
            elif key not in DEFAULTS[kind] and key != "total_num_steps":
                if source in KNOWN:
                    self.refuse(source, value, f"is not a parameter of {kind}")
                else:
                    self.unknown(source)
            elif key.endswith("_ratio"):  # WarmupCosineLR: a fraction of the optimizer's lr
                target = "train.warmup_min_lr" if key == "warmup_min_ratio" else "train.min_lr"
                number = isinstance(value, (int, float)) and not isinstance(value, bool)
                self.set(source, value * lr if number else value, target, f" (x train.lr={lr!r})", given=value)
            else:
                self.set(source, value, DIRECT[source])

    def cpu_offload(self) -> None:
        """DeepSpeed's older ``zero_optimization.cpu_offload``: true is ``offload_optimizer.device = "cpu"``."""
        key = "zero_optimization.cpu_offload"
        if key in self.ds and self.flags(key):
            value = self.ds[key]
            self.set(key, "cpu" if value is True else value if value == AUTO else "none",
                     "parallel.offload_optimizer", given=value)

    def leaf(self, key: str, value: Any) -> None:
        """A key mapped one to one, accepted with no effect, required to have one value, or unknown."""
        block = next((b for b in NO_EFFECT if b.endswith(".") and key.startswith(b)), key)
        if key in DIRECT:
            self.set(key, value, DIRECT[key])
        elif key in REQUIRED:
            wanted, why = REQUIRED[key]
            if value != wanted:
                self.refuse(key, value, f"is not supported: {why}; leave it out or set {json.dumps(wanted)}")
            else:
                self.accept(key, value, why)
        elif block in NO_EFFECT:
            self.accept(key, value, NO_EFFECT[block])
        elif inner := sorted(k[len(key) + 1:] for k in KNOWN if k.startswith(f"{key}.")):  # "fp16": true
            example = next((k for k in ("enabled", "stage", "type") if k in inner), inner[0])
            self.refuse(key, value, f"must be a block of keys, e.g. {{{json.dumps(example)}: ...}}")
        else:
            self.unknown(key)

    def unknown(self, key: str) -> None:
        close = difflib.get_close_matches(key, sorted(KNOWN), n=1, cutoff=0.6)
        self.problems.append(f"{key} is not a DeepSpeed key paratrain knows"
                             + (f": did you mean {close[0]}?" if close else ": remove it"))


def load_config(path: str | Path | None = None, overrides: list[str] = (), deepspeed: str | None = None,
                world_size: int | None = None, report: Callable[[str], None] | None = None) -> Config:
    """``config_file.load(path, overrides)`` with a DeepSpeed JSON config mapped onto the file's keys first (the
    overrides win over both): ``deepspeed`` (``--deepspeed``), else the file's top-level ``deepspeed = "path"``,
    relative to the file. ``world_size`` derives ``data_parallel`` for DeepSpeed's batch rule; ``report`` gets
    one line per DeepSpeed key."""
    data = read_toml(path) if path is not None else {}
    named = data.pop("deepspeed", None)
    if deepspeed is None and named is not None:
        if not isinstance(named, str):
            raise ConfigError([f"deepspeed={named!r} in {path} must be the path of a DeepSpeed JSON config"])
        deepspeed = str(Path(path).parent / named)
    if deepspeed is not None:
        for line in apply(deepspeed, data, list(overrides), world_size):
            if report is not None:
                report(line)
    return from_dict(data, overrides)


def apply(path: str | Path, data: dict[str, Any], overrides: list[str], world_size: int | None) -> list[str]:
    """Map DeepSpeed config ``path`` onto the TOML tables ``data`` (in place, before ``overrides``); return
    the report, one line per key. ConfigError listing every refused key, before anything is built."""
    # {"a": {"b": 1}} -> {"a.b": 1}; a null is left out, as DeepSpeed reads it, and so is an empty block
    ds = {key: value for key, value in dotted(read(path)) if value is not None}
    base = from_dict({k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}, overrides)
    overridden = set()
    for item in overrides:
        section, _, key = item.partition("=")[0].partition(".")
        if section in Config.sections():
            overridden.add(f"{section}.{Config.sections()[section].ALIASES.get(key, key)}")
    mapping = Mapping(ds, base, overridden)
    par = base.parallel
    mapping.batch(par.derive(world_size).data_parallel if world_size else par.data_parallel)
    mapping.precision()
    mapping.optimizer()
    mapping.scheduler()
    mapping.cpu_offload()
    for key, value in ds.items():  # the keys the block methods above have not taken
        if key not in SPECIAL and not key.startswith(("fp16.", "scheduler.params.")) and not (
                key.startswith("optimizer.params.") and key in DIRECT):
            mapping.leaf(key, value)
    if mapping.problems:
        raise ConfigError([f"deepspeed {path}: {p}" for p in mapping.problems])
    for target, value in mapping.values.items():
        section, key = target.split(".")
        table = data.setdefault(section, {})
        if isinstance(table, dict):  # else from_dict says what is wrong with the TOML
            names = (key, "optimizer_shard") if target == "parallel.zero_stage" else (key,)
            for alias in [a for a, name in Config.sections()[section].ALIASES.items() if name in names]:
                table.pop(alias, None)
            table[key] = value
            if target == "parallel.zero_stage":  # one ZeRO setting: DeepSpeed's stage
                table["optimizer_shard"] = False
    return [f"deepspeed {path}:"] + [f"  {line}" for line in mapping.report()]
