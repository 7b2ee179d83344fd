"""MindSpore's auto-parallel context and communication functions: each option takes effect or is refused."""
import pytest

from forked_ranks import run_distributed
from paratrain import (ConfigError, ParallelMode, TransformerOpParallelConfig, communication,
                       get_auto_parallel_context, reset_auto_parallel_context, set_auto_parallel_context)
from paratrain.context import parallel_config_for
from paratrain.errors import UserError


@pytest.fixture(autouse=True)
def fresh_context():
    reset_auto_parallel_context()
    yield
    reset_auto_parallel_context()


def test_parallel_modes_are_mindspores_strings():
    assert (ParallelMode.STAND_ALONE, ParallelMode.DATA_PARALLEL, ParallelMode.SEMI_AUTO_PARALLEL,
            ParallelMode.AUTO_PARALLEL, ParallelMode.HYBRID_PARALLEL) == (
        "stand_alone", "data_parallel", "semi_auto_parallel", "auto_parallel", "hybrid_parallel")


def test_set_get_reset():
    assert get_auto_parallel_context("parallel_mode") == "stand_alone"
    assert get_auto_parallel_context("full_batch") is True  # paratrain's behaviour, whatever is set
    set_auto_parallel_context(parallel_mode=ParallelMode.SEMI_AUTO_PARALLEL, gradients_mean=False, full_batch=True,
                              loss_repeated_mean=True, device_num=1, enable_parallel_optimizer=True,
                              parallel_optimizer_config={"gradient_accumulation_shard": True}, pipeline_stages=2)
    assert get_auto_parallel_context("parallel_mode") == "semi_auto_parallel"
    assert get_auto_parallel_context("pipeline_stages") == 2
    assert get_auto_parallel_context("parallel_optimizer_config") == {"gradient_accumulation_shard": True}
    reset_auto_parallel_context()
    assert get_auto_parallel_context("pipeline_stages") == 1
    with pytest.raises(UserError, match="unknown option"):
        get_auto_parallel_context("nope")


@pytest.mark.parametrize("options,reason", [
    ({"parallel_mode": "model_parallel"}, "expected one of"),
    ({"full_batch": False}, "keeps its own rows"),
    ({"dataset_strategy": ((2, 1), (2, 1))}, "only 'full_batch'"),
    ({"loss_repeated_mean": False}, "mean over the whole global batch"),
    ({"gradient_fp32_sync": False}, "float32"),
    ({"parameter_broadcast": "yes"}, "True or False"),
    ({"search_mode": "recursive_programming"}, "expected one of dynamic_programming, sharding_propagation"),
    ({"device_num": 8}, "world size is 1"),
    ({"global_rank": 3}, "rank is 0"),
    ({"pipeline_stages": 0}, "must be positive"),
    ({"pipeline_stages": "2"}, "must be an integer"),
    ({"strategy_ckpt_save_file": 3}, "file path"),
    ({"strategy_ckpt_config": {"save_file": "s.json"}}, "strategy_ckpt_save_file"),
    ({"comm_fusion": {"allreduce": {"mode": "auto"}}}, "gradient_aggregation_group"),
    ({"parallel_optimizer_config": {"parallel_optimizer_threshold": 64}}, "whatever its size"),
    ({"parallel_optimizer_config": {"optimizer_weight_shard_size": 2}}, "all data-parallel ranks"),
    ({"enable_parallel_optimizer": "yes"}, "True or False"),
    ({"grad_accumulation_step": 4}, "unknown option"),
])
def test_options_that_cannot_take_effect_are_refused_with_the_reason(options, reason):
    with pytest.raises(UserError, match=reason) as err:
        set_auto_parallel_context(**{"pipeline_stages": 2, **options})
    assert next(iter(options)) in str(err.value)
    assert get_auto_parallel_context("pipeline_stages") == 1  # a refused call sets nothing


def test_auto_parallel_options_are_kept():
    set_auto_parallel_context(parallel_mode=ParallelMode.AUTO_PARALLEL, auto_parallel_search_mode="sharding_propagation",
                              strategy_ckpt_save_file="s.json", parameter_broadcast=True)
    assert get_auto_parallel_context("search_mode") == "sharding_propagation"  # MindSpore's older name, aliased
    assert get_auto_parallel_context("strategy_ckpt_save_file") == "s.json"
    assert get_auto_parallel_context("parameter_broadcast") is True
    assert get_auto_parallel_context("gradients_mean") is False  # MindSpore's default: data parallel sums
    set_auto_parallel_context(parallel_mode=ParallelMode.HYBRID_PARALLEL)
    assert get_auto_parallel_context("parallel_mode") == "hybrid_parallel"


def test_data_parallel_derived_and_optimizer_shard_from_the_context():
    config = parallel_config_for([], 4)
    assert (config.data_parallel, config.model_parallel, config.effective_zero_stage) == (4, 1, 0)
    set_auto_parallel_context(enable_parallel_optimizer=True)
    assert parallel_config_for([], 4).effective_zero_stage == 1
    set_auto_parallel_context(parallel_optimizer_config={"gradient_accumulation_shard": True})
    assert parallel_config_for([], 4).effective_zero_stage == 2
    blocks = TransformerOpParallelConfig(model_parallel=2, zero_stage=3)
    assert parallel_config_for([blocks], 4).effective_zero_stage == 3  # already more sharded


def test_pipeline_stages_from_the_context_unless_the_blocks_disagree():
    blocks = TransformerOpParallelConfig(model_parallel=2, micro_batch_num=4)
    set_auto_parallel_context(pipeline_stages=2)
    config = parallel_config_for([blocks], 8)
    assert (config.data_parallel, config.model_parallel, config.pipeline_stage) == (2, 2, 2)
    assert blocks.pipeline_stage == 1 and not blocks.data_parallel_given  # the user's config is not changed
    with pytest.raises(ConfigError, match="pipeline_stages=2.*pipeline_stage=4"):
        parallel_config_for([TransformerOpParallelConfig(pipeline_stage=4)], 8)


@pytest.mark.parametrize("interleave,scheduler,segments,schedule", [
    (False, "1f1b", 1, "1f1b"), (False, "gpipe", 1, "gpipe"), (True, "1f1b", 2, "interleaved_1f1b"),
    (True, "gpipe", 3, "looped_bfs"), (True, "zero_bubble_v", 2, "zbv_zero_bubble")])
def test_pipeline_config_picks_the_schedule_and_segments_the_virtual_stages(interleave, scheduler, segments, schedule):
    set_auto_parallel_context(pipeline_stages=2, pipeline_config={"pipeline_interleave": interleave,
                                                                   "pipeline_scheduler": scheduler})
    config = parallel_config_for([], 4, segments)
    assert (config.pipeline_schedule, config.virtual_pipeline_stage, config.pipeline_stage) == (schedule, segments, 2)


def test_pipeline_config_refusals():
    with pytest.raises(UserError, match="seqvpp have no counterpart"):
        set_auto_parallel_context(pipeline_config={"pipeline_interleave": True, "pipeline_scheduler": "seqpipe"})
    with pytest.raises(UserError, match="keys among"):
        set_auto_parallel_context(pipeline_config={"interleave": True})
    set_auto_parallel_context(pipeline_stages=2)
    with pytest.raises(ConfigError, match="pipeline_segment 0..1, but the pipeline is not interleaved"):
        parallel_config_for([], 4, 2)
    set_auto_parallel_context(pipeline_config={"pipeline_interleave": True, "pipeline_scheduler": "zero_bubble_v"})
    with pytest.raises(ConfigError, match="two segments per stage"):
        parallel_config_for([], 4, 3)


def test_pipeline_cell_sets_stages_and_segments_by_cell_name():
    from torch import nn

    from paratrain.nn import PipelineCell

    net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    PipelineCell(net, 2, stage_config={"0": 0, "1.0": 1, "1.1": 0}, segment_config={"1.1": 1})
    assert (net[0].pipeline_stage, net[1][0].pipeline_stage, net[1][1].pipeline_stage) == (0, 1, 0)
    assert net[1][1].pipeline_segment == 1 and "pipeline_segment" not in vars(net[0])
    with pytest.raises(UserError, match="'2', which is no cell"):
        PipelineCell(net, 2, stage_config={"2": 0})
    with pytest.raises(UserError, match="expected an int >= 0"):
        PipelineCell(net, 2, segment_config={"0": -1})


@pytest.mark.parametrize("blocks,context,world,reason", [
    ({"optimizer_shard": True}, {"enable_parallel_optimizer": False}, 2, "enable_parallel_optimizer=False"),
    ({"model_parallel": 2}, {"parallel_mode": "data_parallel", "gradients_mean": True}, 2, "use semi_auto_parallel"),
    ({}, {"parallel_mode": "stand_alone"}, 2, "runs one process"),
    ({"model_parallel": 4}, {}, 6, "does not divide the world size 6"),
    ({"data_parallel": 2}, {}, 4, "= 2 does not equal the world size 4"),
])
def test_contradictions_are_refused(blocks, context, world, reason):
    set_auto_parallel_context(**context)
    with pytest.raises(ConfigError, match=reason):
        parallel_config_for([TransformerOpParallelConfig(**blocks)], world)


def test_agreeing_context_and_blocks_pass():
    set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True, enable_parallel_optimizer=True)
    config = parallel_config_for([TransformerOpParallelConfig(data_parallel=2, optimizer_shard=True)], 2)
    assert (config.data_parallel, config.effective_zero_stage) == (2, 1)


def test_blocks_with_different_sizes_are_refused():
    a, b = TransformerOpParallelConfig(model_parallel=2), TransformerOpParallelConfig(model_parallel=4)
    with pytest.raises(ConfigError, match=r"model_parallel \(2 and 4\)"):
        parallel_config_for([a, b], 8)


def test_communication_in_one_process(monkeypatch):
    communication.init()
    assert (communication.get_rank(), communication.get_group_size()) == (0, 1)
    assert communication.get_rank("hccl_world_group") == 0
    with pytest.raises(UserError, match="only the group of all ranks"):
        communication.get_group_size("my_group")
    with pytest.raises(UserError, match="uses 'gloo'"):
        communication.init("nccl")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (communication.get_rank(), communication.get_group_size()) == (3, 4)  # torchrun's, before init()


def _ranks():
    import torch.distributed as dist

    communication.init("gloo")
    set_auto_parallel_context(device_num=2, global_rank=dist.get_rank())
    return communication.get_rank(), communication.get_group_size(), dist.is_initialized()


@pytest.mark.timeout(120)
def test_communication_on_two_ranks():
    assert run_distributed(_ranks, 2) == [(0, 2, True), (1, 2, True)]


def test_transformer_op_parallel_config_takes_mindspores_positional_order_and_defaults():
    from paratrain.nn import MoEConfig, TransformerOpParallelConfig

    # MindSpore's order: data_parallel, model_parallel, expert_parallel, pipeline_stage, pipeline_segment,
    # micro_batch_num, recompute, optimizer_shard, gradient_aggregation_group, vocab_emb_dp
    config = TransformerOpParallelConfig(1, 2, 1, 2, 1, 4, "none", False, 2, False)
    assert (config.data_parallel, config.model_parallel, config.pipeline_stage, config.micro_batch_num,
            config.gradient_aggregation_group, config.vocab_emb_dp) == (1, 2, 2, 4, 2, False)
    assert TransformerOpParallelConfig().gradient_aggregation_group == 4
    assert TransformerOpParallelConfig(pipeline_stage=2, pipeline_segment=2).virtual_pipeline_stage == 2
    moe = MoEConfig(expert_num=2, group_wise_a2a=True, comp_comm_parallel=True, comp_comm_parallel_degree=3)
    assert (moe.group_wise_a2a, moe.comp_comm_parallel, moe.comp_comm_parallel_degree) == (True, True, 3)


def test_vocab_embedding_takes_mindspores_forward_keyword():
    import torch

    from paratrain.nn import VocabEmbedding

    embedding = VocabEmbedding(vocab_size=8, embedding_size=4)
    ids = torch.tensor([[1, 2, 3]])
    out, table = embedding(input_ids=ids)
    assert torch.equal(out, table[ids])


def test_mindspores_default_of_4_aggregation_groups_runs_a_model_of_fewer_layers():
    from paratrain import config_file
    from paratrain.config_rules import validate
    from paratrain.nn import TransformerOpParallelConfig

    cfg = config_file.from_dict({"model": {"kind": "gpt", "vocab_size": 64, "hidden_size": 32, "num_heads": 4,
                                           "ffn_hidden_size": 64, "decoder_layers": 2, "seq_length": 16}})
    cfg.parallel = TransformerOpParallelConfig(data_parallel=1)
    assert cfg.parallel.gradient_aggregation_group == 4 and cfg.parallel.aggregation_groups(2) == 2
    assert validate(cfg, world_size=1) == []  # 4 groups of 2 layers: one per layer, as MindSpore's lambda_func


def test_set_algo_parameters_are_checked_and_kept_and_multi_subgraphs_accepted():
    import paratrain
    from paratrain.context import _set_multi_subgraphs

    paratrain.set_algo_parameters(elementwise_op_strategy_follow=True, fully_use_devices=False)
    try:
        assert paratrain.get_algo_parameters("elementwise_op_strategy_follow") is True
        assert paratrain.get_algo_parameters("tensor_slice_align_size") == 16  # MindSpore's default
        with pytest.raises(UserError, match=r"set_algo_parameters\(fully_use_devices='yes'\): expected True or "
                                            r"False"):
            paratrain.set_algo_parameters(fully_use_devices="yes")
        with pytest.raises(UserError, match=r"set_algo_parameters\(search=1\): unknown option; known: "
                                            r"algo_approxi_epsilon, "):
            paratrain.set_algo_parameters(search=1)
    finally:
        paratrain.reset_algo_parameters()
    assert paratrain.get_algo_parameters("fully_use_devices") is True
    _set_multi_subgraphs()
    with pytest.raises(UserError, match=r"_set_multi_subgraphs\(1\): expected True or False"):
        _set_multi_subgraphs(1)
