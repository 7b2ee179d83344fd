"""The llama kind against ``transformers`` itself: tiny random Llama, Qwen2, Qwen3 and Mistral models made here and
saved in two shards; paratrain's logits from their directories equal HF's, on one process and on 2 gloo ranks."""
from __future__ import annotations

import pytest
import torch

import torch.nn.functional as F

from forked_ranks import run_distributed
from paratrain import config_file
from paratrain.config import ConfigError, ModelConfig
from paratrain.config import hf_model_settings as model_settings, read_hf_config as read_config
from paratrain.errors import UserError
from paratrain.models import build_model
from paratrain.models.hf import load_hf_weights

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 12
SIZES = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
             num_hidden_layers=2, max_position_embeddings=64)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
CASES = {
    "llama_gqa2": ("LlamaConfig", {}),
    "llama_mqa": ("LlamaConfig", {"num_key_value_heads": 1}),
    "llama3_rope_tied": ("LlamaConfig", {"rope_parameters": {"rope_theta": 500000.0, **LLAMA3},
                                         "tie_word_embeddings": True}),
    "llama_linear_rope": ("LlamaConfig", {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear",
                                                              "factor": 2.0}}),
    "qwen2_bias": ("Qwen2Config", {}),
    "qwen3_qk_norm_head_dim": ("Qwen3Config", {"head_dim": 16, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "llama_4_layers": ("LlamaConfig", {"num_hidden_layers": 4}),
}


def hf_model(case: str):
    name, extra = CASES[case]
    torch.manual_seed(0)
    cfg = getattr(transformers, name)(**{**SIZES, **extra})
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():  # HF's init leaves norms at 1 and biases at 0: random ones catch a misplaced one
        for pname, p in model.named_parameters():
            if "norm" in pname or "bias" in pname:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """case -> (directory of the HF model saved in two shards, HF's logits of ``ids``)."""
    out = {}
    for case in CASES:
        model, directory = hf_model(case), tmp_path_factory.mktemp(case)
        model.save_pretrained(directory, max_shard_size="40KB")
        assert (directory / "model.safetensors.index.json").exists()
        with torch.no_grad():
            out[case] = (directory, model(ids()).logits)
    return out


def ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def llama_config(directory, **keys) -> ModelConfig:
    return ModelConfig(**{"kind": "llama", "seq_length": SEQ, "hidden_dropout": 0.0,
                          **model_settings(read_config(directory)), **keys})


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers_on_one_process(case, hf_dirs):
    directory, want = hf_dirs[case]
    model = build_model(llama_config(directory)).eval()
    load_hf_weights([model], model, directory)
    with torch.no_grad():
        got = model(ids())
    assert relative(got, want) <= 1e-5


def test_settings_follow_config_json(hf_dirs):
    settings = model_settings(read_config(hf_dirs["qwen3_qk_norm_head_dim"][0]))
    assert settings["head_dim"] == 16 and settings["qk_norm"] and not settings["qkv_bias"]
    assert settings["tie_embeddings"] and settings["num_kv_heads"] == 2
    llama3 = model_settings(read_config(hf_dirs["llama3_rope_tied"][0]))
    assert llama3["rope_theta"] == 500000.0 and llama3["rope_scaling"] == LLAMA3
    assert model_settings(read_config(hf_dirs["qwen2_bias"][0]))["qkv_bias"]


def test_other_architectures_refused_naming_them():
    with pytest.raises(ConfigError, match="GPT2LMHeadModel.*LlamaForCausalLM, Qwen2ForCausalLM"):
        model_settings({"architectures": ["GPT2LMHeadModel"]})


def test_missing_unexpected_and_misshaped_tensors_refused_naming_each(hf_dirs):
    directory = hf_dirs["llama_gqa2"][0]
    model = build_model(llama_config(directory, ffn_hidden_size=40, decoder_layers=3))
    with pytest.raises(UserError) as err:
        load_hf_weights([model], model, directory)
    message = str(err.value)
    assert "missing model.layers.2.self_attn.q_proj.weight" in message
    assert "model.layers.0.mlp.up_proj.weight is (48, 32), the model's is (40, 32)" in message


def test_kv_heads_model_parallel_rule_names_the_values_that_work():
    from paratrain.config import Config
    from paratrain.config_rules import validate

    cfg = Config()
    cfg.model = ModelConfig(kind="llama", hidden_size=64, num_heads=8, num_kv_heads=2, ffn_hidden_size=64)
    cfg.parallel.model_parallel = 4
    problems = validate(cfg)
    assert any("num_kv_heads=2 is not divisible by parallel.model_parallel=4" in p and "[1, 2]" in p
               for p in problems), problems
    cfg.model = ModelConfig(kind="gpt", num_kv_heads=2)
    cfg.parallel.model_parallel = 1
    assert any("model.num_kv_heads=2 is a key of model.kind='llama'" in p for p in validate(cfg))


def test_the_toml_takes_config_json_and_refuses_a_contradiction_showing_both(hf_dirs):
    directory = str(hf_dirs["qwen3_qk_norm_head_dim"][0])
    cfg = config_file.from_dict({"model": {"from_hf": directory, "seq_length": SEQ}})
    m = cfg.model
    assert (m.kind, m.num_kv_heads, m.head_dim, m.qk_norm, m.hidden_dropout) == ("llama", 2, 16, True, 0.0)
    with pytest.raises(ConfigError) as err:
        config_file.from_dict({"model": {"from_hf": directory, "num_heads": 8, "kind": "gpt", "ffn_hidden_size": 48}})
    message = str(err.value)
    assert "model.num_heads=8 contradicts" in message and "(num_attention_heads): 4" in message
    assert "model.kind='gpt' contradicts" in message and "ffn_hidden_size" not in message


STEPS, BATCH, LR = 5, 4, 2e-3
LAYOUTS = {  # name: (case, world size, parallel section)
    "one_process": ("llama_gqa2", 1, {}),
    "tp2": ("llama_gqa2", 2, {"mp": 2}),
    "dp2_zero3": ("llama_gqa2", 2, {"dp": 2, "zero_stage": 3}),
    "qwen3_tied_tp2_vocab_rows_sp": ("qwen3_qk_norm_head_dim", 2, {"mp": 2, "vocab_emb_dp": False,
                                                                   "sequence_parallel": True}),
    "qwen2_dp2_zero3": ("qwen2_bias", 2, {"dp": 2, "zero_stage": 3}),
    "llama3_tied_pp2_1f1b": ("llama3_rope_tied", 2, {"pp": 2, "micro_batch_num": 2, "pipeline_schedule": "1f1b"}),
    "dp2_tp2_pp2_gpipe": ("llama_gqa2", 8, {"dp": 2, "mp": 2, "pp": 2, "micro_batch_num": 2,
                                            "pipeline_schedule": "gpipe"}),
    "mistral_dp2_zero1_recompute_full": ("mistral", 2, {"dp": 2, "zero_stage": 1, "recompute": "full"}),
    "mqa_dp2_zero2_selective": ("llama_mqa", 2, {"dp": 2, "zero_stage": 2, "recompute": "selective"}),
    **{f"pp2_v2_{schedule}": ("llama_4_layers", 2, {"pp": 2, "virtual_pipeline_stage": 2, "micro_batch_num": 4,
                                                    "pipeline_schedule": schedule})
       for schedule in ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble")},
}


def run_config(directory, tmp_dir, parallel: dict):
    return config_file.from_dict({
        "run": {"dir": str(tmp_dir)}, "model": {"from_hf": str(directory), "seq_length": SEQ},
        "parallel": parallel, "metrics": {"log_steps": 1},
        "train": {"steps": STEPS, "global_batch_size": BATCH, "lr": LR, "min_lr": LR, "warmup_steps": 0,
                  "weight_decay": 0.0, "grad_clip": 0.0}})


def trainer_losses(cfg) -> list[float]:
    from paratrain.trainer import Trainer

    return [record["loss"] for record in Trainer(cfg).train()]


def plain_hf_losses(case: str, cfg, model=None) -> list[float]:
    """A plain torch loop over the HF model (``model``, e.g. a peft model around it, or the case's) on the batches
    paratrain trains on, with the same AdamW over its trainable parameters."""
    from paratrain.data.loader import ShardedBatches, build_dataset

    model, t = (model or hf_model(case)).train(), cfg.train
    data = ShardedBatches(build_dataset(cfg), BATCH, 0, 1, torch.device("cpu"))
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=0.0,
                                  fused=True)
    losses = []
    for step in range(STEPS):
        batch = data.host_rows(step)
        logits = model(batch["input_ids"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_five_steps_from_hf_weights_equal_a_plain_loop_over_the_hf_model(layout, hf_dirs, tmp_path):
    case, world_size, parallel = LAYOUTS[layout]
    cfg = run_config(hf_dirs[case][0], tmp_path / layout, parallel)
    want = plain_hf_losses(case, cfg)
    got = trainer_losses(cfg) if world_size == 1 else run_distributed(trainer_losses, world_size, cfg,
                                                                      timeout=300)[0]
    assert len(got) == STEPS and want[-1] < want[0]
    # the first loss is the HF weights' forward; Adam then amplifies the summation order of sharded matmuls
    errors = [abs(a - b) / b for a, b in zip(got, want)]
    assert errors[0] <= 1e-5 and max(errors) <= (1e-5 if world_size == 1 else 1e-4), (got, want)


def test_text_trains_with_the_hf_tokenizer_counting_every_id_in_the_loss(hf_dirs, tmp_path):
    """data.kind = "text" on a from_hf run takes the directory's tokenizer.json and its EOS between lines; id 0 is
    a word like any other (no padding in windows of text): the losses equal the plain loop over the HF model."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    from paratrain.data.loader import build_dataset

    directory = shutil.copytree(hf_dirs["llama_gqa2"][0], tmp_path / "hf")
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    words = torch.randint(0, VOCAB, (40, 9), generator=torch.Generator().manual_seed(3))
    words[:, 0] = 0  # every line starts with the word of id 0
    (tmp_path / "text.txt").write_text("".join(" ".join(f"w{i}" for i in row) + "\n" for row in words.tolist()))
    cfg = run_config(directory, tmp_path / "run", {})
    cfg.data.kind, cfg.data.path = "text", str(tmp_path / "text.txt")
    eos = transformers.AutoConfig.from_pretrained(directory).eos_token_id
    stream = [t for row in words.tolist() for t in (*row, eos)]
    assert build_dataset(cfg).stream.tolist() == stream
    want = plain_hf_losses("llama_gqa2", cfg)
    assert trainer_losses(cfg) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_bf16_and_fp16_on_tp2_follow_one_process_and_the_fp32_loop(precision, hf_dirs, tmp_path):
    """Mixed precision on the llama kind: tp2 takes the steps of one process in the same precision, and both stay
    near the plain fp32 loop over the HF model (the compute really ran in 16 bits: not equal to it)."""
    cfg = run_config(hf_dirs["llama_gqa2"][0], tmp_path / "one", {})
    cfg.train.mixed_precision = precision
    one = trainer_losses(cfg)
    cfg.run.dir, cfg.parallel.model_parallel = str(tmp_path / "tp2"), 2
    tp2 = run_distributed(trainer_losses, 2, cfg, timeout=300)[0]
    fp32 = plain_hf_losses("llama_gqa2", cfg)
    assert tp2 == pytest.approx(one, rel=1e-2) and one == pytest.approx(fp32, rel=3e-2)
    assert one != pytest.approx(fp32, rel=1e-6)


def test_plan_counts_llama3_8b_from_the_module_built_on_the_meta_device(capsys):
    from conftest import ROOT
    from paratrain.cli import main

    assert main(["plan", "--config", str(ROOT / "examples/llama3_8b.toml"), "--top", "1"]) in (0, None)
    assert "model: llama, 8.03 B parameters (8,030,261,248), 32 layers" in capsys.readouterr().out


def test_qwen3_preset_counts_what_transformers_builds_and_its_dry_run_equals_the_planner(capsys):
    """examples/qwen3_0_6b.toml against Qwen3ForCausalLM of the same published config.json, built on the meta
    device; the dry run's counted bytes equal the planner's prediction."""
    from conftest import ROOT
    from paratrain.cli import main

    hf = transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                                  head_dim=128, intermediate_size=3072, num_hidden_layers=28, rms_norm_eps=1e-6,
                                  tie_word_embeddings=True)
    with torch.device("meta"):
        want = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf).parameters())
    preset = str(ROOT / "examples/qwen3_0_6b.toml")
    assert main(["plan", "--config", preset, "--top", "1"]) in (0, None)
    assert f"parameters ({want:,}), 28 layers" in capsys.readouterr().out
    assert main(["plan", "--config", preset, "--dry-run"]) in (0, None)
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("0 ")]
    assert rows and all(row[-1] == "True" for row in rows)


def test_a_resumed_run_goes_on_from_its_own_checkpoint_not_the_hf_weights(hf_dirs, tmp_path):
    case = "llama_gqa2"
    cfg = run_config(hf_dirs[case][0], tmp_path, {})
    want = plain_hf_losses(case, cfg)
    cfg.train.steps, cfg.checkpoint.save_steps = 3, 3
    first = trainer_losses(cfg)
    cfg.train.steps = STEPS
    resumed = trainer_losses(cfg)
    got = first + resumed
    assert len(resumed) == STEPS - 3
    assert max(abs(a - b) / b for a, b in zip(got, want)) <= 1e-5, (got, want)


def test_export_of_a_dp2_tp2_run_loads_in_transformers_with_the_same_logits(hf_dirs, tmp_path):
    """A dp2 x tp2 run of Qwen3 (tied, head_dim 16) saved after 2 steps, exported as an HF directory from its sharded
    checkpoint: transformers' logits of the export equal paratrain's of the checkpoint."""
    from paratrain.checkpoint import export
    from paratrain.cli import main

    directory = hf_dirs["qwen3_qk_norm_head_dim"][0]
    cfg = run_config(directory, tmp_path / "run", {"dp": 2, "mp": 2, "vocab_emb_dp": False})
    cfg.train.steps, cfg.checkpoint.save_steps = 2, 2
    run_distributed(trainer_losses, 4, cfg, timeout=300)
    assert main(["export", str(cfg.checkpoint_path), str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="sdpa").eval()
    model = build_model(cfg.model).eval()
    from safetensors.torch import load_file

    model.load_state_dict(load_file(export(cfg.checkpoint_path, tmp_path / "plain.safetensors")))
    with torch.no_grad():
        want, got = model(ids()), loaded(ids()).logits
    assert relative(got, want) <= 1e-5
    assert relative(want, hf_dirs["qwen3_qk_norm_head_dim"][1]) > 1e-4  # trained: not the HF weights again


def meta_and_normal_losses(cfg, meta_dir) -> tuple[list[float], list[float]]:
    normal = trainer_losses(cfg)
    cfg.run.dir = str(meta_dir)
    torch.set_default_device("meta")  # a tensor made without naming its device fails loudly
    try:
        return normal, trainer_losses(cfg)
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize("parallel", [{}, {"mp": 2}], ids=["one_process", "tp2"])
def test_from_hf_trains_under_a_meta_default_device(parallel, hf_dirs, tmp_path):
    cfg = run_config(hf_dirs["qwen3_qk_norm_head_dim"][0], tmp_path / "normal", {**parallel, "vocab_emb_dp": False})
    cfg.train.steps = 2
    if parallel:
        normal, meta = run_distributed(meta_and_normal_losses, 2, cfg, str(tmp_path / "meta"), timeout=300)[0]
    else:
        normal, meta = meta_and_normal_losses(cfg, tmp_path / "meta")
    assert normal == pytest.approx(meta, rel=1e-6)


def test_flops_count_the_matmuls_of_the_module_built_on_the_meta_device():
    """A layer's forward FLOPs are 2 x tokens x its weight matrices' sizes (grouped kv heads, head_dim, gated FFN)
    and attention's 4 x rows x T^2 x the query width."""
    from paratrain.plan.counts import model_counts

    m = ModelConfig(kind="llama", hidden_size=64, num_heads=4, num_kv_heads=1, head_dim=24, ffn_hidden_size=96,
                    seq_length=16)
    with torch.device("meta"):
        layer = build_model(m).layers["0"]
    matrices = sum(p.numel() for name, p in layer.named_parameters() if name.endswith("proj.weight"))
    forward = model_counts(m).layers[(False, False)].at(2).forward
    assert forward == 2 * 2 * 16 * matrices + 4 * 2 * 16 * 16 * 4 * 24


def test_a_broken_safetensors_header_is_refused_naming_the_directory(hf_dirs, tmp_path):
    import shutil

    directory = tmp_path / "broken"
    shutil.copytree(hf_dirs["llama_gqa2"][0], directory)
    shard = sorted(directory.glob("*.safetensors"))[0]
    shard.write_bytes(b"\xff" * 16 + shard.read_bytes()[16:])
    model = build_model(llama_config(directory))
    with pytest.raises(UserError, match="cannot read its safetensors"):
        load_hf_weights([model], model, directory)


@pytest.mark.parametrize("case", ["llama_gqa2", "qwen3_qk_norm_head_dim"])
def test_packed_documents_equal_transformers_given_the_same_mask_and_positions(case, hf_dirs):
    """Documents packed in a row (each attending only itself, rotary positions restarting at each) give the logits
    ``transformers`` gives with a 4-D mask and position ids of its own making."""
    directory, _ = hf_dirs[case]
    model = build_model(llama_config(directory)).eval()
    load_hf_weights([model], model, directory)
    starts = [[0, 5, 9], [0, 3, 4]]  # the documents' first tokens in each row (one of a single token)
    document_ids = torch.tensor([[sum(s <= t for s in row) - 1 for t in range(SEQ)] for row in starts])
    position_ids = torch.tensor([[t - max(s for s in row if s <= t) for t in range(SEQ)] for row in starts])
    with torch.no_grad():
        got = model(ids(), position_ids=position_ids, document_ids=document_ids)
        same_document = document_ids[:, None, :, None] == document_ids[:, None, None, :]
        mask = same_document & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        want = hf_model(case)(ids(), attention_mask=mask, position_ids=position_ids).logits
        whole = model(ids())
    assert relative(got, want) <= 1e-5
    assert relative(whole, want) > 1e-2  # the mask and positions matter in these rows
