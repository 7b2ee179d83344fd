"""What a ``train`` command checks before anything is built or any rank starts.

``paratrain train`` (and the ``Trainer``) runs :func:`check` before joining its process group,
``paratrain launch -- train ...`` once before starting any rank, whose ranks then do not repeat it
(:func:`launcher_checked`). Everything wrong is reported at once as one ``ConfigError`` (exit code
2), each problem naming the key, file or value and a fix: the config rules; ZeRO-Offload only with an accelerator;
the model state and a lower bound of the activations against a device's or this host's memory
(``decoder_layers=1e12`` is refused in milliseconds); the data files and tokenizer; writable run and checkpoint
directories; and the checkpoint a resume would take.
"""
from __future__ import annotations

import argparse
import codecs
import hashlib
import json
import os
import socket
import tempfile
from pathlib import Path

from paratrain.config import Config, ConfigError
from paratrain.config_file import parse_overrides
from paratrain.config_rules import validate

CHECKED_ENV = "PARATRAIN_CHECKED_CONFIG"  # set by ``paratrain launch`` for its ranks: the check_digest it made
TEXT_HEAD = 1 << 20  # bytes of a text file read to tell text from binary
MIN_BPE_VOCAB = 260  # a byte-level BPE needs the 256 bytes and 4 special tokens


def train_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The ``--config`` and ``--deepspeed`` of the ``train`` command line ``argv``, and its overrides."""
    parser = argparse.ArgumentParser(prog="paratrain train", add_help=False)
    parser.add_argument("--config")
    parser.add_argument("--deepspeed")
    args, rest = parser.parse_known_args(argv)
    return args, parse_overrides(rest)


def train_config(argv: list[str], world_size: int | None = None) -> Config:
    """The Config of the ``train`` command line ``argv`` (``--config FILE``, ``--deepspeed FILE`` and
    ``--section.key=value``) for ``world_size`` ranks."""
    from paratrain.deepspeed_config import load_config

    args, overrides = train_args(argv)
    return load_config(args.config, overrides, args.deepspeed, world_size)


def check(cfg: Config, world_size: int, local_world_size: int | None = None, resolved: bool = False) -> Config:
    """Raise ConfigError listing every problem above, or a CheckpointError about the resume; else return
    ``cfg``. ``local_world_size``: ranks on this host (default ``$LOCAL_WORLD_SIZE``, else ``world_size``)."""
    ConfigError.raise_any(validate(cfg, world_size, resolved))  # the checks below trust these numbers
    ConfigError.raise_any(offload_problems(cfg) + fp8_problems(cfg))
    local = local_world_size or ranks_on_this_host(world_size)
    ConfigError.raise_any(memory_problems(cfg, world_size, local) + data_problems(cfg))
    check_resume(cfg)
    ConfigError.raise_any(directory_problems(cfg))
    return cfg


def check_digest(cfg: Config, world_size: int, local_world_size: int, resolved: bool = False) -> str:
    """What names one :func:`check`: a SHA-256 of ``cfg``'s values, the rank counts, whether the layout must fit
    them (``resolved``, or no ``parallel.auto``), this host and the working directory (relative paths and the files
    checked are this host's)."""
    fits = resolved or not cfg.parallel.auto
    what = [cfg.to_dict(), world_size, local_world_size, fits, socket.gethostname(), os.getcwd()]
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def launcher_checked(cfg: Config, world_size: int, resolved: bool = False) -> bool:
    """Whether this rank's launcher (``paratrain launch``) made the ``check`` this rank would make of ``cfg`` (as
    loaded, before the run resolves it): the same config for the same ranks on this host (``$CHECKED_ENV``). A
    rank torchrun restarts checks again: the checkpoint a resume would take has changed since."""
    given = os.environ.get(CHECKED_ENV)
    return (given is not None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            and given == check_digest(cfg, world_size, ranks_on_this_host(world_size), resolved))


def offload_problems(cfg: Config) -> list[str]:
    """Offload moves model state from an accelerator to the host: refused on a CPU device, where FSDP2's
    CPUOffloadPolicy cannot run ("Cannot access accelerator device when none is available")."""
    from paratrain.device import device

    p = cfg.parallel
    if not p.offloads or device().type != "cpu":
        return []
    name = "offload_optimizer" if p.offload_optimizer == "cpu" else "offload_param"
    return [f"parallel.{name}='cpu' needs an accelerator: FSDP2's CPUOffloadPolicy moves parameters, gradients "
            f"and optimizer state from a GPU to host memory, and this run's device is the CPU (PARATRAIN_DEVICE="
            f"{os.environ.get('PARATRAIN_DEVICE', 'auto')}, no CUDA in use), where they are in host memory "
            f"already: set parallel.{name}='none' (DeepSpeed: zero_optimization.{name}.device 'none')"]


def fp8_problems(cfg: Config) -> list[str]:
    """``train.mixed_precision = "fp8"`` needs fp8 tensor cores and torchao (``paratrain.precision``)."""
    from paratrain.device import device
    from paratrain.precision import fp8_unavailable

    why = fp8_unavailable(device()) if cfg.train.mixed_precision == "fp8" else None
    return [f"train.mixed_precision='fp8' cannot run here: {why}; use mixed_precision='bf16'"] if why else []


# --- sizes ---------------------------------------------------------------------------------------

def host_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit when lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def memory_problems(cfg: Config, world_size: int, local_world_size: int) -> list[str]:
    """A problem when the model cannot fit: weights, gradients and AdamW moments (4 copies of every parameter
    that trains, 1 of a frozen base) over all ``world_size`` ranks, plus one hidden state per layer for a
    micro-batch's tokens, exceed a device's memory or this host's for its ``local_world_size`` ranks (model state
    against the host's with ZeRO-Offload). Both are lower bounds."""
    from paratrain.plan.cost import DTYPE_BYTES, model_params, state_bytes

    m, p = cfg.model, cfg.parallel
    if not m.spec.stacks:  # not built of Transformer layers: not costed
        return []
    params, trained = model_params(m, cfg.lora), model_params(m, cfg.lora, trainable=True)
    base_dtype = cfg.lora.base_dtype if cfg.lora.enabled and cfg.lora.base_dtype != "float32" else m.dtype
    # a frozen base (LoRA) is only its weights; what trains has gradients and AdamW state too
    state = ((params - trained) * DTYPE_BYTES[base_dtype] + state_bytes(trained * DTYPE_BYTES[m.dtype])) / world_size
    tokens = sum(m.sequence_lengths().values())
    micro_batch_num = 1 if p.auto else p.micro_batch_num  # the planner may pick more micro-batches
    activations = cfg.train.global_batch_size * tokens * m.hidden_size * 4 * m.num_layers / (
        world_size * micro_batch_num)
    over = _over_memory(state, activations, local_world_size, p.offloads)
    if over is None:
        return []
    need, where = over
    sizes = ", ".join(f"model.{k}={getattr(m, k)}" for k in (
        "vocab_size", "hidden_size", "ffn_hidden_size", *(["encoder_layers"] if m.spec.encoder_decoder else []),
        "decoder_layers", *m.sequence_lengths()))
    return [f"{sizes} make {params:.3g} parameters, whose weights, gradients and AdamW state need {_size(state)} "
            f"per rank even sharded over all {world_size} ranks, and train.global_batch_size="
            f"{cfg.train.global_batch_size} at least {_size(activations)} of activations: {_size(need)} is more "
            f"than {where}; make the model or the batch smaller or use more devices (`paratrain plan` sizes "
            f"every layout)"]


def _over_memory(state: float, activations: float, local_world_size: int, offloads: bool = False):
    """(bytes needed, "where") when a rank's model ``state`` and ``activations`` (bytes) do not fit on a GPU
    (state in host memory with ZeRO-Offload) or a host with ``local_world_size`` ranks; None when they fit."""
    import torch

    from paratrain.device import device

    dev = device()
    host_where = f"this host's {_size(host_memory())} of memory for its {local_world_size} rank(s)"
    if dev.type != "cuda":
        checks = [((state + activations) * local_world_size, host_memory(), host_where)]
    else:
        capacity = torch.cuda.get_device_properties(dev).total_memory
        checks = [(activations + (0 if offloads else state), capacity,
                   f"the {_size(capacity)} of one {torch.cuda.get_device_name(dev)}")]
        if offloads:  # the model state lives in host memory
            checks.append((state * local_world_size, host_memory(), host_where))
    return next(((need, where) for need, capacity, where in checks if need > capacity), None)


def ranks_on_this_host(world_size: int) -> int:
    """``$LOCAL_WORLD_SIZE``, else ``world_size`` (every rank on this host)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or world_size


def net_memory_problem(net, world_size: int) -> str | None:
    """For a user's net (``Model.train``): a problem when 4 copies of its parameters (weights, gradients, two
    moments) over all ``world_size`` ranks exceed a device's or this host's memory (activations not counted)."""
    params = sum(p.numel() for p in net.parameters())
    state = 4 * sum(p.numel() * p.element_size() for p in net.parameters()) / world_size
    over = _over_memory(state, 0.0, ranks_on_this_host(world_size))
    if over is None:
        return None
    need, where = over
    return (f"the net's {params:.3g} parameters need {_size(state)} per rank for their weights, gradients and "
            f"optimizer state even sharded over all {world_size} ranks: {_size(need)} is more than {where}; make "
            f"the net smaller or use more devices")


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024:
            return f"{nbytes:.3g} {unit}"
        nbytes /= 1024
    return f"{nbytes:.3g} PiB"


# --- data ----------------------------------------------------------------------------------------

def data_problems(cfg: Config) -> list[str]:
    """Every problem with the files ``data`` names, before any is read in earnest."""
    d = cfg.data
    if d.problems():
        return d.problems()
    if d.kind == "synthetic":
        return []
    if d.kind == "cifar10":
        return _cifar_problems(Path(d.path))
    text = not d.path.endswith(".npy")
    if d.kind == "documents":
        from paratrain.data.documents import document_problems
        problems = document_problems(Path(d.path), d.text_field)
    elif d.kind == "chat":
        from paratrain.data.chat import chat_problems
        problems = chat_problems(Path(d.path))
    else:
        problems = _file_problems("data.path", Path(d.path), text)
    if not text and not problems:
        problems += _token_array_problems(Path(d.path), cfg.model.vocab_size)
    if d.eval_path:
        problems += _eval_path_problems(cfg)
    if text and not problems and cfg.model.from_hf and not d.tokenizer:
        problems += _hf_tokenizer_problems(cfg.model.from_hf, cfg.model.vocab_size)
    elif text and not problems:  # a tokenizer is trained on data.path: only worth checking when that is fine
        tokenizer = Path(d.tokenizer or Path(d.path).with_name("tokenizer.json"))
        if tokenizer.is_dir():
            problems.append(f"data.tokenizer={tokenizer} is a directory: give its tokenizer.json")
        elif not tokenizer.exists() and d.kind == "chat":
            problems.append(f"data.tokenizer={tokenizer} does not exist: chat data needs the tokenizer its chat "
                            f"template was written for (or model.from_hf, whose tokenizer it takes)")
        elif not tokenizer.exists() and cfg.model.vocab_size < MIN_BPE_VOCAB:
            problems.append(f"tokenizer {tokenizer} does not exist and would be trained on data.path with "
                            f"model.vocab_size={cfg.model.vocab_size} tokens, too few for a byte-level BPE: set "
                            f"model.vocab_size >= {MIN_BPE_VOCAB}, or data.tokenizer to a trained one")
        elif not tokenizer.exists() and (problem := writable_problem("data.tokenizer", tokenizer.parent)):
            problems.append(f"tokenizer {tokenizer} does not exist and would be trained and saved there, but "
                            f"{problem}")
    if d.kind == "chat" and not problems:
        problems += _chat_template_problems(cfg)
    return problems


def _eval_path_problems(cfg: Config) -> list[str]:
    """``data.eval_path`` must hold data of ``data.kind``'s kind: documents, conversations, a text file or a ``.npy``
    stream of the vocabulary, translation pairs."""
    key, path = "data.eval_path", Path(cfg.data.eval_path)
    if cfg.data.kind == "documents":
        from paratrain.data.documents import document_problems
        return document_problems(path, cfg.data.text_field, key)
    if cfg.data.kind == "chat":
        from paratrain.data.chat import chat_problems
        return chat_problems(path, key)
    if cfg.data.kind == "text" and path.suffix == ".npy":
        return _file_problems(key, path, text=False) or _token_array_problems(path, cfg.model.vocab_size, key)
    return _file_problems(key, path, text=True)


def _chat_template_problems(cfg: Config) -> list[str]:
    """The chat template of ``data.kind = "chat"`` must be found and be a jinja template."""
    from paratrain.data import DataError
    from paratrain.data.chat import ChatTemplate

    try:
        ChatTemplate.load(cfg.model.from_hf or None, cfg.data.chat_template or None)
    except DataError as exc:
        return [str(exc)]
    return []


def _hf_tokenizer_problems(directory: str, vocab_size: int) -> list[str]:
    """The tokenizer of a ``model.from_hf`` directory must load, name an EOS and fit the model's vocabulary."""
    from paratrain.data import DataError
    from paratrain.data.tokenizer import Tokenizer

    try:
        tokenizer = Tokenizer.of_hf_model(directory)
    except DataError as exc:
        return [str(exc)]
    if tokenizer.vocab_size > vocab_size:
        return [f"model.from_hf={directory!r}: its tokenizer.json has {tokenizer.vocab_size} tokens, more than the "
                f"model's vocab_size={vocab_size}: it is not this model's tokenizer (or set data.tokenizer)"]
    return []


def _token_array_problems(path: Path, vocab_size: int, key: str = "data.path") -> list[str]:
    """A ``.npy`` token stream must be a 1-D array of integer token ids of the model's vocabulary (read once
    here, a chunk at a time: an id out of range would fail a step in the middle of training)."""
    import numpy as np

    with open(path, "rb") as f:
        if f.read(6) != b"\x93NUMPY":
            return [f"{key}={path} is not a .npy array: save the token ids with numpy.save, or give a text file"]
    try:
        ids = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as exc:
        return [f"{key}={path} cannot be read as a .npy array ({exc}): save the token ids with numpy.save"]
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        return [f"{key}={path} holds a {ids.ndim}-D {ids.dtype} array: give a 1-D array of integer token ids"]
    chunk = 1 << 24
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        low, high = int(part.min()), int(part.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            return [f"{key}={path} holds token id {bad} (at index {start + int(np.argmax(part == bad))}), "
                    f"not one of model.vocab_size={vocab_size}: raise vocab_size above the largest id or fix the data"]
    return []


def _file_problems(key: str, path: Path, text: bool) -> list[str]:
    if not path.exists():
        hint = (" (run `paratrain preprocess sample --out data/sample` for a sample corpus)"
                if key == "data.path" else "")
        return [f"{key}={path} does not exist{hint}"]
    if path.is_dir():
        return [f"{key}={path} is a directory: give the file in it"]
    try:
        with open(path, "rb") as f:
            head = f.read(TEXT_HEAD)
    except OSError as exc:
        return [f"{key}={path} cannot be read ({exc.strerror})"]
    if not head:
        return [f"{key}={path} is empty"]
    if not text:
        return []
    if b"\0" in head:
        return [f"{key}={path} is binary (it holds NUL bytes), not text: give a UTF-8 text file"]
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < TEXT_HEAD)
    except UnicodeDecodeError as exc:
        return [f"{key}={path} is not UTF-8 text (byte {head[exc.start]:#04x} at offset {exc.start}): "
                f"convert it to UTF-8"]
    return []


def _cifar_problems(path: Path) -> list[str]:
    from paratrain.data.cifar import RECORD

    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is a file"
        return [f"data.path={path} {what}: point it at the cifar-10-batches-bin directory"]
    files = sorted(path.glob("data_batch_*.bin"))
    if not files:
        return [f"data.path={path} has no data_batch_*.bin: point it at the cifar-10-batches-bin directory"]
    return [f"{f} is {f.stat().st_size} bytes, not a whole number of {RECORD}-byte CIFAR-10 records"
            for f in files if f.stat().st_size == 0 or f.stat().st_size % RECORD]


# --- directories and resume -----------------------------------------------------------------------

def directory_problems(cfg: Config) -> list[str]:
    """The run directory and the checkpoint directory must be writable (created here when missing): a stop
    saves a checkpoint whatever ``checkpoint.save_steps`` says."""
    problem = writable_problem("run.dir", cfg.run.path)
    if problem and not cfg.checkpoint.dir:
        return [problem]  # the checkpoint directory, <run dir>/checkpoints, fails with it
    return [p for p in (problem, writable_problem("checkpoint.dir", cfg.checkpoint_path)) if p]


def writable_problem(key: str, path: Path) -> str | None:
    """Why directory ``path`` (given as ``key``) cannot be created and written in, or None; creates it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".paratrain-write-test-")
        os.close(fd)
        os.unlink(probe)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        return f"{key}={path} cannot be a directory: {blocker} is a file; choose another {key}"
    except OSError as exc:
        return f"{key}={path} is not writable ({exc.strerror}); choose another {key}"
    except ValueError:  # a NUL character
        return f"{key}={str(path)!r} holds a NUL character, which no path can: remove it"
    return None


def check_resume(cfg: Config) -> None:
    """An explicit ``checkpoint.resume`` path must hold a checkpoint; the checkpoint a resume would take
    must have been saved with this model config (CheckpointError otherwise)."""
    from paratrain.checkpoint.core import check_resume_config
    from paratrain.checkpoint.storage import CheckpointError, newest_complete, read_meta, require_checksums, resolve

    spec = (cfg.checkpoint.resume or "none").strip()
    if spec.lower() == "none":
        return
    if spec.lower() == "auto":
        path = newest_complete(cfg.checkpoint_path, warn=False, prefix=cfg.checkpoint.prefix)
        if path is None:
            return
        try:
            meta = read_meta(path)
        except CheckpointError:  # resume goes back past it, or says why not
            return
    else:
        path = resolve(spec)
        meta = read_meta(path)
    require_checksums(path, meta, cfg.checkpoint.trust_unverified)
    check_resume_config(meta, cfg, path, report=False)
