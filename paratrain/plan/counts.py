"""What a built-in model costs, counted on the model itself: one training step of it on fake tensors.

The model of a ``ModelConfig`` is built under ``FakeTensorMode`` (shapes and dtypes, no data: a 405B layer costs
nothing), with as few layers as hold each kind of layer (``sample_config``), and run forward and backward on a
micro-batch of one sequence (the fewest whose tokens fill the experts' routing groups) and of twice as many, in train
mode and in the run's compute dtype, its attention as a fused kernel runs it (no attention weights kept: attention
dropout left out, which would make the CPU take its unfused path), its loss computed as the placed model computes it.
Recorded per layer and per part outside the layers (``pipeline_parts``; what the model's own forward keeps around
them, the tensors every layer takes, counts as ``inputs``):

- the bytes autograd saves for backward: every distinct storage a ``saved_tensors_hooks`` pack sees, parameters
  aside (recompute ``none``); the layer's inputs, which is what a checkpointed layer keeps (``full``); the inputs and
  the outputs of the ops selective recompute keeps (``paratrain.parallel.recompute.keeps``: ``selective``);
- the FLOPs of every op by ``torch.utils.flop_counter``'s formulas (matmuls, attention; norms, activations and adds
  have none, as in the usual model-FLOPs count), in forward, in backward (``ModuleTracker`` knows whose), and of the
  forward ops selective recompute runs again.

Tensor parallelism is counted on the model as one tensor-parallel rank holds it: every Linear and Embedding the
modules' ``parallel_plan()`` splits is narrowed to its shard (``SHARDED_DIMS``), so attention runs on the rank's
heads and the feed-forward on its columns. With sequence parallelism, what is saved outside the modules that split
(the norms, dropout and residual stream between the sublayers) holds 1/tp of the tokens; selective recompute also
keeps the output of each row-split Linear's all-reduce (reduce-scatter). The counts are affine in the rows of the
micro-batch (a word table's gradient, say, is not per row) but for the experts' capacity, rounded up per micro-batch:
the two forwards fix the line (``Piece.at``), ``model_counts(rows=)`` counts one micro-batch exactly.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass

from paratrain.config import LoraConfig, ModelConfig

# the dim of a Linear's or an Embedding's parameter that each split kind of ``parallel_plan()`` shards over
# model_parallel (``paratrain.parallel.tensor.parallel_style``: DTensor's ColwiseParallel and RowwiseParallel)
SHARDED_DIMS = {("colwise", "weight"): 0, ("colwise", "bias"): 0, ("head", "weight"): 0, ("head", "bias"): 0,
                ("rowwise", "weight"): 1, ("vocab_rows", "weight"): 0}
SPLIT_KINDS = ("colwise", "rowwise", "head", "vocab_rows")
RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Counts:
    """A layer's or a part's costs in one training step on a micro-batch, on one tensor-parallel rank: the bytes
    autograd keeps for backward per recompute mode (``saved``: mode -> bytes), the FLOPs of its forward and of its
    backward, and those of the forward ops that selective recompute runs again (``recomputed``)."""

    saved: dict
    forward: float = 0.0
    backward: float = 0.0
    recomputed: float = 0.0

    def __sub__(self, other: "Counts") -> "Counts":
        return Counts({k: v - other.saved[k] for k, v in self.saved.items()}, self.forward - other.forward,
                      self.backward - other.backward, self.recomputed - other.recomputed)

    def __add__(self, other: "Counts") -> "Counts":
        return Counts({k: v + other.saved[k] for k, v in self.saved.items()}, self.forward + other.forward,
                      self.backward + other.backward, self.recomputed + other.recomputed)

    def __mul__(self, factor: float) -> "Counts":
        return Counts({k: v * factor for k, v in self.saved.items()}, self.forward * factor, self.backward * factor,
                      self.recomputed * factor)

    @property
    def train_flops(self) -> float:
        """Forward and backward FLOPs (no recompute)."""
        return self.forward + self.backward


@dataclass(frozen=True)
class Piece:
    """A layer's or a part's ``Counts`` on a micro-batch of any number of rows: ``fixed + rows x per_row``."""

    per_row: Counts
    fixed: Counts

    @classmethod
    def fit(cls, one: Counts, two: Counts, rows: int = 1) -> "Piece":
        """From the counts of a micro-batch of ``rows`` and of twice as many rows."""
        return cls((two - one) * (1 / rows), one * 2 - two)

    def at(self, rows: float) -> Counts:
        return self.fixed + self.per_row * rows


@dataclass(frozen=True)
class ModelCounts:
    """A model's counts on one tensor-parallel rank: one layer of each kind ``(is_decoder_layer, is_moe)``, each
    part of ``pipeline_parts`` by name, and ``inputs``, what the model's forward itself keeps around them (ids,
    masks)."""

    layers: dict  # (is_decoder_layer, is_moe) -> Piece
    parts: dict  # part name -> Piece
    inputs: Piece


def sample_config(m: ModelConfig) -> ModelConfig:
    """``m`` with as few layers as hold each kind of layer of ``m`` at the same place modulo ``moe.every`` (the
    kinds and shapes stay, the count does not matter)."""
    every = m.moe_config.every
    counts = [n - every * max(0, n // every - 1) for n in m.stack_layers.values()]
    return dataclasses.replace(m, **dict(zip(("encoder_layers", "decoder_layers")[-len(counts):], counts)))


def model_counts(m: ModelConfig, tp: int = 1, sequence_parallel: bool = False, vocab_emb_dp: bool = True,
                 precision: str = "none", lengths: tuple[int, int] | None = None,
                 lora: LoraConfig | None = None, rows: int | None = None) -> ModelCounts:
    """``m``'s counts (module docstring) on one of ``tp`` tensor-parallel ranks, with ``sequence_parallel``, the word
    table split unless ``vocab_emb_dp``, forward in ``precision`` ("none", "bf16", "fp16"), on sequences of
    ``lengths`` (source, target; default ``m.lengths``), with ``lora``'s adapters on a frozen base. ``rows``: for a
    mixture of experts, one forward on a micro-batch of that many rows, exact there (the experts' capacity is
    rounded up per micro-batch) and proportional elsewhere, instead of the affine fit, which is exact for the
    others."""
    rows = rows if m.moe_config.expert_num > 1 else None  # without experts the line is exact
    args = (tp, sequence_parallel and tp > 1, vocab_emb_dp or tp == 1, precision, tuple(lengths or m.lengths), rows)
    key = repr((m, lora, args))  # (the planner asks for the same counts of every layout it weighs)
    if key not in _COUNTED:
        sample = dataclasses.replace(sample_config(m), attention_dropout=0.0)
        _COUNTED[key] = _count(sample, lora or LoraConfig(), *args)
    return _COUNTED[key]


_COUNTED: dict[str, ModelCounts] = {}  # per model, layout and lengths


def _count(m: ModelConfig, lora: LoraConfig, tp: int, sequence_parallel: bool, vocab_emb_dp: bool, precision: str,
           lengths: tuple[int, int], rows: int | None) -> ModelCounts:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from paratrain.lora import add_adapters
    from paratrain.models import build_model

    # the fewest rows whose tokens split into the experts' routing groups, and twice as many
    group = m.moe_config.expert_group_size if m.moe_config.expert_num > 1 else None
    least = math.lcm(*(group // math.gcd(group, length) for length in lengths)) if group else 1
    _autograd_started_on_the_cpu()
    # (fake tensors draw no random numbers, but building the model seeds nothing of the run's either)
    with torch.random.fork_rng(devices=[]), FakeTensorMode(), torch.device("cpu"):
        model = add_adapters(build_model(m), lora)
        if m.dtype != "float32":
            _to_dtype(model, getattr(torch, m.dtype))
        _narrow(model, tp, vocab_emb_dp)
        counts = [_one_forward(model, m, n, lengths, tp, sequence_parallel, precision)
                  for n in ((rows,) if rows else (least, 2 * least))]
    if rows is None:
        pieces = {name: Piece.fit(counts[0][name], counts[1][name], least) for name in counts[1]}
    else:
        pieces = {name: Piece(c * (1 / rows), c * 0) for name, c in counts[0].items()}
    from paratrain.modules.moe import MoE
    from paratrain.modules.transformer import pipeline_blocks

    first_stack, layers = next(iter(model.layer_stacks)), {}
    for name, _, _ in pipeline_blocks(model):
        is_moe = any(isinstance(x, MoE) for x in model.get_submodule(name).modules())
        kind = (name.rpartition(".")[0] != first_stack, is_moe)
        layers.setdefault(kind, pieces[name])
    parts = {name: pieces[name] for name in model.pipeline_parts if name in pieces}
    return ModelCounts(layers, parts, pieces[""])


@functools.cache
def _autograd_started_on_the_cpu() -> None:
    """One backward on a CPU tensor, once a process, before the first on fake tensors: torch 2.11's autograd engine,
    when fake tensors run its first backward, marks the process so that a backward in any child it forks later
    fails ("Unable to handle autograd's threading in combination with fork-based multiprocessing"); after a first
    backward on a CPU tensor it does not (nor does torch 2.13's)."""
    import torch

    torch.ones(1, device="cpu", requires_grad=True).sum().backward()


def _to_dtype(model, dtype) -> None:
    """``model.to(dtype)`` on fake tensors (whose ``Module.to`` cannot swap them): each floating parameter and buffer
    replaced by one of ``dtype``, a parameter shared by several modules once."""
    import torch

    made: dict = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_floating_point():
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(p.to(dtype), requires_grad=p.requires_grad)
                setattr(module, name, made[id(p)])
        for name, b in list(module.named_buffers(recurse=False)):
            if b.is_floating_point():
                module._buffers[name] = b.to(dtype)


def _narrow(model, tp: int, vocab_emb_dp: bool) -> None:
    """Every parameter ``parallel_plan()`` splits cut to the first of its ``tp`` shards (``torch.chunk``'s)."""
    import torch

    from paratrain.parallel.tensor import declared_plan

    if tp == 1:
        return
    for name, kind in declared_plan(model).items():
        if kind not in SPLIT_KINDS or (kind == "vocab_rows" and vocab_emb_dp):
            continue
        module = model.get_submodule(name)
        for local, p in list(module.named_parameters(recurse=False)):
            dim = SHARDED_DIMS.get((kind, local))
            if dim is not None:
                shard = p.chunk(tp, dim)[0]
                setattr(module, local, torch.nn.Parameter(torch.empty_like(shard), requires_grad=p.requires_grad))


def _batch(m: ModelConfig, rows: int, lengths: tuple[int, int]) -> dict:
    """A micro-batch of the model's inputs and labels (fake: their values do not matter)."""
    import torch

    source, target = lengths
    ids = {"src_ids": (rows, source), "tgt_in_ids": (rows, target)} if m.spec.encoder_decoder else {
        "input_ids": (rows, target)}
    return {**{k: torch.ones(shape, dtype=torch.long) for k, shape in ids.items()},
            "labels": torch.ones((rows, target), dtype=torch.long)}


def _one_forward(model, m: ModelConfig, rows: int, lengths, tp: int, sequence_parallel: bool,
                 precision: str) -> dict:
    """Counts of each layer, part and of the model's own forward ("") on a micro-batch of ``rows``: forward and
    backward of its loss."""
    import torch

    from paratrain.modules.linear_cross_entropy import token_loss_sum
    from paratrain.modules.transformer import pipeline_blocks
    from paratrain.precision import autocast

    modules = dict(model.named_modules())
    parts = [name for name in model.pipeline_parts if name in modules]
    batch = _batch(m, rows, lengths)
    labels = batch.pop("labels")
    model.train()
    with _Recorder(model, [name for name, _, _ in pipeline_blocks(model)] + parts, tp, sequence_parallel) as recorder:
        with autocast(precision, torch.device("cpu")):
            if tp == 1 and m.spec.loss_in_head:  # as ``paratrain.parallel.model_loss.TokenSumLoss`` computes the loss
                loss = model(**batch, labels=labels)
            else:
                logits = model(**batch)
                with recorder.in_region(parts[-1]):  # the head's
                    loss = token_loss_sum(logits.float(), labels, m.ignore_index)
        loss.backward()
    return recorder.counts()


def net_train_flops(net, batch: tuple) -> float:
    """The training FLOPs (forward and backward, no recompute) of a user's ``net`` on one global ``batch`` (its
    forward's arguments; it returns its loss), counted as a built-in model's (``_Recorder``) on fake tensors of its
    parameters', buffers' and the batch's shapes and dtypes: the net itself is left as it was. Raises what its
    forward raises on tensors without values (an op whose output depends on them, a device named in the net)."""
    import itertools

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fake(t):
        return torch.empty(t.shape, dtype=t.dtype, device="cpu").requires_grad_(t.requires_grad)

    named = itertools.chain(net.named_parameters(remove_duplicate=False), net.named_buffers(remove_duplicate=False))
    _autograd_started_on_the_cpu()
    with FakeTensorMode():
        tensors = {name: fake(t) for name, t in named}
        inputs = tuple(fake(t) if isinstance(t, torch.Tensor) else t for t in batch)
        with _Recorder(net, [], 1, False) as recorder:
            loss = torch.func.functional_call(net, tensors, inputs)
            loss.float().sum().backward()
    return recorder.counts()[""].train_flops


class _Recorder:
    """Counts, for the region each op runs in (a layer or a part of ``regions``, or "" for neither), the bytes
    autograd saves per recompute mode and the FLOPs of forward, of backward, and of the forward ops selective
    recompute runs again: a ``saved_tensors_hooks``, a dispatch mode and torch's ``ModuleTracker``."""

    def __init__(self, model, regions: list[str], tp: int, sequence_parallel: bool):
        from torch.utils.module_tracker import ModuleTracker

        from paratrain.parallel.tensor import declared_plan

        root = type(model).__name__
        plan = declared_plan(model)
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.tracker = ModuleTracker()
        self.regions = {f"{root}.{region}": region for region in regions}
        # where the residual stream is whole under sequence parallelism: in the modules that split, and around them
        splitting = [fqn for fqn, kind in plan.items() if kind in SPLIT_KINDS or isinstance(kind, tuple)]
        self.split = {f"{root}.{fqn}" for fqn in splitting} | {f"{root}.{fqn.rpartition('.')[0]}".rstrip(".")
                                                                for fqn, kind in plan.items()
                                                                if kind in ("colwise", "rowwise")}
        self.rowwise = {id(model.get_submodule(fqn)) for fqn, kind in plan.items() if kind == "rowwise"}
        self.inputs = {id(model.get_submodule(region)) for region in regions}
        self.params = {p.untyped_storage()._cdata for p in model.parameters()}
        self.entries: dict = {}
        self.override: str | None = None
        self.shared: set = set()  # storages every layer takes
        self.seen = {mode: set() for mode in RECOMPUTE_MODES}  # storages counted
        self.kept: list = []  # the tensors counted, alive until the end (a freed storage's address is reused)
        hooked = [m for m in model.modules() if id(m) in self.inputs | self.rowwise]
        self.handles = [h for m in hooked for h in (m.register_forward_pre_hook(self._enter, with_kwargs=True),
                                                     m.register_forward_hook(self._leave))]

    @contextlib.contextmanager
    def in_region(self, region: str):
        """Count what runs inside as ``region``'s."""
        self.override = region
        try:
            yield
        finally:
            self.override = None

    def entry(self, region: str | None = None) -> dict:
        """The counts of ``region``, by default the one running now."""
        if region is None:
            running = max((r for r in self.tracker.parents if r in self.regions), key=len, default=None)
            region = self.override or self.regions.get(running, "")
        return self.entries.setdefault(region, {
            "saved": dict.fromkeys(RECOMPUTE_MODES, 0.0), "forward": 0.0, "backward": 0.0, "recomputed": 0.0})

    def on_stream(self) -> bool:
        """Whether this op runs on the residual stream (1/tp of the tokens under sequence parallelism)."""
        return not self.split & self.tracker.parents

    def note(self, t, modes: tuple, on_stream: bool) -> None:
        """Count ``t``'s storage for each of ``modes`` where it is not counted yet: in this region, or the model's
        own when it is one of the inputs every layer takes (the encoder output, the masks)."""
        storage = t.untyped_storage()
        if storage._cdata in self.params:
            return
        nbytes = storage.nbytes() / (self.tp if on_stream and self.sequence_parallel else 1)
        entry = self.entry("" if storage._cdata in self.shared else None)
        for mode in modes:
            if storage._cdata not in self.seen[mode]:
                self.seen[mode].add(storage._cdata)
                entry["saved"][mode] += nbytes
        self.kept.append(t)

    def _enter(self, module, args, kwargs):
        """A layer's or a part's inputs are what a checkpoint of it keeps; those after the first (the encoder output,
        the masks) are the same for every layer."""
        from torch.utils._pytree import tree_leaves

        if id(module) not in self.inputs:
            return
        tensors = [t for t in tree_leaves((args, kwargs)) if hasattr(t, "untyped_storage")]
        first = args[0] if args and hasattr(args[0], "untyped_storage") else None
        self.shared |= {t.untyped_storage()._cdata for t in tensors if t is not first}
        for t in tensors:
            self.note(t, ("selective", "full"), self.on_stream())

    def _leave(self, module, args, output):
        if id(module) in self.rowwise and self.tp > 1:  # the output of its all-reduce (reduce-scatter)
            self.entry()["saved"]["selective"] += output.untyped_storage().nbytes() / (
                self.tp if self.sequence_parallel else 1)

    def pack(self, t):
        self.note(t, ("none",), self.on_stream())
        return t

    def op(self, func, args, kwargs, out) -> None:
        """After an op: its FLOPs; in forward, its outputs if selective recompute keeps them."""
        from torch.utils._pytree import tree_leaves
        from torch.utils.flop_counter import flop_registry

        from paratrain.parallel.recompute import keeps

        formula = flop_registry.get(func._overloadpacket) or cpu_flash_formula().get(func._overloadpacket)
        flops = _formula_flops(formula, args, kwargs, out) if formula is not None else 0
        entry, backward = self.entry(), self.tracker.is_bw
        entry["backward" if backward else "forward"] += flops
        if backward:
            return
        if keeps(func, args, kwargs):
            for t in tree_leaves(out):
                if hasattr(t, "untyped_storage"):
                    self.note(t, ("selective",), self.on_stream())
        else:
            entry["recomputed"] += flops

    def counts(self) -> dict:
        self.entry()  # the model's own
        return {region: Counts(e["saved"], e["forward"], e["backward"], e["recomputed"])
                for region, e in self.entries.items()}

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                recorder.op(func, args, kwargs or {}, out)
                return out

        self.contexts = [self.tracker, torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t), Dispatch()]
        for context in self.contexts:
            context.__enter__()
        return self

    def __exit__(self, *exc):
        for context in reversed(self.contexts):
            context.__exit__(*exc)
        for handle in self.handles:
            handle.remove()
        return False


def _formula_flops(formula, args, kwargs, out) -> float:
    """``formula``'s FLOPs of an op; an attention whose key/value heads serve groups of query heads, which torch
    2.11's formulas refuse, counted with its key/value heads repeated (the same FLOPs)."""
    try:
        return formula(*args, **kwargs, out_val=out)
    except AssertionError:
        heads = max(a.shape[1] for a in args if hasattr(a, "ndim") and a.ndim == 4)
        args = [a.repeat_interleave(heads // a.shape[1], 1) if hasattr(a, "ndim") and a.ndim == 4 and a.shape[1] < heads
                else a for a in args]
        return formula(*args, **kwargs, out_val=out)


@functools.cache
def cpu_flash_formula() -> dict:
    """The FLOPs formulas of the CPU's fused attention kernel, forward and backward, which ``torch.utils.flop_counter``
    lacks: the CUDA flash kernel's (the same leading arguments)."""
    import torch
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[aten._scaled_dot_product_flash_attention],
            aten._scaled_dot_product_flash_attention_for_cpu_backward:
                flop_registry[aten._scaled_dot_product_flash_attention_backward]}
