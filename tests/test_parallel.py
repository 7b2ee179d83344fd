"""Every layout trains with the loss of one process (same seed, same global batch, dropout 0).

The layouts of one world size run one after another in one group of forked
workers (start-up dominates); the single-process reference of each model section is computed in this
process, once for all the layouts that train that model.
"""
import functools

import pytest

from conftest import tiny_config
from forked_ranks import run_distributed
from paratrain.trainer import Trainer

STEPS = 10
GPT = {"kind": "gpt"}
LAYOUTS = {  # name: (world size, parallel section, model section)
    "dp2": (2, {"dp": 2, "micro_batch_num": 2}, {}),
    "mp2": (2, {"mp": 2}, {}),
    "mp2_vocab_sharded_tied": (2, {"mp": 2, "vocab_emb_dp": False}, {"tie_embeddings": True}),
    "mp2_sequence_parallel": (2, {"mp": 2, "sequence_parallel": True}, {}),
    "mp2_recompute_full": (2, {"mp": 2, "recompute": "full"}, {}),
    "dp2_recompute_selective": (2, {"dp": 2, "recompute": "selective"}, {}),
    "dp2_zero1_micro2": (2, {"dp": 2, "zero_stage": 1, "micro_batch_num": 2}, {}),
    "gpt_dp2_zero2": (2, {"dp": 2, "zero_stage": 2}, GPT),
    # a vocabulary larger than the tokens of all ranks: the tables stay sharded, the tokens travel (parallel/vocab.py)
    "gpt_dp2_zero3_vocab_rows": (2, {"dp": 2, "zero_stage": 3, "micro_batch_num": 2}, {**GPT, "vocab_size": 256}),
    "dp2_zero2_tied_vocab_rows": (2, {"dp": 2, "zero_stage": 2}, {"vocab_size": 256, "tie_embeddings": True}),
    "gpt_mp2_sp_vocab_sharded": (2, {"mp": 2, "sequence_parallel": True, "vocab_emb_dp": False}, GPT),
    "mp4": (4, {"mp": 4}, {}),
    "dp2_mp2": (4, {"dp": 2, "mp": 2}, {}),
    "dp4_zero3": (4, {"dp": 4, "zero_stage": 3}, {}),
    "dp2_mp2_zero1": (4, {"dp": 2, "mp": 2, "optimizer_shard": True, "gradient_aggregation_group": 2}, {}),
    "dp2_mp2_zero3": (4, {"dp": 2, "mp": 2, "zero_stage": 3, "micro_batch_num": 2}, {}),
    "gpt_dp2_mp2_zero3_sp_full": (4, {"dp": 2, "mp": 2, "zero_stage": 3, "sequence_parallel": True,
                                      "recompute": "full"}, GPT),
    "pp2_gpipe": (2, {"pp": 2, "micro_batch_num": 2, "pipeline_schedule": "gpipe"}, {}),
    "pp2_1f1b": (2, {"pp": 2, "micro_batch_num": 4, "pipeline_schedule": "1f1b"}, {}),
    "pp2_interleaved_v2": (2, {"pp": 2, "micro_batch_num": 4, "pipeline_schedule": "interleaved_1f1b",
                               "virtual_pipeline_stage": 2}, {}),
    "pp2_uneven_split": (2, {"pp": 2, "micro_batch_num": 2, "layer_stages": [0, 0, 0, 1]}, {}),
    "gpt_pp2_tied": (2, {"pp": 2, "micro_batch_num": 2}, {**GPT, "tie_embeddings": True}),
    "gpt_pp2_zbv_zero_bubble": (2, {"pp": 2, "micro_batch_num": 4, "pipeline_schedule": "zbv_zero_bubble",
                                    "virtual_pipeline_stage": 2}, {**GPT, "decoder_layers": 4}),
    "pp4": (4, {"pp": 4, "micro_batch_num": 4}, {}),
    "pp2_dp2_zero3": (4, {"pp": 2, "dp": 2, "zero_stage": 3, "micro_batch_num": 2}, {}),
    "gpt_pp2_dp2_tied": (4, {"pp": 2, "dp": 2, "micro_batch_num": 4}, {**GPT, "tie_embeddings": True}),
    "gpt_pp2_dp2_zbv_zero_bubble": (4, {"pp": 2, "dp": 2, "micro_batch_num": 4, "pipeline_schedule": "zbv_zero_bubble",
                                        "virtual_pipeline_stage": 2}, {**GPT, "decoder_layers": 4}),
    "pp2_mp2_tied_vocab_sharded": (4, {"pp": 2, "mp": 2, "vocab_emb_dp": False, "micro_batch_num": 2},
                                   {"tie_embeddings": True}),
    "dp2_mp2_pp2_tutorial": (8, {"dp": 2, "mp": 2, "pp": 2, "micro_batch_num": 4}, {}),
}


def config(tmp_dir, parallel, model):
    return tiny_config(run={"dir": str(tmp_dir)}, parallel=parallel, model=model, train={"steps": STEPS})


def train_losses(cfg):
    """Loss and gradient norm of every step (Adam hides a wrong gradient scale from the loss)."""
    return [(r["loss"], r["grad_norm"]) for r in Trainer(cfg).train()]


def train_layouts(configs):
    return {name: train_losses(cfg) for name, cfg in configs.items()}


@functools.cache
def reference_losses(model_items: tuple, tmp_root: str):
    """``train_losses`` of one process (no parallel settings) for the model section ``dict(model_items)``."""
    name = "_".join(f"{key}-{value}" for key, value in model_items) or "default"
    return train_losses(config(f"{tmp_root}/reference/{name}", {}, dict(model_items)))


@functools.cache
def distributed_losses(world_size, tmp_root):
    configs = {name: config(f"{tmp_root}/{name}", parallel, model)
               for name, (world, parallel, model) in LAYOUTS.items() if world == world_size}
    return run_distributed(train_layouts, world_size, configs, timeout=600)[0]


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("layouts"))


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_one_process(name, tmp_root):
    world, parallel, model = LAYOUTS[name]
    reference = reference_losses(tuple(sorted(model.items())), tmp_root)
    assert reference[-1][0] < reference[0][0]  # it trains, so equal trajectories mean something
    got = distributed_losses(world, tmp_root)[name]
    for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got, reference), 1):
        assert loss == pytest.approx(want_loss, rel=1e-4), f"{name}: loss at step {step}"
        assert norm == pytest.approx(want_norm, rel=1e-4), f"{name}: grad norm at step {step}"


def test_owners_deal_the_largest_tensors_first_to_the_least_loaded_rank():
    from paratrain.parallel.data import owners

    assert owners([10, 40, 30, 20], 2) == [0, 0, 1, 1]  # 40 -> 0, 30 -> 1, 20 -> 1 (30 < 40), 10 -> 0 (40 < 50)
    assert owners([5, 5, 5], 3) == [0, 1, 2]
    sizes = [7, 1, 8, 3, 3, 9, 2, 6]
    for ranks in (2, 3, 4):
        owner = owners(sizes, ranks)
        load = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(ranks)]
        assert max(load) - min(load) <= max(sizes), (ranks, load)
        assert set(owner) == set(range(ranks))


@pytest.mark.parametrize("kind,tie,want", [
    ("gpt", False, ["embed", "norm", "head"]),
    ("gpt", True, ["norm"]),  # the tied word table stays with the root
    ("transformer", False, ["transformer.encoder.norm", "transformer.decoder.norm", "head"]),  # embeds share words
])
def test_fsdp_part_units_leave_shared_parameters_to_the_root(kind, tie, want):
    import torch

    from paratrain.models import build_model
    from paratrain.modules.transformer import pipeline_blocks
    from paratrain.parallel.data import part_units

    with torch.device("meta"):
        model = build_model(tiny_config(model={"kind": kind, "tie_embeddings": tie}).model)
    names = {id(m): n for n, m in model.named_modules()}
    layers = [model.get_submodule(name) for name, _, _ in pipeline_blocks(model)]
    assert sorted(names[id(m)] for m in part_units(model, layers)) == sorted(want)
    model.head = None  # a pipeline chunk without the head
    assert "head" not in [names[id(m)] for m in part_units(model, layers)]


def _vocab_rows(tmp_dir, vocab_size):
    """Where a dp2 ZeRO 3 GPT keeps its tables, and its summed loss on one batch with and without gradients: this
    rank's and that of both ranks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    trainer = Trainer(tiny_config(run={"dir": tmp_dir}, parallel={"dp": 2, "zero_stage": 3},
                                  model={**GPT, "vocab_size": vocab_size}, train={"steps": 2}))
    trainer.train()
    model = trainer.model
    states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
    groups = [g for state in states  # torch 2.11 holds one parameter group a unit, 2.13 a list
              for g in getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group] if g is not None]
    fsdp_params = {id(p.sharded_param) for g in groups for p in g.fsdp_params}
    head, word = model.head.weight, model.embed.word.embedding.weight  # sharded (DTensors) between steps
    out = {"classes": (type(model.head).__name__, type(model.embed.word.embedding).__name__),
           "rows": (head.to_local().shape[0], word.to_local().shape[0]),
           "fsdp": (id(head) in fsdp_params, id(word) in fsdp_params)}
    batch = trainer.data.batch(0)
    inputs, labels = batch["input_ids"], batch["labels"]
    with_grad = model(inputs, labels=labels)
    with torch.no_grad():
        without = model(inputs, labels=labels)
    mine = torch.stack([with_grad.detach(), without])
    both = mine.clone()
    dist.all_reduce(both)
    return {**out, "loss": mine.tolist(), "both_ranks": both.tolist()}


@pytest.mark.slow
def test_vocab_rows_stay_sharded_while_tokens_travel(tmp_path):
    """dp * tokens <= vocab: each rank keeps half the table and head rows, FSDP2 never gathers them, and the loss
    computed by moving tokens, summed over the ranks, equals the one of the whole table (no gradients: evaluation);
    more tokens than table rows: FSDP2 keeps them."""
    sharded, fsdp = (run_distributed(_vocab_rows, 2, str(tmp_path / str(v)), v, timeout=300) for v in (256, 48))
    for rank in sharded:
        assert rank["classes"] == ("ShardedVocabHeadOutputHead", "ShardedVocabRowsEmbedding")
        assert rank["rows"] == (128, 128) and rank["fsdp"] == (False, False)
        assert rank["both_ranks"][0] == pytest.approx(rank["both_ranks"][1], rel=1e-5)
    # with gradients a rank's share is the loss of every rank's targets among its vocabulary rows, not of its tokens
    assert sharded[0]["loss"][0] != pytest.approx(sharded[0]["loss"][1], rel=1e-3)
    for rank in fsdp:
        assert rank["classes"] == ("FSDPOutputHead", "Embedding") and rank["fsdp"] == (True, True)
        assert rank["rows"] == (24, 24)


def _zero1_state(tmp_dir):
    """(parameter name -> elements, names whose optimizer state this rank holds, parameters after 3 steps)."""
    trainer = Trainer(tiny_config(run={"dir": tmp_dir}, parallel={"dp": 2, "zero_stage": 1}, train={"steps": 3}))
    trainer.train()
    names = {p: n for n, p in trainer.model.named_parameters()}
    params = {n: p.detach().numpy().copy() for p, n in names.items()}
    return {n: p.size for n, p in params.items()}, [names[p] for p in trainer.optimizer.state], params


@pytest.mark.slow
def test_zero1_keeps_each_parameters_optimizer_state_on_one_rank(tmp_path):
    (sizes, held0, params0), (_, held1, params1) = run_distributed(_zero1_state, 2, str(tmp_path))
    assert held0 and held1 and not set(held0) & set(held1)  # every rank steps a disjoint share
    assert set(held0) | set(held1) == set(sizes)  # and together they step every parameter
    for held in (held0, held1):
        assert sum(sizes[n] for n in held) <= sum(sizes.values()) / 2 + max(sizes.values())
    for name in params0:  # the owners' broadcasts left the replicas equal
        assert (params0[name] == params1[name]).all(), name


def test_pipeline_split_balances_layer_costs():
    """The default split leaves the slowest chunk the least work any split can, the head counted with the last layer."""
    import itertools

    import pytest

    from paratrain.config import ModelConfig, ParallelConfig
    from paratrain.models import build_model
    from paratrain.modules.transformer import pipeline_blocks
    from paratrain.parallel.pipeline import chunk_rank, layer_chunks
    from paratrain.plan.cost import chunk_of_layers, layer_costs

    cfg = tiny_config(model={"encoder_layers": 3, "decoder_layers": 2})
    blocks = pipeline_blocks(build_model(cfg.model))
    costs = layer_costs(cfg.model)
    assert costs[0] < costs[3] < costs[4]  # a decoder layer adds cross-attention, the last layer the head
    for pp in (2, 3, 4, 5):
        owner = layer_chunks(blocks, ParallelConfig(pipeline_stage=pp), costs)
        assert owner == sorted(owner) and set(owner) == set(range(pp))
        slowest = max(sum(c for c, o in zip(costs, owner) if o == chunk) for chunk in range(pp))
        assert slowest == min(max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
                              for cuts in itertools.combinations(range(1, len(costs)), pp - 1))
    assert layer_chunks(blocks, ParallelConfig(pipeline_stage=2)) == [0, 0, 1, 1, 1]  # equal costs: later chunks fuller
    with pytest.raises(ValueError, match="cannot split 5 layers into 6"):
        layer_chunks(blocks, ParallelConfig(pipeline_stage=6), costs)
    # the head of a 512-wide GPT on a 32k vocabulary costs five layers: it shares its stage with one
    gpt = ModelConfig(kind="gpt", vocab_size=32000, hidden_size=512, num_heads=8, ffn_hidden_size=2048,
                      decoder_layers=6, seq_length=128)
    assert chunk_of_layers(gpt, ParallelConfig(pipeline_stage=2)) == [0, 0, 0, 0, 0, 1]
    by_function = ParallelConfig(pipeline_stage=2, layer_stages=lambda layer_id, offset, cfg: int(offset > 0))
    assert layer_chunks(blocks, by_function, costs) == [0, 0, 0, 1, 1]
    zbv = ParallelConfig(pipeline_stage=2, virtual_pipeline_stage=2, pipeline_schedule="zbv_zero_bubble")
    assert [chunk_rank(c, zbv) for c in range(4)] == [0, 1, 1, 0]


def _coalesced_broadcast(bucket_bytes):
    import torch
    import torch.distributed as dist

    from paratrain.distributed import init_from_env
    from paratrain.parallel.data import coalesced

    rank, _ = init_from_env()
    shapes = [(3, torch.float32), (5, torch.bfloat16), (40, torch.float32), (2, torch.float32)]
    tensors = [torch.full((n,), float(100 * rank + i), dtype=dtype, device="cpu")
               for i, (n, dtype) in enumerate(shapes)]
    calls = []

    def broadcast(flat):
        calls.append((flat.numel(), str(flat.dtype)))
        return dist.broadcast(flat, src=1, async_op=True)
    coalesced(tensors, broadcast, bucket_bytes)
    return [t.float().tolist() for t in tensors], calls


@pytest.mark.slow
def test_coalesced_collectives_run_per_bucket_and_write_every_tensor_back():
    """ZeRO-1's broadcasts from the owners and a hybrid net's gradient all-reduce go through ``coalesced``."""
    want = [[100.0 + i] * n for i, n in enumerate((3, 5, 40, 2))]  # rank 1's values everywhere
    for bucket_bytes, calls in ((1 << 20, [(45, "torch.float32"), (5, "torch.bfloat16")]),
                                (64, [(3, "torch.float32"), (40, "torch.float32"), (2, "torch.float32"),
                                      (5, "torch.bfloat16")])):  # a tensor over the bucket size is a bucket alone
        for values, seen in run_distributed(_coalesced_broadcast, 2, bucket_bytes, timeout=120):
            assert values == want and seen == calls


def _clipped_partial_gradient():
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from paratrain.distributed import init_from_env
    from paratrain.optim import clip_grad_norm

    init_from_env()
    mesh = init_device_mesh("cpu", (2,))
    param = torch.nn.Parameter(DTensor.from_local(torch.zeros(3, device="cpu"), mesh, [Replicate()]))
    param.grad = DTensor.from_local(torch.full((3,), 2.0, device="cpu"), mesh, [Partial()])  # whole: 4 each
    norm = clip_grad_norm([param], 1.0)
    return float(norm), param.grad.full_tensor().tolist()


@pytest.mark.slow
def test_clipping_scales_partial_gradients():
    """A sequence-parallel norm's gradient is a Partial DTensor until reduced; clipping scales it like any other
    (torch 2.11's DTensor _foreach_mul_ left such gradients as they were)."""
    for norm, grad in run_distributed(_clipped_partial_gradient, 2, timeout=120):
        assert norm == pytest.approx(4 * 3 ** 0.5)
        assert grad == pytest.approx([4 / norm] * 3)  # the whole gradient now has norm 1
