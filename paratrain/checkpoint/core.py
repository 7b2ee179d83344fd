"""Saving and resuming a training run: sliced per rank through DCP, atomic, reshardable.

Model and optimizer state come from ``torch.distributed.checkpoint.state_dict`` (optimizer state flattened to
``state.<param fqn>.<name>``), so keys are plain parameter names and tensors are DTensors sliced over whatever mesh
the run uses; DCP reshards them on load. Every rank saves the keys it holds (a pipeline chunk: some layers, under
their original names) and loads only its own, whatever layout wrote them. What is not a tensor goes to
``paratrain.json``, RNG states to one safetensors file per rank (``storage.py``: the on-disk format).
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
import tomli_w

from paratrain import progress
from paratrain.checkpoint.full import MODEL_PREFIX, OPTIM_PREFIX, export
from paratrain.checkpoint.storage import (DCP_METADATA, FORMAT_VERSION, INTEGRATED_FILE, LATEST, LAYOUT_KEYS,
                                          META_FILE, TMP_PREFIX, CheckpointError, ChecksumCheck, DamagedCheckpoint,
                                          check_checksums, checkpoint_name, checksum_owner, complete_checkpoints,
                                          dcp_load, dcp_save, file_checksum, file_entry, fsync_dir,
                                          holds_tensor_data, raise_if_damaged, rank_file_name, read_meta,
                                          require_checksums, resolve, step_dirs, tensor_entries, verify, write_atomic,
                                          write_file, write_meta)
from paratrain.config import MODEL_KINDS, USER_MODEL_KIND, Config, ModelConfig
from paratrain.errors import UserError
from paratrain.lora import is_adapter
from paratrain.mesh import Layout

log = logging.getLogger("paratrain.checkpoint")

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj) -> list:
    """``obj`` of every rank, in rank order (our own values between live ranks, never read from disk)."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def restart_count() -> int:
    """Which restart of a launched job this is: torchrun's ``TORCHELASTIC_RESTART_COUNT`` (0 for the first attempt),
    the highest over the ranks, since the agent of a node restarted by another node's failure keeps its own count."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) == 0:
        return 0  # not started by torchrun, or by one that never restarts: alike on every rank
    return max(_gather(int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)))


def _write_failed(final: Path, exc: OSError) -> str:
    where = f" ({exc.filename})" if exc.filename else ""
    fix = {errno.EFBIG: "raise the file size limit (ulimit -f)", errno.ENOSPC: "free space",
           errno.EDQUOT: "free space within your disk quota"}.get(exc.errno)
    return (f"cannot write checkpoint {final}: {exc.strerror or exc}{where}: "
            + (f"{fix}, or set checkpoint.dir to another file system" if fix else "set checkpoint.dir to a "
               "directory you can write"))


def _together(fn, final: Path):
    """``fn()`` on every rank; when it fails on any rank, every rank raises a CheckpointError with the first failed
    rank's message (an OSError: :func:`_write_failed`), none waits for the others. Returns ``fn``'s result."""
    problem, result = None, None
    try:
        result = fn()
    except OSError as exc:
        problem = _write_failed(final, exc)
    except UserError as exc:
        problem = str(exc)
    except BaseException as exc:  # tell the other ranks instead of leaving them waiting
        problem = f"saving checkpoint {final} failed on rank {_rank_world()[0]}: {type(exc).__name__}: {exc}"
    failed = next((p for p in _gather(problem) if p is not None), None)
    if failed is not None:
        raise CheckpointError(failed)
    return result


def _agree_intact(problem: str | None) -> None:
    """Raise DamagedCheckpoint on every rank when any rank found a damaged file (``problem`` names it)."""
    raise_if_damaged(next((p for p in _gather(problem) if p is not None), None))


def layout_dict(layout: Layout) -> dict:
    """The layout a run uses, with every rank's (pp, dp, cp, tp) coordinates."""
    cfg = layout.config
    coords = _gather([layout.pp_rank, layout.dp_rank, layout.cp_rank, layout.tp_rank])
    return {"world_size": len(coords), "data_parallel": cfg.data_parallel, "model_parallel": cfg.model_parallel,
            "pipeline_stage": cfg.pipeline_stage, "context_parallel": cfg.context_parallel,
            "zero_stage": cfg.effective_zero_stage, "sequence_parallel": cfg.sequence_parallel,
            "vocab_emb_dp": cfg.vocab_emb_dp,
            "ranks": [{"pp": c[0], "dp": c[1], "cp": c[2], "tp": c[3]} for c in coords]}


def _json_value(value):
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    return value


def _like(value, template):
    """A JSON value back in the type the live optimizer holds (tuples for betas...)."""
    if isinstance(template, tuple) and isinstance(value, list):
        return tuple(_like(v, t) for v, t in zip(value, template))
    if isinstance(template, torch.Tensor):
        return torch.tensor(value, dtype=template.dtype, device=template.device)
    return value


# model keys that change no weight's shape or meaning (regularisation only): they may change on resume
MODEL_TRAINING_KEYS = ("hidden_dropout", "attention_dropout")
# the model keys an image classifier (a kind without Transformer layers) reads
IMAGE_MODEL_KEYS = ("kind", "encoder_layers", "hidden_size", "dtype")
LENGTH_KEYS = ("seq_length", "src_seq_length", "tgt_seq_length")
LORA_SHAPE_KEYS = ("rank", "target_modules")
CHANGEABLE_SECTIONS = ("train", "data", "parallel")  # listed when changed; run, checkpoint, metrics are not


def _model_keys(kind: str) -> list[str]:
    """The model keys that shape the weights of a model of ``kind`` or give them their meaning (only ``kind`` for
    a user's net: its tensors' names and shapes say the rest)."""
    spec = MODEL_KINDS.get(kind)
    if spec is None:
        return ["kind"]
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    if not spec.stacks:
        return [n for n in names if n in IMAGE_MODEL_KEYS]
    unused = [k for k in LENGTH_KEYS if k not in spec.length_keys]
    if not spec.encoder_decoder:
        unused.append("encoder_layers")
    return [n for n in names if n not in MODEL_TRAINING_KEYS and n not in unused]


def resume_changes(saved: dict, config: Config) -> tuple[list[str], list[str]]:
    """Keys whose value differs between the config a checkpoint was saved with (``saved``, as in its
    ``paratrain.json``) and ``config``, as ``section.key: saved → now``: (model and adapter keys that forbid
    resuming, the changed training keys). A key the checkpoint does not record is taken at its default."""
    def differ(section: str, keys) -> list[str]:
        old, now = saved.get(section, {}), getattr(config, section)
        default = type(now)()
        out = []
        for key in keys:
            before, after = old.get(key, getattr(default, key)), getattr(now, key)
            if not callable(after) and before != after:
                out.append(f"{section}.{key}: {before} → {after}")
        return out

    kinds = (saved.get("model", {}).get("kind", config.model.kind), config.model.kind)
    strict = [k for k in _model_keys(kinds[0]) if k in _model_keys(kinds[1]) or k == "kind"]
    if kinds[1] == USER_MODEL_KIND:  # its tensors' names and shapes, checked as they load, say whether it fits
        strict = []  # (older checkpoints of a user's net record a default "transformer")
    refused = differ("model", strict) + differ("lora", LORA_SHAPE_KEYS)  # the adapters' tensors
    changed = differ("model", [k for k in MODEL_TRAINING_KEYS if k not in strict])
    for section in CHANGEABLE_SECTIONS:
        changed += differ(section, [f.name for f in dataclasses.fields(getattr(config, section))])
    return refused, changed


def check_resume_config(meta: dict, config: Config, path: Path, report: bool = True) -> None:
    """Refuse to resume from checkpoint ``path`` (``meta``: its paratrain.json) into ``config`` when a model
    key differs, listing every one; with ``report``, log the training keys that changed."""
    refused, changed = resume_changes(meta.get("config", {}), config)
    if refused:
        what = refused[0] if len(refused) == 1 else f"{len(refused)} keys differ"
        listed = "".join(f"\n  - {r}" for r in refused) if len(refused) > 1 else ""
        raise CheckpointError(f"checkpoint {path} was saved with another model ({what}): resume with the model it "
                              f"was saved with, or start a new run (checkpoint.resume=none or another run.dir)"
                              + listed)
    if changed and report:
        log.warning("checkpoint: resuming %s with changed settings: %s", path.name, "; ".join(changed))


class Checkpointer:
    """Saves every ``checkpoint.save_steps`` steps and resumes a run from a checkpoint.

    ``model_parts``: the model, or this rank's pipeline chunks, all under ``optimizer``; ``scheduler``: the LR
    scheduler, or None; ``states``: name -> object with ``state_dict``/``load_state_dict`` saved with them.
    Directories are named ``step_00000008``, or ``<checkpoint.prefix>-1_8`` with a prefix (the trainer's run is one
    epoch); ``keep_max`` counts those of the same prefix.
    """

    def __init__(self, config: Config, layout: Layout, model_parts: list[nn.Module],
                 optimizer: torch.optim.Optimizer, scheduler, states: dict):
        self.config, self.layout = config, layout
        self.model_parts, self.optimizer, self.scheduler, self.states = model_parts, optimizer, scheduler, states
        self.cfg = config.checkpoint
        self.root = config.checkpoint_path
        self.last_saved_step: int | None = None
        self.resumed_from: Path | None = None

    # --- what is saved --------------------------------------------------------------------

    @property
    def saves_frozen(self) -> bool:
        """Whether checkpoints hold the frozen base of a LoRA run: only when no ``model.from_hf`` holds it (the
        run's config names the directory, which a resume and an export read it from again)."""
        return not (self.config.lora.enabled and self.config.model.from_hf)

    def _collect(self) -> tuple[nn.Module, dict, dict, dict[str, str], dict[str, torch.Tensor]]:
        """(module, model state, optimizer state, state key -> saved key, saved key -> tensor for DCP). The module is
        the model, or one ``ModuleList`` over the parts whose leading index is stripped from the keys, so that keys
        are the parameter names of the whole model. A weight held twice (a tied table in two chunks) is one tensor."""
        strip = len(self.model_parts) > 1
        module = nn.ModuleList(self.model_parts) if strip else self.model_parts[0]
        msd = get_model_state_dict(module, options=OPTIONS)
        if not self.saves_frozen:
            msd = {key: value for key, value in msd.items() if is_adapter(key)}
        osd = get_optimizer_state_dict(module, self.optimizer, options=OPTIONS)
        names = {k: MODEL_PREFIX + (k.split(".", 1)[1] if strip else k) for k in msd}
        for k in osd:
            kind, rest = k.split(".", 1)  # "state" | "param_groups", then <fqn>.<name>
            names[k] = OPTIM_PREFIX + kind + "." + (rest.split(".", 1)[1] if strip else rest)
        tensors = {}
        for key, value in (msd | osd).items():
            if isinstance(value, torch.Tensor):
                tensors.setdefault(names[key], value)
        return module, msd, osd, names, tensors

    def _rng_state(self) -> dict[str, torch.Tensor]:
        """The random state of the host and of this rank's GPU (dropout draws there)."""
        state = {"torch_cpu": torch.get_rng_state()}
        if self.layout.device.type == "cuda":
            state["torch_cuda"] = torch.cuda.get_rng_state(self.layout.device)
        return state

    # --- saving ---------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether ``step`` is to be saved: a multiple of ``checkpoint.save_steps`` (0: never), not saved yet."""
        return self.cfg.save_steps > 0 and step % self.cfg.save_steps == 0 and step != self.last_saved_step

    def maybe_save(self, step: int) -> Path | None:
        """Save ``step`` if it is ``due``."""
        return self.save(step) if self.due(step) else None

    def _fault_point(self, stage: str, step: int) -> None:
        """Hook for fault-injection tests (the save of ``step`` killed at ``stage``); does nothing."""

    def save(self, step: int, name: str | None = None) -> Path:
        """Write checkpoint ``step`` atomically, as directory ``name`` (default: named after the step and
        ``checkpoint.prefix``); every rank calls it. Returns the final directory.

        A failure on any rank (a full disk, ``File too large``) raises a CheckpointError naming the
        file on every rank, so none is left waiting for the others; the unfinished directory is removed and
        the checkpoints saved before stay as they were."""
        name = name or checkpoint_name(step, self.cfg.prefix)
        tmp, final = self.root / (TMP_PREFIX + name), self.root / name
        try:
            return self._save(step, tmp, final)
        except CheckpointError:  # every rank raises it, after every rank stopped writing
            if _rank_world()[0] == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _save(self, step: int, tmp: Path, final: Path) -> Path:
        from safetensors.torch import save

        start = time.perf_counter()
        rank = _rank_world()[0]

        def prepare():
            if rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
        _together(prepare, final)  # collective: also orders the mkdir before any write
        layout = layout_dict(self.layout)
        _, msd, osd, names, tensors = self._collect()
        settings = {}  # the optimizer's non-tensor entries, keyed without the optim. prefix
        for key, value in (msd | osd).items():
            if not isinstance(value, torch.Tensor):
                settings.setdefault(names[key][len(OPTIM_PREFIX):], _json_value(value))
        # pipeline stages hold different parameters: rank 0 records them all
        settings = {k: v for part in _gather(settings) for k, v in part.items()}

        rank_state = save(self._rng_state(), metadata={"rank": str(rank), "python_random": json.dumps(
            random.getstate())})
        written = _together(lambda: {rank_file_name(rank): write_file(tmp / rank_file_name(rank), rank_state)}, final)
        self._fault_point("rank_state_written", step)
        try:
            written |= dcp_save(tensors, tmp)
        except OSError as exc:  # DCP failed on every rank together, with the first failed rank's error
            raise CheckpointError(_write_failed(final, exc)) from None
        # dcp.save returns once every rank's shards are written and rank 0 wrote .metadata
        self._fault_point("shards_written", step)
        written = {k: v for part in _gather(written) for k, v in part.items()}  # rank 0 records every rank's files

        def commit():
            if rank == 0:
                self._commit(step, tmp, final, layout, settings, written)
        _together(commit, final)
        self.last_saved_step = step
        progress.saved(step)
        if rank == 0:
            log.info("checkpoint: saved %s in %.2f s", final, time.perf_counter() - start)
        return final

    def _commit(self, step: int, tmp: Path, final: Path, layout: dict, settings: dict, written: dict) -> None:
        """Rank 0, after every rank finished writing the files ``written`` (name -> size and checksum): finish
        the directory, record every file's checksum, rename, point ``latest`` at it."""
        missing = [rank_file_name(r) for r in range(layout["world_size"]) if not (tmp / rank_file_name(r)).is_file()]
        if missing or not (tmp / DCP_METADATA).is_file():
            raise CheckpointError(f"checkpoint {tmp}: files missing after all ranks saved: "
                                  f"{missing or [DCP_METADATA]}")
        if self.cfg.integrated_save:
            # the whole model from the shards just written: same code path as `paratrain export`
            self._write_meta(tmp, step, layout, settings, files={})
            export(tmp, tmp / INTEGRATED_FILE)
        config_toml = tomli_w.dumps(self.recorded_config()).encode()
        written = {**written, "config.toml": write_file(tmp / "config.toml", config_toml)}
        files = {}
        for p in sorted(tmp.iterdir()):
            if p.is_file() and p.name != META_FILE:  # the integrated model.safetensors is hashed here, once
                files[p.name] = written.get(p.name) or file_entry(p.stat().st_size, file_checksum(p))
        self._write_meta(tmp, step, layout, settings, files)
        self._fault_point("meta_written", step)
        fsync_dir(tmp)
        if final.exists():  # a checkpoint of this step from an earlier run, never pointed at or superseded
            old = final.with_name(TMP_PREFIX + "old-" + final.name)
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(final)
        fsync_dir(self.root)
        self._fault_point("renamed", step)
        write_atomic(self.root / LATEST, final.name + "\n")
        self._prune(keep=final)

    def _write_meta(self, directory: Path, step: int, layout: dict, settings: dict, files: dict) -> None:
        sched = self.scheduler
        schedule = None if sched is None else {"last_epoch": sched.last_epoch, "_step_count": sched._step_count,
                                               "last_lr": sched.get_last_lr()[0]}
        meta = {"format": FORMAT_VERSION, "step": step, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "layout": layout, "config": self.recorded_config(), "scheduler": schedule,
                **{name: state.state_dict() for name, state in self.states.items()}, "optimizer_settings": settings,
                "torch_version": torch.__version__, "files": files}
        write_meta(directory, meta)

    def recorded_config(self) -> dict:
        """The run's config as its checkpoints record it: a user's net (``USER_MODEL_KIND``) by its kind alone,
        not by the sizes of a built-in model it is not."""
        config = self.config.to_dict()
        if self.config.model.kind == USER_MODEL_KIND:
            config["model"] = {"kind": USER_MODEL_KIND}
        return config

    def _prune(self, keep: Path) -> None:
        """Keep the ``keep_max`` newest complete checkpoints (0: all); drop leftovers of killed saves."""
        for leftover in self.root.glob(TMP_PREFIX + "*"):
            shutil.rmtree(leftover, ignore_errors=True)
        if self.cfg.keep_max == 0:  # keep all
            return
        complete = [p for _, p in step_dirs(self.root, self.cfg.prefix) if (p / META_FILE).is_file()]
        for path in complete[self.cfg.keep_max:]:
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)

    # --- resuming -------------------------------------------------------------------------

    def resume(self) -> int:
        """Apply ``checkpoint.resume`` ("auto" | a path | "none"); returns the step to continue from.

        "auto" takes the newest complete checkpoint whose files are intact, going back past damaged
        ones with a warning naming the file; a path must be intact or the resume is refused. A restarted
        attempt of a launch (:func:`restart_count`) resumes as "auto" whatever the config says when the
        checkpoint directory holds a complete checkpoint (saved by an earlier attempt)."""
        spec = (self.cfg.resume or "none").strip()
        if spec.lower() != "auto" and restart_count() > 0 and self._agreed_candidates():
            spec = "auto"
        if spec.lower() == "none":
            return 0
        if spec.lower() != "auto":
            return self.load(resolve(spec))
        candidates = self._agreed_candidates()
        for path in candidates:
            try:
                return self.load(path)
            except DamagedCheckpoint as exc:
                if _rank_world()[0] == 0:
                    log.warning("checkpoint: skipping %s: %s; trying the one before it", path.name, exc)
        if candidates:
            raise CheckpointError(f"all {len(candidates)} checkpoints in {self.root} are damaged (see the warnings): "
                                  f"set checkpoint.resume=none to start over")
        return 0

    def _agreed_candidates(self) -> list[Path]:
        """The complete checkpoints of this prefix, newest first, as rank 0 sees them (all ranks try the same
        ones)."""
        found = complete_checkpoints(self.root, prefix=self.cfg.prefix) if _rank_world()[0] == 0 else []
        return [self.root / name for name in _gather([p.name for p in found])[0]]

    def load(self, path: str | Path) -> int:
        """Load checkpoint ``path`` (any layout wrote it) into the parts, optimizer, scheduler and states;
        returns its step. The model config must match (:func:`check_resume_config`); a damaged file (README:
        Checksums, in that order) raises a DamagedCheckpoint naming it before anything read from it is set."""
        from safetensors import safe_open

        start = time.perf_counter()
        path = Path(path)
        rank, world = _rank_world()
        meta = read_meta(path)
        require_checksums(path, meta, self.cfg.trust_unverified)
        check_resume_config(meta, self.config, path, report=rank == 0)
        lacking = [name for name in self.states if name not in meta]
        if lacking:
            raise CheckpointError(f"checkpoint {path} holds no {', '.join(lacking)} state in {META_FILE}: it was "
                                  f"not saved by a paratrain training run; load its weights with "
                                  f"paratrain.load_checkpoint instead")
        meta, metadata = verify(path, meta, checksums=False)  # on every rank: all raise the same error
        share = [n for n in meta["files"] if checksum_owner(n, world) == rank and n != DCP_METADATA]
        _agree_intact(check_checksums(path, meta, [n for n in share if not holds_tensor_data(n)]))
        saved_keys = tensor_entries(metadata)

        module, msd, osd, names, wanted = self._collect()
        missing = [k for k in wanted if k not in saved_keys]
        if missing:
            raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensors this model needs, e.g. "
                                  f"{', '.join(missing[:4])}: was it written for another model config?")
        for key, value in wanted.items():
            saved = tuple(saved_keys[key].size)
            if tuple(value.shape) != saved:
                raise CheckpointError(f"checkpoint {path}: {key} has shape {list(saved)}, the model needs "
                                      f"{list(value.shape)}: was it written for another model config?")
        checking = ChecksumCheck(path, meta, [n for n in share if holds_tensor_data(n)])
        error = None
        try:
            dcp_load(wanted, path)
        except CheckpointError as exc:
            error = exc
        except Exception as exc:
            error = CheckpointError(f"checkpoint {path}: reading the shards failed: {exc}")
        _agree_intact(checking.result())  # a damaged file explains a failed read: it is reported first
        if error is not None:
            raise error

        settings = meta["optimizer_settings"]
        for sd in (msd, osd):
            for key, value in list(sd.items()):
                name = names[key]
                if isinstance(value, torch.Tensor):
                    if wanted[name] is not value:  # a second copy of a tied weight
                        value.copy_(wanted[name])
                elif name[len(OPTIM_PREFIX):] in settings:
                    sd[key] = _like(settings[name[len(OPTIM_PREFIX):]], value)
        set_model_state_dict(module, msd, options=dataclasses.replace(OPTIONS, strict=self.saves_frozen))
        set_optimizer_state_dict(module, self.optimizer, osd, options=OPTIONS)

        # scheduler counters only: base_lrs follow the config and the param groups of this layout
        sched = meta["scheduler"]
        if self.scheduler is not None and sched is not None:
            self.scheduler.last_epoch = sched["last_epoch"]
            self.scheduler._step_count = sched["_step_count"]
            self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        for name, state in self.states.items():
            state.load_state_dict(meta[name])

        rank_file = path / rank_file_name(self._rng_source(meta["layout"], rank))
        try:
            with safe_open(str(rank_file), "pt") as f:
                torch.set_rng_state(f.get_tensor("torch_cpu"))
                if "torch_cuda" in f.keys() and self.layout.device.type == "cuda":
                    torch.cuda.set_rng_state(f.get_tensor("torch_cuda"), self.layout.device)
                python_random = json.loads(f.metadata()["python_random"])
                random.setstate((python_random[0], tuple(python_random[1]), python_random[2]))
        except FileNotFoundError:
            raise DamagedCheckpoint(f"checkpoint {path} is damaged: file {rank_file} is missing") from None
        except Exception as exc:
            raise DamagedCheckpoint(f"checkpoint {path} is damaged: file {rank_file} is unreadable ({exc})") from None

        step = int(meta["step"])
        self.resumed_from = path
        self.last_saved_step = step
        if rank == 0:
            saved = meta["layout"]
            log.warning("checkpoint: resumed from %s (step %d, saved under dp %d x mp %d x pp %d, zero %d) in %.2f s",
                        path, step, saved["data_parallel"], saved["model_parallel"], saved["pipeline_stage"],
                        saved["zero_stage"], time.perf_counter() - start)
        return step

    def _rng_source(self, saved: dict, rank: int) -> int:
        """Whose RNG state this rank continues: its own in the same layout; otherwise the saved rank
        with the same data-parallel index (dropout streams are per dp rank, shared by tp and cp peers)."""
        now = layout_dict(self.layout)
        if all(saved.get(k) == now.get(k) for k in LAYOUT_KEYS):
            return rank
        dp = now["ranks"][rank]["dp"] % saved["data_parallel"]
        return next((r for r, c in enumerate(saved["ranks"])
                     if c["dp"] == dp and c["tp"] == 0 and c["pp"] == 0 and c.get("cp", 0) == 0), 0)
