"""A user's own net on any layout (paratrain.parallel.user.place_net): tensor parallel where its modules declare a
plan, pipeline stages from ``pipeline_stage`` attributes (the forward traced), FSDP over data parallel; every
layout trains with the losses and gradient norms of one process. Plain torch modules sit between the blocks."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.torch_version import __version__ as TORCH_VERSION

from forked_ranks import run_distributed

from paratrain.modules.token_loss import TokenMean


class Block(nn.Module):
    """A residual MLP block that declares its tensor-parallel split, as paratrain.nn's blocks do."""

    is_transformer_layer = True

    def __init__(self, hidden):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def parallel_plan(self):
        return {"fc1": "colwise", "fc2": "rowwise"}

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Embedding(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.table = nn.Embedding(vocab, hidden)

    def parallel_plan(self):
        return {"table": "vocab_rows"}

    def forward(self, ids):
        return self.table(ids)


class TokenLoss(nn.Module):
    """Mean cross-entropy over masked tokens, declared a token loss as paratrain.nn's is: it ends in a TokenMean."""

    def __init__(self):
        super().__init__()
        self.token_mean = TokenMean()

    def forward(self, logits, labels, mask):
        return self.token_mean((F.cross_entropy(logits, labels, reduction="none") * mask).sum(), mask.sum())


class Net(nn.Module):
    """ids, labels, mask (B, T) -> the mean token loss; ``mine`` is a plain torch layer of the user's own."""

    def __init__(self, vocab=32, hidden=16, layers=4):
        super().__init__()
        self.embedding, self.mine = Embedding(vocab, hidden), nn.Linear(hidden, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head, self.loss = nn.Linear(hidden, vocab), TokenLoss()

    def forward(self, ids, labels, mask):
        x = self.mine(self.embedding(ids))
        for block in self.blocks:
            x = block(x)
        return self.loss(self.head(x).flatten(0, 1), labels.flatten(), mask.flatten())


def _batches(steps=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 32, (8, 6), generator=g), torch.randint(0, 32, (8, 6), generator=g),
             (torch.rand(8, 6, generator=g) > 0.2).float()) for _ in range(steps)]


def train(parallel: dict, steps=4, net_class=Net, batches=None):
    """(loss, gradient norm) of each step of the tiny net (a ``net_class``) placed on ``parallel``, on ``batches``
    (default: ``steps`` of ``_batches``)."""
    from paratrain.config import ParallelConfig
    from paratrain.distributed import init_from_env
    from paratrain.mesh import Layout

    torch.set_num_threads(1)
    _, world = init_from_env()
    torch.manual_seed(0)
    net = net_class()
    stages = parallel.get("pipeline_stage", 1)
    for i, block in enumerate(net.blocks):
        block.pipeline_stage = i * stages // len(net.blocks)
    config = ParallelConfig(**parallel)
    return train_placed(net, config, Layout(config, world), batches or _batches(steps))


def train_placed(net, config, layout, batches, **place_options):
    """(loss, gradient norm) of each step of ``net`` placed on ``layout`` (``place_net`` with ``place_options``)
    with AdamW and gradients clipped to norm 1 (``paratrain.engine``), one step a batch."""
    from paratrain.config import MetricsConfig
    from paratrain.engine import Engine
    from paratrain.metrics import StepTimer
    from paratrain.parallel.user import place_net
    from paratrain.precision import LossScaler

    placed = place_net(net, config, layout, batches[0], **place_options)
    optimizer = torch.optim.AdamW([p for _, p in placed.named_parameters()], lr=1e-2)
    engine = Engine(placed, optimizer, None, layout, LossScaler(False, device=layout.device),
                    StepTimer(MetricsConfig(), device=layout.device, mfu=False), grad_clip=1.0)
    out = []
    for step, batch in enumerate(batches, 1):
        record = engine.step(step, batch, {"tokens": 0, "samples": 0, "flops": 0.0}, to_host=True)
        out.append((record["loss"], record["grad_norm"]))
    return out


LAYOUTS = {
    "dp2": {"data_parallel": 2},
    "mp2": {"model_parallel": 2},
    "dp2_mp2_zero3_micro2": {"data_parallel": 2, "model_parallel": 2, "zero_stage": 3, "micro_batch_num": 2},
    "pp2": {"pipeline_stage": 2, "micro_batch_num": 2},
    "dp2_mp2_pp2": {"data_parallel": 2, "model_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 2},
}


@pytest.fixture(scope="module")
def one_process():
    return train({})


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_user_net_matches_one_process(name, one_process):
    parallel = LAYOUTS[name]
    world = parallel.get("data_parallel", 1) * parallel.get("model_parallel", 1) * parallel.get("pipeline_stage", 1)
    got = run_distributed(train, world, parallel, timeout=300)[0]
    assert one_process[-1][0] < one_process[0][0] or one_process[-1] != one_process[0]
    for step, (g, want) in enumerate(zip(got, one_process)):
        assert g == pytest.approx(want, rel=1e-4), f"{name}: step {step + 1}"


class ExpandedMaskNet(Net):
    """Net whose blocks mix the tokens under (B, T, T) weights built with ``.expand``, as people build attention
    masks, from the mask and the embeddings: the view (zero strides) is used on both sides of a stage boundary and
    needs more than the inputs, so the pipeline sends it."""

    def forward(self, ids, labels, mask):
        x = self.mine(self.embedding(ids))
        keep = (mask * x.mean(-1).sigmoid())[:, None, :].expand(-1, ids.shape[1], -1)
        for block in self.blocks:
            x = block(x + keep @ x / ids.shape[1])
        return self.loss(self.head(x).flatten(0, 1), labels.flatten(), mask.flatten())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2", "dp2_mp2_pp2"])
def test_a_stage_boundary_carries_an_expanded_mask(name):
    from paratrain.config import ParallelConfig

    parallel = LAYOUTS[name]
    want = train({}, 3, ExpandedMaskNet)
    got = run_distributed(train, ParallelConfig(**parallel).world_size, parallel, 3, ExpandedMaskNet, timeout=300)[0]
    assert want[-1][0] < want[0][0]
    for step, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, rel=1e-5), f"{name}: step {step + 1}"


class ShiftedNet(Net):
    """Net that takes ids and a mask and computes in its forward, before the first block, the labels (the ids
    shifted) and the mask of the positions that have one: tensors of the first stage used by the last, computed
    from the inputs alone, one of them integer."""

    def forward(self, ids, mask):
        labels, keep = ids.roll(-1, 1), mask * (torch.arange(ids.shape[1]) < ids.shape[1] - 1)
        return super().forward(ids, labels, keep)


def train_shifted(parallel: dict) -> list:
    """The losses of three steps of ShiftedNet on one batch."""
    ids, _, mask = _batches(1)[0]
    return [step[0] for step in train(parallel, net_class=ShiftedNet, batches=[(ids, mask)] * 3)]


def _traced_stage_arguments() -> list[list[str]]:
    """The arguments of each stage of ShiftedNet's traced pipeline (two stages): "input_i" for the net's inputs,
    "received" for a tensor from the stage before."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    from paratrain.parallel.traced_pipeline import (_inputs_to_every_stage, _InputsByName, _recompute_from_inputs,
                                                    by_name)

    ids, _, mask = _batches(1)[0]
    pipe = pipeline(_InputsByName(ShiftedNet()), (), by_name((ids, mask)),
                    split_spec={"blocks.2": SplitPoint.BEGINNING})
    _inputs_to_every_stage(pipe)
    _recompute_from_inputs(pipe)
    return [[a.target if a.op == "placeholder" else "received" for a in stage.args]
            for stage in pipe.split_gm.graph.find_nodes(op="call_module")]


def test_a_traced_stage_receives_only_what_the_inputs_alone_do_not_give():
    # in a worker: tracing leaves autograd unusable in the processes a test forks after it
    assert run_distributed(_traced_stage_arguments, 1, timeout=120)[0] == [["input_0", "input_1"],
                                                                           ["received", "input_0", "input_1"]]


@pytest.mark.slow
def test_tensors_computed_from_the_inputs_are_computed_again_by_the_stage_that_uses_them():
    parallel = LAYOUTS["pp2"]
    want = train_shifted({})
    got = run_distributed(train_shifted, 2, parallel, timeout=300)[0]
    assert want[-1] < want[0]
    assert got == pytest.approx(want, rel=1e-5)


class ArgmaxNet(Net):
    """Net whose second stage adds the argmax of the first stage's activations: an integer tensor that only the
    first stage can compute."""

    def forward(self, ids, labels, mask):
        x = self.mine(self.embedding(ids))
        for block in self.blocks:
            if block.pipeline_stage == 0:
                x = block(x)
                hint = x.argmax(-1, keepdim=True)
            else:
                x = block(x + hint)
        return self.loss(self.head(x).flatten(0, 1), labels.flatten(), mask.flatten())


@pytest.mark.slow
@pytest.mark.skipif(TORCH_VERSION >= (2, 13), reason="torch 2.13 passes integer tensors between traced stages")
def test_integer_tensors_computed_by_a_stage_are_refused_before_torch_2_13():
    with pytest.raises(RuntimeError, match=r"cannot pass integer tensors between the stages of a traced net \(\w+ "
                                           r"\(torch.int64\) into stage 1"):
        run_distributed(train, 2, LAYOUTS["pp2"], 1, ArgmaxNet, timeout=300)


def test_declared_plan_and_stage_starts():
    from paratrain.parallel.tensor import declared_plan
    from paratrain.parallel.traced_pipeline import stage_starts

    net = Net()
    assert declared_plan(net) == {"embedding.table": "vocab_rows", **{f"blocks.{i}.{n}": k for i in range(4)
                                                                            for n, k in (("fc1", "colwise"), ("fc2", "rowwise"))}}
    net.head.pipeline_stage = 1  # the blocks are stage 0 by default; a user's module starts stage 1
    assert list(stage_starts(net, _batches(1)[0], 2)) == ["head"]


def test_a_forward_that_cannot_be_split_is_refused_with_the_reason():
    from paratrain.parallel.traced_pipeline import UnsplittableNet, stage_starts

    net = Net()
    net.blocks[0].pipeline_stage, net.blocks[1].pipeline_stage = 1, 0
    with pytest.raises(UnsplittableNet, match="blocks.1 runs after a module of stage 1 but is in stage 0"):
        stage_starts(net, _batches(1)[0], 2)
    net = Net()
    with pytest.raises(UnsplittableNet, match=r"no module has pipeline_stage in \[1\]"):
        stage_starts(net, _batches(1)[0], 2)
    net.blocks[2].pipeline_stage, net.blocks[2].pipeline_segment = 0, 1
    net.blocks[1].pipeline_stage = 1
    with pytest.raises(UnsplittableNet, match=r"virtual stage in \[3\]"):
        stage_starts(net, _batches(1)[0], 2, segments=2)
    net.blocks[3].pipeline_stage, net.blocks[3].pipeline_segment = 1, 1
    assert list(stage_starts(net, _batches(1)[0], 2, segments=2)) == ["blocks.1", "blocks.2", "blocks.3"]
    net.blocks[0].pipeline_stage, net.blocks[0].pipeline_segment = 0, 1
    with pytest.raises(UnsplittableNet, match="blocks.1 runs after a module of stage 0, segment 1 but is in stage 1, "
                                              "segment 0"):
        stage_starts(net, _batches(1)[0], 2, segments=2)


class Branching(Net):
    def forward(self, ids, labels, mask):
        if ids.sum() > 100:  # data-dependent Python control flow: no single graph to split
            ids = ids.flip(1)
        return super().forward(ids, labels, mask)


def _place_branching():
    from paratrain.config import ParallelConfig
    from paratrain.distributed import init_from_env
    from paratrain.mesh import Layout
    from paratrain.parallel.traced_pipeline import UnsplittableNet
    from paratrain.parallel.user import place_net

    _, world = init_from_env()
    net = Branching()
    net.blocks[2].pipeline_stage = net.blocks[3].pipeline_stage = 1
    config = ParallelConfig(pipeline_stage=2, micro_batch_num=2)
    try:
        place_net(net, config, Layout(config, world), _batches(1)[0])
    except UnsplittableNet as exc:
        return str(exc)
    return "placed"


@pytest.mark.slow
def test_data_dependent_control_flow_is_refused():
    message = run_distributed(_place_branching, 2, timeout=120)[0]
    assert message.startswith("the net's forward cannot be split into pipeline stages:"), message


# --- the tutorial's shape: paratrain.nn blocks, lambda_func stages, a head placed by its attribute ---------------

class EmbeddingLayer(nn.Module):
    """The tutorial's embedding: word + position tables (VocabEmbedding), ids (B, T) -> (B, T, H) and the table."""

    def __init__(self, parallel_config):
        import paratrain.nn as pnn

        super().__init__()
        self.word = pnn.VocabEmbedding(40, 32, parallel_config=parallel_config.embedding_dp_mp_config)
        self.position = pnn.VocabEmbedding(16, 32, parallel_config=parallel_config.embedding_dp_mp_config)

    def forward(self, ids, positions):
        word, table = self.word(ids)
        return word + self.position(positions)[0], table


class TutorialNet(nn.Module):
    """The tutorial's translation net: embeddings, Transformer, a Linear head on the last stage, masked loss."""

    def __init__(self, parallel_config):
        import paratrain.nn as pnn

        super().__init__()
        self.src_embedding, self.tgt_embedding = EmbeddingLayer(parallel_config), EmbeddingLayer(parallel_config)
        self.transformer = pnn.Transformer(hidden_size=32, batch_size=8, ffn_hidden_size=64, src_seq_length=8,
                                           tgt_seq_length=8, encoder_layers=2, decoder_layers=2, num_heads=4,
                                           attention_dropout_rate=0.0, hidden_dropout_rate=0.0,
                                           parallel_config=parallel_config)
        self.head = nn.Linear(32, 40, bias=False)
        self.head.pipeline_stage = parallel_config.pipeline_stage - 1
        self.mask = pnn.AttentionMask(8)
        self.loss = pnn.CrossEntropyLoss(parallel_config=parallel_config.dp_mp_config)

    def forward(self, src, src_pos, src_mask, tgt, tgt_pos, tgt_mask, labels):
        x, _ = self.src_embedding(src, src_pos)
        y, _ = self.tgt_embedding(tgt, tgt_pos)
        encoder_mask = src_mask[:, None, :] * src_mask[:, :, None]
        memory_mask = tgt_mask[:, :, None] * src_mask[:, None, :]
        out, _, _ = self.transformer(x, encoder_mask, y, self.mask(tgt_mask), memory_mask)
        return self.loss(self.head(out).reshape(-1, 40), labels.reshape(-1), tgt_mask.reshape(-1))


def tutorial_batches(n=4):
    g = torch.Generator().manual_seed(1)
    positions = torch.arange(8).expand(8, 8).contiguous()
    out = []
    for _ in range(n):
        src, tgt, labels = (torch.randint(1, 40, (8, 8), generator=g) for _ in range(3))
        mask = (torch.arange(8)[None] < torch.randint(3, 9, (8,), generator=g)[:, None]).float()
        out.append((src, positions, mask, tgt, positions, mask, labels))
    return out


def train_tutorial(parallel: dict):
    """(loss, gradient norm) of each step of the tutorial net placed on ``parallel``."""
    from paratrain.config import ParallelConfig
    from paratrain.distributed import init_from_env
    from paratrain.mesh import Layout

    torch.set_num_threads(1)
    _, world = init_from_env()
    torch.manual_seed(0)
    config = ParallelConfig(**parallel)
    return train_placed(TutorialNet(config), config, Layout(config, world), tutorial_batches())


TUTORIAL_LAYOUTS = {"mp2_vocab_sharded": {"model_parallel": 2, "vocab_emb_dp": False},
                    "dp2_mp2_pp2": {"data_parallel": 2, "model_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 4}}


@pytest.mark.slow
@pytest.mark.parametrize("name", TUTORIAL_LAYOUTS)
def test_tutorial_net_matches_one_process(name):
    parallel = TUTORIAL_LAYOUTS[name]
    world = parallel.get("data_parallel", 1) * parallel.get("model_parallel", 1) * parallel.get("pipeline_stage", 1)
    want = train_tutorial({})
    got = run_distributed(train_tutorial, world, parallel, timeout=400)[0]
    for step, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, rel=1e-4), f"{name}: step {step + 1}"


def test_a_ranks_share_that_does_not_split_into_micro_batches_is_refused_naming_it():
    from paratrain.config import ParallelConfig
    from paratrain.errors import UserError
    from paratrain.mesh import Layout
    from paratrain.parallel.user import place_net

    config = ParallelConfig(micro_batch_num=3)
    placed = place_net(Net(), config, Layout(config, 1), _batches(1)[0])
    placed.loss.rows_of_this_rank = True
    with pytest.raises(UserError, match=r"a batch of 8 rows does not split into 3 equal parts \(this rank's share "
                                        r"of a dataset sharded per rank x micro_batch_num=3\)"):
        placed.forward_backward(_batches(1)[0])
    placed.loss.rows_of_this_rank = False
    with pytest.raises(UserError, match=r"\(data_parallel=1 x micro_batch_num=3\)"):
        placed.forward_backward(_batches(1)[0])


def test_a_steps_loss_is_its_micro_batches_whatever_the_schedule_computed_before_them():
    """StepLoss counts a step's last micro_batch_num losses only (torch 2.13's pipeline stages call the loss
    function once more to infer the backward's shapes); a loss's own token counts divide the gradients later."""
    from paratrain.config import ParallelConfig
    from paratrain.parallel.micro_batches import StepLoss
    from paratrain.mesh import Layout

    config = ParallelConfig(micro_batch_num=2)
    norm = StepLoss(Layout(config, 1), 2, torch.tensor(4.0), counted=True)
    norm.token_sum(torch.tensor(float("nan")), torch.tensor(0.0))  # a shape inference
    for loss_sum, count in [(6.0, 2.0), (9.0, 4.0)]:
        assert float(norm.token_sum(torch.tensor(loss_sum), torch.tensor(count))) == loss_sum * 4  # x loss scale
    result = norm.result()
    assert float(result["loss"]) == pytest.approx(15 / 6) and float(result["grad_scale"]) == pytest.approx(1 / 6)
    mean = StepLoss(Layout(config, 1), 2, 1.0)
    assert [float(mean.mean(torch.tensor(x))) for x in (2.0, 4.0)] == [1.0, 2.0]
    assert float(mean.result()["loss"]) == 3.0 and "grad_scale" not in mean.result()


class FusedNet(Net):
    """Net whose cells are put in MindSpore's communication groups by hand (``comm_fusion``, as
    ``Cell.set_comm_fusion`` sets it): blocks 0-1, blocks 2-3 with the head, the embedding alone."""

    def __init__(self):
        super().__init__()
        for module, group in [(self.blocks[0], 1), (self.blocks[1], 1), (self.blocks[2], 2), (self.blocks[3], 2),
                              (self.head, 2), (self.embedding, 3)]:
            for inner in module.modules():
                inner.comm_fusion = group


def _fused_groups(parallel):
    from paratrain.config import ParallelConfig
    from paratrain.distributed import init_from_env
    from paratrain.mesh import Layout
    from paratrain.parallel.user import place_net

    _, world = init_from_env()
    torch.manual_seed(0)
    net = FusedNet()
    config = ParallelConfig(**parallel)
    place_net(net, config, Layout(config, world), _batches(1)[0])
    state = [m._get_fsdp_state() for m in (*net.blocks, net.head, net.embedding)]
    return [a is b for a, b in zip(state, state[1:])]


@pytest.mark.slow
def test_comm_fusion_groups_are_the_fsdp_units_and_train_as_one_process(one_process):
    parallel = {"data_parallel": 2, "zero_stage": 3}
    # blocks 0 = 1, 1 != 2, 2 = 3, 3 = head, head != embedding
    assert run_distributed(_fused_groups, 2, parallel, timeout=120)[0] == [True, False, True, True, False]
    got = run_distributed(train, 2, parallel, 4, FusedNet, timeout=300)[0]
    for step, (g, want) in enumerate(zip(got, one_process)):
        assert g == pytest.approx(want, rel=1e-4), f"step {step + 1}"


def test_sequence_parallel_on_a_users_net_is_refused():
    from paratrain.config import ParallelConfig
    from paratrain.errors import UserError
    from paratrain.mesh import Layout
    from paratrain.parallel.user import place_net

    config = ParallelConfig(sequence_parallel=True)
    with pytest.raises(UserError, match="sequence_parallel on a user's net is not offered"):
        place_net(Net(), config, Layout(config, 1), _batches(1)[0])


def train_interleaved(parallel: dict, steps=4):
    """``train`` with the blocks over virtual stages: block i in segment i // pipeline_stage, on stage
    i % pipeline_stage, or for the zero-bubble V on the stages 0, 1 then 1, 0 (the embedding before the first
    block, the head after the last)."""
    from paratrain.config import ParallelConfig
    from paratrain.distributed import init_from_env
    from paratrain.mesh import Layout

    torch.set_num_threads(1)
    _, world = init_from_env()
    torch.manual_seed(0)
    net = Net()
    stages = parallel["pipeline_stage"]
    v_shape = parallel["pipeline_schedule"] == "zbv_zero_bubble"
    for i, block in enumerate(net.blocks):
        segment = i // stages
        block.pipeline_stage = stages - 1 - i % stages if v_shape and segment else i % stages
        block.pipeline_segment = segment
    config = ParallelConfig(**parallel, virtual_pipeline_stage=len(net.blocks) // stages)
    return train_placed(net, config, Layout(config, world), _batches(steps))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
                                      "zbv_zero_bubble"])
def test_every_schedule_with_virtual_stages_matches_one_process(schedule, one_process):
    parallel = {"pipeline_stage": 2, "micro_batch_num": 2, "pipeline_schedule": schedule}
    got = run_distributed(train_interleaved, 2, parallel, timeout=300)[0]
    for step, (g, want) in enumerate(zip(got, one_process)):
        assert g == pytest.approx(want, rel=1e-4), f"{schedule}: step {step + 1}"


def _named_after_placing():
    """(name, class name, is a DTensor) of the tutorial net's parameters placed on model_parallel=2, named after
    placing, and the loss of a step taken after, and a deep copy's name."""
    import copy

    from torch.distributed.tensor import DTensor

    from paratrain.config import ParallelConfig
    from paratrain.distributed import init_from_env
    from paratrain.mesh import Layout
    from paratrain.nn.cell import mindspore_named
    from paratrain.parallel.user import place_net

    torch.set_num_threads(1)
    _, world = init_from_env()
    torch.manual_seed(0)
    config = ParallelConfig(model_parallel=2)
    net = TutorialNet(config)
    placed = place_net(net, config, Layout(config, world), tutorial_batches(1)[0])
    params = mindspore_named(net, named=placed.named_parameters())
    loss = placed.forward_backward(tutorial_batches(1)[0])["loss"]
    return ([(p.name, isinstance(p, DTensor)) for p in params], float(loss), copy.deepcopy(params[0]).name)


def test_parameters_of_a_placed_net_have_their_mindspore_names():
    named, loss, copied = run_distributed(_named_after_placing, 2, timeout=240)[0]
    names = [name for name, _ in named]
    assert any(name.endswith(".gamma") for name in names) and any(name.endswith(".beta") for name in names)
    assert any(is_dtensor for _, is_dtensor in named)  # the split ones are DTensors, named all the same
    assert loss == loss and copied == names[0]


def _tutorial_ops_net(strategy_of_add, model_parallel=2):
    from paratrain.config import ParallelConfig
    from paratrain import ops

    config = ParallelConfig(data_parallel=2, model_parallel=model_parallel)
    net = TutorialNet(config)
    net.add = ops.Add().shard(strategy_of_add)
    net.head_matmul = ops.MatMul(transpose_b=True).shard(((1, 1), (1, 1)))
    net.no_equal = ops.NotEqual().shard(((1, 1), ()))
    return net, config


def test_ops_splitting_the_batch_only_go_with_the_blocks_and_others_are_refused():
    from paratrain import ops
    from paratrain.errors import UserError
    from paratrain.train.placement import op_by_op

    net, config = _tutorial_ops_net(((2, 1, 1), (2, 1, 1)))
    assert op_by_op(net, config) is False  # placed by the blocks' placement, data parallel
    assert op_by_op(*_tutorial_ops_net(((2, 1, 1), (2, 1, 1)), model_parallel=1)) is False
    assert op_by_op(*_tutorial_ops_net(((1, 2, 1), (1, 2, 1)), model_parallel=1)) is True  # op by op
    net, config = _tutorial_ops_net(((1, 2, 1), (1, 2, 1)))
    with pytest.raises(UserError, match=r"split more than the batch over data_parallel=2 \(add.shard\(\(\(1, 2, 1\), "
                                        r"\(1, 2, 1\)\)\)\) with blocks given model_parallel=2"):
        op_by_op(net, config)
    net.add = ops.Add()
    net.head_matmul = ops.MatMul(transpose_b=True).shard(((2, 1), (2, 1)))  # a weight split: model parallel
    with pytest.raises(UserError, match=r"head_matmul.shard"):
        op_by_op(net, config)


def _gathered_dtypes(parallel: dict, precision: str) -> set:
    """The dtypes the tiny net's Linear weights have while its forward runs, placed on ``parallel`` in
    ``precision`` (under bf16 autocast, as ``Model(amp_level="O2")`` runs it)."""
    from paratrain.config import ParallelConfig
    from paratrain.distributed import init_from_env
    from paratrain.mesh import Layout
    from paratrain.parallel.user import place_net
    from paratrain.precision import autocast

    torch.set_num_threads(1)
    _, world = init_from_env()
    torch.manual_seed(0)
    net, config, seen = Net(), ParallelConfig(**parallel), set()
    for module in net.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(lambda module, args: seen.add(module.weight.dtype))
    placed = place_net(net, config, Layout(config, world), _batches(1)[0], precision)
    with autocast(precision, placed.device):
        placed.model(*_batches(1)[0])
    return seen


@pytest.mark.parametrize("parallel", [{"data_parallel": 2, "zero_stage": 2}, {"data_parallel": 2, "zero_stage": 3}])
def test_a_users_net_with_amp_and_zero_gathers_its_parameters_in_the_compute_dtype(parallel):
    """As a built-in model: FSDP gathers a bf16 run's parameters in bf16 (half the bytes of fp32); without amp in
    fp32."""
    assert run_distributed(_gathered_dtypes, 2, parallel, "bf16") == [{torch.bfloat16}] * 2
    assert run_distributed(_gathered_dtypes, 2, parallel, "none") == [{torch.float32}] * 2


class MindSporeLossNet(Net):
    """``Net`` with paratrain.nn's CrossEntropyLoss, whose mean is over MindSpore's ``Σmask + 1e-5``."""

    def __init__(self):
        import paratrain.nn as pnn

        super().__init__()
        self.loss = pnn.CrossEntropyLoss()


def _one_kept_token():
    """A batch in which the loss keeps one token (its denominator 1 + 1e-5), on the first data-parallel rank."""
    ids, labels, _ = _batches(1)[0]
    mask = torch.zeros(8, 6)
    mask[0, 2] = 1.0
    return [(ids, labels, mask)]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{}, {"data_parallel": 2}, {"pipeline_stage": 2, "micro_batch_num": 2}],
                         ids=["one process", "dp2", "pp2"])
def test_a_placed_cross_entropy_loss_divides_by_the_kept_tokens_plus_1e_5_as_mindspore(parallel):
    """MindSpore's CrossEntropyLoss: Σ(loss × mask) / (Σmask + 1e-5), with the gradient of that value; a placed
    net's step divides the global batch's sum by its count plus the same 1e-5."""
    from paratrain.config import ParallelConfig

    torch.manual_seed(0)
    net = MindSporeLossNet()
    ids, labels, mask = _one_kept_token()[0]
    logits = net.head(torch.nn.Sequential(*net.blocks)(net.mine(net.embedding(ids)))).flatten(0, 1)
    token_loss = F.cross_entropy(logits, labels.flatten(), reduction="none")
    want = (token_loss * mask.flatten()).sum() / (mask.sum() + 1e-5)
    want.backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters()]))
    world = ParallelConfig(**parallel).world_size
    loss, norm = run_distributed(train, world, parallel, 1, MindSporeLossNet, _one_kept_token(), timeout=300)[0][0]
    assert loss == pytest.approx(want.item(), rel=1e-6, abs=0)
    assert norm == pytest.approx(grad_norm.item(), rel=1e-6, abs=0)
