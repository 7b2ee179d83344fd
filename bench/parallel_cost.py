"""Communication and model-state memory of parallel layouts: counted on real steps against an analytic model.

For each layout (data parallel with ZeRO stages, tensor parallel with and without
sequence parallel and vocab sharding, 2D, expert parallel with its all-to-all) and each model (a small encoder-decoder
and a GPT), ``paratrain.trainer.Trainer`` runs real training steps in forked gloo
workers. After one warm-up step (FSDP2 lazy init, first all-gathers) the next
``--steps`` steps run under a ``TorchDispatchMode`` that sees every collective:
DTensor's functional collectives (``torch.ops._c10d_functional.*``, also those
issued inside DTensor's own op dispatch, e.g. the vocab-parallel loss) and the
c10d ops FSDP2 and ``torch.distributed`` calls issue (``torch.ops.c10d.*``:
``_allgather_base_``, ``_reduce_scatter_base_``, ``allreduce_`` ...).

(a) Bytes sent per step per rank, by the ring formula on the full tensor of size S
    over a group of n ranks: all-reduce 2(n-1)/n*S, all-gather and reduce-scatter
    (n-1)/n*S. Collectives are labelled by the phase of ``train_step`` they run in:
    ``fwd_bwd`` (forward + backward, FSDP2's gathers and gradient reductions),
    ``optimizer``, and the small ones listed apart: ``scalars`` (token count and
    loss all-reduces over dp), ``grad_norm`` (the global gradient norm) and
    ``loss_value``. The compared number is everything except those three
    labels; the analytic value is ``analytic_comm`` below (Megatron's tensor-parallel
    collectives + FSDP2's data-parallel ones, derived from the model's shapes).
(b) Parameter + gradient + optimizer-state bytes per rank, read from the tensors
    (local shards of DTensors; gradients just before ``zero_grad``; AdamW's
    exp_avg / exp_avg_sq / step) against ``analytic_state``.

Both are reported as the maximum over ranks (all ranks of a layout agree here).

    python bench/parallel_cost.py [--json PATH] [--layouts a,b] [--models transformer,gpt] [--detail]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tests/forked_ranks.py: forked gloo workers

from forked_ranks import run_distributed  # noqa: E402
from paratrain.plan.cost import collective_bytes  # noqa: E402

# name: parallel section (micro_batch_num stays 1: every formula below is per micro-batch
# for tensor parallel, and ZeRO < 3 communicates once per step anyway)
LAYOUTS = {
    "dp2_zero0": {"dp": 2},
    "dp2_zero1": {"dp": 2, "zero_stage": 1},
    "dp2_zero2": {"dp": 2, "zero_stage": 2},
    "dp2_zero3": {"dp": 2, "zero_stage": 3},
    "dp4_zero3": {"dp": 4, "zero_stage": 3},
    "mp2": {"mp": 2},
    "mp4": {"mp": 4},
    "mp2_sp": {"mp": 2, "sequence_parallel": True},
    "mp2_vocab_sharded": {"mp": 2, "vocab_emb_dp": False},
    "mp2_sp_vocab_sharded": {"mp": 2, "sequence_parallel": True, "vocab_emb_dp": False},
    "dp2_mp2_zero0": {"dp": 2, "mp": 2},
    "dp2_mp2_zero3": {"dp": 2, "mp": 2, "zero_stage": 3},
    # a mixture of experts in every layer, its 4 experts split over the 2 data-parallel ranks (all-to-all)
    "dp2_ep2_moe": {"dp": 2, "expert_parallel": 2, "model": {"moe": {"expert_num": 4, "num_experts_chosen": 2}}},
}
MODELS = ("transformer", "gpt")
SMALL_PHASES = ("scalars", "grad_norm", "loss_value")  # listed apart, not compared
# (object, attribute, phase): collectives issued while the attribute runs get that phase label
LABELS = [("trainer_module", "clip_grad_norm", "grad_norm"),
          ("trainer_module", "_whole", "loss_value"), ("trainer_module", "whole", "loss_value"),
          ("layout", "all_reduce_dp", "scalars"), ("layout", "all_reduce_pp", "scalars"),
          ("optimizer", "step", "optimizer")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names of LAYOUTS")
    p.add_argument("--models", default=",".join(MODELS), help="transformer (encoder-decoder) and/or gpt")
    p.add_argument("--steps", type=int, default=2, help="counted steps after one warm-up step")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--layers", type=int, default=2, help="encoder layers = decoder layers = GPT layers")
    p.add_argument("--length", type=int, default=32, help="source = target length, GPT sequence length")
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--detail", action="store_true",
                   help="print every collective of one step on rank 0 (the module is ModTracker's innermost "
                        "current module: exact in forward, approximate in backward)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per group of forked workers")
    return p.parse_args(argv)


def make_config(a: argparse.Namespace, kind: str, layout: dict, run_dir: str):
    from paratrain import config_file

    parallel = {k: v for k, v in layout.items() if k != "model"}
    return config_file.from_dict({
        "run": {"dir": run_dir, "seed": 0},
        "model": {"kind": kind, "vocab_size": a.vocab, "hidden_size": a.hidden, "num_heads": a.heads,
                  "ffn_hidden_size": a.ffn, "encoder_layers": a.layers, "decoder_layers": a.layers,
                  "src_seq_length": a.length, "tgt_seq_length": a.length, "seq_length": a.length,
                  "hidden_dropout": 0.0, "attention_dropout": 0.0, **layout.get("model", {})},
        "parallel": parallel,
        "train": {"global_batch_size": a.batch, "steps": 1 + a.steps, "lr": 1e-3, "warmup_steps": 1},
        "metrics": {"log_steps": 1000},
    })


def world_size(parallel: dict) -> int:
    return parallel.get("dp", 1) * parallel.get("mp", 1)


# --- counting collectives ---------------------------------------------------------------------

# c10d op -> (kind, index of the argument holding this rank's input)
C10D_OPS = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 1), "allgather_": ("all_gather", 1),
    "allgather_coalesced_": ("all_gather", 1), "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0), "reduce_": ("reduce", 0), "gather_": ("gather", 0),
    "scatter_": ("scatter", 0), "send": ("send", 0), "recv_": ("recv", 0),
}
# _c10d_functional op -> kind (input is argument 0, the group is the argument named group_name)
FUNCTIONAL_OPS = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast", "broadcast_": "broadcast",
}
NOT_COMMUNICATING = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_"}


def _tensor_bytes(value) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _shape(value):
    import torch

    if isinstance(value, torch.Tensor):
        return list(value.shape)
    if isinstance(value, (list, tuple)):
        return [_shape(v) for v in value][:4]
    return None


def _counter_class():
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveCounter(TorchDispatchMode):
        """Records every collective (op, group size, bytes sent by the ring formula, phase, module)."""

        def __init__(self, tracker=None):
            super().__init__()
            self.events: list[dict] = []
            self.phase = "fwd_bwd"
            self.tracker = tracker

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # let DTensor dispatch; its collectives come back through this mode
            ns, name = func.namespace, func._schema.name.split("::")[-1]
            if ns in ("c10d", "_c10d_functional", "c10d_functional") and name not in NOT_COMMUNICATING:
                self._record(func, ns, name, args, kwargs)
            return func(*args, **kwargs)

        def _record(self, func, ns, name, args, kwargs):
            if ns == "c10d":
                kind, index = C10D_OPS.get(name, ("unknown", 0))
                names = [arg.name for arg in func._schema.arguments]
                group = args[names.index("process_group")]  # a ScriptObject: unbox it
                n = (group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group)).size()
            else:
                kind, index = FUNCTIONAL_OPS.get(name, "unknown"), 0
                group = kwargs.get("group_name", args[-1])
                n = (group if isinstance(group, dist.ProcessGroup) else _resolve_process_group(group)).size()
            local = _tensor_bytes(args[index])
            full = local * n if kind == "all_gather" else local
            module = "?"
            if self.tracker is not None:
                module = max(self.tracker.parents, key=lambda p: p.count("."))
                module += " (bw)" if self.tracker.is_bw else ""
            self.events.append({"phase": self.phase, "op": f"{ns}.{name}", "kind": kind, "group_size": n,
                                "shape": _shape(args[index]), "full_bytes": full,
                                "bytes_sent": collective_bytes(kind, full, n), "module": module})

    return CollectiveCounter


@contextlib.contextmanager
def labelled(counter, obj, attr: str, phase: str):
    """While ``obj.attr`` runs, collectives are labelled ``phase``."""
    original = getattr(obj, attr)
    own = attr in getattr(obj, "__dict__", {})  # else a class attribute: deleting ours restores it

    def wrapper(*args, **kwargs):
        previous, counter.phase = counter.phase, phase
        try:
            return original(*args, **kwargs)
        finally:
            counter.phase = previous

    setattr(obj, attr, wrapper)
    try:
        yield
    finally:
        if own:
            setattr(obj, attr, original)
        else:
            delattr(obj, attr)


# --- per-rank model-state bytes ---------------------------------------------------------------

def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    t = t._local_tensor if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def state_bytes(model, optimizer, grad_bytes: int) -> dict:
    params = {id(p): p for p in model.parameters()}.values()
    opt = defaultdict(int)
    for state in optimizer.state.values():
        for key, value in state.items():
            if hasattr(value, "numel"):
                opt[key] += _local_bytes(value)
    param_bytes = sum(_local_bytes(p) for p in params)
    return {"params": param_bytes, "grads": grad_bytes, "optimizer": dict(opt),
            "total": param_bytes + grad_bytes + sum(opt.values())}


# --- the worker -------------------------------------------------------------------------------

def measure(configs: dict, steps: int) -> dict:
    """On every rank: for each config, one warm-up step, then ``steps`` counted steps."""
    import logging

    import paratrain.trainer as trainer_module
    from torch.distributed._tools.mod_tracker import ModTracker

    # "2 sequential all_reduce operations will be performed" (2D grad norm): counted under grad_norm
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    counter_class = _counter_class()
    out = {}
    for name, cfg in configs.items():
        trainer = trainer_module.Trainer(cfg)
        trainer.train_step()
        trainer.step += 1
        tracker = ModTracker()
        counter = counter_class(tracker)
        grads = {}

        def zero_grad(*args, _original=trainer.optimizer.zero_grad, **kwargs):
            grads["bytes"] = sum(_local_bytes(p.grad) for p in {id(p): p for p in trainer.model.parameters()}.values()
                                 if p.grad is not None)
            return _original(*args, **kwargs)

        trainer.optimizer.zero_grad = zero_grad
        with contextlib.ExitStack() as stack:
            for obj, attr, phase in LABELS:
                obj = {"trainer_module": trainer_module, "layout": trainer.layout,
                       "optimizer": trainer.optimizer}[obj]
                if hasattr(obj, attr):  # names of the trainer version at hand
                    stack.enter_context(labelled(counter, obj, attr, phase))
            stack.enter_context(tracker)
            stack.enter_context(counter)
            for _ in range(steps):
                trainer.train_step()
                trainer.step += 1
        by_phase = defaultdict(float)
        for e in counter.events:
            by_phase[e["phase"]] += e["bytes_sent"] / steps
        out[name] = {"comm_by_phase": dict(by_phase),
                     "comm": sum(v for k, v in by_phase.items() if k not in SMALL_PHASES),
                     "events": counter.events[: len(counter.events) // steps],
                     "state": state_bytes(trainer.model, trainer.optimizer, grads.get("bytes", 0))}
    return out


# --- the analytic model -----------------------------------------------------------------------

COLWISE = ("q_proj", "k_proj", "v_proj", "fc1")  # weight and bias sharded over mp
ROWWISE = ("out_proj", "fc2")  # weight sharded over mp, bias replicated


def param_split(cfg) -> dict:
    """Parameter bytes of one tensor-parallel rank, from the plain model's shapes (Megatron's split).

    Returns those bytes, the number of parameter tensors, the LayerNorm bytes (their grads
    are partial sums over mp with sequence parallel) and the experts' bytes of one expert-parallel rank (apart:
    data parallelism does not reduce them).
    """
    import torch
    from torch import nn

    from paratrain.models import build_model

    torch.manual_seed(0)
    model = build_model(cfg.model)
    mp = cfg.parallel.model_parallel
    norms = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    split = {"params": 0.0, "tensors": 0, "norm": 0.0, "experts": 0.0}
    for name, p in {id(p): (n, p) for n, p in model.named_parameters()}.values():
        module, leaf = name.rsplit(".", 2)[-2:]
        split["tensors"] += 1
        if module == "experts":  # sharded on the expert dim over expert_parallel (this layout: mp 1)
            split["experts"] += p.numel() * p.element_size() / cfg.parallel.expert_parallel
            continue
        sharded = (module in COLWISE or (module in ROWWISE and leaf == "weight") or module == "head"
                   or (name.endswith("word.embedding.weight") and not cfg.parallel.vocab_emb_dp))
        nbytes = p.numel() * p.element_size() / (mp if sharded else 1)
        split["params"] += nbytes
        split["norm"] += nbytes if id(p) in norms else 0
    return split


def tp_shapes(cfg) -> dict:
    """Activation bytes of one micro-batch on one rank (a = B*L*H*dtype bytes) and the layer counts."""
    m, p = cfg.model, cfg.parallel
    b = 4 if m.dtype == "float32" else 2
    batch = cfg.train.global_batch_size // p.data_parallel // p.micro_batch_num
    if m.kind == "gpt":
        a = batch * m.seq_length * m.hidden_size * b
        return {"a_src": a, "a_tgt": a, "enc_layers": m.decoder_layers, "dec_layers": 0, "embed_calls": [a],
                "positions": [m.seq_length * m.hidden_size * b], "tokens": batch * m.seq_length}
    a_src, a_tgt = (batch * length * m.hidden_size * b for length in (m.src_seq_length, m.tgt_seq_length))
    return {"a_src": a_src, "a_tgt": a_tgt, "enc_layers": m.encoder_layers, "dec_layers": m.decoder_layers,
            "embed_calls": [a_src, a_tgt], "tokens": batch * m.tgt_seq_length,
            "positions": [length * m.hidden_size * b for length in (m.src_seq_length, m.tgt_seq_length)]}


def analytic_comm(cfg) -> dict:
    """Bytes each rank should send per step, by component (``micro_batch_num`` micro-batches).

    Tensor parallel (Megatron, n = mp, a = B*L*H activation bytes of one micro-batch, B = the
    rank's micro-batch): per encoder/GPT layer 2 all-reduces forward (attention and FFN
    outputs) and 2 backward (their input gradients); per decoder layer 3 forward and 4
    backward (the 4th is the encoder output's gradient from cross-attention, of B*S*H).
    With sequence parallel each all-reduce becomes an all-gather + reduce-scatter pair (same
    bytes). The head's input gradient is all-reduced (SP: gathered forward, reduce-scattered
    backward). Vocab-parallel loss: 3 all-reduces of B*T fp32 (max, sum of exp, target logit).
    A vocab-sharded embedding all-reduces its partial lookups (SP: reduce-scatter forward and
    all-gather backward); a replicated one under SP all-gathers its output gradient. With SP the
    LayerNorm gradients (partial sums over the sequence shards) are all-reduced once, and the
    position table's gradient (L*H per table, each rank adds its rows) is all-gathered.

    Data parallel (FSDP2 over dp, f = (dp-1)/dp, P = parameter bytes of this rank's tensor-parallel
    shard): stage 0 all-reduces the gradients (2fP); stages 1-2 all-gather the parameters once and
    reduce-scatter the gradients (2fP); stage 3 gathers again in backward (3fP per micro-batch).

    Expert parallel (``paratrain.plan.cost.all_to_all_bytes``, per micro-batch): each mixture-of-experts layer's
    dispatch and combine all-to-all, forward and backward; the experts' gradients are all-reduced over the
    dp / ep ranks holding the same experts.
    """
    from paratrain.plan.cost import DTYPE_BYTES, all_to_all_bytes

    p = cfg.parallel
    dp, mp, micro = p.data_parallel, p.model_parallel, p.micro_batch_num
    ar, half = 2 * (mp - 1) / mp, (mp - 1) / mp  # all-reduce; all-gather or reduce-scatter
    comp = {}
    split = param_split(cfg)
    if mp > 1:
        t = tp_shapes(cfg)
        a_src, a_tgt = t["a_src"], t["a_tgt"]
        comp["tp_layers"] = micro * ar * (t["enc_layers"] * 4 * a_src + t["dec_layers"] * (6 * a_tgt + a_src))
        comp["tp_head"] = micro * ar * a_tgt
        comp["tp_loss_stats"] = micro * ar * 3 * t["tokens"] * 4
        if not p.vocab_emb_dp:  # partial lookups summed: all-reduce (SP: reduce-scatter fwd + all-gather bwd)
            comp["tp_embedding"] = micro * ar * sum(t["embed_calls"])
        elif p.sequence_parallel:  # replicated embedding split along the sequence: bwd all-gathers its grad
            comp["tp_embedding"] = micro * half * sum(t["embed_calls"])
        if p.sequence_parallel:  # LayerNorm grads are partial sums over the sequence shards
            comp["tp_sp_norm_grads"] = ar * split["norm"]
            # each rank adds only its rows of the (L, H) position table: backward all-gathers that grad
            comp["tp_sp_position_grads"] = micro * half * sum(t["positions"])
    if dp > 1:
        f = (dp - 1) / dp
        params = split["params"]  # P_local: the parameter bytes of this rank's tensor-parallel shard
        if not p.shards_parameters:  # one all-reduce of the gradients
            comp["dp_grads"] = 2 * f * params
            if p.shards_only_optimizer_state:  # then every parameter broadcast from the rank that stepped it
                comp["dp_params_broadcast"] = f * params
        elif p.effective_zero_stage < 3:  # all-gather in forward, reduce-scatter of the gradients
            comp["dp_params_grads"] = 2 * f * params
        else:  # all-gather in forward and again in backward, reduce-scatter, per micro-batch
            # (the root module's too: FSDP2 reshards it after forward like the layer groups)
            comp["dp_params_grads"] = micro * 3 * f * params
    ep = p.expert_parallel
    if ep > 1:
        rows = cfg.train.global_batch_size // dp // micro
        comp["ep_all_to_all"] = micro * all_to_all_bytes(cfg.model, p, rows, DTYPE_BYTES[cfg.model.dtype])
    if dp // ep > 1:
        comp["edp_expert_grads"] = collective_bytes("all_reduce", split["experts"], dp // ep)
    comp["total"] = sum(comp.values())
    return comp


def analytic_state(cfg) -> dict:
    """Per-rank bytes at rest: parameters, gradients, AdamW exp_avg + exp_avg_sq (+ a 4-byte step per tensor)."""
    split = param_split(cfg)
    params = split["params"]
    if cfg.parallel.shards_parameters:  # stages 2 and 3 shard params, grads and states
        params /= cfg.parallel.data_parallel
    optimizer = 2 * params + 4 * split["tensors"]
    if cfg.parallel.shards_only_optimizer_state:
        optimizer /= cfg.parallel.data_parallel  # replicas, each stepping ~1/dp of the parameter tensors
    params += split["experts"]  # each expert-parallel rank's experts, whole
    optimizer += 2 * split["experts"]
    return {"params": params, "grads": params, "optimizer": optimizer, "total": 2 * params + optimizer}


def known_excess(cfg) -> dict:
    """What paratrain (torch 2.13) sends or keeps beyond the analytic model, found with ``--detail``.

    These are not part of the analytic value (the acceptance ratio is measured/analytic); they
    are listed so that measured = analytic + excess can be checked to the byte.
    """
    p = cfg.parallel
    comm, state, small = {}, {}, {}
    if p.model_parallel > 1 and p.sequence_parallel and p.data_parallel == 1:
        ar = 2 * (p.model_parallel - 1) / p.model_parallel
        # the Partial LayerNorm grads stay Partial in .grad: clip_grad_norm all-reduces them for
        # the norm and the optimizer step all-reduces them again (FSDP2 reduces them once when dp > 1)
        small["grad_norm"] = ar * param_split(cfg)["norm"]
    return {"comm": comm, "state": state, "small": small}


# --- driver -----------------------------------------------------------------------------------

def run(a: argparse.Namespace) -> list[dict]:
    names, models = a.layouts.split(","), a.models.split(",")
    unknown = [n for n in names if n not in LAYOUTS] + [k for k in models if k not in MODELS]
    if unknown:
        raise SystemExit(f"unknown layout or model: {unknown}; layouts: {', '.join(LAYOUTS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="parallel_cost_") as tmp:
        jobs = defaultdict(dict)  # world size -> {(model, layout): config}
        for kind in models:
            for name in names:
                jobs[world_size(LAYOUTS[name])][f"{kind}/{name}"] = make_config(
                    a, kind, LAYOUTS[name], f"{tmp}/{kind}_{name}")
        for world, configs in sorted(jobs.items()):
            per_rank = run_distributed(measure, world, configs, a.steps, timeout=a.timeout)
            for key, cfg in configs.items():
                rows.append(compare(key, cfg, [r[key] for r in per_rank]))
    order = {f"{k}/{n}": i for i, (k, n) in enumerate((k, n) for k in models for n in names)}
    return sorted(rows, key=lambda r: order[r["name"]])


def compare(key: str, cfg, ranks: list[dict]) -> dict:
    comm = analytic_comm(cfg)
    state = analytic_state(cfg)
    measured_comm = max(r["comm"] for r in ranks)
    measured_state = max(r["state"]["total"] for r in ranks)
    small = {ph: max(r["comm_by_phase"].get(ph, 0.0) for r in ranks) for ph in SMALL_PHASES}
    excess = known_excess(cfg)
    comm_explained = comm["total"] + sum(excess["comm"].values())
    state_explained = state["total"] + sum(excess["state"].values())
    return {"name": key, "world_size": len(ranks),
            "comm_bytes": measured_comm, "comm_analytic": comm["total"],
            "comm_ratio": measured_comm / comm["total"] if comm["total"] else (1.0 if measured_comm == 0 else
                                                                              float("inf")),
            "comm_analytic_parts": comm, "comm_by_phase": ranks[0]["comm_by_phase"], "small_collectives": small,
            "state_bytes": measured_state, "state_analytic": state["total"],
            "state_ratio": measured_state / state["total"], "state_parts": ranks[0]["state"],
            "state_analytic_parts": state, "known_excess": excess,
            "comm_explained_ratio": measured_comm / comm_explained if comm_explained else 1.0,
            "state_explained_ratio": measured_state / state_explained, "events": ranks[0]["events"]}


def print_table(rows: list[dict], detail: bool) -> None:
    """ratio = measured/analytic; +excess = measured/(analytic + known_excess), which should be 1."""
    head = (f"{'layout':34} {'comm KB/step':>12} {'analytic':>9} {'ratio':>6} {'+excess':>7}   "
            f"{'state KB':>9} {'analytic':>9} {'ratio':>6} {'+excess':>7}   {'small KB: scalars,norm,loss':>28}")
    print(head)
    print("-" * len(head))
    for r in rows:
        small = ",".join(f"{r['small_collectives'][ph] / 1024:.2f}" for ph in SMALL_PHASES)
        print(f"{r['name']:34} {r['comm_bytes'] / 1024:12.1f} {r['comm_analytic'] / 1024:9.1f} "
              f"{r['comm_ratio']:6.3f} {r['comm_explained_ratio']:7.3f}   {r['state_bytes'] / 1024:9.1f} "
              f"{r['state_analytic'] / 1024:9.1f} {r['state_ratio']:6.3f} {r['state_explained_ratio']:7.3f}   "
              f"{small:>28}")
        if detail:
            grouped = defaultdict(lambda: [0, 0.0])
            for e in r["events"]:
                k = (e["phase"], e["op"], e["group_size"], str(e["shape"]), e["module"])
                grouped[k][0] += 1
                grouped[k][1] += e["bytes_sent"]
            for (phase, op, n, shape, module), (count, sent) in grouped.items():
                print(f"    {phase:10} {op:48} n={n} x{count:<3} {shape:18} {sent / 1024:9.2f} KB  {module}")
            print(f"    analytic: { {k: round(v / 1024, 2) for k, v in r['comm_analytic_parts'].items()} }")


def main(argv=None) -> int:
    a = parse_args(argv)
    rows = run(a)
    print_table(rows, a.detail)
    bad = [r["name"] for r in rows if r["comm_ratio"] > 1.05 or r["state_ratio"] > 1.05]
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "bar": 1.05, "over_bar": bad,
            "layouts": {r["name"]: {k: v for k, v in r.items() if k != "events"} for r in rows}}, indent=1))
    unknown = sorted({e["op"] for r in rows for e in r["events"] if e["kind"] == "unknown"})
    if unknown:
        print(f"\ncollectives of unknown kind (counted as (n-1)/n of their input): {', '.join(unknown)}")
    if bad:
        print(f"\nmeasured/analytic above 1.05: {', '.join(bad)}")
    excess = defaultdict(list)
    for r in rows:
        for kind in ("comm", "state", "small"):
            for name, value in r["known_excess"][kind].items():
                excess[f"{kind}: {name}"].append(f"{r['name']} {value / 1024:.1f} KB")
    if excess:
        print("\nknown excess over the analytic model (per step per rank; see known_excess()):")
        for name, where in excess.items():
            print(f"  {name}: " + "; ".join(where))
    return 0


if __name__ == "__main__":
    sys.exit(main())
