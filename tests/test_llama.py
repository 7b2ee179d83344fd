"""The llama kind against ``transformers`` itself: tiny random Llama, Qwen2, Qwen3 and Mistral models made here and
saved in two shards; paratrain's logits from their directories equal HF's, on one process and on 2 gloo ranks."""
from __future__ import annotations

import pytest
import torch

from paratrain.config import ConfigError, ModelConfig
from paratrain.errors import UserError
from paratrain.models import build_model
from paratrain.models.hf import load_hf_weights, model_settings, read_config

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
    load_hf_weights(model, directory)
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
    with pytest.raises(UserError, match="GPT2LMHeadModel.*LlamaForCausalLM, Qwen2ForCausalLM"):
        model_settings({"architectures": ["GPT2LMHeadModel"]})


def test_missing_unexpected_and_misshaped_tensors_refused_naming_each(hf_dirs):
    directory = hf_dirs["llama_gqa2"][0]
    model = build_model(llama_config(directory, ffn_hidden_size=40, decoder_layers=3))
    with pytest.raises(UserError) as err:
        load_hf_weights(model, directory)
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
