import pytest

from paratrain import TransformerOpParallelConfig, config_file
from paratrain.config import Config, ConfigError, ParallelConfig
from paratrain.config_rules import check, validate


def problems_for(world_size=None, **sections):
    cfg = config_file.from_dict(sections)
    return validate(cfg, world_size)


def only_problem(world_size=None, **sections):
    problems = problems_for(world_size, **sections)
    assert len(problems) == 1, problems
    return problems[0]


def test_defaults_are_valid():
    assert validate(Config(), world_size=1) == []


def test_world_size_must_equal_product():
    msg = only_problem(4, parallel={"dp": 2, "mp": 2, "pp": 2, "micro_batch_num": 2},
                       model={"encoder_layers": 2, "decoder_layers": 2})
    assert "data_parallel=2" in msg and "model_parallel=2" in msg and "pipeline_stage=2" in msg
    assert "= 8" in msg and "world size 4" in msg


@pytest.mark.parametrize("field,value,divisors", [
    ("num_heads", 6, "[1, 2, 3, 6]"), ("ffn_hidden_size", 250, "[1, 2, 5, 10, 25, 50, 125, 250]")])
def test_model_sizes_divisible_by_model_parallel(field, value, divisors):
    model = {"hidden_size": 120, "num_heads": 4, "ffn_hidden_size": 256, field: value}
    msg = only_problem(parallel={"model_parallel": 4}, model=model)
    assert f"model.{field}={value}" in msg and "model_parallel=4" in msg and divisors in msg


def test_hidden_size_divisible_by_model_parallel():
    problems = problems_for(parallel={"model_parallel": 4}, model={"hidden_size": 66, "num_heads": 2})
    assert any("model.hidden_size=66 is not divisible by parallel.model_parallel=4" in p for p in problems)


def test_vocab_divisible_only_when_sharded():
    assert problems_for(parallel={"mp": 2}, model={"vocab_size": 63}) == []
    msg = only_problem(parallel={"mp": 2, "vocab_emb_dp": False}, model={"vocab_size": 63})
    assert "model.vocab_size=63" in msg and "vocab_emb_dp=false" in msg and "64" in msg


def test_fewer_layers_than_stages():
    msg = only_problem(parallel={"pipeline_stage": 4, "micro_batch_num": 4}, model={"encoder_layers": 1, "decoder_layers": 2})
    assert "3 layers" in msg and "pipeline_stage=4" in msg


def test_batch_divisible_by_dp_times_micro_batches():
    msg = only_problem(parallel={"dp": 2, "micro_batch_num": 3}, train={"global_batch_size": 16})
    assert "global_batch_size=16" in msg and "data_parallel=2" in msg and "micro_batch_num=3" in msg and "6" in msg


def test_sequence_length_divisible_with_sequence_parallel():
    msg = only_problem(parallel={"mp": 4, "sequence_parallel": True}, model={"src_seq_length": 30})
    assert "model.src_seq_length=30" in msg and "model_parallel=4" in msg and "sequence_parallel" in msg
    assert problems_for(parallel={"mp": 4}, model={"src_seq_length": 30}) == []


def test_non_positive_sizes():
    problems = problems_for(model={"hidden_size": 0, "num_heads": -2})
    assert any("model.hidden_size=0 must be positive" in p for p in problems)
    assert any("model.num_heads=-2 must be positive" in p for p in problems)


@pytest.mark.parametrize("value", [1.0, -0.1])
def test_dropout_range(value):
    msg = only_problem(model={"hidden_dropout": value})
    assert f"model.hidden_dropout={value}" in msg and "[0, 1)" in msg


def test_every_violation_reported_at_once():
    problems = problems_for(2, parallel={"mp": 4}, model={"num_heads": 6, "hidden_dropout": 0.5},
                            train={"global_batch_size": 5})
    text = "\n".join(problems)
    assert "num_heads=6" in text and "world size 2" in text
    with pytest.raises(ConfigError) as err:
        check(config_file.from_dict({"parallel": {"mp": 4}, "model": {"num_heads": 6}}), world_size=4)
    assert "num_heads=6" in str(err.value)


def test_unknown_keys_get_a_suggestion():
    with pytest.raises(ConfigError) as err:
        config_file.from_dict({"model": {"hiden_size": 3}, "paralel": {}})
    text = str(err.value)
    assert "model.hiden_size" in text and "did you mean model.hidden_size" in text
    assert "[paralel]" in text and "[parallel]" in text


def test_overrides_and_aliases():
    cfg = config_file.from_dict({"parallel": {"dp": 2}}, ["parallel.tp=4", "model.hidden_dropout=0", "train.lr=1e-3",
                                                           "parallel.vocab_emb_dp=false", "run.name=x"])
    p = cfg.parallel
    assert (p.data_parallel, p.model_parallel, p.mp, p.tp, p.vocab_emb_dp) == (2, 4, 4, 4, False)
    assert cfg.model.hidden_dropout == 0.0 and cfg.train.lr == 1e-3 and cfg.run.name == "x"
    with pytest.raises(ConfigError, match="expected an integer"):
        config_file.from_dict({}, ["parallel.dp=two"])


def test_toml_round_trip(tmp_path):
    cfg = config_file.from_dict({}, ["parallel.mp=2", "model.kind=gpt", "parallel.recompute=selective"])
    config_file.save(cfg, tmp_path / "c.toml")
    again = config_file.load(tmp_path / "c.toml")
    assert again == cfg


def test_mindspore_views_and_recompute():
    p = TransformerOpParallelConfig(data_parallel=2, model_parallel=4, vocab_emb_dp=False, optimizer_shard=True)
    assert p is not None and isinstance(p, ParallelConfig)
    assert (p.dp_mp_config.data_parallel, p.dp_mp_config.model_parallel) == (2, 4)
    assert p.embedding_dp_mp_config.vocab_emb_dp is False
    assert p.effective_zero_stage == 1
    p.recompute = lambda layer_id, offset, config: "full" if layer_id % 2 else "none"
    assert [p.recompute_mode(i) for i in range(3)] == ["none", "full", "none"]
    p.recompute = True
    assert p.recompute_mode(0) == "full"


def test_tied_embeddings_with_model_parallel_need_sharded_vocab():
    msg = only_problem(parallel={"mp": 2}, model={"tie_embeddings": True})
    assert "tie_embeddings=true" in msg and "model_parallel=2" in msg and "vocab_emb_dp=false" in msg
    assert problems_for(parallel={"mp": 2, "vocab_emb_dp": False}, model={"tie_embeddings": True}) == []


def test_pipeline_rules():
    msg = only_problem(parallel={"pp": 2}, model={"encoder_layers": 2, "decoder_layers": 2})
    assert "micro_batch_num=1" in msg and "pipeline_stage=2" in msg
    msg = only_problem(parallel={"pp": 2, "micro_batch_num": 2, "virtual_pipeline_stage": 2, "pipeline_schedule": "1f1b"},
                       model={"encoder_layers": 2, "decoder_layers": 2})
    assert "virtual_pipeline_stage=2" in msg and "interleaved_1f1b" in msg
    msg = only_problem(parallel={"pp": 2, "micro_batch_num": 2, "layer_stages": [0, 1, 0, 1]},
                       model={"encoder_layers": 2, "decoder_layers": 2})
    assert "layer_stages=[0, 1, 0, 1]" in msg and "4 layers" in msg
    assert problems_for(parallel={"pp": 2, "micro_batch_num": 2, "layer_stages": [0, 0, 0, 1]},
                        model={"encoder_layers": 2, "decoder_layers": 2}) == []


def test_zero_bubble_schedules_are_refused_for_the_encoder_decoder():
    parallel = {"pp": 2, "micro_batch_num": 2, "virtual_pipeline_stage": 2, "pipeline_schedule": "zbv_zero_bubble"}
    msg = only_problem(parallel=parallel, model={"encoder_layers": 2, "decoder_layers": 2})
    assert "zbv_zero_bubble" in msg and "encoder-decoder" in msg and "1f1b" in msg
    assert problems_for(parallel=parallel, model={"kind": "gpt", "decoder_layers": 4}) == []


def test_data_parallel_derived_from_the_world_size_when_not_given():
    cfg = config_file.from_dict({"parallel": {"model_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 2}})
    assert validate(cfg, world_size=8) == [] and not cfg.parallel.data_parallel_given  # validate changes nothing
    assert check(cfg, world_size=8).parallel.data_parallel == 2 and cfg.parallel.data_parallel_given
    assert TransformerOpParallelConfig(model_parallel=2).derive(6).data_parallel == 3
    explicit = config_file.from_dict({"parallel": {"dp": 1, "mp": 2}})
    assert "= 2 does not equal the world size 4" in only_problem(4, parallel={"dp": 1, "mp": 2})
    assert check(explicit).parallel.data_parallel == 1  # no world size: nothing derived
    msg = only_problem(6, parallel={"mp": 4})
    assert "does not divide the world size 6" in msg and "data_parallel (not given)" in msg


def test_mindspore_names_are_aliases():
    cfg = config_file.from_dict({
        "checkpoint": {"save_checkpoint_steps": 5, "keep_checkpoint_max": 2, "directory": "ck", "prefix": "net"},
        "parallel": {"enable_parallel_optimizer": True, "stage_num": 2},
        "model": {"hidden_dropout_rate": 0.2, "attention_dropout_rate": 0.3}}, ["parallel.pipeline_stages=2"])
    c = cfg.checkpoint
    assert (c.save_steps, c.keep_max, c.dir, c.prefix) == (5, 2, "ck", "net")
    assert cfg.parallel.effective_zero_stage == 1 and cfg.parallel.pipeline_stage == 2
    assert (cfg.model.hidden_dropout, cfg.model.attention_dropout) == (0.2, 0.3)


@pytest.mark.parametrize("section,key,hint", [
    ("parallel", "parallel_mode", "paratrain has no parallel mode: it follows from data_parallel, model_parallel and "
                                  "pipeline_stage; a Python script may call paratrain.set_auto_parallel_context"),
    ("parallel", "device_num", "--nproc-per-node"),
    ("train", "save_checkpoint_steps", "did you mean checkpoint.save_steps?"),
    ("train", "keep_max", "did you mean checkpoint.keep_max?"),
    ("train", "enable_parallel_optimizer", "did you mean parallel.optimizer_shard?"),
    ("parallel", "hidden_dropout_rate", "did you mean model.hidden_dropout?"),
    ("train", "batch_size", "did you mean train.global_batch_size?"),
])
def test_mindspore_names_point_to_the_right_key(section, key, hint):
    with pytest.raises(ConfigError) as err:
        config_file.from_dict({section: {key: 1}})
    assert f"unknown key {section}.{key} (" in str(err.value) and hint in str(err.value)
    assert "did you mean parallel.data_parallel" not in str(err.value)


@pytest.mark.parametrize("name, plain", [
    ("paratrain", True), ("run-2.v1_b", True), ("9lives", True), ("x" * 128, True), ("", False), ("..", False),
    ("../../../x", False), ("a/b", False), (".hidden", False), ("-flag", False), ("a b", False), ("a\0b", False),
    ("x" * 129, False), ("café", False)])
def test_run_name_job_name_and_prefix_follow_one_rule(name, plain):
    """run.name and checkpoint.prefix are refused exactly when `paratrain launch --name` refuses the name."""
    from paratrain.launch.jobs import JobError, check_name

    try:
        check_name(name)
        job_ok = True
    except JobError:
        job_ok = False
    config = [p for p in problems_for(run={"name": name}, checkpoint={"prefix": name})
              if p.startswith(("run.name=", "checkpoint.prefix="))]
    assert job_ok == plain and (config == []) == plain


def test_synthetic_task_defaults_to_the_models_own():
    cfg = Config()
    assert cfg.data.task == "" and cfg.data.synthetic_task("transformer") == "reverse"
    assert cfg.data.synthetic_task("gpt") == "markov"
    assert problems_for(model={"kind": "gpt"}, data={"task": "markov"}) == []
    assert problems_for(data={"task": "copy"}) == []


def test_the_registry_of_model_kinds_drives_validation(monkeypatch):
    """model.kind is checked against MODEL_KINDS, whose entry says which data a kind takes; its layer stacks are
    those of the model its builder makes."""
    import dataclasses

    from conftest import tiny_config
    from paratrain import config
    from paratrain.models import build_model
    from paratrain.modules.transformer import pipeline_blocks
    from paratrain.plan.cost import layer_names

    monkeypatch.setitem(config.MODEL_KINDS, "tiny_lm", dataclasses.replace(config.MODEL_KINDS["gpt"],
                                                                           data_kinds=("text",)))
    assert problems_for(model={"kind": "bert"}) == ["model.kind='bert' is not one of transformer, gpt, llama, "
                                                    "resnet, tiny_lm"]
    assert problems_for(model={"kind": "tiny_lm"}) == ["data.kind='synthetic' has no batches for "
                                                       "model.kind='tiny_lm': use data.kind 'text'"]
    resnet = {"model": {"kind": "resnet"}, "data": {"kind": "cifar10", "path": "x"}}
    assert "the planner knows Transformer layers" in only_problem(parallel={"auto": True}, **resnet)
    for kind in ("transformer", "gpt", "llama"):
        cfg = tiny_config(model={"kind": kind}).model
        model = build_model(cfg)
        assert list(model.layer_stacks) == list(cfg.spec.stacks)
        assert [name for name, _, _ in pipeline_blocks(model)] == layer_names(cfg)
