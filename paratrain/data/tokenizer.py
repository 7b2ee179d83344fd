"""Subword tokenizer: byte-pair encoding trained with HF ``tokenizers``, saved as one ``tokenizer.json``.

Special tokens have the fixed ids of ``paratrain.data.synthetic`` (PAD=0, BOS=1, EOS=2, UNK=3). Text is
NFC-normalised and split GPT-2 style over UTF-8 bytes: any text round-trips and no character is unknown.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from paratrain.data import DataError
from paratrain.data.synthetic import BOS, EOS, PAD, UNK

SPECIAL_TOKENS = {PAD: "<pad>", BOS: "<s>", EOS: "</s>", UNK: "<unk>"}


class Tokenizer:
    """A tokenizer: text -> token ids and back (``decode`` stops at the first ``eos_id`` and skips special tokens,
    so a row of model output decodes directly). paratrain's own (``train``, ``load``) is a BPE with the special
    ids of ``paratrain.data.synthetic`` that adds no BOS/EOS; a Hugging Face model's (``of_hf_model``) encodes as
    its ``tokenizer.json`` says (BOS where its post-processor adds one) and ends a text with the model's EOS."""

    def __init__(self, hf: HFTokenizer, eos_id: int = EOS):
        self.hf, self.eos_id = hf, eos_id

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        ids = list(ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.hf.decode(ids, skip_special_tokens=True)

    def decode_batch(self, rows: Iterable[Iterable[int]]) -> list[str]:
        return [self.decode(row) for row in rows]

    def fingerprint(self) -> str:
        """Hash of the tokenizer's JSON: names caches of text tokenized with it."""
        return hashlib.sha1(self.hf.to_str().encode()).hexdigest()[:12]

    def save(self, path: str | Path) -> Path:
        """Write ``tokenizer.json`` atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self.hf.save(str(tmp))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        if not Path(path).is_file():
            raise FileNotFoundError(f"tokenizer file {path} does not exist: train one with "
                                    f"`paratrain tokenizer train --input FILE --vocab-size N --out {path}`")
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception for a file it cannot parse
            raise DataError(f"tokenizer {path} is not a tokenizer.json ({exc}): train one with `paratrain "
                            f"tokenizer train` or point data.tokenizer at another") from None
        for token_id, token in SPECIAL_TOKENS.items():
            if hf.token_to_id(token) != token_id:
                raise DataError(f"tokenizer {path} maps {token} to id {hf.token_to_id(token)}, paratrain's own "
                                f"tokenizers have it at {token_id} (a Hugging Face model's is taken from "
                                f"model.from_hf: leave data.tokenizer out)")
        return cls(hf)

    @classmethod
    def of_hf_model(cls, directory: str | Path) -> "Tokenizer":
        """The ``tokenizer.json`` of a Hugging Face model directory, ending texts with the model's first EOS id."""
        path = Path(directory) / "tokenizer.json"
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception for a file it cannot parse
            raise DataError(f"model.from_hf={str(directory)!r}: cannot read its tokenizer {path} ({exc})") from None
        eos = eos_ids(Path(directory))
        if not eos:
            raise DataError(f"model.from_hf={str(directory)!r}: its generation_config.json / config.json name no "
                            f"eos_token_id, the id that ends each document of data.kind='text'")
        return cls(hf, eos[0])

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> "Tokenizer":
        """BPE with at most ``vocab_size`` tokens (special tokens and the 256 bytes included) learned from ``texts``."""
        if vocab_size < 256 + len(SPECIAL_TOKENS):
            raise DataError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least "
                             f"{256 + len(SPECIAL_TOKENS)} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
        hf = HFTokenizer(models.BPE(unk_token=SPECIAL_TOKENS[UNK]))
        hf.normalizer = normalizers.NFC()
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                      special_tokens=[SPECIAL_TOKENS[i] for i in sorted(SPECIAL_TOKENS)],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        hf.train_from_iterator(texts, trainer=trainer)
        return cls(hf)


def eos_ids(directory: Path) -> tuple[int, ...]:
    """The ids that end a text by a Hugging Face directory's ``generation_config.json``, else (without one) its
    ``config.json``, as ``transformers`` decides."""
    generation = directory / "generation_config.json"
    path = generation if generation.is_file() else directory / "config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)


def lines_of(paths: Iterable[str | Path]) -> Iterator[str]:
    """Every line of the files, each tab-separated field on its own (so a pairs file trains on both sides)."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                yield from line.rstrip("\n").split("\t")


def train_tokenizer(inputs: list[str | Path], vocab_size: int, out: str | Path, min_frequency: int = 2) -> Tokenizer:
    """Train on the lines of ``inputs`` (see ``lines_of``) and save to ``out``."""
    tokenizer = Tokenizer.train(lines_of(inputs), vocab_size, min_frequency)
    tokenizer.save(out)
    return tokenizer
