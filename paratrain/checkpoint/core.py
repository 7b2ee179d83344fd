"""Saving and resuming a training run: sliced per rank through DCP, atomic, reshardable.

The trainer hands the checkpointer what it saves (as torchtitan's CheckpointManager):

- ``model_parts``: the model, or this rank's pipeline chunks, under one ``optimizer``.
  A pipeline chunk that holds only some layers, under their original parameter names,
  saves and loads through the same code: every rank contributes the keys it holds,
  DCP's index is their union (a tied table held by two stages is one entry), and on
  load each rank asks for its own keys only, whatever layout wrote them.
- the LR ``scheduler`` (its counters), and ``states``: named objects with
  ``state_dict``/``load_state_dict`` (loss scale, data position);
- the run's ``Config`` and ``Layout``, recorded with the checkpoint.

Model and optimizer state come from ``torch.distributed.checkpoint.state_dict``
(``get_state_dict``/``set_state_dict``, optimizer state flattened to
``state.<param fqn>.<name>``), so keys are plain parameter names and tensors are
DTensors sliced over whatever mesh the run uses; DCP reshards them on load. What
is not a tensor (the optimizer's per-parameter settings, schedule counters, loss
scale, data position, config, layout) goes to ``paratrain.json``; RNG states go to
one small safetensors file per rank. See ``storage.py`` for the on-disk format.
"""
from __future__ import annotations

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

from paratrain.checkpoint.full import MODEL_PREFIX, OPTIM_PREFIX, export
from paratrain.checkpoint.storage import (DCP_METADATA, FORMAT_VERSION, INTEGRATED_FILE, LATEST, META_FILE,
                                          TMP_PREFIX, CheckpointError, checkpoint_name, dcp_load, dcp_save, fsync_dir,
                                          newest_complete, parse_name, rank_file_name, resolve, step_dirs,
                                          tensor_entries, verify, write_atomic)

from paratrain.config import Config
from paratrain.device import device
from paratrain.mesh import Layout

log = logging.getLogger("paratrain.checkpoint")

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_ok(ok: bool) -> bool:
    """True when ``ok`` holds on every rank."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], device=device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def layout_dict(layout: Layout) -> dict:
    """The layout a run uses, with every rank's (pp, dp, tp) coordinates."""
    cfg = layout.config
    rank, world = _rank_world()
    coords = [layout.pp_rank, layout.dp_rank, layout.tp_rank]
    if dist.is_initialized():
        gathered = [None] * world
        dist.all_gather_object(gathered, coords)  # our own ints, between live ranks, not from disk
        coords = gathered
    else:
        coords = [coords]
    return {"world_size": world, "data_parallel": cfg.data_parallel, "model_parallel": cfg.model_parallel,
            "pipeline_stage": cfg.pipeline_stage, "zero_stage": cfg.effective_zero_stage,
            "sequence_parallel": cfg.sequence_parallel, "vocab_emb_dp": cfg.vocab_emb_dp,
            "ranks": [{"pp": c[0], "dp": c[1], "tp": c[2]} for c in coords]}


def _same_layout(a: dict, b: dict) -> bool:
    keys = ("world_size", "data_parallel", "model_parallel", "pipeline_stage", "zero_stage", "ranks")
    return all(a.get(k) == b.get(k) for k in keys)


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


class Checkpointer:
    """Saves every ``checkpoint.save_steps`` steps and resumes a run from a checkpoint.

    ``model_parts``: the model, or this rank's pipeline chunks, all under ``optimizer``;
    ``scheduler``: the LR scheduler, or None; ``states``: name -> object with
    ``state_dict``/``load_state_dict`` saved with them. Directories are named ``step_00000008``, or
    ``<checkpoint.prefix>-1_8`` with a prefix (the trainer's run is one epoch); ``keep_max`` counts
    those of the same prefix.
    """

    def __init__(self, config: Config, layout: Layout, model_parts: list[nn.Module],
                 optimizer: torch.optim.Optimizer, scheduler, states: dict):
        self.config, self.layout = config, layout
        self.model_parts, self.optimizer, self.scheduler, self.states = model_parts, optimizer, scheduler, states
        self.cfg = config.checkpoint
        self.root = Path(self.cfg.dir) if self.cfg.dir else config.run.path / "checkpoints"
        self.last_saved_step: int | None = None
        self.resumed_from: Path | None = None

    # --- what is saved --------------------------------------------------------------------

    def _collect(self) -> tuple[nn.Module, dict, dict, dict[str, str]]:
        """(module, model state, optimizer state, state key -> saved key). The module is the model, or one
        ``ModuleList`` over the parts whose leading index is stripped from the keys, so that keys are the
        parameter names of the whole model."""
        strip = len(self.model_parts) > 1
        module = nn.ModuleList(self.model_parts) if strip else self.model_parts[0]
        msd = get_model_state_dict(module, options=OPTIONS)
        osd = get_optimizer_state_dict(module, self.optimizer, options=OPTIONS)
        names = {k: MODEL_PREFIX + (k.split(".", 1)[1] if strip else k) for k in msd}
        for k in osd:
            kind, rest = k.split(".", 1)  # "state" | "param_groups", then <fqn>.<name>
            names[k] = OPTIM_PREFIX + kind + "." + (rest.split(".", 1)[1] if strip else rest)
        return module, msd, osd, names

    def _state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors for DCP keyed model.<fqn> / optim.<key>, the optimizer's non-tensor entries keyed
        without the optim. prefix). A weight held twice (a tied table in two chunks) is saved once."""
        tensors, settings = {}, {}
        _, msd, osd, names = self._collect()
        for key, value in (msd | osd).items():
            if isinstance(value, torch.Tensor):
                tensors.setdefault(names[key], value)
            else:
                settings.setdefault(names[key][len(OPTIM_PREFIX):], value)
        return tensors, settings

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
        ``checkpoint.prefix``); every rank calls it. Returns the final directory."""
        from safetensors.torch import save_file

        start = time.perf_counter()
        rank, world = _rank_world()
        name = name or checkpoint_name(step, self.cfg.prefix)
        tmp, final = self.root / (TMP_PREFIX + name), self.root / name
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        layout = layout_dict(self.layout)  # collective: also orders the mkdir before any write
        tensors, settings = self._state()
        if dist.is_initialized():  # pipeline stages hold different parameters: rank 0 records them all
            gathered = [None] * world
            dist.all_gather_object(gathered, {k: _json_value(v) for k, v in settings.items()})
            settings = {k: v for part in gathered for k, v in part.items()}

        rank_file = tmp / rank_file_name(rank)
        save_file(self._rng_state(), str(rank_file), metadata={"rank": str(rank), "python_random": json.dumps(
            random.getstate())})
        with open(rank_file, "rb+") as f:
            os.fsync(f.fileno())
        self._fault_point("rank_state_written", step)
        dcp_save(tensors, tmp)
        # dcp.save returns once every rank's shards are written and rank 0 wrote .metadata
        self._fault_point("shards_written", step)
        _barrier()  # every rank file is in place

        ok, error = True, None
        if rank == 0:
            try:
                self._commit(step, tmp, final, layout, settings)
            except BaseException as exc:  # tell the other ranks instead of leaving them waiting
                ok, error = False, exc
        if not _all_ok(ok):
            if error is not None:
                raise error
            raise CheckpointError(f"rank 0 failed to commit checkpoint {final}; see its log")
        self.last_saved_step = step
        if rank == 0:
            log.info("checkpoint: saved %s in %.2f s", final, time.perf_counter() - start)
        return final

    def _commit(self, step: int, tmp: Path, final: Path, layout: dict, settings: dict) -> None:
        """Rank 0, after every rank finished writing: finish the directory, rename, point ``latest`` at it."""
        missing = [rank_file_name(r) for r in range(layout["world_size"]) if not (tmp / rank_file_name(r)).is_file()]
        if missing or not (tmp / DCP_METADATA).is_file():
            raise CheckpointError(f"checkpoint {tmp}: files missing after all ranks saved: "
                                  f"{missing or [DCP_METADATA]}")
        if self.cfg.integrated_save:
            # the whole model from the shards just written: same code path as `paratrain export`
            self._write_meta(tmp, step, layout, settings, files={})
            export(tmp, tmp / INTEGRATED_FILE)
        (tmp / "config.toml").write_text(self.config.to_toml())
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file() and p.name != META_FILE}
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
        meta = {
            "format": FORMAT_VERSION,
            "step": step,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "layout": layout,
            "config": self.config.to_dict(),
            "scheduler": schedule,
            **{name: state.state_dict() for name, state in self.states.items()},
            "optimizer_settings": {k: _json_value(v) for k, v in settings.items()},
            "torch_version": torch.__version__,
            "files": files,
        }
        write_atomic(directory / META_FILE, json.dumps(meta, indent=1, default=str))

    def _prune(self, keep: Path) -> None:
        """Keep the ``keep_max`` newest complete checkpoints; drop leftovers of killed saves."""
        for leftover in self.root.glob(TMP_PREFIX + "*"):
            shutil.rmtree(leftover, ignore_errors=True)
        if self.cfg.keep_max > 0:
            complete = [p for _, p in step_dirs(self.root, self.cfg.prefix) if (p / META_FILE).is_file()]
            for path in complete[self.cfg.keep_max:]:
                if path != keep:
                    shutil.rmtree(path, ignore_errors=True)

    # --- resuming -------------------------------------------------------------------------

    def resume(self) -> int:
        """Apply ``checkpoint.resume`` ("auto" | a path | "none"); returns the step to continue from."""
        spec = (self.cfg.resume or "none").strip()
        if spec.lower() == "none":
            return 0
        if spec.lower() == "auto":
            path = self._agreed_auto_path()
            if path is None:
                return 0
        else:
            path = resolve(spec)
        return self.load(path)

    def _agreed_auto_path(self) -> Path | None:
        """The newest complete checkpoint of this prefix, as rank 0 sees it (all ranks use the same one)."""
        rank, _ = _rank_world()
        epoch, step = -1, -1
        if rank == 0:
            found = newest_complete(self.root, prefix=self.cfg.prefix)
            if found is not None:
                _, epoch, step = parse_name(found.name)
        if dist.is_initialized():
            box = torch.tensor([epoch, step], dtype=torch.int64, device=device())
            dist.broadcast(box, src=0)
            epoch, step = box.tolist()
        return None if step < 0 else self.root / checkpoint_name(step, self.cfg.prefix, epoch)

    def load(self, path: str | Path) -> int:
        """Load checkpoint ``path`` (any layout wrote it) into the parts, optimizer, scheduler and states;
        returns its step."""
        from safetensors import safe_open

        start = time.perf_counter()
        path = Path(path)
        meta, metadata = verify(path)  # on every rank: all raise the same error, none waits for the others
        rank, world = _rank_world()
        saved_keys = tensor_entries(metadata)

        module, msd, osd, names = self._collect()
        wanted: dict[str, torch.Tensor] = {}
        for key, value in (msd | osd).items():
            if isinstance(value, torch.Tensor):
                wanted.setdefault(names[key], value)
        missing = [k for k in wanted if k not in saved_keys]
        if missing:
            raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensors this model needs, e.g. "
                                  f"{', '.join(missing[:4])}: was it written for another model config?")
        for key, value in wanted.items():
            saved = tuple(saved_keys[key].size)
            if tuple(value.shape) != saved:
                raise CheckpointError(f"checkpoint {path}: {key} has shape {list(saved)}, the model needs "
                                      f"{list(value.shape)}: was it written for another model config?")
        try:
            dcp_load(wanted, path)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"checkpoint {path}: reading the shards failed: {exc}") from exc

        settings = meta["optimizer_settings"]
        for sd in (msd, osd):
            for key, value in list(sd.items()):
                name = names[key]
                if isinstance(value, torch.Tensor):
                    if wanted[name] is not value:  # a second copy of a tied weight
                        value.copy_(wanted[name])
                elif name[len(OPTIM_PREFIX):] in settings:
                    sd[key] = _like(settings[name[len(OPTIM_PREFIX):]], value)
        set_model_state_dict(module, msd, options=OPTIONS)
        set_optimizer_state_dict(module, self.optimizer, osd, options=OPTIONS)

        # scheduler counters only: base_lrs follow the config and the param groups of this layout
        sched = meta["scheduler"]
        if self.scheduler is not None and sched is not None:
            self.scheduler.last_epoch = sched["last_epoch"]
            self.scheduler._step_count = sched["_step_count"]
            self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        for name, state in self.states.items():
            state.load_state_dict(meta[name])

        source_rank = self._rng_source(meta["layout"], rank)
        rank_file = path / rank_file_name(source_rank)
        try:
            with safe_open(str(rank_file), "pt") as f:
                torch.set_rng_state(f.get_tensor("torch_cpu"))
                if "torch_cuda" in f.keys() and self.layout.device.type == "cuda":
                    torch.cuda.set_rng_state(f.get_tensor("torch_cuda"), self.layout.device)
                python_random = json.loads(f.metadata()["python_random"])
                random.setstate((python_random[0], tuple(python_random[1]), python_random[2]))
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path} is damaged: file {rank_file} is missing") from None
        except Exception as exc:
            raise CheckpointError(f"checkpoint {path}: {rank_file} is unreadable ({exc})") from None

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
        with the same data-parallel index (dropout streams are per dp rank, shared by tp peers)."""
        now = layout_dict(self.layout)
        if _same_layout(saved, now):
            return rank
        dp = now["ranks"][rank]["dp"] % saved["data_parallel"]
        return next((r for r, c in enumerate(saved["ranks"]) if c["dp"] == dp and c["tp"] == 0 and c["pp"] == 0), 0)
