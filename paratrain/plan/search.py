"""Layouts: evaluate one (memory per device, step time, MFU, feasibility), enumerate and rank them, and choose one for
a job (``parallel.auto``).

Step time of one rank = (micro_batch_num + bubble) x (compute + tensor-parallel + pipeline communication of one
micro-batch) + data-parallel communication, where compute is the rank's hardware FLOPs (recompute included) over
peak x efficiency and communication is ring volume over the bandwidth of the link class the group spans. The mesh is
("pp", "dp", "tp") with tp innermost: a tp group stays inside a node when tp <= devices_per_node, a dp group when dp
x tp <= devices_per_node, pipeline neighbours when the whole job fits one node.

ZeRO-Offload (``offload_optimizer`` / ``offload_param`` = "cpu", FSDP2's CPUOffloadPolicy) moves the rank's model
state at rest (parameter shards, gradients, optimizer state) from the device to host memory; the device keeps what
is gathered (the whole parameters a step works on, unsharded gradients before their reduce-scatter) and the
activations. Each gather copies the parameter shard host -> device (once a step at stages 1-2; in forward and in
backward of every micro-batch at stage 3), each reduced gradient shard goes back, and AdamW runs on the host at its
memory bandwidth. The search considers offload only when no layout fits without it.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os

from paratrain.config import Config, ConfigError, ParallelConfig
from paratrain.config_rules import divisors, validate
from paratrain.metrics.flops import model_flops
from paratrain.plan import cost
from paratrain.plan.cost import Hardware, collective_bytes

FIELDS = ("data_parallel", "model_parallel", "pipeline_stage", "micro_batch_num", "zero_stage", "recompute",
          "sequence_parallel", "offload_optimizer", "offload_param")


def evaluate(cfg: Config, par: ParallelConfig, hw: Hardware, cache: dict | None = None) -> dict:
    """Memory per device, predicted step time and MFU of one layout (``par``) of ``cfg``'s model.

    A layout that breaks a configuration rule (e.g. a global batch not divisible by data_parallel)
    is still costed, with the micro-batch rounded up, and reported infeasible with the rule.
    """
    m = cfg.model
    dp, tp, pp, mb = par.data_parallel, par.model_parallel, par.pipeline_stage, par.micro_batch_num
    gb = cfg.train.global_batch_size
    b = -(-gb // (dp * mb))
    row = {**{k: getattr(par, k) for k in FIELDS}, "zero_stage": par.effective_zero_stage, "micro_batch_size": b,
           "pipeline_schedule": par.pipeline_schedule if pp > 1 else "none",
           "virtual_pipeline_stage": par.virtual_pipeline_stage}
    problems = validate(dataclasses.replace(cfg, parallel=par), dp * tp * pp)
    if any(size % tp for size in (m.num_heads, m.hidden_size, m.ffn_hidden_size)) or \
            pp * par.virtual_pipeline_stage > m.num_layers:
        row.update(feasible=False, reason="; ".join(problems), memory_gib=None, step_time_s=None, mfu=None)
        return row
    spec = cost.activation_spec(cfg)
    pbytes = cost.DTYPE_BYTES[m.dtype]
    key = (dp, tp, pp, par.shards_parameters, par.shards_only_optimizer_state, par.virtual_pipeline_stage,
           par.pipeline_schedule, par.vocab_emb_dp, par.gradient_aggregation_group)
    cache = {} if cache is None else cache
    if key not in cache:
        cache[key] = cost.stage_states(m, par, pbytes)
    states = cache[key]
    modes = cost.recompute_modes(par, m)
    zero, accumulate = par.effective_zero_stage, (mb > 1 or pp > 1)
    tokens = cost.tokens_per_rank(cfg, dp)
    travel = par.moves_tokens(tokens, m.vocab_size)  # the tables stay sharded (paratrain.parallel.vocab)
    worst, act_micro = None, []
    for stage, st in enumerate(states):
        act = cost.stage_activation_bytes(cfg, par, stage, st, spec, modes)
        produced = cost.stage_activation_bytes(cfg, par, stage, st, spec, ["none"] * len(modes))["per_micro_batch"]
        act_micro.append(produced * (4 if "full" in modes else 3))  # bytes streamed by elementwise work
        if not par.shards_parameters:  # replicas (stages 0, 1): gradients reduced in their own storage
            transient = 0
        elif zero < 3 or pp > 1:  # whole parameters gathered, gradients accumulated whole
            gathered = st.whole_params - (st.table_params if travel else 0)
            transient = gathered + (gathered if accumulate else st.group_params)
        else:
            transient = 3 * st.group_params  # two groups' parameters (prefetch) and one group's gradients
        total = (0 if par.offloads else st.total) + transient + act["total"]
        if worst is None or total > worst[0]:
            worst = (total, stage, st, act, transient)
    total, stage, st, act, transient = worst
    per_layer = {}
    source, target = m.lengths
    for d, moe, mode in itertools.product((False, True), (False, True), ("none", "selective", "full")):
        tokens = b * (target if d else source)
        collectives = (7 if d else 4) + ((3 if d else 2) if mode == "full" else 0)  # TP all-reduces
        calls = collectives * (2 if par.sequence_parallel else 1) if tp > 1 else 0  # SP: gather + scatter
        per_layer[(d, moe, mode)] = (cost.layer_train_flops(m, tp, b, d, moe, mode),
                                     collectives * tokens * m.hidden_size * spec.elem, calls)
    tokens_b = b * target
    times = []
    for s in states:
        flops, tp_bytes, calls = 0.0, 0.0, 0
        for _, d, i in s.layers:
            fl, by, n = per_layer[(d, cost.is_moe(m, d, i), modes[i + m.encoder_layers if d else i])]
            flops, tp_bytes, calls = flops + fl, tp_bytes + by, calls + n
        if any("head" in parts for parts in s.parts):
            flops += 3 * 2 * tokens_b * m.hidden_size * m.vocab_size / tp
            tp_bytes += tokens_b * m.hidden_size * spec.elem + 3 * tokens_b * 4
        # elementwise work (norms, softmax, activations, dropout) streams the activations ~3 times (4 with
        # full recompute); each layer costs a fixed overhead per micro-batch
        memory_time = act_micro[len(times)] / hw.mem_bw + len(s.layers) * hw.layer_overhead + calls * hw.latency
        tp_time = hw.transfer_time(collective_bytes("all_reduce", tp_bytes, tp), tp)
        times.append((hw.compute_time(flops) + memory_time + tp_time, flops))
    t_micro = max(t for t, _ in times)
    pp_time = 0.0
    if pp > 1:  # forward activation and backward gradient over each boundary, per micro-batch
        boundary = tokens_b * m.hidden_size * spec.elem / (tp if par.sequence_parallel else 1)
        if m.spec.encoder_decoder:
            boundary *= 2  # encoder output + decoder state
        pp_time = hw.transfer_time(2 * boundary * par.virtual_pipeline_stage, dp * tp * pp)
    dp_time = 0.0
    if dp > 1:
        whole = max(s.whole_params - (s.table_params if travel else 0) for s in states)
        # tokens travelling to the tables: hidden-sized rows gathered and reduce-scattered per use and micro-batch
        uses = max(s.table_uses for s in states) if travel else 0
        token_rows = mb * uses * 2 * collective_bytes("all_gather", dp * tokens * m.hidden_size * spec.elem, dp)
        if zero == 3:  # parameters gathered in forward and backward, gradients reduce-scattered
            gathers = 1 if pp > 1 else mb
            volume = gathers * (2 * collective_bytes("all_gather", whole, dp)
                                + collective_bytes("reduce_scatter", whole, dp))
        else:  # stage 1 on replicas: the all-reduce, then every parameter broadcast from its owner
            volume = collective_bytes("all_reduce", whole, dp) + (
                collective_bytes("all_gather", whole, dp) if par.shards_only_optimizer_state else 0)
        # one gather and/or reduction per layer group (gradient_aggregation_group buckets)
        groups = par.aggregation_groups(max(len(s.layers) for s in states)) + 1
        calls = groups * (3 * (1 if pp > 1 else mb) if zero == 3 else (2 if zero else 1))
        calls += 2 * mb * uses
        dp_time = hw.transfer_time(volume + token_rows, dp * tp, calls)
    bubble = cost.bubble_micro_batches(par)
    # AdamW reads parameter, gradient and two states and writes three of them
    optimizer_time = max(7 * s.stepped for s in states) / (hw.host_mem_bw if par.offloads else hw.mem_bw)
    host = cost.offload_bytes(par, st) if par.offloads else {"host": 0, "host_to_device": 0, "device_to_host": 0}
    offload_time = (host["host_to_device"] + host["device_to_host"]) / hw.host_bw
    ep_time = hw.transfer_time(mb * cost.all_to_all_bytes(m, par, b, spec.elem), dp * tp)  # the experts' all-to-all
    step = (mb + bubble) * (t_micro + pp_time) + dp_time + ep_time + offload_time + optimizer_time
    mfu = model_flops(m, gb) / (step * hw.devices * hw.peak_flops)
    fits = total <= hw.usable_memory
    memory = (f"needs {total / cost.GiB:.2f} GiB on pipeline rank {stage} > {hw.usable_memory / cost.GiB:.2f} GiB "
              f"usable: model state {st.total / cost.GiB:.1f} (params {st.params / cost.GiB:.1f}, grads "
              f"{st.grads / cost.GiB:.1f}, optimizer {st.optimizer / cost.GiB:.1f}), gathered by ZeRO "
              f"{transient / cost.GiB:.1f}, activations {act['total'] / cost.GiB:.1f} ({act['in_flight']:g} "
              f"micro-batches of {act['per_micro_batch'] / cost.GiB:.2f})")
    if par.offloads:
        memory = memory.replace("model state", "model state on the host, not counted:")
    reasons = ([] if fits else [memory]) + problems
    if host["host"] > hw.host_memory:
        reasons.append(f"offload needs {host['host'] / cost.GiB:.2f} GiB of host memory per device > "
                       f"{hw.host_memory / cost.GiB:.2f} GiB")
    row.update(feasible=not reasons, reason="; ".join(reasons), memory_gib=total / cost.GiB, memory_bytes=int(total),
               step_time_s=step, mfu=mfu,
               breakdown={"params": st.params, "grads": st.grads, "optimizer": st.optimizer, "zero_gathered": transient,
                          "activations": act["total"], "in_flight": act["in_flight"],
                          "compute_s": (mb + bubble) * hw.compute_time(max(fl for _, fl in times)),
                          "bubble_micro_batches": bubble, "dp_comm_s": dp_time, "ep_comm_s": ep_time,
                          "pp_comm_s": (mb + bubble) * pp_time,
                          "optimizer_s": optimizer_time, "host_bytes": host["host"],
                          "host_to_device_bytes": host["host_to_device"],
                          "device_to_host_bytes": host["device_to_host"], "offload_s": offload_time,
                          "worst_stage": stage})
    return row


def candidates(cfg: Config, devices: int, micro_batch_sizes=(1, 2, 4, 8, 16, 32),
               zero_stages=(0, 1, 3), recomputes=("none", "selective", "full")) -> list[ParallelConfig]:
    """Every layout worth considering for ``devices``: dp x tp x pp = devices, tp dividing the heads,
    micro-batch sizes from ``micro_batch_sizes``, 1F1B and interleaved 1F1B (2 chunks per rank)."""
    m, gb = cfg.model, cfg.train.global_batch_size
    out = []

    def layout(dp, tp, pp, mb, schedule="1f1b", v=1, zero=0, rc="none", sp=False):
        out.append(dataclasses.replace(cfg.parallel, data_parallel=dp, model_parallel=tp, pipeline_stage=pp,
                                       micro_batch_num=mb, pipeline_schedule=schedule, virtual_pipeline_stage=v,
                                       zero_stage=zero, optimizer_shard=False, recompute=rc, sequence_parallel=sp,
                                       layer_stages=[]))

    for tp in divisors(devices):
        if m.num_heads % tp or m.hidden_size % tp or m.ffn_hidden_size % tp:
            continue
        for pp in divisors(devices // tp):
            if pp > m.num_layers:
                continue
            dp = devices // tp // pp
            if gb % dp:  # still listed (infeasible: the batch does not split), one plain layout
                layout(dp, tp, pp, pp)
                continue
            local = gb // dp
            sizes = sorted({b for b in micro_batch_sizes if local % b == 0} | ({local} if pp == 1 else set()))
            for b in sizes:
                mb = local // b
                if pp > 1 and mb < pp:
                    continue
                schedules = [("1f1b", 1)]
                if pp > 1 and mb % pp == 0 and m.num_layers >= 2 * pp:
                    schedules.append(("interleaved_1f1b", 2))
                for (sched, v), zero, rc, sp in itertools.product(schedules, zero_stages if dp > 1 else (0,),
                                                                 recomputes, (False, True) if tp > 1 else (False,)):
                    layout(dp, tp, pp, mb, sched, v, zero, rc, sp)
    return out


def rank_key(row: dict):
    """Feasible first, then by step time; infeasible ones by how much memory they need."""
    if row["feasible"]:
        return (0, row["step_time_s"], row["memory_gib"])
    return (1, row["memory_gib"] if row["memory_gib"] is not None else math.inf, 0)


def search(cfg: Config, hw: Hardware, **kwargs) -> list[dict]:
    """Every candidate layout evaluated, best first. When none fits, the ZeRO layouts again with
    ZeRO-Offload (optimizer state at stages 1 and 3, parameters too at stage 3)."""
    cache: dict = {}
    layouts = candidates(cfg, hw.devices, **kwargs)
    rows = [evaluate(cfg, par, hw, cache) for par in layouts]
    if not any(r["feasible"] for r in rows):
        rows += [evaluate(cfg, dataclasses.replace(par, zero_stage=zero, offload_optimizer="cpu",
                                                   offload_param="cpu" if zero == 3 else "none"), hw, cache)
                 for par in layouts if par.zero_stage == 0 for zero in (1, 3)]
    rows.sort(key=rank_key)
    for i, row in enumerate(rows):
        row["rank"] = i + 1
    return rows


def choose_layout(cfg: Config, world_size: int, devices_per_node: int | None = None,
                  hw: Hardware | None = None) -> tuple[ParallelConfig, str]:
    """The best layout of ``cfg``'s model for ``world_size`` processes, and why (for ``parallel.auto``).

    Keeps the user's non-searched settings (vocab_emb_dp, gradient_aggregation_group...). The
    hardware defaults to an 80 GB, 312 TFLOP/s device; on a machine without CUDA the memory is
    taken as unlimited and only the predicted step time ranks layouts.
    """
    rows = search(cfg, hw or Hardware.default(world_size, devices_per_node or world_size))
    if not rows:
        raise ConfigError([f"parallel.auto: no layout of this model fits {world_size} processes (global batch "
                           f"{cfg.train.global_batch_size}, {cfg.model.num_heads} heads)"])
    best = rows[0]
    if not best["feasible"]:
        raise ConfigError([f"parallel.auto: no layout fits in memory on {world_size} devices; the smallest: "
                           f"{best['reason']}"])
    par = dataclasses.replace(cfg.parallel, auto=True, **{k: best[k] for k in FIELDS},
                              optimizer_shard=False, pipeline_schedule=best["pipeline_schedule"]
                              if best["pipeline_stage"] > 1 else cfg.parallel.pipeline_schedule,
                              virtual_pipeline_stage=best["virtual_pipeline_stage"], layer_stages=[])
    feasible = sum(r["feasible"] for r in rows)
    offload = (f" offload_optimizer={par.offload_optimizer} offload_param={par.offload_param}" if par.offloads
               else "")
    why = (f"parallel.auto: chose data_parallel={par.data_parallel} model_parallel={par.model_parallel} "
           f"pipeline_stage={par.pipeline_stage} micro_batch_num={par.micro_batch_num} zero_stage={par.zero_stage} "
           f"recompute={par.recompute} sequence_parallel={par.sequence_parallel}{offload}: predicted step "
           f"{best['step_time_s']:.3g} s, {best['memory_gib']:.2f} GiB per device, the fastest of {feasible} "
           f"feasible layouts out of {len(rows)} on {world_size} devices ({devices_per_node or world_size} per node)")
    return par, why


def resolve_auto(cfg: Config, world_size: int, report=print) -> Config:
    """With ``parallel.auto``: put the layout ``choose_layout`` picks for ``world_size`` processes into
    ``cfg.parallel`` (``auto`` stays set, recording that it was planned) and ``report`` why."""
    cfg.parallel, why = choose_layout(cfg, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    report(why)
    return cfg
