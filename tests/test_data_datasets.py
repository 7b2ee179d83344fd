"""Tokenizer, translation and text datasets on the real preprocessing path, CIFAR-10 binary reader."""
import numpy as np
import pytest
import torch

from paratrain.cli import main
from paratrain import config_file
from paratrain.config import ConfigError
from paratrain.data.loader import ShardedBatches, build_dataset
from paratrain.data.cifar import CifarDataset, write_cifar_bin
from paratrain.data.datasets import TextDataset
from paratrain.data.sample_corpus import write_sample
from paratrain.data.synthetic import BOS, EOS, PAD, UNK
from paratrain.data.tokenizer import SPECIAL_TOKENS, Tokenizer
from paratrain.data.wmt14 import read_pairs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("sample")
    return write_sample(out, train=400, heldout=20, seed=1)


def test_tokenizer_round_trip_and_special_ids(corpus, tmp_path):
    path = tmp_path / "tokenizer.json"
    assert main(["tokenizer", "train", "--input", str(corpus["train"]["en_fr"]), "--vocab-size", "1000",
                 "--out", str(path)]) == 0
    tok = Tokenizer.load(path)
    assert 400 < tok.vocab_size <= 1000
    assert {tok.hf.token_to_id(t): i for i, t in SPECIAL_TOKENS.items()} == {PAD: PAD, BOS: BOS, EOS: EOS, UNK: UNK}
    for text in ["Les petites filles n'aiment pas la pomme.", "Ünïcode «guillemets» 日本語  two  spaces\tand tab"]:
        ids = tok.encode(text)
        assert min(ids) >= 4 and tok.decode(ids) == text
        assert tok.decode([BOS] + ids + [EOS, 17, PAD]) == text
    assert len(tok.encode("Les petites filles.")) < len("Les petites filles.") / 2  # merges were learned


def _config(tmp_path, path, **data):
    return config_file.from_dict({"run": {"seed": 3, "dir": str(tmp_path / "run")},
                                  "model": {"vocab_size": 1000, "src_seq_length": 32, "tgt_seq_length": 32},
                                  "data": {"kind": "translation", "path": str(path),
                                           "tokenizer": str(tmp_path / "tok.json"), **data}})


def test_translation_batches_shapes_and_shift(corpus, tmp_path):
    cfg = _config(tmp_path, corpus["train"]["en_fr"])
    dataset = build_dataset(cfg)
    assert len(list(corpus["train"]["en_fr"].parent.glob("*.cache"))) == 1
    tok = Tokenizer.load(tmp_path / "tok.json")
    assert len(dataset) + dataset.num_filtered == 400 and len(dataset) > 380
    batch = ShardedBatches(dataset, 8, dp_rank=1, dp_size=2).batch(3)
    src, tgt_in, labels = batch["src_ids"], batch["tgt_in_ids"], batch["labels"]
    assert src.shape == tgt_in.shape == labels.shape == (4, 32) and src.dtype == torch.int64
    assert (tgt_in[:, 0] == BOS).all()
    valid = labels != PAD
    assert torch.equal(tgt_in[:, 1:][valid[:, 1:]], labels[:, :-1][valid[:, 1:]])  # decoder input = labels shifted
    lengths = valid.sum(1)
    assert (labels[torch.arange(4), lengths - 1] == EOS).all()
    assert ((tgt_in != PAD).sum(1) == lengths).all()
    pairs = dict(read_pairs(corpus["train"]["en_fr"]))
    for s, t in zip(tok.decode_batch(src.tolist()), tok.decode_batch(labels.tolist())):
        assert pairs[s] == t
    again = build_dataset(cfg)  # from the cache
    assert torch.equal(ShardedBatches(again, 8, 1, 2).batch(3)["labels"], labels)


def test_too_long_pairs_filtered_or_truncated(corpus, tmp_path):
    cfg = _config(tmp_path, corpus["train"]["en_fr"])
    cfg.model.tgt_seq_length = 12
    filtered = build_dataset(cfg)
    assert filtered.num_filtered > 0 and (filtered.tgt_lengths <= 12).all()
    cfg.data.too_long, cfg.data.dynamic_padding = "truncate", True
    truncated = build_dataset(cfg)
    assert len(truncated) == 400
    batch = truncated.rows(np.arange(16), np.arange(16))
    assert batch["labels"].shape[1] <= 12 and batch["src_ids"].shape[1] == truncated.src_lengths[:16].max()
    cfg.model.vocab_size = 500
    with pytest.raises(ConfigError, match="model.vocab_size=500"):
        build_dataset(cfg)


def test_text_dataset_windows(tmp_path):
    stream = np.arange(4, 4 + 41, dtype=np.int32)
    np.save(tmp_path / "tokens.npy", stream)
    data = TextDataset(tmp_path / "tokens.npy", None, seq_length=8)
    assert len(data) == 5
    batch = data.rows(np.array([2, 0]))
    assert torch.equal(batch["input_ids"][0], torch.arange(20, 28))
    assert torch.equal(batch["labels"], batch["input_ids"] + 1)


def test_cifar_binary_reader(tmp_path):
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (7, 3, 32, 32), dtype=np.uint8), np.array([3, 0, 9, 1, 1, 5, 2])
    write_cifar_bin(tmp_path / "data_batch_1.bin", images[:4], labels[:4])
    write_cifar_bin(tmp_path / "data_batch_2.bin", images[4:], labels[4:])
    data = CifarDataset(tmp_path)
    assert len(data) == 7
    batch = data.rows(np.array([5, 1]))
    assert batch["labels"].tolist() == [5, 0] and batch["images"].shape == (2, 3, 32, 32)
    assert batch["images"][0, 2, 31, 0].item() == pytest.approx((images[5, 2, 31, 0] / 255 - 0.4465) / 0.2616, rel=1e-5)
    cfg = config_file.from_dict({"data": {"kind": "cifar10", "path": str(tmp_path)}, "train": {"global_batch_size": 4}})
    assert ShardedBatches(build_dataset(cfg), 4, 0, 2).batch(1)["images"].shape == (2, 3, 32, 32)
    (tmp_path / "test_batch.bin").write_bytes(b"\0" * 3000)
    with pytest.raises(ValueError, match="not a whole number"):
        CifarDataset(tmp_path, train=False)


def test_length_bucketing_on_translation_reports_less_padding(corpus, tmp_path):
    cfg = _config(tmp_path, corpus["train"]["en_fr"], dynamic_padding=True)
    plain = ShardedBatches(build_dataset(cfg), 16).sampler.padding_fraction(20)
    cfg.data.bucket_size = 5
    bucketed = ShardedBatches(build_dataset(cfg), 16)
    assert bucketed.sampler.padding_fraction(20) < 0.7 * plain
    batch = bucketed.batch(2)
    assert batch["tgt_in_ids"].shape[1] == (batch["labels"] != PAD).sum(1).max()
