"""The pipeline split of a user's net by tracing (``split_traced``): its forward traced with
``torch.distributed.pipelining`` (torch.export) and cut where its modules' ``pipeline_stage`` attributes say
(``stage_starts``), the stage graphs rewritten so that every stage takes the net's inputs by name (``by_name``),
computes again the tensors those alone give, and receives the rest contiguous. A forward that cannot be traced
(data-dependent Python control flow...) is refused with torch's reason."""
from __future__ import annotations

import operator
import warnings

import torch
from torch import fx, nn
from torch.distributed.pipelining import Pipe, SplitPoint, pipeline as trace_pipeline
from torch.distributed.pipelining.stage import _PipelineStage
from torch.fx.node import map_arg
from torch.torch_version import __version__ as TORCH_VERSION

from paratrain.config import ParallelConfig
from paratrain.errors import UserError
from paratrain.parallel.pipeline import StageFixes

# torch 2.13's FSDP2 warns whenever a wrapped module returns a view; a traced stage's outputs only go to the
# pipeline's send and to its backward, never into an in-place op, which is what the warning is about
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w*GraphModule\) returned a view",
                        category=UserWarning)


class UnsplittableNet(UserError):
    """A net that cannot be split into the pipeline stages its ``pipeline_stage`` attributes ask for."""


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


def split_traced(net: nn.Module, micro: tuple, config: ParallelConfig) -> Pipe:
    """``net``'s forward on one micro-batch ``micro`` as the ``config.pipeline_stage`` x ``virtual_pipeline_stage``
    stage modules of a pipe; UnsplittableNet with the reason when it cannot be split so."""
    try:
        pipe = trace_pipeline(_InputsByName(net), (), by_name(micro),
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
    carried = _integer_boundaries(pipe) if TORCH_VERSION < (2, 13) else []
    if carried:
        raise UnsplittableNet(f"torch {TORCH_VERSION} cannot pass integer tensors between the stages of a traced "
                              f"net ({', '.join(carried)}; 2.13 can): compute them from the net's inputs alone "
                              f"(the stage that uses them then computes them itself), or use torch 2.13")
    _contiguous_boundaries(pipe)
    return pipe


class _InputsByName(nn.Module):
    """The net under its own parameter names, taking its inputs as keywords (``by_name``). Traced so, a stage
    that uses an input (labels, a mask) has it as a root input of the pipe, which ``_inputs_to_every_stage``
    turns into a keyword argument of that stage; no stage sends an input on to the next (torch before 2.13
    cannot send an integer tensor between stages)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        for name, child in net.named_children():
            self.register_module(name, child)
        self._forward = net.forward

    def forward(self, **inputs):
        # 1-d: (loss sum, token count) or the loss, as NetLoss.output_loss reads it
        return self._forward(*(inputs[f"input_{i}"] for i in range(len(inputs)))).reshape(-1)


def by_name(inputs) -> dict:
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


def _integer_boundaries(pipe: Pipe) -> list[str]:
    """The tensors that a stage of the traced ``pipe`` (``torch.distributed.pipelining.pipeline``) receives
    from the stage before and that are not floating point (the argmax of activations), as "name (dtype) into
    stage k". torch 2.11 and 2.12 cannot pass one: their receiving stage asks it to require grad, their sending
    stage waits for its gradient."""
    found = []
    stages = [node for node in pipe.split_gm.graph.nodes if node.op == "call_module"]
    for index, node in enumerate(stages):
        placeholders = [n for n in pipe.split_gm.get_submodule(node.target).graph.nodes if n.op == "placeholder"]
        for placeholder, source in zip(placeholders, node.args):
            value = placeholder.meta.get("val")
            if source.op != "placeholder" and isinstance(value, torch.Tensor) and not value.is_floating_point():
                found.append(f"{placeholder.name} ({value.dtype}) into stage {index}")
    return found


class TracedStage(StageFixes, _PipelineStage):
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
