"""``paratrain preprocess wmt14|sample`` and ``paratrain tokenizer train``."""
from __future__ import annotations

import argparse
from pathlib import Path

from paratrain.config import ConfigError


def _check_out(out: str) -> None:
    """The output directory ``--out`` must be one that can be made and written in."""
    from paratrain.preflight import writable_problem

    problem = writable_problem("--out", Path(out))
    if problem:
        raise ConfigError([problem])


def cmd_preprocess_wmt14(args) -> int:
    from paratrain.data import wmt14

    if args.archive and (args.src or args.ref):
        raise ConfigError(["give either --archive or --src and --ref, not both"])
    if not args.archive and not (args.src and args.ref):
        raise ConfigError(["give --src SRC.sgm and --ref REF.sgm, or --archive test-full.tgz"])
    _check_out(args.out)
    if args.archive:
        written = wmt14.preprocess_archive(args.archive, args.out, args.src_lang or "en", args.tgt_lang or "fr",
                                           args.test_set)
    else:
        written = wmt14.preprocess_files(args.src, args.ref, args.out, args.src_lang, args.tgt_lang)
    for path in written.values():
        print(f"{path}: {sum(1 for _ in open(path, encoding='utf-8'))} pairs")
    return 0


def cmd_preprocess_sample(args) -> int:
    from paratrain.data.sample_corpus import write_sample

    if args.train < 1 or args.heldout < 1:
        raise ConfigError([f"--train {args.train} and --heldout {args.heldout} must be 1 or more pairs"])
    _check_out(args.out)
    for split, paths in write_sample(args.out, args.train, args.heldout, args.seed).items():
        print(f"{split}: {', '.join(str(p) for p in paths.values())}")
    return 0


def cmd_tokenizer_train(args) -> int:
    from paratrain.data import DataError, not_utf8
    from paratrain.data.tokenizer import train_tokenizer

    if args.min_frequency < 0:
        raise ConfigError([f"--min-frequency {args.min_frequency} must be 0 or more (pairs seen fewer times are "
                           f"not merged)"])
    try:
        tokenizer = train_tokenizer(args.input, args.vocab_size, args.out, args.min_frequency)
    except UnicodeDecodeError as exc:
        raise not_utf8(" or ".join(args.input), exc) from None
    except OSError as exc:
        raise DataError(f"{exc.filename}: {exc.strerror}") from None
    print(f"{args.out}: {tokenizer.vocab_size} tokens")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Register ``preprocess`` and ``tokenizer`` on the ``paratrain`` command."""
    preprocess = sub.add_parser("preprocess", help="turn raw corpora into tab-separated sentence pairs")
    kinds = preprocess.add_subparsers(dest="corpus", required=True)
    wmt = kinds.add_parser("wmt14", help="newstest .sgm files (or test-full.tgz) -> wmt14.<src>_<tgt>.txt both ways")
    wmt.add_argument("--src", help="source .sgm, e.g. newstest2014-fren-src.en.sgm")
    wmt.add_argument("--ref", help="reference .sgm, e.g. newstest2014-fren-ref.fr.sgm")
    wmt.add_argument("--archive", help="the official test-full.tgz, read without unpacking")
    wmt.add_argument("--test-set", default="newstest2014", help="test set inside --archive")
    wmt.add_argument("--src-lang", help="source language (default: from the file name; en with --archive)")
    wmt.add_argument("--tgt-lang", help="target language (default: from the file name; fr with --archive)")
    wmt.add_argument("--out", required=True, help="output directory")
    wmt.set_defaults(func=cmd_preprocess_wmt14)
    sample = kinds.add_parser("sample", help="generate the English-French sample corpus as .sgm and preprocess it")
    sample.add_argument("--out", required=True, help="output directory (train/ and test/ pairs files inside)")
    sample.add_argument("--train", type=int, default=20000, help="training pairs")
    sample.add_argument("--heldout", type=int, default=500, help="held-out pairs")
    sample.add_argument("--seed", type=int, default=0)
    sample.set_defaults(func=cmd_preprocess_sample)

    tokenizer = sub.add_parser("tokenizer", help="train a BPE tokenizer")
    actions = tokenizer.add_subparsers(dest="action", required=True)
    train = actions.add_parser("train", help="learn BPE merges from text files (tab-separated fields split)")
    train.add_argument("--input", nargs="+", required=True, help="text or source<TAB>target files")
    train.add_argument("--vocab-size", type=int, required=True, help="tokens including PAD/BOS/EOS/UNK and 256 bytes")
    train.add_argument("--min-frequency", type=int, default=2)
    train.add_argument("--out", required=True, help="tokenizer.json to write")
    train.set_defaults(func=cmd_tokenizer_train)
