"""Layouts: evaluate one (memory per device, step time, MFU, feasibility), enumerate and rank them, and choose one for
a job (``parallel.auto``).

Step time of one rank = (micro_batch_num + bubble) x (compute + tensor-parallel + pipeline communication of one
micro-batch) + data-parallel communication, where compute is the rank's hardware FLOPs (recompute included) over
peak x efficiency and communication is ring volume over the bandwidth of the link class the group spans. The mesh is
("pp", "dp", "cp", "tp") with tp innermost: a tp group stays inside a node when tp <= devices_per_node, a dp group when
dp x cp x tp <= devices_per_node, pipeline neighbours when the whole job fits one node. Context parallelism (cp)
divides a rank's compute and activations by cp and adds its attention's all-to-alls or ring passes
(``cost.context_parallel_bytes``); the search weighs it for sequences of ``LONG_SEQUENCE`` tokens or more.

ZeRO-Offload (``offload_optimizer`` / ``offload_param`` = "cpu") moves the rank's model state at rest to host
memory; the device keeps what is gathered and the activations, the copies each way cost host bandwidth
(``cost.offload_bytes``) and AdamW runs on the host at its memory bandwidth. The search considers offload only when
no layout fits without it.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
from dataclasses import dataclass

from paratrain.config import Config, ConfigError, ModelConfig, ParallelConfig
from paratrain.config_rules import divisible_problems, divisors, model_parallel_sizes, validate
from paratrain.metrics.flops import model_flops
from paratrain.plan import cost
from paratrain.plan.cost import Hardware, collective_bytes

LONG_SEQUENCE = 4096  # tokens a sequence from which the search also splits it over ranks (context parallelism)
FIELDS = ("data_parallel", "model_parallel", "pipeline_stage", "context_parallel", "micro_batch_num", "zero_stage",
          "recompute",
          "sequence_parallel", "offload_optimizer", "offload_param")


def evaluate(cfg: Config, par: ParallelConfig, hw: Hardware, cache: dict | None = None) -> dict:
    """Memory per device, predicted step time and MFU of one layout (``par``) of ``cfg``'s model. A layout that breaks
    a configuration rule (e.g. a global batch not divisible by data_parallel) is still costed, with the micro-batch
    rounded up, and reported infeasible with the rule."""
    m = cfg.model
    b = -(-cfg.train.global_batch_size // (par.data_parallel * par.micro_batch_num))
    problems = validate(dataclasses.replace(cfg, parallel=par), par.world_size)
    if divisible_problems(model_parallel_sizes(m), par.model_parallel) or \
            par.pipeline_stage * par.virtual_pipeline_stage > m.num_layers:
        return layout_row(par, b) | dict(feasible=False, reason="; ".join(problems), memory_gib=None,
                                         step_time_s=None, mfu=None)
    spec = cost.activation_spec(cfg)
    # the model state's placement (micro-batches, recompute and sequence parallelism aside), costed once a search
    key = (par.data_parallel, par.model_parallel, par.pipeline_stage, par.context_parallel, par.shards_parameters,
           par.shards_only_optimizer_state, par.virtual_pipeline_stage, par.pipeline_schedule, par.vocab_emb_dp,
           par.gradient_aggregation_group)
    cache = {} if cache is None else cache
    states = cache[key] = cache.get(key) or cost.stage_states(m, par, cost.DTYPE_BYTES[m.dtype], cfg.lora)
    modes = cost.recompute_modes(par, m)
    travel = par.moves_tokens(cost.tokens_per_rank(cfg, par.data_parallel), m.vocab_size)
    peak = peak_memory(cfg, par, states, spec, modes, travel)
    micro = micro_batch_times(cfg, par, hw, states, spec, modes, b)
    times = step_times(cfg, par, hw, states, peak.state, spec, travel, b, micro)
    return report_row(cfg, par, hw, b, problems, peak, times)


def layout_row(par: ParallelConfig, micro_batch_size: int) -> dict:
    """The fields of a report row that name the layout."""
    return {**{k: getattr(par, k) for k in FIELDS}, "zero_stage": par.effective_zero_stage,
            "micro_batch_size": micro_batch_size, "virtual_pipeline_stage": par.virtual_pipeline_stage,
            "pipeline_schedule": par.pipeline_schedule if par.pipeline_stage > 1 else "none"}


@dataclass
class PeakMemory:
    """The pipeline rank that needs the most device memory, and what for."""

    total: float  # bytes
    stage: int
    state: cost.StageState  # its model state at rest
    gathered: float  # whole parameters (and gradients) ZeRO gathers on top of the state at rest
    activations: dict  # cost.stage_activation_bytes


def gathered_bytes(par: ParallelConfig, st: cost.StageState, travel: bool) -> float:
    """Bytes a rank holds transiently under ZeRO: at stages 1-2 (or 3 in a pipeline) every parameter gathered
    whole until backward, and the gradients whole too when they accumulate; at stage 3 about two layer groups'
    parameters (prefetch) and one group's gradients. The word tables stay sharded where the tokens ``travel``."""
    if not par.shards_parameters:  # replicas (stages 0, 1): gradients reduced in their own storage
        return 0
    if par.effective_zero_stage < 3 or par.pipeline_stage > 1:
        gathered = st.whole_params - (st.table_params if travel else 0)
        accumulate = par.micro_batch_num > 1 or par.pipeline_stage > 1
        return gathered + (gathered if accumulate else st.group_params)
    return 3 * st.group_params


def peak_memory(cfg: Config, par: ParallelConfig, states: list[cost.StageState], spec: cost.ActivationSpec,
                modes: list[str], travel: bool) -> PeakMemory:
    """Device memory of the pipeline rank that needs the most: model state at rest (on the host with offload, not
    counted), what ZeRO gathers, activations."""
    worst = None
    for stage, st in enumerate(states):
        act = cost.stage_activation_bytes(cfg, par, stage, st, spec, modes)
        transient = gathered_bytes(par, st, travel)
        total = (0 if par.offloads else st.total) + transient + act["total"]
        if worst is None or total > worst.total:
            worst = PeakMemory(total, stage, st, transient, act)
    return worst


def micro_batch_times(cfg: Config, par: ParallelConfig, hw: Hardware, states: list[cost.StageState],
                      spec: cost.ActivationSpec, modes: list[str], b: int) -> list[tuple[float, float]]:
    """(seconds, hardware FLOPs) of one micro-batch of ``b`` rows, forward and backward, on each pipeline rank: its
    layers' and head's matmuls, the elementwise work (norms, softmax, activations, dropout), which streams the
    activations ~3 times (4 with full recompute), a fixed overhead per layer, and the tensor-parallel collectives."""
    m, tp, cp = cfg.model, par.model_parallel, par.context_parallel
    per_layer = {}
    source, target = m.lengths
    for d, moe, mode in itertools.product((False, True), (False, True), ("none", "selective", "full")):
        tokens = b * (target if d else source) / cp  # context parallelism: this rank's share of each sequence
        collectives = (7 if d else 4) + ((3 if d else 2) if mode == "full" else 0)  # TP all-reduces
        calls = collectives * (2 if par.sequence_parallel else 1) if tp > 1 else 0  # SP: gather + scatter
        if not m.layer_counts().get((d, moe)):
            continue
        per_layer[(d, moe, mode)] = (cost.layer_train_flops(m, par, b, d, moe, mode, spec, cfg.lora) / cp,
                                     collectives * tokens * m.hidden_size * spec.elem, calls)
    tokens_b = b * target / cp
    times = []
    for stage, s in enumerate(states):
        flops, tp_bytes, calls = 0.0, 0.0, 0
        for _, d, i in s.layers:
            fl, by, n = per_layer[(d, cost.is_moe(m, d, i), modes[i + m.encoder_layers if d else i])]
            flops, tp_bytes, calls = flops + fl, tp_bytes + by, calls + n
        if any("head" in parts for parts in s.parts):
            flops += cost.part_train_flops(m, par, b, {"head"}, spec) / cp
            tp_bytes += tokens_b * m.hidden_size * spec.elem + 3 * tokens_b * 4
        produced = cost.stage_activation_bytes(cfg, par, stage, s, spec, ["none"] * len(modes))["per_micro_batch"]
        streamed = produced * (4 if "full" in modes else 3)
        memory_time = streamed / hw.mem_bw + len(s.layers) * hw.layer_overhead + calls * hw.latency
        tp_time = hw.transfer_time(collective_bytes("all_reduce", tp_bytes, tp), tp)
        times.append((hw.compute_time(flops) + memory_time + tp_time, flops))
    return times


def pipeline_time(m: ModelConfig, par: ParallelConfig, hw: Hardware, b: int, spec: cost.ActivationSpec) -> float:
    """Seconds per micro-batch of the forward activation and the backward gradient crossing each chunk boundary."""
    if par.pipeline_stage == 1:
        return 0.0
    boundary = (b * m.lengths[1] * m.hidden_size * spec.elem / (par.model_parallel if par.sequence_parallel else 1)
                / par.context_parallel)
    if m.spec.encoder_decoder:
        boundary *= 2  # encoder output + decoder state
    return hw.transfer_time(2 * boundary * par.virtual_pipeline_stage, par.world_size)


def data_parallel_time(m: ModelConfig, par: ParallelConfig, hw: Hardware, states: list[cost.StageState],
                       spec: cost.ActivationSpec, travel: bool, b: int) -> float:
    """Seconds of a step's data-parallel collectives: ZeRO-3's gathers and reduce-scatters, or the gradient
    all-reduce (and stage 1's broadcast of the stepped parameters), in one call per gradient_aggregation_group,
    and the tokens' rows travelling to the word tables and heads where they stay sharded. With context parallelism
    the gradients are reduced over data x context parallel ranks."""
    mb, pp, zero = par.micro_batch_num, par.pipeline_stage, par.effective_zero_stage
    dp = par.data_parallel * par.context_parallel
    if dp == 1:
        return 0.0
    whole = max(s.whole_params - (s.table_params if travel else 0) for s in states)
    # tokens travelling to the tables: hidden-sized rows gathered and reduce-scattered per use and micro-batch
    uses = max(s.table_uses for s in states) if travel else 0
    tokens = b * m.lengths[1]
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
    return hw.transfer_time(volume + token_rows, dp * par.model_parallel, calls)


def step_times(cfg: Config, par: ParallelConfig, hw: Hardware, states: list[cost.StageState],
               peak_state: cost.StageState, spec: cost.ActivationSpec, travel: bool, b: int,
               micro: list[tuple[float, float]]) -> dict:
    """The step time of the layout and its parts: ``micro`` (``micro_batch_times``) and the pipeline transfers
    over the micro-batches and the bubble, the data-parallel and expert-parallel communication, the optimizer step
    (on the host with offload, at its memory bandwidth) and the offload copies of the pipeline rank ``peak_state``
    (``cost.offload_bytes``)."""
    m, mb = cfg.model, par.micro_batch_num
    bubble = cost.bubble_micro_batches(par)
    pp_time = pipeline_time(m, par, hw, b, spec)
    dp_time = data_parallel_time(m, par, hw, states, spec, travel, b)
    ep_time = hw.transfer_time(mb * cost.all_to_all_bytes(m, par, b, spec.elem), par.data_parallel * par.model_parallel)
    # the cp group's ranks are model_parallel apart (the mesh is pp, dp, cp, tp)
    cp_time = hw.transfer_time(mb * cost.context_parallel_bytes(m, par, b, spec.elem),
                               par.context_parallel * par.model_parallel)
    # AdamW reads parameter, gradient and two states and writes three of them
    optimizer_time = max(7 * s.stepped for s in states) / (hw.host_mem_bw if par.offloads else hw.mem_bw)
    host = cost.offload_bytes(par, peak_state) if par.offloads else {"host": 0, "host_to_device": 0,
                                                                      "device_to_host": 0}
    offload_time = (host["host_to_device"] + host["device_to_host"]) / hw.host_bw
    t_micro = max(t for t, _ in micro)
    step = (mb + bubble) * (t_micro + pp_time) + dp_time + ep_time + cp_time + offload_time + optimizer_time
    return {"step": step, "compute_s": (mb + bubble) * hw.compute_time(max(fl for _, fl in micro)),
            "bubble_micro_batches": bubble, "dp_comm_s": dp_time, "ep_comm_s": ep_time, "cp_comm_s": cp_time,
            "pp_comm_s": (mb + bubble) * pp_time, "optimizer_s": optimizer_time, "host_bytes": host["host"],
            "host_to_device_bytes": host["host_to_device"], "device_to_host_bytes": host["device_to_host"],
            "offload_s": offload_time}


def memory_reason(par: ParallelConfig, hw: Hardware, peak: PeakMemory) -> str:
    """Why a layout does not fit a device: what its fullest pipeline rank needs, part by part."""
    st, act, gib = peak.state, peak.activations, cost.GiB
    memory = (f"needs {peak.total / gib:.2f} GiB on pipeline rank {peak.stage} > {hw.usable_memory / gib:.2f} GiB "
              f"usable: model state {st.total / gib:.1f} (params {st.params / gib:.1f}, grads "
              f"{st.grads / gib:.1f}, optimizer {st.optimizer / gib:.1f}), gathered by ZeRO "
              f"{peak.gathered / gib:.1f}, activations {act['total'] / gib:.1f} ({act['in_flight']:g} "
              f"micro-batches of {act['per_micro_batch'] / gib:.2f})")
    if par.offloads:
        memory = memory.replace("model state", "model state on the host, not counted:")
    return memory


def report_row(cfg: Config, par: ParallelConfig, hw: Hardware, b: int, problems: list[str], peak: PeakMemory,
               times: dict) -> dict:
    """The row ``paratrain plan`` reports for a layout: its fields, feasibility and why not, memory, step time,
    MFU and their breakdown."""
    reasons = ([] if peak.total <= hw.usable_memory else [memory_reason(par, hw, peak)]) + problems
    if times["host_bytes"] > hw.host_memory:
        reasons.append(f"offload needs {times['host_bytes'] / cost.GiB:.2f} GiB of host memory per device > "
                       f"{hw.host_memory / cost.GiB:.2f} GiB")
    step, st = times["step"], peak.state
    mfu = model_flops(cfg.model, cfg.train.global_batch_size) / (step * hw.devices * hw.peak_flops)
    breakdown = {"params": st.params, "grads": st.grads, "optimizer": st.optimizer, "zero_gathered": peak.gathered,
                 "activations": peak.activations["total"], "in_flight": peak.activations["in_flight"],
                 **{k: v for k, v in times.items() if k != "step"}, "worst_stage": peak.stage}
    return layout_row(par, b) | dict(feasible=not reasons, reason="; ".join(reasons), memory_gib=peak.total / cost.GiB,
                                     memory_bytes=int(peak.total), step_time_s=step, mfu=mfu, breakdown=breakdown)


def context_parallel_sizes(cfg: Config, devices: int) -> list[int]:
    """The context-parallel sizes the search weighs: 1 and the config's own, and for a decoder whose sequences have
    ``LONG_SEQUENCE`` tokens or more every split over a divisor N of ``devices`` that cuts them in 2N chunks."""
    m = cfg.model
    sizes = {1, cfg.parallel.context_parallel}
    if not m.spec.encoder_decoder and m.seq_length >= LONG_SEQUENCE:
        sizes |= {n for n in divisors(devices) if m.seq_length % (2 * n) == 0}
    return sorted(n for n in sizes if devices % n == 0)


def candidates(cfg: Config, devices: int, micro_batch_sizes=(1, 2, 4, 8, 16, 32),
               zero_stages=(0, 1, 3), recomputes=("none", "selective", "full")) -> list[ParallelConfig]:
    """Every layout worth considering for ``devices``: dp x cp x tp x pp = devices, cp from
    ``context_parallel_sizes``, tp dividing the heads, micro-batch sizes from ``micro_batch_sizes``, 1F1B and
    interleaved 1F1B (2 chunks per rank)."""
    m, gb = cfg.model, cfg.train.global_batch_size
    out = []

    def layout(dp, tp, pp, mb, schedule="1f1b", v=1, zero=0, rc="none", sp=False):
        out.append(dataclasses.replace(cfg.parallel, data_parallel=dp, model_parallel=tp, pipeline_stage=pp,
                                       context_parallel=cp, micro_batch_num=mb, pipeline_schedule=schedule,
                                       virtual_pipeline_stage=v, zero_stage=zero, optimizer_shard=False, recompute=rc,
                                       sequence_parallel=sp, layer_stages=[]))

    for cp, tp in ((cp, tp) for cp in context_parallel_sizes(cfg, devices) for tp in divisors(devices // cp)):
        if divisible_problems(model_parallel_sizes(m), tp):
            continue
        for pp in divisors(devices // cp // tp):
            if pp > m.num_layers:
                continue
            dp = devices // cp // tp // pp
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
    """The best layout of ``cfg``'s model for ``world_size`` processes, and why (for ``parallel.auto``). Keeps the
    user's non-searched settings (vocab_emb_dp, gradient_aggregation_group...). The hardware defaults to an 80 GB, 312
    TFLOP/s device; on a machine without CUDA the memory is taken as unlimited and only the predicted step time ranks
    layouts."""
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
    context = f" context_parallel={par.context_parallel}" if par.context_parallel > 1 else ""
    why = (f"parallel.auto: chose data_parallel={par.data_parallel} model_parallel={par.model_parallel} "
           f"pipeline_stage={par.pipeline_stage}{context} micro_batch_num={par.micro_batch_num} "
           f"zero_stage={par.zero_stage} recompute={par.recompute} sequence_parallel={par.sequence_parallel}{offload}: "
           f"predicted step {best['step_time_s']:.3g} s, {best['memory_gib']:.2f} GiB per device, the fastest of "
           f"{feasible} feasible layouts out of {len(rows)} on {world_size} devices "
           f"({devices_per_node or world_size} per node)")
    return par, why


def resolve_auto(cfg: Config, world_size: int, report=print) -> Config:
    """With ``parallel.auto``: put the layout ``choose_layout`` picks for ``world_size`` processes into
    ``cfg.parallel`` (``auto`` stays set, recording that it was planned) and ``report`` why."""
    cfg.parallel, why = choose_layout(cfg, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    report(why)
    return cfg
