"""``paratrain generate``: greedy decoding with a key/value cache equals ``transformers``' ``generate(do_sample=False)``
on tiny random HF models made here, and equals decoding without a cache on a trained gpt run; sampling's cut;
refusals."""
from __future__ import annotations

import pytest
import torch

from paratrain import config_file
from paratrain.cli import main
from paratrain.generation import generate, sample

transformers = pytest.importorskip("transformers")
from test_llama import hf_model  # noqa: E402 (needs transformers)

NEW = 12


def word_tokenizer(path, vocab_size: int) -> list[str]:
    """A word-level tokenizer.json of words w0 .. w{vocab_size - 1} at ``path``; the words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(vocab_size)]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return words


def sharp(model):
    """``model`` with weights large enough that its greedy choices depend on attention: at HF's init
    (std 0.02) the logits hardly depend on the earlier tokens, and a wrong cache would decode the same."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.25)
    return model


def run_generate(capsys, *args) -> str:
    assert main(["generate", *args]) == 0
    return capsys.readouterr().out.strip()


@pytest.mark.parametrize("case", ["llama_gqa2", "llama3_rope_tied", "qwen3_qk_norm_head_dim", "qwen2_bias"])
def test_greedy_with_a_cache_equals_transformers_generate(case, tmp_path, capsys):
    model = sharp(hf_model(case))
    model.generation_config.eos_token_id = None  # a random model may pick any id: decode all NEW tokens
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    prompt = [5, 17, 3, 60, 22, 9, 41]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    got = run_generate(capsys, "--checkpoint", str(tmp_path), "--prompt-ids", " ".join(map(str, prompt)),
                       "--max-new-tokens", str(NEW), "--ids")
    assert [int(i) for i in got.split()] == want[0, len(prompt):].tolist()


def test_a_text_prompt_goes_through_the_directorys_tokenizer_and_stops_at_eos(tmp_path, capsys):
    model = sharp(hf_model("llama_gqa2"))
    prompt = [7, 8, 9, 10]
    with torch.no_grad():
        free = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                              eos_token_id=None)[0, len(prompt):].tolist()
    model.generation_config.eos_token_id = free[3]  # the 4th new token (or an earlier one like it) ends the text
    model.save_pretrained(tmp_path)
    words = word_tokenizer(tmp_path / "tokenizer.json", model.config.vocab_size)
    got = run_generate(capsys, "--checkpoint", str(tmp_path), "--prompt", " ".join(words[i] for i in prompt),
                       "--max-new-tokens", str(NEW))
    assert got == " ".join(words[i] for i in free[: free.index(free[3]) + 1])


def test_a_trained_gpt_run_decodes_with_its_cache_as_without(tmp_path, capsys):
    from paratrain.trainer import Trainer

    cfg = config_file.from_dict({"run": {"dir": str(tmp_path)}, "model": {"kind": "gpt", "seq_length": 24},
                                 "train": {"steps": 2, "global_batch_size": 4}, "checkpoint": {"save_steps": 2}})
    Trainer(cfg).train()
    capsys.readouterr()
    from paratrain.generation import load_generator

    gen = load_generator(cfg.checkpoint_path, "cpu")
    tokens = torch.tensor([[1, 9, 33, 12]])
    with torch.no_grad():
        for _ in range(8):  # no cache: the whole sequence again for each token
            tokens = torch.cat([tokens, gen.model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    got = run_generate(capsys, "--checkpoint", str(cfg.checkpoint_path), "--prompt-ids", "1 9 33 12",
                       "--max-new-tokens", "8")
    new = tokens[0, 4:].tolist()
    assert got.split() == [str(i) for i in new[: new.index(2) + 1 if 2 in new else None]]
    with pytest.raises(SystemExit, match="2"):
        raise SystemExit(main(["generate", "--checkpoint", str(cfg.checkpoint_path), "--prompt-ids", "1 2 3",
                               "--max-new-tokens", "22"]))
    assert "more than the model's 24 positions" in capsys.readouterr().err


def test_sampling_keeps_the_most_likely_tokens_reaching_top_p():
    logits = torch.tensor([[0.6, 0.3, 0.1]]).log().expand(2000, 3)
    draws = sample(logits, temperature=1.0, top_p=0.5, generator=torch.Generator().manual_seed(0))
    assert (draws == 0).all()  # 0.6 alone reaches 0.5
    draws = sample(logits, temperature=1.0, top_p=0.8, generator=torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {0, 1}  # 0.6 + 0.3 reach 0.8: token 2 is cut
    share = (draws == 1).float().mean().item()
    assert abs(share - 1 / 3) < 0.05  # the kept ones renormalised: 0.3 / 0.9
    assert (sample(logits, temperature=0.0) == 0).all()


def test_sampling_is_reproducible_by_seed_and_rows_stop_at_eos():
    torch.manual_seed(0)
    model = hf_model("llama_gqa2")

    def logits_model(ids, caches):  # the HF model's logits, ignoring the cache: a full forward each time
        caches.setdefault("ids", []).append(ids)
        return model(torch.cat(caches["ids"], dim=1)).logits[:, -ids.shape[1]:]

    prompt = torch.tensor([[3, 4, 5], [6, 7, 8]])
    runs = [generate(logits_model, prompt, 10, (), 1.0, 0.9, torch.Generator().manual_seed(seed)) for seed in
            (1, 1, 2)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    eos = int(runs[0][0, 5])
    stopped = generate(logits_model, prompt, 10, (eos,), 1.0, 0.9, torch.Generator().manual_seed(1))
    first = (runs[0][0, 3:] == eos).nonzero()[0, 0].item() + 4
    assert torch.equal(stopped[0, :first], runs[0][0, :first])
    assert (stopped[0, first:] == eos).all() or stopped.shape[1] == first


def test_refusals_name_the_cause(tmp_path, capsys):
    from paratrain.trainer import Trainer

    cfg = config_file.from_dict({"run": {"dir": str(tmp_path)}, "model": {"kind": "transformer"},
                                 "train": {"steps": 1, "global_batch_size": 2}, "checkpoint": {"save_steps": 1}})
    Trainer(cfg).train()
    capsys.readouterr()
    cases = [(["--prompt-ids", "1 2"], "an encoder-decoder translates with `paratrain translate`"),
             (["--prompt", "a", "--prompt-ids", "1"], "not both"),
             (["--prompt-ids", "1 x"], "expected token ids"),
             (["--prompt-ids", "1", "--top-p", "0"], "out of range")]
    for args, message in cases:
        assert main(["generate", "--checkpoint", str(cfg.checkpoint_path), *args]) == 2
        assert message in capsys.readouterr().err
