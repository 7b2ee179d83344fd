"""A user's own net on any layout: ``place_net(net, config, layout, example_batch)``.

The net is a plain ``nn.Module`` whose ``forward(*batch)`` returns its loss, built from
``paratrain.nn`` blocks and plain torch layers. What is split comes from the net itself:

- **Tensor parallel**: every module with a ``parallel_plan()`` method (the ``paratrain.nn``
  blocks) names its own Linear/Embedding submodules and their split over ``model_parallel``,
  in the kinds of ``paratrain.parallel.tensor``: ``colwise`` (output features), ``rowwise``
  (input features, outputs summed), ``vocab_rows`` (embedding rows, lookups summed)...
  Everything else is replicated and data-parallel, as MindSpore does with ops that have no strategy.
- **Layers**: modules marked ``is_transformer_layer`` are the units of recompute and of FSDP
  (their own ``recompute_mode``, set by ``recompute()`` or MindSpore's ``lambda_func``, or the
  config's ``recompute`` for all of them).
- **Pipeline** (``pipeline_stage > 1``): ``pipeline_stage`` attributes set on any submodule say
  where each stage starts, in the order the forward runs them. The forward is traced with
  ``torch.distributed.pipelining`` (torch.export) at those points, so tensors computed on one
  stage reach the later stages that use them (those computed from the net's inputs alone are
  computed again there); the net's inputs (ids, labels, masks) reach every stage as keyword
  arguments of the schedule. A forward that cannot be traced (data-dependent Python control
  flow...) is refused with torch's reason. Each rank keeps its stage's module, then tensor
  parallel, recompute and FSDP are applied to it. Parameter names stay the net's.
- **Loss**: token losses that declare ``supports_sum_and_count`` (``paratrain.nn.CrossEntropyLoss``)
  get ``reduction = "sum_and_count"`` and return (sum, count), so the loss of a step is the mean
  over every masked token of the global batch whatever the layout; a net returning any other
  scalar has it averaged over micro-batches and replicas.
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
import warnings

import torch
from torch import fx, nn
from torch.distributed.pipelining import Pipe, SplitPoint, pipeline as trace_pipeline
from torch.distributed.pipelining.stage import _PipelineStage
from torch.distributed.tensor.parallel import parallelize_module
from torch.fx.node import map_arg
from torch.torch_version import __version__ as TORCH_VERSION

from paratrain.config import ParallelConfig
from paratrain.context import GRAPH_MODE, get_context
from paratrain.errors import UserError
from paratrain.mesh import Layout
from paratrain.metrics.timer import no_phase
from paratrain.modules.moe import MoE, moe_totals
from paratrain.modules.token_loss import token_means_to
from paratrain.parallel.data import apply_data_parallel, fusion_groups
from paratrain.parallel.expert import apply_expert_parallel
from paratrain.parallel.micro_batches import StepLoss, forward_backward, forward_only, has_rows
from paratrain.parallel.pipeline import StageFixes, build_schedule, chunk_rank, integer_boundaries
from paratrain.parallel.recompute import apply_recompute
from paratrain.parallel.tensor import declared_plan, gradient_like_parameter, has_submodule, parallel_style

# torch 2.13's FSDP2 warns whenever a wrapped module returns a view; a traced stage's outputs only go to the
# pipeline's send and to its backward, never into an in-place op, which is what the warning is about
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w*GraphModule\) returned a view",
                        category=UserWarning)


class UnsplittableNet(UserError):
    """A net that cannot be split into the pipeline stages its ``pipeline_stage`` attributes ask for."""


def _layer_stacks(net: nn.Module) -> dict[str, int]:
    """The containers of the net's layers with the layers before each (MindSpore's offset)."""
    stacks, count = {}, 0
    for name, module in net.named_modules():
        if getattr(module, "is_transformer_layer", False):
            parent = name.rpartition(".")[0]
            if parent not in stacks:
                stacks[parent] = count
            count += 1
    return stacks


def stage_starts(net: nn.Module, example: tuple, stages: int, segments: int = 1,
                 v_shape: bool = False) -> dict[str, SplitPoint]:
    """Where each pipeline stage after the first begins: the first module (in forward order) whose
    ``pipeline_stage`` (set on it, not inherited) is that stage. With ``segments`` > 1 the stages are virtual:
    a module of ``pipeline_stage`` s (the pipeline rank that holds it) and ``pipeline_segment`` g (MindSpore's
    interleave) is virtual stage g * stages + s, or with ``v_shape`` (the zero-bubble V, two segments) s in
    segment 0 and 2 * stages - 1 - s in segment 1."""
    order = []

    def note(module, args, name):
        stage, segment = module.pipeline_stage, vars(module).get("pipeline_segment", 0)
        if not (0 <= stage < stages and 0 <= segment < segments):
            raise UnsplittableNet(f"{name}: pipeline_stage={stage}, pipeline_segment={segment} is not in "
                                  f"0..{stages - 1}, 0..{segments - 1} (the job's pipeline stages and segments)")
        chunk = 2 * stages - 1 - stage if v_shape and segment else segment * stages + stage
        order.append((name, chunk, f"stage {stage}, segment {segment}" if segments > 1 else f"stage {stage}"))

    hooks = [module.register_forward_pre_hook(lambda m, args, name=name: note(m, args, name))
             for name, module in net.named_modules() if "pipeline_stage" in vars(module)]
    try:
        with torch.no_grad():
            net(*example)
    finally:
        for hook in hooks:
            hook.remove()
    starts, current, current_where = {}, 0, "stage 0"
    for name, chunk, where in order:
        if chunk < current:
            raise UnsplittableNet(f"{name} runs after a module of {current_where} but is in {where}: stages "
                                  f"(and segments) must follow the order the forward runs the modules")
        if chunk > current:
            starts[name], current, current_where = SplitPoint.BEGINNING, chunk, where
    missing = sorted(set(range(1, stages * segments)) - {chunk for _, chunk, _ in order})
    if missing:
        what = f"pipeline_stage in {missing}" if segments == 1 else f"virtual stage in {missing}"
        raise UnsplittableNet(f"no module has {what}: set module.pipeline_stage (and pipeline_segment, or pass a "
                              f"lambda_func) so that every stage holds layers")
    return starts


# what a net placed whole on every rank (hybrid) or op by op (semi-auto, auto) does not take: option -> (its
# default, why)
NOT_OFFERED = {
    "sequence_parallel": (False, "its ops run on whole (or strategy-split) sequences"),
    "expert_parallel": (1, "it holds no paratrain.nn MoE blocks to split"),
    "recompute": ("none", "its layers are not placed one by one"),
    "offload_optimizer": ("none", "its parameters are not FSDP-sharded"),
    "offload_param": ("none", "its parameters are not FSDP-sharded"),
}


def refuse_options(config: ParallelConfig, net: nn.Module, mode: str, problems: list[str] = ()) -> None:
    """Raise one UserError naming, with the reason, every option of ``config`` that ``mode`` does not honour
    (``NOT_OFFERED``, a layer's own ``recompute_mode``, and the caller's ``problems``)."""
    problems = [f"{option}={getattr(config, option)!r}: {why}" for option, (default, why) in NOT_OFFERED.items()
                if getattr(config, option) != default] + list(problems)
    if any(getattr(m, "recompute_mode", "none") != "none" for m in net.modules()):
        problems.append(f"a layer's recompute_mode: {NOT_OFFERED['recompute'][1]}")
    if problems:
        raise UserError(f"{mode} does not offer " + "; ".join(problems) + ": leave these options at their "
                        f"defaults (a net of paratrain.nn blocks without ops has them under semi_auto_parallel)")


class Placed:
    """What every placement of a user's net gives ``paratrain.engine``: this rank's modules (``parts``), their
    parameters, ``phase`` and the forward and backward of a global batch (``forward_backward(batch, loss_scale,
    rows_of_this_rank) -> dict``) in ``config.micro_batch_num`` micro-batches, run by
    ``paratrain.parallel.micro_batches.forward_backward`` and normalised by its ``StepLoss`` on ``layout``.
    A net whose token losses can return (sum, count) (``supports_sum_and_count``) is switched to them."""

    def __init__(self, net: nn.Module, config: ParallelConfig, layout: Layout, precision: str = "none"):
        self.config, self.layout, self.device, self.precision = config, layout, layout.device, precision
        self.summed = _sum_and_count(net)
        # a mixture of experts' aux loss, which the net adds to its token losses' means: with several
        # micro-batches the step counts their tokens first (StepLoss.count_first)
        self.counts_first = self.summed and config.micro_batch_num > 1 and any(
            isinstance(m, MoE) for m in net.modules())
        self.parts = [net]
        self._norm: StepLoss | None = None  # this step's
        self.phase = no_phase  # a StepTimer's phase, set by the engine's face

    def _rows(self, batch: tuple, rows_of_this_rank: bool, replicas: int = 1) -> tuple:
        """This rank's rows of a global batch on its device: the ``dp_rank``-th of ``replicas`` equal parts
        (unless ``rows_of_this_rank``: a dataset sharded per rank gave them already), each a whole number of
        micro-batches; UserError when they do not split so."""
        micro_batch_num = self.config.micro_batch_num
        replicas = 1 if rows_of_this_rank else replicas
        size = next((t.shape[0] for t in batch if has_rows(t)), 0)
        parts = replicas * micro_batch_num
        if size % parts:
            split = ("this rank's share of a dataset sharded per rank" if rows_of_this_rank
                     else f"data_parallel={replicas}")
            raise UserError(f"a batch of {size} rows does not split into {parts} equal parts ({split} x "
                            f"micro_batch_num={micro_batch_num}): give a batch size divisible by {parts}")
        rows = size // replicas
        start = self.layout.dp_rank * rows  # (one replica, or rows of this rank: the batch as it is)
        mine = (t[start:start + rows] if replicas > 1 and has_rows(t) else t for t in batch)
        return tuple(t.to(self.device, non_blocking=True) if isinstance(t, torch.Tensor) else t for t in mine)

    def _micro_loss(self, output: torch.Tensor, target=None, pairs: bool = True) -> torch.Tensor:
        """What backward runs on for one micro-batch (``StepLoss``): its loss sum and token count (``pairs``: a
        pipeline stage's output; else its token losses' means plus any other terms), or its plain loss
        (``target``: a pipeline schedule's, unused). A loss of another shape (per row, per token) is refused."""
        # a token loss of the user's own (``supports_sum_and_count``) returns its pair itself, making no token means
        pair = self.summed and (pairs or not self._norm.pending)
        if not isinstance(output, torch.Tensor) or output.numel() != (2 if pair else 1):
            what = (f"a tensor of shape {list(output.shape)}" if isinstance(output, torch.Tensor)
                    else f"a {type(output).__name__}")
            raise UserError(f"the net returned {what}, not a loss: reduce it to "
                            f"{'a (sum, count) pair' if pair else 'a scalar'}, or give Model a loss_fn")
        if self.summed and not pair:
            loss = self._norm.with_token_means(output)
        else:
            output = output.reshape(-1).float()
            loss = self._norm.token_sum(output[0], output[1]) if pair else self._norm.mean(output[0])
        # a net of no trainable parameter has nothing to learn: its backward is a no-op
        return loss if loss.requires_grad else loss.requires_grad_()

    def _run(self, batch: tuple, loss_scale: torch.Tensor | float, forward=None, pipeline=None) -> dict:
        """Forward and backward of this rank's ``batch`` (``_rows``) in micro-batches through ``forward(*micro)``
        (the net's output; its token losses give their means: ``paratrain.modules.token_loss``), or a pipeline
        schedule's ``pipeline(batch)``; returns ``StepLoss.result()``."""
        self._norm = StepLoss(self.layout, self.config.micro_batch_num, loss_scale, counted=self.summed)
        with token_means_to(self._norm if self.summed and pipeline is None else None):
            if self.counts_first and pipeline is None:
                self._norm.count_first(lambda: forward_only(batch, self.config, self.precision, self.device, forward,
                                                            self.phase))
                moe_totals(self.parts[0])  # the statistics of the step's forwards with gradients only
            forward_backward(batch, self.config, self.precision, self.device, self.phase, module=self.parts[0],
                             loss_of=lambda micro: self._micro_loss(forward(*micro), pairs=False),
                             pipeline=pipeline)
        return self._norm.result()

    def parameters(self):
        return itertools.chain.from_iterable(part.parameters() for part in self.parts)

    def named_parameters(self):
        """(name in the whole net, this rank's parameter)."""
        for part in self.parts:
            yield from part.named_parameters()


class PlacedNet(Placed):
    """A user's net placed on a layout (``Placed``): tensor, pipeline, expert and data parallel as the net and
    ``config`` say. ``forward_backward(batch, loss_scale)`` runs a global batch (a tuple of tensors, the net's
    forward arguments, batch first): this rank keeps its data-parallel rows and splits them into
    ``micro_batch_num`` micro-batches, run forward in ``precision`` ("none", "bf16", "fp16"). Gradients end up as
    those of the global-batch loss times ``loss_scale`` on one device once the engine applies the ``grad_scale``
    returned with the loss.
    """

    def __init__(self, net: nn.Module, config: ParallelConfig, layout: Layout, example: tuple,
                 precision: str = "none"):
        super().__init__(net, config, layout, precision)
        if config.sequence_parallel:
            raise UserError("sequence_parallel on a user's net is not offered: its own modules between the blocks "
                            "(residuals, norms) would need sequence-sharded activations; leave it off (the built-in "
                            "models of `paratrain train` have it)")
        self.on_meta = any(p.is_meta for p in net.parameters())  # placed as it is, materialised after
        if not self.on_meta:
            net.to(self.device)
        self.pipeline = None
        if config.pipeline_stage > 1:
            if config.expert_parallel > 1:
                raise UserError(f"expert_parallel={config.expert_parallel} with pipeline_stage="
                                f"{config.pipeline_stage} on a user's net is not supported: its traced stages hold "
                                f"no MoE blocks to split; use pipeline_stage=1, or expert_parallel=1 (the built-in "
                                f"models of `paratrain train` have both)")
            self.parts = self._pipeline_stages(net, example)
        else:
            self.parts = [self._parallelize(net, net)]

    # --- placing ----------------------------------------------------------------------------

    def _parallelize(self, module: nn.Module, originals: nn.Module, root: nn.Module | None = None) -> nn.Module:
        """Tensor parallel, recompute and data parallel on ``module`` (the net or a traced stage of it)."""
        config = self.config
        if config.model_parallel > 1:
            for name, kind in declared_plan(originals).items():
                style = parallel_style(kind)  # a user's net: no sequence parallel, declared embedding splits
                if style is None or not has_submodule(module, name):
                    continue
                original = originals.get_submodule(name)
                parent, _, child = name.rpartition(".")
                module.get_submodule(parent).register_module(child, original)  # a traced leaf: the real layer again
                parallelize_module(original, self.layout.tp_mesh, style)
                if kind == "vocab_rows":
                    original.weight.register_post_accumulate_grad_hook(gradient_like_parameter)
        apply_expert_parallel(module, config, self.layout)
        module.layer_stacks = {s: o for s, o in _layer_stacks(originals).items() if has_submodule(module, s)}
        layers = [originals.get_submodule(n) for n, m in originals.named_modules()
                  if getattr(m, "is_transformer_layer", 0)]
        if any(getattr(layer, "recompute_mode", "none") != "none" for layer in layers):
            config = _with_layer_recompute(config, layers)
        apply_recompute(module, config)
        if get_context("mode") == GRAPH_MODE:  # as train.compile: after tensor parallel and recompute
            for layer in [layer for layer in layers if layer in set(module.modules())] or [module]:
                layer.compile()
        if config.data_parallel > 1:
            groups = [[m for m in group if m in set(module.modules())] for group in fusion_groups(originals)]
            apply_data_parallel(module, config, self.layout, root=root, every_batch_norm=False,
                                groups=[group for group in groups if group] or None)
        return module

    def _pipeline_stages(self, net: nn.Module, example: tuple) -> list[nn.Module]:
        """The traced stage modules of this rank: one per virtual stage (``chunk_rank``), and the schedule."""
        config, layout = self.config, self.layout
        if get_context("mode") == GRAPH_MODE:
            raise UserError("set_context(mode=GRAPH_MODE) with pipeline stages: a traced stage runs its layers "
                            "inlined, so they cannot be compiled one by one; use PYNATIVE_MODE with pipeline_stages")
        micro = tuple(t[: t.shape[0] // (config.data_parallel * config.micro_batch_num)].to(
            "meta" if self.on_meta else self.device) for t in example)
        if self.summed and not _returns_its_token_loss(net, micro):
            raise UserError(f"pipeline_stage={config.pipeline_stage}: the net's loss adds other terms (a mixture of "
                            f"experts' aux loss...) to its CrossEntropyLoss, whose (sum, count) the last stage sends "
                            f"on to be added up over the micro-batches; use pipeline_stage=1, or return the loss alone")
        try:
            pipe = trace_pipeline(_InputsByName(net), (), _by_name(micro),
                                  split_spec=stage_starts(net, micro, config.pipeline_stage,
                                                          config.virtual_pipeline_stage,
                                                          config.pipeline_schedule == "zbv_zero_bubble"))
        except UnsplittableNet:
            raise
        except Exception as exc:  # torch.export's own message says what it could not trace
            raise UnsplittableNet(f"the net's forward cannot be split into pipeline stages: "
                                  f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}") from exc
        chunks = config.pipeline_stage * config.virtual_pipeline_stage
        if pipe.num_stages != chunks:
            raise UnsplittableNet(f"the traced forward has {pipe.num_stages} stages, not {chunks}")
        _inputs_to_every_stage(pipe)
        _recompute_from_inputs(pipe)
        carried = integer_boundaries(pipe) if TORCH_VERSION < (2, 13) else []
        if carried:
            raise UnsplittableNet(f"torch {TORCH_VERSION} cannot pass integer tensors between the stages of a traced "
                                  f"net ({', '.join(carried)}; 2.13 can): compute them from the net's inputs alone "
                                  f"(the stage that uses them then computes them itself), or use torch 2.13")
        _contiguous_boundaries(pipe)
        ids = [chunk for chunk in range(chunks) if chunk_rank(chunk, config) == layout.pp_rank]
        modules = [pipe.get_stage_module(chunk) for chunk in ids]
        for module in modules:
            self._parallelize(module, net, root=module)
        # what pipe.build_stage builds, less its rewrite of the device of factory calls: the trace ran on this device
        stages = [_TracedStage(module, chunk, pipe.info(), self.device, group=layout.pp_group)
                  for chunk, module in zip(ids, modules)]
        self.is_last = chunks - 1 in ids
        self.pipeline = build_schedule(stages, config, self._micro_loss)
        return modules

    # --- a step -----------------------------------------------------------------------------

    def forward_backward(self, batch: tuple, loss_scale: torch.Tensor | float = 1.0,
                         rows_of_this_rank: bool = False) -> dict:
        """Forward and backward of one global batch, or with ``rows_of_this_rank`` of this data-parallel rank's
        rows of it (a dataset sharded per rank); returns ``StepLoss.result()``: the global batch's loss (a device
        tensor) and, for a loss with sum and count, the ``grad_scale`` the engine's optimizer step applies."""
        mine = self._rows(batch, rows_of_this_rank, self.config.data_parallel)
        if self.pipeline is None:
            return self._run(mine, loss_scale, self.parts[0])
        target = torch.zeros(len(mine[0]), device=self.device) if self.is_last else None
        return self._run(mine, loss_scale, pipeline=lambda inputs: self.pipeline.step(
            **_by_name(inputs), target=target, return_outputs=False))


class _InputsByName(nn.Module):
    """The net under its own parameter names, taking its inputs as keywords (``_by_name``). Traced so, a stage
    that uses an input (labels, a mask) has it as a root input of the pipe, which ``_inputs_to_every_stage``
    turns into a keyword argument of that stage; no stage sends an input on to the next (torch before 2.13
    cannot send an integer tensor between stages)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        for name, child in net.named_children():
            self.register_module(name, child)
        self._forward = net.forward

    def forward(self, **inputs):
        # 1-d: (loss sum, token count) or the loss, as _micro_loss reads it
        return self._forward(*(inputs[f"input_{i}"] for i in range(len(inputs)))).reshape(-1)


def _by_name(inputs) -> dict:
    """The net's positional inputs as the keyword arguments of its traced pipeline: ``input_0``, ``input_1``..."""
    return {f"input_{i}": x for i, x in enumerate(inputs)}


def _inputs_to_every_stage(pipe: Pipe) -> None:
    """Make every stage module of ``pipe`` take all the net's inputs, by name, after the tensors it receives: a
    schedule passes its keyword arguments to every stage, and a positional argument of a later stage is a tensor
    received from the stage before."""
    inputs = pipe.split_gm.graph.find_nodes(op="placeholder")
    for node in pipe.split_gm.graph.find_nodes(op="call_module"):
        graph = pipe.split_gm.get_submodule(node.target).graph
        used = dict(zip(node.args, graph.find_nodes(op="placeholder"), strict=True))
        first_op = next(n for n in graph.nodes if n.op != "placeholder")
        for root in inputs:
            if root in used:
                first_op.prepend(used[root])  # after the received tensors, in the inputs' order
            else:
                with graph.inserting_before(first_op):
                    graph.placeholder(root.target).meta["val"] = root.meta["val"]
        node.args = tuple(a for a in node.args if a not in inputs) + tuple(inputs)
        pipe.split_gm.get_submodule(node.target).recompile()
    pipe.split_gm.recompile()


def _stage_inputs(pipe: Pipe, stage: fx.Node) -> dict[str, fx.Node]:
    """The placeholders of a stage module (``stage``: its node in the pipe's graph) that take the net's inputs,
    by input name."""
    placeholders = pipe.split_gm.get_submodule(stage.target).graph.find_nodes(op="placeholder")
    return {arg.target: p for p, arg in zip(placeholders, stage.args, strict=True) if arg.op == "placeholder"}


def _recompute_from_inputs(pipe: Pipe) -> None:
    """Have each stage compute itself, from the net's inputs, the tensors it would receive that an earlier stage
    computed from those inputs alone (labels shifted in the forward, a mask), and send those no more: torch
    before 2.13 cannot send an integer tensor between stages, nor a float one that gets no gradient."""
    split = pipe.split_gm
    stages = split.graph.find_nodes(op="call_module")
    for stage in stages:
        graph = split.get_submodule(stage.target).graph
        inputs = _stage_inputs(pipe, stage)
        first_op = next(n for n in graph.nodes if n.op != "placeholder")
        args = []
        for placeholder, source in zip(graph.find_nodes(op="placeholder"), stage.args, strict=True):
            if source.target is not operator.getitem:  # an input of the net, or the single output of a stage
                args.append(source)
                continue
            producer, index = source.args
            copies = {p: inputs[name] for name, p in _stage_inputs(pipe, producer).items()}
            value = split.get_submodule(producer.target).graph.find_nodes(op="output")[0].args[0][index]
            nodes = _computed_from(value, set(copies))
            if nodes is None:
                args.append(source)
                continue
            with graph.inserting_before(first_op):
                for node in nodes:
                    copies[node] = graph.node_copy(node, copies.__getitem__)
            placeholder.replace_all_uses_with(copies[value])
            graph.erase_node(placeholder)
        stage.args = tuple(args)
        split.get_submodule(stage.target).recompile()
    for stage in stages:
        _drop_unused_outputs(pipe, stage)
    split.recompile()


def _computed_from(value: fx.Node, inputs: set[fx.Node]) -> list[fx.Node] | None:
    """The nodes that compute ``value`` from ``inputs`` alone, in graph order; None when it also needs a
    parameter, a buffer, a received tensor or random numbers."""
    needed, todo = set(), [value]
    while todo:
        node = todo.pop()
        if node in needed or node in inputs:
            continue
        if node.op != "call_function" or torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            return None
        needed.add(node)
        todo.extend(node.all_input_nodes)
    return [node for node in value.graph.nodes if node in needed]


def _drop_unused_outputs(pipe: Pipe, stage: fx.Node) -> None:
    """Remove from a stage module's outputs those no other stage takes any more (``_recompute_from_inputs``),
    and the computations only they needed."""
    unused = [user for user in stage.users if user.target is operator.getitem and not user.users]
    if not unused:
        return
    module = pipe.split_gm.get_submodule(stage.target)
    output = module.graph.find_nodes(op="output")[0]
    values = output.args[0]
    dropped = [values[getitem.args[1]] for getitem in unused]
    for getitem in unused:
        pipe.split_gm.graph.erase_node(getitem)
    taken = sorted(stage.users, key=lambda getitem: getitem.args[1])
    output.args = (tuple(values[getitem.args[1]] for getitem in taken),)
    for index, getitem in enumerate(taken):
        getitem.args = (stage, index)
    for value in dropped:
        _erase_if_unused(value)
    module.recompile()


def _erase_if_unused(node: fx.Node) -> None:
    """Erase ``node`` when nothing uses it and it is a function call, then the same for its inputs."""
    if node.users or node.op != "call_function":
        return
    sources = node.all_input_nodes
    node.graph.erase_node(node)
    for source in sources:
        _erase_if_unused(source)


class _TracedStage(StageFixes, _PipelineStage):
    """A traced pipeline stage whose inputs from the net's caller are all keyword arguments
    (``_inputs_to_every_stage``): only the tensors received from the stage before are positional."""

    def _create_act_recv_info(self):
        # torch 2.11 (not 2.13) fails reading an input of the whole pipe on a stage after the first: they
        # reach the stage as keyword arguments, so none is listed among what it receives
        received = [arg.op != "placeholder" for arg in self.node.args]
        return tuple(info for info, keep in zip(super()._create_act_recv_info(), received, strict=True) if keep)


def _contiguous_boundaries(pipe: Pipe) -> None:
    """Make every tensor that crosses a stage boundary contiguous and of its traced dtype, in the stage graphs and in
    the traced values that torch builds the receive and gradient buffers from. Send and receive take only contiguous
    tensors, and a value a forward hands on may be a view: a mask built with ``.expand`` has zero strides, a transpose
    swapped ones; under autocast (bf16, fp16) a stage's output is in the compute dtype, but the buffers that receive it
    were made from the fp32 trace."""
    for node in pipe.split_gm.graph.find_nodes(op="call_module"):
        module = pipe.split_gm.get_submodule(node.target)
        graph = module.graph
        output = graph.find_nodes(op="output")[0]
        with graph.inserting_before(output):
            output.args = map_arg(output.args, _contiguous)
        for placeholder, source in zip(graph.find_nodes(op="placeholder"), node.args, strict=True):
            if source.op != "placeholder":  # received from another stage
                placeholder.meta["val"] = placeholder.meta["val"].contiguous()
        module.recompile()


def _contiguous(node: fx.Node) -> fx.Node:
    """``node`` in its traced dtype and contiguous when it is a tensor (no-ops at run time on one that already is)."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return node
    cast = node.graph.call_method("to", (node, value.dtype))
    copy = node.graph.call_method("contiguous", (cast,))
    cast.meta["val"], copy.meta["val"] = value, value.contiguous()
    return copy


def place_net(net: nn.Module, config: ParallelConfig, layout: Layout, example_batch: tuple,
              precision: str = "none") -> PlacedNet:
    """Place ``net`` (built identically on every rank) on ``layout``; ``example_batch`` is one global batch."""
    return PlacedNet(net, config, layout, example_batch, precision)


def _sum_and_count(net: nn.Module) -> bool:
    """Switch the net's token losses that can (``supports_sum_and_count``: paratrain.nn's CrossEntropyLoss) to
    return (sum, count); whether it has any."""
    losses = [m for m in net.modules() if getattr(m, "supports_sum_and_count", False)]
    for loss in losses:
        loss.reduction = "sum_and_count"
    return bool(losses)


class _TokenLossCalls:
    """A stand-in for a step's ``StepLoss`` that keeps the token means a forward's token losses return."""

    def __init__(self):
        self.means = []

    def token_mean(self, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        self.means.append(total / count.clamp(min=1e-5))
        return self.means[-1]


def _returns_its_token_loss(net: nn.Module, example: tuple) -> bool:
    """Whether ``net(*example)`` returns its one token loss's value itself, nothing added (or a loss of the user's
    own that makes no token means)."""
    calls = _TokenLossCalls()
    with torch.no_grad(), token_means_to(calls):
        output = net(*example)
    return not calls.means or (len(calls.means) == 1 and output is calls.means[0])


def _with_layer_recompute(config: ParallelConfig, layers: list[nn.Module]) -> ParallelConfig:
    """``config`` with one recompute mode per layer: the layer's own where set, else the config's."""
    modes = [getattr(layer, "recompute_mode", "none") for layer in layers]
    modes = [m if m != "none" else config.recompute_mode(i) for i, m in enumerate(modes)]
    return dataclasses.replace(config, recompute=modes)
