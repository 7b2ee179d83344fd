"""Per-rank cost model of one layout: model-state bytes, activation bytes, step time.

Everything is derived from the model's shapes and from how paratrain shards (see ``paratrain/parallel``):

- Parameters: read off the model built on the meta device, one layer of each kind (``model_description``): their
  shapes, the tensor-parallel split the modules' ``parallel_plan()`` declares (Megatron's: q/k/v/fc1 weight and bias
  and the head column-sharded, out_proj/fc2 weights row-sharded, their biases, LayerNorms and position tables
  replicated, the word table sharded only with ``vocab_emb_dp=false``) and the experts' split, and the layers and
  parts that use them; shards follow ``torch.chunk`` (rank 0 holds the largest). ZeRO stages 1-3 (FSDP2
  ``fully_shard`` over dp) shard dim 0 of each local tensor again; stage 0 keeps it whole. Pipeline chunks follow
  ``layer_chunks``' split, balanced by ``layer_costs`` (the head's FLOPs with the last layer's), and hold the parts
  the model places there, including the extra word-table copies of the encoder-decoder and of a tied head.
- Gradients: same placement as the parameters at rest, for the parameters that train (a frozen base under LoRA
  adapters has none, and no optimizer state). Optimizer: AdamW exp_avg and exp_avg_sq like the parameter
  plus a 4-byte ``step`` per tensor (fused AdamW).
- Transient model state (peak, on top of the above): stages 1-2 gather every parameter of the rank in forward and
  keep it until backward; with gradient accumulation (micro_batch_num > 1 without pipeline) or a pipeline (which
  keeps FSDP2 unsharded across micro-batches) the gradients are accumulated unsharded too. Stage 3 holds about two
  layer groups' whole parameters (prefetch) unless a pipeline keeps them gathered.
- Activations and FLOPs: counted on the model itself, one layer of each kind and each part run forward and backward
  on fake tensors as one tensor-parallel rank holds them (``paratrain.plan.counts``): the bytes autograd keeps per
  recompute mode, the FLOPs of forward, backward and of what selective recompute runs again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from paratrain.config import Config, LoraConfig, ModelConfig, ParallelConfig
from paratrain.plan.counts import SHARDED_DIMS, model_counts, sample_config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GiB = 1024 ** 3


def chunk_size(n: int, k: int, rank: int = 0) -> int:
    """Length of ``rank``'s piece when ``torch.chunk`` splits ``n`` into ``k`` (DTensor Shard, FSDP2)."""
    if k <= 1:
        return n
    c = -(-n // k)
    return max(0, min(c, n - rank * c))


# --- parameters ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Param:
    """A parameter of the model as built, and how paratrain splits it."""

    shape: tuple
    tp_dim: int | None = None  # the dim split over model_parallel
    split_kind: str | None = None  # the ``parallel_plan()`` kind of its module ("vocab_rows": a word table)
    expert: bool = False  # experts: dim 0 split over expert_parallel, left whole by data parallelism
    trainable: bool = True  # False: a frozen base under LoRA adapters, with no gradient and no optimizer state

    @property
    def table(self) -> bool:
        """Whether it is a word table or an output head, (vocab, hidden) both."""
        return self.split_kind in ("vocab_rows", "head")


@dataclass(frozen=True)
class ModelParams:
    """A model's parameters: those of one layer of each kind (``layer_counts``' keys) and those outside the layers,
    each with the parts of ``pipeline_parts`` that use it (a shared word table: several)."""

    layers: dict  # (is_decoder_layer, is_moe) -> [Param]
    others: list  # [(Param, frozenset of part names)]


_DESCRIBED: dict[str, ModelParams] = {}  # per model config, its layer counts aside


def model_description(m: ModelConfig, lora: LoraConfig | None = None) -> ModelParams:
    """``m``'s parameters (with ``lora``'s adapters, the rest frozen), read off the model built on the meta device
    with as few layers as hold each kind of layer (``sample_config``)."""
    sample, lora = sample_config(m), lora or LoraConfig()
    key = repr((sample, lora))
    if key not in _DESCRIBED:
        _DESCRIBED[key] = _describe(sample, lora)
    return _DESCRIBED[key]


def _describe(m: ModelConfig, lora: LoraConfig) -> ModelParams:
    """The parameters of ``m`` (and ``lora``'s adapters) built on the meta device: shapes from the tensors, splits
    from the modules' ``parallel_plan()`` and the experts' split, users from the layers and ``pipeline_parts`` the
    pipeline splits, frozen or not."""
    import torch
    from torch.distributed.tensor import Shard

    from paratrain.lora import add_adapters
    from paratrain.models import build_model
    from paratrain.modules.moe import MoE
    from paratrain.modules.transformer import pipeline_blocks
    from paratrain.parallel.expert import _TENSOR_PARALLEL as EXPERT_SPLITS
    from paratrain.parallel.pipeline import parameter_holders
    from paratrain.parallel.tensor import declared_plan

    with torch.device("meta"):
        model = add_adapters(build_model(m), lora)
    plan = declared_plan(model)
    experts = {id(p) for block in model.modules() if isinstance(block, MoE) for p in block.experts.parameters()}

    def described(name: str, p: torch.Tensor) -> Param:
        module, _, local = name.rpartition(".")
        if id(p) in experts:
            placement = EXPERT_SPLITS[local]
            return Param(tuple(p.shape), placement.dim if isinstance(placement, Shard) else None, expert=True,
                         trainable=p.requires_grad)
        split = plan.get(module)
        return Param(tuple(p.shape), SHARDED_DIMS.get((split, local)), split if isinstance(split, str) else None,
                     trainable=p.requires_grad)

    layers, first_stack = {}, next(iter(model.layer_stacks))
    for name, _, _ in pipeline_blocks(model):
        layer = model.get_submodule(name)
        kind = (name.rpartition(".")[0] != first_stack, any(isinstance(x, MoE) for x in layer.modules()))
        if kind not in layers:  # the first layer of each kind
            layers[kind] = [described(n, p) for n, p in layer.named_parameters(prefix=name)]
    parts = list(model.pipeline_parts)
    holders = parameter_holders(model, {part: i for i, part in enumerate(parts)})
    others = [(described(name, p), frozenset(parts[i] for i in holders[name]))
              for name, p in model.named_parameters() if name in holders]
    return ModelParams(layers, others)


def local_numel(p: Param, par: ParallelConfig, tp_rank: int = 0, dp_rank: int = 0) -> int:
    """Elements of ``p`` this rank holds at rest."""
    shape = list(p.shape)
    if p.tp_dim is not None and not (p.split_kind == "vocab_rows" and par.vocab_emb_dp):
        shape[p.tp_dim] = chunk_size(shape[p.tp_dim], par.model_parallel, tp_rank)
    if p.expert:  # E/ep experts a rank (data parallelism leaves them alone)
        return math.prod([chunk_size(shape[0], par.expert_parallel), *shape[1:]])
    shards = par.data_parallel * par.context_parallel  # FSDP2 shards over data x context parallel
    if par.shards_parameters and shards > 1:
        shape[0] = chunk_size(shape[0], shards, dp_rank)
    return math.prod(shape)


def tp_numel(p: Param, par: ParallelConfig) -> int:
    """Elements of ``p`` on tensor-parallel rank 0 before data-parallel sharding (what FSDP gathers)."""
    return local_numel(p, ParallelConfig(model_parallel=par.model_parallel, vocab_emb_dp=par.vocab_emb_dp,
                                         expert_parallel=par.expert_parallel))


def layer_blocks(m: ModelConfig) -> list[tuple[bool, int, int]]:
    """(is_decoder_layer, layer_id, offset) of every layer in execution order (``pipeline_blocks``): the layers of
    a second stack are an encoder-decoder's decoder layers."""
    counts = list(m.stack_layers.values())
    return [(stack > 0, i, sum(counts[:stack])) for stack, n in enumerate(counts) for i in range(n)]


def chunk_of_layers(m: ModelConfig, par: ParallelConfig) -> list[int]:
    """The chunk of every layer, as ``paratrain.parallel.pipeline`` splits them, without building the model."""
    from paratrain.parallel.pipeline import layer_chunks  # imported here: importing the cost model loads no torch

    return layer_chunks(layer_blocks(m), par, layer_costs(m))


def layer_costs(m: ModelConfig) -> list[int]:
    """Training FLOPs of one sequence in each layer, in execution order, the output head's with the last layer's
    (embeddings are lookups): the work the pipeline split balances (``paratrain.parallel.pipeline.layer_chunks``).
    On a 32k vocabulary the head of a 512-wide model costs about five layers."""
    counted = model_counts(m)
    costs = [int(counted.layers[(d, is_moe(m, d, i))].at(1).train_flops) for d, i, _ in layer_blocks(m)]
    if costs:  # not for a model without Transformer layers (ResNet)
        costs[-1] += int(sum(piece.at(1).train_flops for piece in counted.parts.values()))
    return costs


def tokens_per_rank(cfg: Config, data_parallel: int) -> int | None:
    """The most tokens of a rank's micro-batch on either side (rows x the longer sequence length), for a model whose
    head computes the loss from labels; None for others (``paratrain.parallel.vocab``)."""
    if not cfg.model.spec.loss_in_head:
        return None
    rows = -(-cfg.train.global_batch_size // (data_parallel * cfg.parallel.micro_batch_num))
    return rows * max(cfg.model.lengths)


# the role in this cost model of each part the models declare in ``pipeline_parts``
PART_ROLES = {"embed": "input_embed", "embed_tokens": "input_embed", "src_embed": "input_embed",
              "tgt_embed": "target_embed", "transformer.encoder.norm": "encoder_norm", "norm": "head",
              "transformer.decoder.norm": "head", "head": "head"}


def layer_names(m: ModelConfig) -> list[str]:
    """The names of the model's layers in execution order (``pipeline_blocks``)."""
    return [f"{stack}.{i}" for stack, n in m.stack_layers.items() for i in range(n)]


OPTIMIZER_STATES = 2  # AdamW's exp_avg and exp_avg_sq, each the size of its parameter


def state_bytes(param_bytes: float) -> float:
    """Model-state bytes of parameters of ``param_bytes`` at rest: themselves, their gradients, AdamW's states."""
    return (2 + OPTIMIZER_STATES) * param_bytes


@dataclass
class StageState:
    """Model-state bytes of one pipeline rank (tensor/data-parallel rank 0: the largest shards)."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    stepped: int = 0  # bytes of the parameters it steps (at zero stage 1 on replicas those dp rank 0 owns)
    tensors: int = 0
    whole_params: int = 0  # this rank's tensor-parallel shard, before ZeRO sharding (what FSDP gathers)
    table_params: int = 0  # the part of whole_params in word tables and heads (not gathered when tokens travel)
    table_uses: int = 0  # lookups in word tables and heads per micro-batch (what the tokens travel to)
    group_params: int = 0  # the largest gradient_aggregation_group's whole parameters
    layers: list = field(default_factory=list)  # (chunk, is_decoder, layer_id) held
    parts: list = field(default_factory=list)  # parts set per chunk

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def stage_states(m: ModelConfig, par: ParallelConfig, param_bytes: int | None = None,
                 lora: LoraConfig | None = None) -> list[StageState]:
    """Model-state bytes at rest of every pipeline rank (tp rank 0, dp rank 0): each chunk holds its layers and the
    parts placed with them as the model's ``pipeline_parts`` say (``paratrain.parallel.pipeline.part_chunks``),
    with a copy of every parameter they use. With ``lora`` the frozen base (in ``lora.base_dtype``) has neither
    gradients nor optimizer state; only the adapters do."""
    from paratrain.parallel.pipeline import chunk_rank, part_chunks

    b = param_bytes or DTYPE_BYTES[m.dtype]
    frozen_bytes = DTYPE_BYTES[lora.base_dtype] if lora and lora.enabled and lora.base_dtype != "float32" else b
    described = model_description(m, lora)
    blocks = layer_blocks(m)
    owner = chunk_of_layers(m, par) if par.pipeline_stage > 1 else [0] * len(blocks)
    num_chunks = par.pipeline_stage * par.virtual_pipeline_stage if par.pipeline_stage > 1 else 1
    part_chunk = part_chunks(m.spec.build_function().pipeline_parts, layer_names(m), owner)
    sizes = {k: [(local_numel(p, par), p.trainable) for p in ps] for k, ps in described.layers.items()}
    whole = {k: sum(tp_numel(p, par) for p in ps) for k, ps in described.layers.items()}
    stages = [StageState() for _ in range(par.pipeline_stage)]
    held_sizes = [[] for _ in stages]  # (local size, trainable) of every tensor a pipeline rank holds
    for chunk in range(num_chunks):
        rank = chunk_rank(chunk, par) if par.pipeline_stage > 1 else 0
        st = stages[rank]
        parts = {part for part, c in part_chunk.items() if c == chunk}
        st.parts.append({PART_ROLES[part] for part in parts})
        held = [(d, i) for (d, i, _), o in zip(blocks, owner) if o == chunk]
        st.layers += [(chunk, d, i) for d, i in held]
        keys = [(d, is_moe(m, d, i)) for d, i in held]
        others = [p for p, users in described.others if users & parts]
        tensors = [n for k in keys for n in sizes[k]] + [(local_numel(p, par), p.trainable) for p in others]
        held_sizes[rank] += tensors
        st.params += sum(n * (b if trainable else frozen_bytes) for n, trainable in tensors)
        st.whole_params += (sum(whole[k] for k in keys) + sum(tp_numel(p, par) for p in others)) * b
        st.table_params += sum(tp_numel(p, par) for p in others if p.table) * b
        st.table_uses += len(st.parts[-1] & {"input_embed", "target_embed", "head"})
        st.tensors += len(tensors)
        per_group = max(1, math.ceil(len(held) / par.aggregation_groups(len(held)))) if held else 0
        st.group_params = max(st.group_params, per_group * max(whole.values()) * b)
    for st, holding in zip(stages, held_sizes):
        stepped = [n for n, trainable in holding if trainable]
        st.grads = sum(stepped) * b
        if par.shards_only_optimizer_state and par.data_parallel > 1:
            # zero stage 1 on replicas: each rank steps (and keeps the state of) the parameters dealt to it by size
            from paratrain.parallel.data import owners

            stepped = [n for n, o in zip(stepped, owners(stepped, par.data_parallel)) if o == 0]
        st.stepped = sum(stepped) * b
        st.optimizer = OPTIMIZER_STATES * st.stepped + 4 * len(stepped)
    return stages


def all_to_all_bytes(m: ModelConfig, par: ParallelConfig, micro_batch: int, elem: int) -> float:
    """Bytes one rank sends per micro-batch of ``micro_batch`` rows in the experts' all-to-all
    (``paratrain.parallel.expert``): each mixture-of-experts layer sends the (ep-1)/ep of its capacity slots
    (E x C x H a group) held by other ranks, to dispatch and to combine, in forward and in backward."""
    moe, ep = m.moe_config, par.expert_parallel
    if ep == 1 or moe.expert_num == 1:
        return 0.0
    total = 0.0
    for decoder, layer_id, offset in layer_blocks(m):
        if moe.used_in(offset + layer_id):
            length = m.lengths[decoder]
            tokens = micro_batch * length
            group = moe.expert_group_size or tokens
            capacity = math.ceil(moe.capacity_factor * group * moe.num_experts_chosen / moe.expert_num)
            total += 4 * (ep - 1) / ep * (tokens // group) * moe.expert_num * capacity * m.hidden_size * elem
    return total


def context_parallel_bytes(m: ModelConfig, par: ParallelConfig, micro_batch: int, elem: int) -> float:
    """Bytes one rank sends per micro-batch of ``micro_batch`` rows for attention over its sequence split over
    ``context_parallel`` ranks (``paratrain.parallel.context``), every layer: Ulysses' all-to-alls of q, k, v and
    the output, (cp-1)/cp of each, in forward and in backward; or the ring's keys and values passed cp-1 times in
    forward, and with their gradients in backward."""
    cp = par.context_parallel
    if cp == 1:
        return 0.0
    tokens = micro_batch * m.seq_length // cp
    q, kv = (tokens * heads // par.model_parallel * m.head_size * elem for heads in (m.num_heads, m.kv_heads))
    if par.attention_split(m.num_heads, m.kv_heads) == "ulysses":
        per_layer = 2 * (cp - 1) / cp * (2 * q + 2 * kv)
    else:
        per_layer = 3 * (cp - 1) * 2 * kv
    return m.num_layers * per_layer


def model_params(m: ModelConfig, lora: LoraConfig | None = None, trainable: bool = False) -> int:
    """Number of parameters of the whole (unsplit) model, with ``lora``'s adapters; only those that train with
    ``trainable``. As fast for 10^12 layers as for 2."""
    described = model_description(m, lora)
    counted = [p for p, _ in described.others if p.trainable or not trainable]
    per_layer = {k: sum(math.prod(p.shape) for p in ps if p.trainable or not trainable)
                 for k, ps in described.layers.items()}
    return sum(math.prod(p.shape) for p in counted) + sum(n * per_layer[k] for k, n in m.layer_counts().items())


def offload_bytes(par: ParallelConfig, st: StageState) -> dict:
    """ZeRO-Offload of one pipeline rank (FSDP2's CPUOffloadPolicy): its model state at rest in host memory,
    and the bytes copied per step host -> device (the parameter shard before each all-gather: once a step
    at stages 1-2, forward and backward of every micro-batch at stage 3 without a pipeline) and device ->
    host (the reduced gradient shard: once a step, every micro-batch at stage 3)."""
    if par.effective_zero_stage < 3 or par.pipeline_stage > 1:
        return {"host": st.total, "host_to_device": st.params, "device_to_host": st.grads}
    mb = par.micro_batch_num
    return {"host": st.total, "host_to_device": 2 * mb * st.params, "device_to_host": mb * st.grads}


# --- activations --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ActivationSpec:
    """How a run computes its activations: in ``precision`` (``train.mixed_precision`` resolved: "none", "bf16",
    "fp16"), ``elem`` bytes an element of the tensors it sends."""

    elem: int = 4
    precision: str = "none"


def activation_spec(cfg: Config) -> ActivationSpec:
    """How a run of ``cfg`` on this machine computes its activations."""
    m = cfg.model
    precision = cfg.train.mixed_precision
    if precision == "auto":  # what a run on this machine's device makes of it
        from paratrain.device import device
        from paratrain.precision import resolve_mixed_precision

        precision = resolve_mixed_precision(precision, device())
    return ActivationSpec(elem=2 if (precision != "none" or m.dtype != "float32") else 4, precision=precision)


def is_moe(m: ModelConfig, decoder: bool, layer_id: int) -> bool:
    """Whether layer ``layer_id`` of its stack (a decoder layer's: after the encoder's) is a mixture of experts."""
    return m.moe_config.used_in(layer_id + (m.encoder_layers if decoder else 0))


def counted(m: ModelConfig, par: ParallelConfig, spec: ActivationSpec, lora: LoraConfig | None = None):
    """``paratrain.plan.counts.model_counts`` of ``m`` on one tensor-parallel rank of ``par``."""
    return model_counts(m, par.model_parallel, par.sequence_parallel, par.vocab_emb_dp, spec.precision, lora=lora)


def layer_train_flops(m: ModelConfig, par: ParallelConfig, micro_batch: int, decoder: bool, moe: bool, mode: str,
                      spec: ActivationSpec = ActivationSpec(), lora: LoraConfig | None = None) -> float:
    """Hardware FLOPs of one layer per micro-batch on one tensor-parallel rank: forward, backward and the forward
    ``mode`` recomputes (``full``: all of it, ``selective``: the ops whose outputs it does not keep); a mixture of
    experts (``moe``) runs the router and each token's experts. Under expert parallelism a rank runs its experts on
    every rank's tokens: as many FLOPs as its own tokens make."""
    c = counted(m, par, spec, lora).layers[(decoder, moe)].at(micro_batch)
    return c.train_flops + {"none": 0.0, "selective": c.recomputed, "full": c.forward}[mode]


def layer_activation_bytes(m: ModelConfig, par: ParallelConfig, micro_batch: int, decoder: bool, mode: str,
                           spec: ActivationSpec, moe: bool = False, lora: LoraConfig | None = None) -> float:
    """Bytes one layer keeps for backward per micro-batch on one tensor-parallel rank. ``full``: only the layer
    input; ``selective``: the layer input and the outputs of the ops ``paratrain.parallel.recompute.keeps`` (the
    matmuls, the attention kernel, the tensor-parallel collectives); ``none``: everything autograd saves."""
    return counted(m, par, spec, lora).layers[(decoder, moe)].at(micro_batch).saved[mode]


def extra_activation_bytes(m: ModelConfig, par: ParallelConfig, micro_batch: int, roles: set[str],
                           spec: ActivationSpec, modes: set[str] = frozenset({"none"}),
                           lora: LoraConfig | None = None) -> float:
    """Bytes kept outside the layers per micro-batch by the parts of ``roles`` (``PART_ROLES``: embeddings, final
    norms, the head and its loss) and by the model's own forward, which every chunk runs: the tensors every layer
    takes (masks, the encoder output), kept by attention or, for layers of the recompute ``modes``, checkpoints."""
    c = counted(m, par, spec, lora)
    parts = sum(piece.at(micro_batch).saved["none"] for name, piece in c.parts.items() if PART_ROLES[name] in roles)
    return parts + max(c.inputs.at(micro_batch).saved[mode] for mode in modes | {"none"})


def part_train_flops(m: ModelConfig, par: ParallelConfig, micro_batch: int, roles: set[str],
                     spec: ActivationSpec = ActivationSpec()) -> float:
    """Training FLOPs per micro-batch of the parts of ``roles`` on one tensor-parallel rank (the head's)."""
    c = counted(m, par, spec)
    return sum(piece.at(micro_batch).train_flops for name, piece in c.parts.items() if PART_ROLES[name] in roles)


def in_flight(par: ParallelConfig, stage: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of the rank's
    whole activations per micro-batch (interleaved: chunk-micro-batches / chunks per rank)."""
    pp, m, v = par.pipeline_stage, par.micro_batch_num, par.virtual_pipeline_stage
    if pp == 1:
        return 1
    s = par.pipeline_schedule
    if s == "gpipe" or s == "looped_bfs":
        return m
    if s == "1f1b":
        return min(m, pp - stage)
    # interleaved 1F1B and the zero-bubble schedules: torch's warm-up count + 1, per chunk
    warmup = (v - 1) * pp + 2 * (pp - 1 - stage)
    return min(m * v, warmup + 1) / v


def bubble_micro_batches(par: ParallelConfig) -> float:
    """Idle time of a pipeline rank per step, in micro-batch (forward + backward of its chunks) units."""
    pp, v = par.pipeline_stage, par.virtual_pipeline_stage
    if pp == 1:
        return 0.0
    if par.pipeline_schedule in ("gpipe", "1f1b"):
        return pp - 1
    if par.pipeline_schedule in ("interleaved_zero_bubble", "zbv_zero_bubble"):
        return (pp - 1) / (3 * v)  # B/W split fills most of the bubble
    return (pp - 1) / v


def recompute_modes(par: ParallelConfig, m: ModelConfig) -> list[str]:
    """The recompute mode of every layer in execution order."""
    return [par.recompute_mode(i, off) for _, i, off in layer_blocks(m)]


def stage_activation_bytes(cfg: Config, par: ParallelConfig, stage: int, st: StageState,
                           spec: ActivationSpec | None = None, modes: list[str] | None = None) -> dict:
    """Peak activation bytes of one pipeline rank: micro-batches in flight x per-micro-batch bytes,
    plus, under full or selective recompute, one layer's whole activations while it is recomputed."""
    m = cfg.model
    spec = spec or activation_spec(cfg)
    b = -(-cfg.train.global_batch_size // (par.data_parallel * par.micro_batch_num))
    modes = modes or recompute_modes(par, m)
    counts: dict = {}
    for _, d, i in st.layers:
        key = (d, is_moe(m, d, i), modes[i + m.encoder_layers if d else i])  # a decoder layer: after the encoder
        counts[key] = counts.get(key, 0) + 1
    per_micro, recompute_peak = 0.0, 0.0
    for (d, moe, mode), n in counts.items():
        per_micro += n * layer_activation_bytes(m, par, b, d, mode, spec, moe, cfg.lora)
        if mode != "none":
            recompute_peak = max(recompute_peak, layer_activation_bytes(m, par, b, d, "none", spec, moe, cfg.lora))
    roles = set().union(*st.parts) if st.parts else set()
    per_micro += extra_activation_bytes(m, par, b, roles, spec, {mode for _, _, mode in counts}, cfg.lora)
    # context parallelism: a rank keeps the activations of its 1/cp of each sequence's tokens
    per_micro, recompute_peak = per_micro / par.context_parallel, recompute_peak / par.context_parallel
    flight = in_flight(par, stage)
    return {"per_micro_batch": per_micro, "in_flight": flight, "recompute_peak": recompute_peak,
            "total": per_micro * flight + recompute_peak}


# --- time: compute and communication ------------------------------------------------------------

@dataclass
class Hardware:
    """The devices a job runs on: memory, peak FLOP/s and link bandwidths, and the time of compute and of
    collectives on them (the one model of both the layout planner and the op-strategy search)."""

    devices: int
    devices_per_node: int = 8
    device_memory: float = 80e9  # bytes
    peak_flops: float = 312e12  # per device, in the training dtype
    intra_bw: float = 200e9  # bytes/s of bus bandwidth per device inside a node
    inter_bw: float = 25e9  # bytes/s per device across nodes
    efficiency: float = 0.5  # fraction of peak the matmuls reach
    reserve: float = 0.05  # fraction of device memory kept free (allocator fragmentation, workspaces)
    mem_bw: float = 2e12  # bytes/s of device memory: elementwise ops and the optimizer step are bound by it
    layer_overhead: float = 3e-5  # seconds per layer and micro-batch (kernel launches)
    latency: float = 2e-5  # seconds of start-up per collective
    host_memory: float = 128e9  # bytes of host memory per device (offload keeps the model state there)
    host_bw: float = 25e9  # bytes/s between host and device each way (PCIe 4 x16)
    host_mem_bw: float = 20e9  # bytes/s of host memory one rank's optimizer step streams (offload)

    @classmethod
    def default(cls, devices: int, devices_per_node: int) -> "Hardware":
        """This machine's kind of device: on CUDA its memory with an 80 GB, 312 TFLOP/s device's other figures; on
        the CPU (gloo) matmuls at ~50 GFLOP/s a core and collectives at ~0.5 GB/s, memory not the limit."""
        import torch

        from paratrain.device import device

        if device().type == "cuda":
            return cls(devices, devices_per_node, device_memory=torch.cuda.get_device_properties(device()).total_memory)
        return cls(devices, devices_per_node, device_memory=math.inf, peak_flops=1e11, intra_bw=0.5e9,
                   inter_bw=0.1e9, efficiency=0.6, mem_bw=5e9, layer_overhead=1e-3, latency=3e-3)

    @property
    def usable_memory(self) -> float:
        return self.device_memory * (1 - self.reserve)

    def compute_time(self, flops: float) -> float:
        """Seconds of ``flops`` of matmuls on one device."""
        return flops / (self.peak_flops * self.efficiency)

    def transfer_time(self, nbytes: float, span: int, calls: int = 0) -> float:
        """Seconds to move ``nbytes`` per device in ``calls`` collectives of a group within ``span`` consecutive
        ranks: over the node's links when they fit in one, else the network's."""
        return nbytes / (self.intra_bw if span <= self.devices_per_node else self.inter_bw) + calls * self.latency

    def collective_time(self, kind: str, size: float, group: int, span: int | None = None) -> float:
        """Seconds of one ring collective (``collective_bytes``) of ``group`` ranks within ``span`` ranks
        (default: the group's own)."""
        if group <= 1:
            return 0.0
        return self.transfer_time(collective_bytes(kind, size, group), span or group, calls=1)


def collective_bytes(kind: str, size: float, group: int) -> float:
    """Bytes each of ``group`` ranks sends in a ring collective over a tensor of ``size`` bytes (the whole
    one: an all-gather's output, a reduce-scatter's input): ``all_reduce`` 2 (p - 1) / p of it, the others
    (all-gather, reduce-scatter, all-to-all, pipelined broadcast) (p - 1) / p."""
    return (2 if kind == "all_reduce" else 1) * (group - 1) / group * size
