"""data.kind = "documents": jsonl / parquet / txt documents packed with EOS between them, their document ids and
positions, the block-diagonal causal mask, a llama model's packed logits against each document alone, resume."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from forked_ranks import run_distributed
from paratrain import config_file
from paratrain.data.datasets import DocumentsDataset
from paratrain.data.loader import ShardedBatches, build_dataset
from paratrain.data.synthetic import EOS
from paratrain.data.tokenizer import SPECIAL_TOKENS, Tokenizer
from paratrain.modules.transformer import decoder_mask

VOCAB, SEQ = 40, 16
LENGTHS = [5, 9, 3, 12, 7, 4, 10, 6]  # words of each document


def word_tokenizer(path) -> Tokenizer:
    from tokenizers import Tokenizer as HF, models, pre_tokenizers

    vocab = {token: i for i, token in SPECIAL_TOKENS.items()} | {f"w{i}": i for i in range(4, VOCAB)}
    hf = HF(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.save(str(path))
    return Tokenizer.load(path)


def documents() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [list(rng.integers(4, VOCAB, n)) for n in LENGTHS]


@pytest.fixture
def corpus(tmp_path):
    """A folder: documents 0-2 in a jsonl, 3-5 in a parquet, 6 and 7 one .txt file each."""
    import datasets

    docs = [" ".join(f"w{t}" for t in doc) for doc in documents()]
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[:3])))
    datasets.Dataset.from_dict({"text": docs[3:6]}).to_parquet(str(folder / "b.parquet"))
    (folder / "c.txt").write_text(docs[6])
    (folder / "d.txt").write_text(docs[7])
    word_tokenizer(tmp_path / "tokenizer.json")
    return folder


def test_windows_are_the_documents_packed_with_eos_and_their_ids_and_positions(corpus, tmp_path):
    data = DocumentsDataset(corpus, Tokenizer.load(tmp_path / "tokenizer.json"), SEQ, document_mask=True)
    stream = [t for doc in documents() for t in (*doc, EOS)]
    starts = np.cumsum([0] + [n + 1 for n in LENGTHS])
    assert len(data) == (len(stream) - 1) // SEQ
    rows = data.rows(np.arange(len(data)))
    for i in range(len(data)):
        window = stream[i * SEQ: i * SEQ + SEQ + 1]
        assert rows["input_ids"][i].tolist() == window[:-1] and rows["labels"][i].tolist() == window[1:]
        token = i * SEQ + np.arange(SEQ)
        document = np.searchsorted(starts, token, side="right") - 1
        assert rows["document_ids"][i].tolist() == (document - document[0]).tolist()
        assert rows["position_ids"][i].tolist() == (token - np.maximum(starts[document], i * SEQ)).tolist()
    mask = decoder_mask(None, rows["document_ids"]).mask
    ids = rows["document_ids"]
    for b in range(len(data)):
        for q in range(SEQ):
            for k in range(SEQ):
                assert bool(mask[b, 0, q, k]) == (k <= q and bool(ids[b, q] == ids[b, k]))


@pytest.mark.parametrize("kind,heads", [("llama", {"num_kv_heads": 2}), ("gpt", {})])
def test_packed_logits_equal_each_document_alone(kind, heads, corpus, tmp_path):
    from paratrain.config import ModelConfig
    from paratrain.models import build_model

    data = DocumentsDataset(corpus, Tokenizer.load(tmp_path / "tokenizer.json"), SEQ, document_mask=True)
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind=kind, vocab_size=VOCAB, hidden_size=32, num_heads=4, ffn_hidden_size=48,
                                    decoder_layers=2, seq_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                                    **heads)).eval()
    rows = data.rows(np.arange(len(data)))
    packed = model(rows["input_ids"], position_ids=rows["position_ids"], document_ids=rows["document_ids"])
    plain = model(rows["input_ids"])
    compared = 0
    for b in range(len(data)):
        ids = rows["document_ids"][b]
        for d in ids.unique():
            where = (ids == d).nonzero().flatten()
            alone = model(rows["input_ids"][b, where][None])[0]
            torch.testing.assert_close(packed[b, where], alone, rtol=1e-5, atol=1e-5)
            compared += d > 0
    assert compared and not torch.allclose(packed, plain, atol=1e-3)


def test_resume_gives_the_same_batches_on_another_dp_size(corpus, tmp_path):
    cfg = config_file.from_dict({"model": {"kind": "llama", "vocab_size": VOCAB, "seq_length": 4},
                                 "data": {"kind": "documents", "path": str(corpus), "document_mask": True,
                                          "tokenizer": str(tmp_path / "tokenizer.json")}})
    source = build_dataset(cfg)
    one = ShardedBatches(source, 4)
    for step in range(3):
        one.batch(step)
    state = one.state_dict()
    two = [ShardedBatches(source, 4, r, 2) for r in range(2)]
    for part in two:
        part.load_state_dict(state)
    want = one.batch(3)
    got = [part.batch(3) for part in two]
    for key in ("input_ids", "labels", "document_ids", "position_ids"):
        assert torch.equal(torch.cat([g[key] for g in got]), want[key])


def test_broken_jsonl_line_and_missing_field_and_empty_corpus_are_named(tmp_path):
    from paratrain.data.documents import document_problems

    (tmp_path / "x.jsonl").write_text('{"text": "w4"}\n{"text": oops\n')
    assert "x.jsonl line 2 is not JSON" in document_problems(tmp_path, "text")[0]
    (tmp_path / "x.jsonl").write_text('{"text": "w4"}\n{"body": "w5"}\n')
    assert "x.jsonl line 2 has no field 'text'" in document_problems(tmp_path, "text")[0]
    (tmp_path / "x.jsonl").write_text("\n")
    assert "hold no document" in document_problems(tmp_path, "text")[0]


def test_document_mask_refused_on_the_encoder_decoder_and_off_documents(corpus):
    from paratrain.config import ConfigError
    from paratrain.config_rules import validate

    def problems(**sections):
        try:
            return "\n".join(validate(config_file.from_dict(sections)))
        except ConfigError as exc:
            return str(exc)

    assert "needs a decoder-only model, not model.kind='transformer'" in problems(
        model={"kind": "transformer"}, data={"kind": "documents", "path": str(corpus), "document_mask": True})
    text = config_file.from_dict({"model": {"kind": "llama"},
                                  "data": {"kind": "text", "path": str(corpus), "document_mask": True}})
    assert ("needs the document boundaries of data.kind='documents' or 'chat', not data.kind='text'"
            in text.data.problems()[0])


def trainer_losses(cfg) -> list[float]:
    from paratrain.trainer import Trainer

    return [record["loss"] for record in Trainer(cfg).train()]


@pytest.mark.parametrize("parallel", [{"model_parallel": 2}, {"data_parallel": 2, "zero_stage": 1},
                                      {"pipeline_stage": 2, "micro_batch_num": 2}])
def test_document_mask_losses_on_two_ranks_equal_one_process(parallel, corpus, tmp_path):
    def config(name, layout):
        return config_file.from_dict({
            "run": {"dir": str(tmp_path / name)}, "parallel": layout, "metrics": {"log_steps": 1},
            "model": {"kind": "llama", "vocab_size": VOCAB, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
                      "ffn_hidden_size": 48, "decoder_layers": 2, "seq_length": 8, "hidden_dropout": 0.0,
                      "attention_dropout": 0.0},
            "data": {"kind": "documents", "path": str(corpus), "document_mask": True,
                     "tokenizer": str(tmp_path / "tokenizer.json")},
            "train": {"steps": 4, "global_batch_size": 4, "lr": 1e-2, "warmup_steps": 0}})

    want = trainer_losses(config("one", {}))
    got = run_distributed(trainer_losses, 2, config("two", parallel), timeout=240)[0]
    assert len(got) == 4 and max(abs(a - b) / b for a, b in zip(got, want)) <= 1e-4, (got, want)
