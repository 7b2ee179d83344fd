"""Planner: cost model vs the real sharding (meta-device dry run, real gloo steps), activations vs the tensors
autograd saves, the GPT-3 175B search, ``parallel.auto``."""
import json
import sys
from pathlib import Path

import pytest
import torch

from paratrain import config_file
from paratrain.config import ParallelConfig
from paratrain.config_rules import check, validate
from paratrain.plan import cost
from paratrain.plan.search import Hardware, choose_layout, evaluate, search

ROOT = Path(__file__).resolve().parents[1]


def small(kind, tie=False, **parallel):
    return config_file.from_dict({
        "model": {"kind": kind, "vocab_size": 60, "hidden_size": 32, "num_heads": 4, "ffn_hidden_size": 64,
                  "encoder_layers": 3, "decoder_layers": 4, "tie_embeddings": tie},
        "parallel": parallel, "train": {"global_batch_size": 64}})


# layouts whose per-rank bytes the dry run counts: uneven dp (3), vocab sharding, tied head copies, pipelines
DRY_LAYOUTS = [
    ("gpt", False, {"dp": 4}),
    ("gpt", False, {"dp": 3, "mp": 2, "zero_stage": 1}),
    ("gpt", True, {"pp": 3, "mp": 2, "vocab_emb_dp": False, "micro_batch_num": 6}),
    ("transformer", False, {"dp": 4, "zero_stage": 3}),
    ("transformer", False, {"mp": 4, "vocab_emb_dp": False}),
    ("transformer", False, {"pp": 2, "dp": 2, "mp": 2, "zero_stage": 1, "micro_batch_num": 4}),
    ("transformer", False, {"pp": 2, "virtual_pipeline_stage": 2, "pipeline_schedule": "interleaved_1f1b",
                            "micro_batch_num": 4}),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,tie,parallel", DRY_LAYOUTS)
def test_dry_run_counts_equal_cost_model(kind, tie, parallel):
    from paratrain.plan.dryrun import dry_run

    cfg = small(kind, tie, **parallel)
    counted = dry_run(cfg)
    predicted = cost.stage_states(cfg.model, cfg.parallel)
    assert len(counted) == len(predicted) == cfg.parallel.pipeline_stage
    for c, p in zip(counted, predicted):
        assert (c["params"], c["tensors"], c["optimizer"]) == (p.params, p.tensors, p.optimizer), (c, p)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero", [1, 2])
def test_dry_run_512_ranks(zero):
    """dp 8 x mp 8 x pp 8 on a fake process group of 512 ranks: every stage's bytes as predicted."""
    from paratrain.plan.dryrun import dry_run

    cfg = config_file.from_dict({
        "model": {"kind": "gpt", "vocab_size": 1000, "hidden_size": 256, "num_heads": 8, "ffn_hidden_size": 1024,
                  "decoder_layers": 16, "seq_length": 128},
        "parallel": {"dp": 8, "mp": 8, "pp": 8, "zero_stage": zero, "micro_batch_num": 8, "vocab_emb_dp": False},
        "train": {"global_batch_size": 64}})
    counted = dry_run(cfg, 512)
    predicted = cost.stage_states(cfg.model, cfg.parallel)
    assert [c["rank"] for c in counted] == [64 * s for s in range(8)]
    assert [c["params"] for c in counted] == [p.params for p in predicted]
    assert [c["optimizer"] for c in counted] == [p.optimizer for p in predicted]
    whole = cost.model_params(cfg.model) * 4
    if zero == 1:  # replicas over dp, the optimizer state dealt out over them
        assert whole / 8 < sum(c["params"] for c in counted) < whole / 4
        assert sum(c["optimizer"] for c in counted) < 2 * whole / 8 / 4
    else:  # sharded over mp and dp
        assert sum(c["params"] for c in counted) < whole / 8


def test_layer_split_matches_pipeline_module():
    """The planner's layer list (from the config alone) splits like the built model's."""
    from paratrain.models import build_model
    from paratrain.modules.transformer import pipeline_blocks
    from paratrain.parallel.pipeline import layer_chunks

    for kind in ("gpt", "transformer"):
        for pp, v in ((2, 1), (3, 1), (2, 2), (4, 1)) + (((7, 1), (3, 2)) if kind == "transformer" else ()):
            cfg = small(kind, pp=pp, virtual_pipeline_stage=v)
            with torch.device("meta"):
                model = build_model(cfg.model)
            assert cost.chunk_of_layers(cfg.model, cfg.parallel) == layer_chunks(
                pipeline_blocks(model), cfg.parallel, cost.layer_costs(cfg.model))


MODELS = [("gpt", 0, 5, {}), ("gpt", 0, 7, {"expert_num": 4, "every": 3}), ("transformer", 3, 3, {}),
          ("transformer", 5, 4, {"expert_num": 4, "every": 2}), ("transformer", 1, 4, {"expert_num": 2, "every": 3})]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,encoder,decoder,moe", MODELS)
def test_parameters_read_off_a_small_model_are_the_whole_models(kind, encoder, decoder, moe):
    """The planner reads one layer of each kind off a model with few layers: every layer of the whole model (built
    on the meta device) has its kind's shapes, the count is the whole model's, and a rank of a layout splitting
    every kind of parameter (vocab 62 over 4 ranks: uneven) holds what the really placed model gives it."""
    from paratrain.models import build_model
    from paratrain.modules.transformer import pipeline_blocks
    from paratrain.plan.dryrun import dry_run

    parallel = {"dp": 2, "mp": 4, "vocab_emb_dp": False, "zero_stage": 1, "ep": 2 if moe else 1}
    cfg = config_file.from_dict({"model": {"kind": kind, "vocab_size": 62, "hidden_size": 32, "num_heads": 4,
                                           "ffn_hidden_size": 64, "encoder_layers": encoder, "decoder_layers": decoder,
                                           "moe": moe}, "parallel": parallel, "train": {"global_batch_size": 8}})
    m = cfg.model
    with torch.device("meta"):
        model = build_model(m)
    described = cost.model_description(m)
    for (decoder_layer, layer_id, _), (name, _, _) in zip(cost.layer_blocks(m), pipeline_blocks(model), strict=True):
        shapes = [p.shape for p in described.layers[decoder_layer, cost.is_moe(m, decoder_layer, layer_id)]]
        assert shapes == [tuple(p.shape) for p in model.get_submodule(name).parameters()], name
    assert cost.model_params(m) == sum(p.numel() for p in model.parameters())
    (counted,) = dry_run(cfg)
    (predicted,) = cost.stage_states(m, cfg.parallel)
    assert (counted["params"], counted["tensors"], counted["optimizer"]) == (
        predicted.params, predicted.tensors, predicted.optimizer)


# --- real training steps: parameters, gradients and AdamW state measured by bench/parallel_cost ----

MEASURED = {"dp2_zero0": {"dp": 2}, "dp2_zero1": {"dp": 2, "zero_stage": 1}, "dp2_zero3": {"dp": 2, "zero_stage": 3},
            "mp2": {"mp": 2}, "mp2_sp": {"mp": 2, "sequence_parallel": True},
            "mp2_vocab_sharded": {"mp": 2, "vocab_emb_dp": False}}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_measured_state_bytes_equal_prediction(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT / "tests"))
    import parallel_cost
    from forked_ranks import run_distributed

    a = parallel_cost.parse_args(["--vocab", "62", "--hidden", "32", "--heads", "4", "--ffn", "64", "--layers", "1",
                                  "--length", "8", "--batch", "4", "--steps", "1"])
    configs = {name: parallel_cost.make_config(a, "transformer", par, str(tmp_path / name))
               for name, par in MEASURED.items()}
    ranks = run_distributed(parallel_cost.measure, 2, configs, 1, timeout=280)
    for name, cfg in configs.items():
        p = cost.stage_states(cfg.model, cfg.parallel)[0]
        got = ranks[0][name]["state"]  # rank 0 holds the largest shards
        assert got["params"] == p.params, name
        assert got["grads"] == p.grads, name
        assert sum(got["optimizer"].values()) == p.optimizer, name


# --- activations: bytes autograd keeps, per recompute mode --------------------------------------

def saved_bytes(build, run):
    """``run(build())``; returns its result and the bytes of the distinct storages kept for backward:
    what autograd saved (parameters excluded), the inputs of non-reentrant checkpoints and the op
    outputs that selective recompute's policy keeps."""
    from unittest import mock

    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
    from torch.utils._pytree import tree_leaves
    from torch.utils.checkpoint import CheckpointPolicy

    from paratrain.parallel import recompute

    params, seen = set(), {}

    def note(t):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    def pack(t):
        note(t)
        return t

    original_forward, original_policy = cw.CheckpointWrapper.forward, recompute.selective_policy

    def forward(self, *args, **kwargs):
        for value in (*args, *kwargs.values()):
            note(value)
        return original_forward(self, *args, **kwargs)

    reruns = []

    def policy(ctx, func, *args, **kwargs):
        decision = original_policy(ctx, func, *args, **kwargs)
        if decision == CheckpointPolicy.MUST_SAVE:
            if hasattr(ctx, "op_output"):
                output = ctx.op_output
            else:  # torch 2.11 asks before the op runs: run it again, held so that storages stay distinct
                output = func(*args, **kwargs)
                reruns.append(output)
            for t in tree_leaves(output):
                note(t)
        return decision

    with mock.patch.object(cw.CheckpointWrapper, "forward", forward), \
            mock.patch.object(recompute, "selective_policy", policy):
        model = build()
        params.update(p.untyped_storage().data_ptr() for p in model.parameters())
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run(model)
    return out, sum(seen.values())


@pytest.mark.parametrize("kind", ["gpt", "transformer", "llama"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_activation_bytes_within_1_percent(kind, mode):
    from paratrain.models import build_model
    from paratrain.parallel.recompute import apply_recompute

    cfg = config_file.from_dict({
        "model": {"kind": kind, "vocab_size": 256, "hidden_size": 64, "num_heads": 4, "ffn_hidden_size": 256,
                  "encoder_layers": 2, "decoder_layers": 3, "seq_length": 64, "src_seq_length": 48,
                  "tgt_seq_length": 32, "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "parallel": {"recompute": mode}, "train": {"global_batch_size": 4}})
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    lengths = ("src_seq_length", "tgt_seq_length") if kind == "transformer" else ("seq_length",)
    names = ("src_ids", "tgt_in_ids") if kind == "transformer" else ("input_ids",)
    batch = {n: torch.randint(1, 256, (4, getattr(cfg.model, l)), generator=g) for n, l in zip(names, lengths)}
    labels = torch.randint(1, 256, (4, getattr(cfg.model, lengths[-1])), generator=g)
    loss, measured = saved_bytes(lambda: apply_recompute(build_model(cfg.model), cfg.parallel).train(),
                                 lambda model: model(**batch, labels=labels))
    loss.backward()
    st = cost.stage_states(cfg.model, cfg.parallel)[0]
    predicted = cost.stage_activation_bytes(cfg, cfg.parallel, 0, st)["per_micro_batch"]
    assert abs(predicted / measured - 1) <= 0.01, (predicted, measured)


def test_recompute_and_sequence_parallel_shrink_activations():
    cfg = config_file.from_dict({"model": {"kind": "gpt", "hidden_size": 1024, "num_heads": 16, "ffn_hidden_size": 4096,
                                           "decoder_layers": 4, "seq_length": 1024, "vocab_size": 1000},
                                 "train": {"global_batch_size": 8}})
    spec = cost.activation_spec(cfg)
    values = {}
    for mode in ("none", "selective", "full"):
        for sp in (False, True):
            par = cfg.parallel.__class__(model_parallel=4, sequence_parallel=sp)
            values[mode, sp] = cost.layer_activation_bytes(cfg.model, par, 2, False, mode, spec)
    assert values["full", False] < values["selective", False] < values["none", False]
    assert values["none", True] < values["none", False] and values["full", True] == values["full", False] / 4


def test_in_flight_per_schedule():
    assert cost.in_flight(ParallelConfig(pipeline_stage=4, micro_batch_num=8, pipeline_schedule="gpipe"), 0) == 8
    p = ParallelConfig(pipeline_stage=4, micro_batch_num=8, pipeline_schedule="1f1b")
    assert [cost.in_flight(p, s) for s in range(4)] == [4, 3, 2, 1]
    p = ParallelConfig(pipeline_stage=4, micro_batch_num=8, pipeline_schedule="interleaved_1f1b",
                       virtual_pipeline_stage=2)
    assert cost.in_flight(p, 0) == (4 + 6 + 1) / 2 and cost.in_flight(p, 3) == (4 + 1) / 2
    assert cost.bubble_micro_batches(p) == 1.5


# --- the search ---------------------------------------------------------------------------------

GPT3 = ["--model.kind=gpt", "--model.vocab_size=51200", "--model.hidden_size=12288", "--model.num_heads=96",
        "--model.ffn_hidden_size=49152", "--model.decoder_layers=96", "--model.seq_length=2048",
        "--train.mixed_precision=bf16"]


@pytest.mark.timeout(240)
def test_gpt3_175b_on_1024_devices(capsys):
    from paratrain.cli import main

    assert main(["plan", *GPT3, "--devices", "1024", "--devices-per-node", "8", "--device-memory", "80GB",
                 "--peak-tflops", "312", "--global-batch", "1536", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) > 1000
    for field in ("data_parallel", "model_parallel", "pipeline_stage", "micro_batch_num", "zero_stage", "recompute",
                  "sequence_parallel", "memory_gib", "step_time_s", "mfu", "feasible", "reason"):
        assert all(field in r for r in rows), field
    pure_dp = [r for r in rows if r["model_parallel"] == 1 and r["pipeline_stage"] == 1 and r["zero_stage"] == 0]
    assert pure_dp and all(not r["feasible"] and r["memory_gib"] > 1000 for r in pure_dp)  # ~2.6 TB of state alone
    megatron = [r for r in rows if (r["model_parallel"], r["pipeline_stage"], r["data_parallel"]) == (8, 16, 8)]
    assert any(r["feasible"] for r in megatron)
    best = rows[0]
    assert best["feasible"] and 0.2 < best["mfu"] <= 0.5  # the efficiency (0.5) bounds MFU
    assert all(r["feasible"] for r in rows[:5]) and rows[0]["step_time_s"] <= rows[4]["step_time_s"]
    infeasible = [r for r in rows if not r["feasible"]]
    assert all(r["reason"] for r in infeasible)


def test_plan_table_and_infeasible_reasons(capsys):
    from paratrain.cli import main

    assert main(["plan", "--model.kind=gpt", "--model.hidden_size=2048", "--model.num_heads=16",
                 "--model.ffn_hidden_size=8192", "--model.decoder_layers=24", "--model.seq_length=1024",
                 "--model.vocab_size=50000", "--devices", "16", "--device-memory", "16GiB", "--global-batch", "64",
                 "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "feasible of" in out and "reason: needs" in out


def test_evaluate_reports_config_problems():
    cfg = small("gpt")
    par = cfg.parallel.__class__(data_parallel=3, model_parallel=1)
    row = evaluate(cfg, par, Hardware(3))
    assert not row["feasible"] and "global_batch_size=64 is not divisible" in row["reason"]


def test_choose_layout_and_auto_validation():
    cfg = small("gpt", auto=True)
    assert not [p for p in validate(cfg, 4) if "world size" in p]  # auto: dp x mp x pp need not match yet
    hw = Hardware(4, 4, device_memory=1e12, peak_flops=1e11, intra_bw=1e9, inter_bw=1e8)
    par, why = choose_layout(cfg, 4, 4, hw)
    assert par.world_size == 4 and par.auto and "chose" in why
    cfg.parallel = par
    check(cfg, 4)
    best = search(small("gpt"), hw)[0]
    assert (par.data_parallel, par.model_parallel, par.pipeline_stage) == (
        best["data_parallel"], best["model_parallel"], best["pipeline_stage"])


def test_parallel_auto_resolved_before_the_trainer(tmp_path, capsys):
    from conftest import tiny_config
    from paratrain.trainer import Trainer

    from paratrain.plan import resolve_auto

    cfg = tiny_config(run={"dir": str(tmp_path / "run")}, parallel={"auto": True, "data_parallel": 4},
                      train={"steps": 1}, metrics={"peak_tflops": 1.0, "progress": False})
    trainer = Trainer(resolve_auto(cfg, 1))  # what `paratrain train` does before building the trainer
    assert trainer.cfg.parallel.world_size == 1
    assert "parallel.auto: chose" in capsys.readouterr().out
    assert trainer.cfg.parallel.recompute == "none"  # memory is no limit here, recompute only costs time


def test_plan_dry_run_command(capsys):
    from paratrain.cli import main

    code = main(["plan", "--dry-run", "--devices", "8", "--json", "--model.kind=transformer", "--parallel.dp=2",
                 "--parallel.mp=2", "--parallel.pp=2", "--parallel.micro_batch_num=2", "--parallel.zero_stage=3",
                 "--train.global_batch_size=8"])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and [r["rank"] for r in rows] == [0, 4] and all(r["equal"] for r in rows)


# --- ZeRO-Offload ---------------------------------------------------------------------------------

BIG_GPT = {"kind": "gpt", "vocab_size": 50000, "hidden_size": 2048, "num_heads": 16, "ffn_hidden_size": 8192,
           "decoder_layers": 24, "seq_length": 1024}  # 1.42 B parameters: 21 GiB of fp32 weights + grads + AdamW


def test_offload_proposed_only_when_nothing_else_fits():
    cfg = config_file.from_dict({"model": BIG_GPT, "train": {"global_batch_size": 8, "mixed_precision": "bf16"}})
    rows = search(cfg, Hardware(1, device_memory=16 * 2**30))
    best = rows[0]
    assert best["feasible"] and best["offload_optimizer"] == "cpu" and best["zero_stage"] in (1, 3)
    assert not any(r["feasible"] for r in rows if r["offload_optimizer"] == "none")
    b = best["breakdown"]
    # the model state is on the host: the device holds what is gathered and the activations
    assert b["host_bytes"] == b["params"] + b["grads"] + b["optimizer"] > 20 * 2**30
    assert best["memory_bytes"] == int(b["zero_gathered"] + b["activations"])
    assert b["host_to_device_bytes"] >= b["params"] and b["device_to_host_bytes"] >= b["grads"]
    assert b["offload_s"] > 0 and b["optimizer_s"] == 7 * b["params"] / Hardware(1).host_mem_bw
    roomy = search(cfg, Hardware(1, device_memory=80 * 2**30))
    assert roomy[0]["feasible"] and all(r["offload_optimizer"] == "none" for r in roomy)
    small_host = search(cfg, Hardware(1, device_memory=16 * 2**30, host_memory=8 * 2**30))
    assert not any(r["feasible"] for r in small_host)
    assert any("of host memory per device" in r["reason"] for r in small_host)


def test_offload_bytes_per_step():
    st = cost.StageState(params=100, grads=100, optimizer=208)
    stage1 = ParallelConfig(zero_stage=1, micro_batch_num=4, offload_optimizer="cpu")
    assert cost.offload_bytes(stage1, st) == {"host": 408, "host_to_device": 100, "device_to_host": 100}
    stage3 = ParallelConfig(zero_stage=3, micro_batch_num=4, offload_optimizer="cpu", offload_param="cpu")
    assert cost.offload_bytes(stage3, st) == {"host": 408, "host_to_device": 800, "device_to_host": 400}


def test_op_strategy_search_and_planner_cost_a_collective_alike():
    """One cost model: the time auto parallel's strategy search gives a MatMul's all-reduces and the planner's
    data-parallel gradient all-reduce are both the ring formula computed here, on the same hardware."""
    from conftest import tiny_config
    from paratrain.train.parallel_modes.auto import matmul_cost

    hw = Hardware(2, 8, peak_flops=1e12, efficiency=1.0, intra_bw=1e9, latency=1e-5)

    def all_reduce(size, group, collectives=1):  # seconds of ring all-reduces of `size` bytes in total
        return 2 * (group - 1) / group * size / hw.intra_bw + collectives * hw.latency

    m, k, n = 8, 16, 32
    compute = 3 * 2 * m * k * n / 2 / hw.peak_flops
    # a=2: the weight gradient all-reduced over the batch split; b=2: the output all-reduced in forward
    assert matmul_cost(m, k, n, 2, 1, 1, hw)[0] == pytest.approx(compute + all_reduce(k * n * 4, 2))
    assert matmul_cost(m, k, n, 1, 2, 1, hw)[0] == pytest.approx(compute + all_reduce(m * n * 4, 2))
    cfg = tiny_config(model={"kind": "gpt"})
    par = ParallelConfig(data_parallel=2)
    whole = cost.stage_states(cfg.model, par)[0].whole_params
    groups = par.aggregation_groups(cfg.model.num_layers) + 1  # one all-reduce per layer and one for the rest
    assert evaluate(cfg, par, hw)["breakdown"]["dp_comm_s"] == pytest.approx(all_reduce(whole, 2, groups))


def test_only_kinds_of_transformer_layers_are_planned(capsys):
    from paratrain.cli import main

    for kind in ("resnet", "bert"):
        for dry_run in ([], ["--dry-run"]):
            assert main(["plan", "--devices", "2", f"--model.kind={kind}", *dry_run]) == 2
            assert (f"model.kind='{kind}' cannot be planned: the planner costs Transformer layers, of model.kind "
                    f"'transformer' or 'gpt'") in capsys.readouterr().err


def test_planner_counts_the_flops_the_trainer_counts():
    """The planner's compute is the model's FLOPs as the trainer's MFU counts them (``model_flops``, on the model),
    with a mixture of experts every other layer; full recompute adds a layer's forward once more."""
    from paratrain.metrics.flops import model_flops

    cfg = config_file.from_dict({
        "model": {"kind": "gpt", "vocab_size": 60, "hidden_size": 32, "num_heads": 4, "ffn_hidden_size": 64,
                  "decoder_layers": 2, "moe": {"expert_num": 4, "num_experts_chosen": 2, "every": 2}},
        "train": {"global_batch_size": 8}})
    m, b = cfg.model, 2
    for moe in (False, True):
        none = cost.layer_train_flops(m, ParallelConfig(), b, False, moe, "none")
        forward = cost.counted(m, ParallelConfig(), cost.ActivationSpec()).layers[(False, moe)].at(b).forward
        full = cost.layer_train_flops(m, ParallelConfig(), b, False, moe, "full")
        assert 0 < forward < none and full == none + forward
    dense = config_file.from_dict({"model": {**cfg.model.__dict__, "moe": {}}, "train": {"global_batch_size": 8}})
    hw = Hardware(1, device_memory=1e12)
    compute = [evaluate(c, c.parallel, hw)["breakdown"]["compute_s"] for c in (dense, cfg)]
    extra = model_flops(cfg.model, 8) - model_flops(dense.model, 8)
    # within the experts' capacity, which rounds up per micro-batch and the planner fits over its rows
    assert extra > 0 and compute[1] - compute[0] == pytest.approx(hw.compute_time(extra), rel=0.02)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_expert_activation_bytes_within_1_percent(mode):
    from paratrain.models import build_model
    from paratrain.parallel.recompute import apply_recompute

    cfg = config_file.from_dict({
        "model": {"kind": "gpt", "vocab_size": 256, "hidden_size": 64, "num_heads": 4, "ffn_hidden_size": 256,
                  "decoder_layers": 3, "seq_length": 64, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                  "moe": {"expert_num": 4, "num_experts_chosen": 2, "capacity_factor": 1.0}},
        "parallel": {"recompute": mode}, "train": {"global_batch_size": 4}})
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(1, 256, (4, 64), generator=g) for _ in range(2))
    loss, measured = saved_bytes(lambda: apply_recompute(build_model(cfg.model), cfg.parallel).train(),
                                 lambda model: model(input_ids=ids, labels=labels))
    loss.backward()
    st = cost.stage_states(cfg.model, cfg.parallel)[0]
    predicted = cost.stage_activation_bytes(cfg, cfg.parallel, 0, st)["per_micro_batch"]
    assert abs(predicted / measured - 1) <= 0.01, (predicted, measured)


def test_tables_not_gathered_where_the_tokens_travel():
    """ZeRO 2 over 2 ranks: while all ranks' tokens are fewer than the vocabulary's rows, the word table and head stay
    sharded (``paratrain.parallel.vocab``): what ZeRO gathers leaves out exactly their bytes, and less is sent; with
    more tokens than rows they are gathered as every other parameter."""
    def gpt(vocab, batch):
        return config_file.from_dict({"model": {**small("gpt").model.to_dict(), "vocab_size": vocab},
                                      "train": {"global_batch_size": batch}})

    par = ParallelConfig(data_parallel=2, zero_stage=2)
    hw = Hardware(2)
    for vocab in (256, 262144):
        few, many = 2, vocab // 16  # 2 x 64 tokens; 4 x vocab tokens
        travel, gathered = (evaluate(gpt(vocab, batch), par, hw) for batch in (few, many))
        assert par.moves_tokens(cost.tokens_per_rank(gpt(vocab, few), 2), vocab)
        assert not par.moves_tokens(cost.tokens_per_rank(gpt(vocab, many), 2), vocab)
        tables = 2 * vocab * 32 * 4  # word table and head, fp32
        assert gathered["breakdown"]["zero_gathered"] - travel["breakdown"]["zero_gathered"] == tables
    assert travel["breakdown"]["dp_comm_s"] < gathered["breakdown"]["dp_comm_s"]  # 67 MB of tables not sent


def _backward_of_one_weight() -> float:
    weight = torch.ones(2, requires_grad=True)
    (weight * 3).sum().backward()
    return float(weight.grad.sum())


def test_ranks_forked_after_a_count_run_their_backward():
    """The counts run forward and backward on fake tensors in the process that may fork ranks after (a test, a
    script): the forked ranks' backward still runs (torch 2.11 refused it after a first backward on fake tensors)."""
    from forked_ranks import run_distributed

    from paratrain.plan.counts import model_counts

    model_counts(config_file.from_dict({"model": {"kind": "llama", "hidden_size": 32, "num_heads": 4,
                                                  "num_kv_heads": 2, "ffn_hidden_size": 64, "decoder_layers": 1,
                                                  "vocab_size": 64, "seq_length": 8}}).model)
    assert run_distributed(_backward_of_one_weight, 2, timeout=60) == [6.0, 6.0]
