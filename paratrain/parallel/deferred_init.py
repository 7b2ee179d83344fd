"""Model initialisation without the whole model on any host: build on the meta device, parallelize,
then materialise only this rank's shards, with exactly the values a plain build on the CPU draws.

``record_init(build)`` builds the model on the meta device while recording, in order, every operation that gives a
parameter or buffer its values: its factory (``torch.empty``, ``torch.zeros``...) and the in-place initialisers that
follow (``normal_``, ``uniform_``, ``fill_``, ``zero_``, and in-place arithmetic such as ``mul_``). Once the model is
parallelized (tensor parallel, FSDP, pipeline chunks -- all on the meta device),
``materialize(parts, record, device)`` allocates this rank's shards on ``device`` and replays the record on the CPU
from the random state the build started from, one tensor at a time: a tensor is made in full, as the plain build
made it, this rank's shard of it is copied in, and it is freed. Every tensor is replayed, held by this rank or not,
so the random stream is consumed as the plain build consumed it. Host memory peaks at the largest tensor, not the model.

A build that draws random numbers into anything but its own parameters and buffers, or
computes a parameter from other tensors, cannot be replayed and is refused with the reason.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# in-place initialisers whose result does not depend on the tensor's previous values
OVERWRITES = {"normal_", "uniform_", "fill_", "zero_", "random_", "bernoulli_", "exponential_", "geometric_",
              "log_normal_", "cauchy_"}
ALIASES = {"detach", "alias", "view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "as_strided"}


class DeferredInitError(RuntimeError):
    """The model's construction does something ``materialize`` cannot replay; the message says what."""


@dataclass
class Step:
    """One recorded operation on the tensor ``name``: made by a factory, or changed in place."""

    name: str
    func: object
    args: tuple
    kwargs: dict
    meta: torch.Tensor  # the tensor as the build had it (shape, dtype)
    make: bool = False  # a factory: the tensor is made afresh
    overwrite: bool = False  # an in-place op that ignores the previous values


@dataclass
class InitRecord:
    """What ``record_init`` saw: the built model (on the meta device), the CPU random state the build started from
    and the steps that set its tensors."""

    model: nn.Module
    rng_state: torch.Tensor
    steps: list[Step] = field(default_factory=list)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _storage(t: torch.Tensor):
    return t.untyped_storage()._cdata


def record_init(build) -> InitRecord:
    """``build()`` (a model constructor) on the meta device, with the record of how its tensors got their values."""
    recorder, state = _Recorder(), torch.get_rng_state()
    with torch.device("meta"), recorder:
        model = build()
    return _resolve(model, recorder.ops, state)


_DEFERRED: list[tuple[list, torch.Tensor]] = []  # (ops, CPU random state at its start) of each no_init_parameters


@contextlib.contextmanager
def no_init_parameters():
    """MindSpore's ``no_init_parameters()``: the modules built inside are made on the meta device, their
    initialisation recorded; ``paratrain.train.Model`` places such a net on the meta device and materialises
    only this rank's shards, with the values a plain build from the random state at the block's start draws."""
    recorder, state = _Recorder(), torch.get_rng_state()
    with torch.device("meta"), recorder:
        yield
    _DEFERRED.append((recorder.ops, state))


def deferred_record(model: nn.Module) -> InitRecord | None:
    """The record of the ``no_init_parameters`` block that built ``model``."""
    storages = {_storage(p) for p in model.parameters()}
    for ops, state in reversed(_DEFERRED):
        if any(isinstance(out, torch.Tensor) and _storage(out) in storages for *_, out in ops):
            return _resolve(model, ops, state)
    return None


def _resolve(model: nn.Module, ops: list, rng_state: torch.Tensor) -> InitRecord:
    """The steps of ``ops`` (recorded while building ``model`` on the meta device) that set ``model``'s tensors."""
    names = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        names.setdefault(_storage(t), name)
    record = InitRecord(model, rng_state)
    for func, args, kwargs, out in ops:
        op = func._schema.name.split("::")[-1]
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        random = torch.Tag.nondeterministic_seeded in func.tags
        if op in ALIASES:
            continue
        if not tensors:  # a factory
            if isinstance(out, torch.Tensor) and _storage(out) in names:
                record.steps.append(Step(names[_storage(out)], func, args, kwargs, out, make=True))
            elif random:
                raise DeferredInitError(f"the model's construction draws random numbers ({op}) outside its "
                                        f"parameters and buffers: it cannot be initialised shard by shard")
            continue
        target = names.get(_storage(tensors[0]))
        if op.endswith("_") and target is None and random:
            # a tensor the build drew into and then dropped (a head weight replaced by the tied table):
            # replayed into a scratch tensor, for the random numbers it took
            target = f"(dropped tensor {_storage(tensors[0])})"
        if op.endswith("_") and target is not None:
            if len(tensors) > 1:
                raise DeferredInitError(f"{target} is initialised from another tensor ({op}): it cannot be "
                                        f"initialised shard by shard")
            record.steps.append(Step(target, func, args[1:], kwargs, tensors[0], overwrite=op in OVERWRITES))
        elif random or (isinstance(out, torch.Tensor) and _storage(out) in names):
            raise DeferredInitError(f"the model's construction computes {names.get(_storage(out), 'a tensor')} "
                                    f"with {op} from other tensors: it cannot be initialised shard by shard")
    return record


def _tensors_by_name(parts: list[nn.Module]) -> dict[str, list[torch.Tensor]]:
    """Parameters and buffers of the parts under their names in the whole model (recompute wrappers left out)."""
    out: dict[str, list[torch.Tensor]] = {}
    for part in parts:
        for name, t in [*part.named_parameters(), *part.named_buffers()]:
            out.setdefault(name.replace(_CHECKPOINT_PREFIX, ""), []).append(t)
    return out


def _tied_parameters(part: nn.Module) -> list[tuple[nn.Module, str, tuple[nn.Module, str]]]:
    """(module, attribute, (module, attribute) holding the same parameter first) for every tied parameter."""
    first, ties = {}, []
    for module in part.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            if id(p) in first:
                ties.append((module, name, first[id(p)]))
            else:
                first[id(p)] = (module, name)
    return ties


@torch.no_grad()
def _copy_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(target, DTensor):
        full = full.to(target.device_mesh.device_type)
        shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(shard)
    else:
        target.copy_(full)


def materialize(parts: list[nn.Module], record: InitRecord, device: torch.device,
                param_device: torch.device | None = None) -> None:
    """Allocate ``parts`` (built by ``record_init``, parallelized on the meta device) on ``device`` (their
    parameters on ``param_device`` when given: offloaded shards) and give them their values by replaying
    ``record`` from the CPU random state its build started from (the caller's random state is left as it was)."""
    for part in parts:
        ties = _tied_parameters(part)
        hooks = {name: list(p._post_accumulate_grad_hooks.values()) for name, p in part.named_parameters()
                 if getattr(p, "_post_accumulate_grad_hooks", None)}
        part.to_empty(device=param_device or device)
        if param_device is not None:  # buffers are used where the computation runs
            for module in part.modules():
                module._buffers.update({name: b.to(device) for name, b in module._buffers.items() if b is not None})
        for module, name, (source, source_name) in ties:  # to_empty gives each holder its own copy
            setattr(module, name, getattr(source, source_name))
        for name, functions in hooks.items():  # to_empty makes new tensors: hooks registered on the old are gone
            p = part.get_parameter(name)
            p._post_accumulate_grad_hooks = None
            for function in functions:
                p.register_post_accumulate_grad_hook(function)
    targets = _tensors_by_name(parts)
    unset = sorted(set(targets) - {step.name for step in record.steps})
    if unset:
        raise DeferredInitError(f"no recorded initialisation for {', '.join(unset[:4])}: were they made "
                                f"outside the build that record_init ran?")
    last, needed = {}, set()  # last step of each tensor; steps whose result a later in-place op reads
    for i, step in enumerate(record.steps):
        if step.name in last and not (step.make or step.overwrite):
            needed.add(last[step.name])
        last[step.name] = i
    live: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(record.rng_state)
        for i, step in enumerate(record.steps):
            if step.make:
                kwargs = {**step.kwargs, "device": torch.device("cpu")}
                live[step.name] = step.func(*step.args, **kwargs)
            else:
                if step.overwrite or step.name not in live:
                    live[step.name] = torch.empty(step.meta.shape, dtype=step.meta.dtype, device="cpu")
                step.func(live[step.name], *step.args, **step.kwargs)
            if last[step.name] == i:
                for target in targets.get(step.name, []):
                    _copy_shard(target, live[step.name])
            if i not in needed:
                live.pop(step.name)
