"""Issue 17: what a hostile or unlucky user does ends in one clear message, never in lost or wrong work.

- A table of bad inputs (configs, overrides, sizes, data files, directories, checkpoints, corpora,
  launches): each ends with exit code 2 and one line on stderr (``paratrain: ...``) naming the key,
  file or value, no traceback, in under 5 s, and for launches without starting a rank. They run
  in-process through ``paratrain.cli.main``; a few run as real processes to show that no
  traceback reaches the terminal.
- Damaged checkpoints (a flipped byte, truncated and missing files): an explicit resume is refused
  naming the file, ``resume = "auto"`` goes back to the newest intact checkpoint with a warning
  naming it and continues exactly as from that checkpoint; ``paratrain checkpoint verify`` says which.
- A checkpoint saved with another model is refused, listing the keys; changed training keys are logged.
- The fp16 floor: an overflow at the minimum loss scale, or too many skipped steps in a row, stops
  training with exit code 5; a run that skipped steps says how many.
"""
import copy
import json
import logging
import os
import resource
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import PYTHON, one_thread
from paratrain import cli
from test_launch import use_registry

BASE = """
[run]
seed = 7
[model]
kind = "gpt"
vocab_size = 300
hidden_size = 32
num_heads = 4
ffn_hidden_size = 64
decoder_layers = 2
seq_length = 16
hidden_dropout = 0.0
attention_dropout = 0.0
[train]
global_batch_size = 4
steps = 2
warmup_steps = 1
[metrics]
log_steps = 100
progress = false
peak_tflops = 1.0
"""


class Files:
    """Builds the inputs of one case under ``root``."""

    def __init__(self, root: Path, checkpoint: Path | None = None):
        self.root, self.checkpoint = root, checkpoint
        self.config = root / "base.toml"
        self.config.write_text(BASE)

    def file(self, name: str, data: bytes | str) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        return path

    def train(self, *overrides: str, config: Path | str | None = None) -> list[str]:
        return ["train", "--config", str(config or self.config), f"--run.dir={self.root / 'run'}", *overrides]

    def data(self, kind: str, path: Path | str, *more: str) -> list[str]:
        return self.train(f"--data.kind={kind}", f"--data.path={path}", *more)

    def damaged(self, damage) -> Path:
        """A copy of the saved checkpoint with ``damage(path)`` done to it."""
        path = self.root / "damaged" / self.checkpoint.name
        shutil.copytree(self.checkpoint, path)
        damage(path)
        return path

    def resume(self, damage, *overrides: str) -> list[str]:
        return self.train(f"--checkpoint.resume={self.damaged(damage)}", *overrides)

    def toml(self, section: str, line: str) -> list[str]:
        """``train`` with BASE plus ``line`` in ``[section]``, and no ``--run.dir`` (a TOML value no override hides:
        the run directory is ``runs/paratrain`` under the test's working directory)."""
        text = BASE.replace(f"[{section}]\n", f"[{section}]\n{line}\n") if f"[{section}]" in BASE else \
            f"{BASE}[{section}]\n{line}\n"
        return ["train", "--config", str(self.file("c.toml", text))]

    def deepspeed(self, ds: str, *overrides: str) -> list[str]:
        return self.train("--deepspeed", str(self.file("ds.json", ds)), *overrides)

    def npy(self, name: str, array) -> Path:
        import io

        import numpy as np

        buffer = io.BytesIO()
        np.save(buffer, np.asarray(array))
        return self.file(name, buffer.getvalue())

    def plan(self, *flags: str) -> list[str]:
        return ["plan", "--config", str(self.config), *flags]

    def launch(self, *flags: str) -> list[str]:
        return ["launch", "--nproc-per-node", "1", "--dry-run", *flags, "--", *self.train()]


def flip_byte(file: Path, offset: int | None = None) -> None:
    """Flip one byte of ``file`` (by default in the middle, which in a shard is tensor data)."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0xFF
    file.write_bytes(bytes(data))


def truncate(file: Path, size: int = 100) -> None:
    with open(file, "r+b") as f:
        f.truncate(size)


def edit_meta(change) -> callable:
    def damage(path: Path) -> None:
        meta = json.loads((path / "paratrain.json").read_text())
        change(meta)
        (path / "paratrain.json").write_text(json.dumps(meta))
    return damage


def evil_pickle(path: Path) -> None:
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    (path / ".metadata").write_bytes(pickle.dumps(Evil()))


SHARD = "__0_0.distcp"
RANK_FILE = "rank_00000.safetensors"

# case -> (argv from Files, text the message must hold)
CASES = {
    # the config file itself
    "config-is-a-directory": (lambda f: f.train(config=f.root), "is a directory"),
    "config-missing": (lambda f: f.train(config=f.root / "nope.toml"), "nope.toml does not exist"),
    "config-not-utf8": (lambda f: f.train(config=f.file("c.toml", b"[model]\nkind = \"\xff\xfe\"\n")),
                        "is not UTF-8 text (byte 0xff"),
    "config-binary": (lambda f: f.train(config=f.file("c.toml", bytes(range(256)) * 4)), "c.toml"),
    "config-not-a-regular-file": (lambda f: f.train(config="/dev/zero"), "/dev/zero is not a regular file"),
    "config-bad-toml": (lambda f: f.train(config=f.file("c.toml", "[model\nkind=")), "is not valid TOML"),
    "config-unknown-section": (lambda f: f.train(config=f.file("c.toml", "[modle]\nkind='gpt'\n")),
                               "did you mean [model]"),
    "config-section-not-table": (lambda f: f.train(config=f.file("c.toml", "model = 3\n")),
                                 "[model] must be a table"),
    "config-unknown-key": (lambda f: f.train("--model.hiden_size=64"), "did you mean model.hidden_size"),
    "config-wrong-type": (lambda f: f.train("--model.hidden_size=big"), "model.hidden_size='big'"),
    # override syntax
    "override-without-value": (lambda f: f.train("--train.lr"), "has no value"),
    "override-without-section": (lambda f: f.train("--lr=1"), "unexpected argument '--lr=1'"),
    "override-not-a-number": (lambda f: f.train("--train.lr=fast"), "train.lr='fast'"),
    "override-bool": (lambda f: f.train("--model.tie_embeddings=maybe"), "expected true or false"),
    # numbers that are not finite, negative, or absurd
    "lr-nan": (lambda f: f.train("--train.lr=nan"), "train.lr=nan is not a finite number"),
    "lr-inf": (lambda f: f.train("--train.lr=inf"), "train.lr=inf is not a finite number"),
    "lr-minus-inf": (lambda f: f.train("--train.lr=-inf"), "train.lr=-inf is not a finite number"),
    "lr-zero": (lambda f: f.train("--train.lr=0"), "train.lr=0.0 must be positive"),
    "min-lr-nan": (lambda f: f.train("--train.min_lr=nan"), "train.min_lr=nan"),
    "grad-clip-inf": (lambda f: f.train("--train.grad_clip=inf"), "train.grad_clip=inf"),
    "weight-decay-negative": (lambda f: f.train("--train.weight_decay=-1"), "must not be negative"),
    "dropout-nan": (lambda f: f.train("--model.hidden_dropout=nan"), "model.hidden_dropout=nan"),
    "dropout-one": (lambda f: f.train("--model.attention_dropout=1"), "outside [0, 1)"),
    "steps-1e23": (lambda f: f.train("--train.steps=1e23"), "train.steps=1e+23 is absurd"),
    "steps-zero": (lambda f: f.train("--train.steps=0"), "train.steps=0 must be positive"),
    "steps-negative": (lambda f: f.train("--train.steps=-5"), "train.steps=-5 must be positive"),
    "steps-fraction": (lambda f: f.train("--train.steps=1.5"), "expected an integer"),
    "steps-nan": (lambda f: f.train("--train.steps=nan"), "expected an integer, got nan"),
    "warmup-negative": (lambda f: f.train("--train.warmup_steps=-1"), "warmup_steps=-1"),
    "batch-absurd": (lambda f: f.train("--train.global_batch_size=1e13"), "global_batch_size=1e+13 is absurd"),
    "beta1-above-one": (lambda f: f.train("--train.beta1=1.5"), "train.beta1=1.5 is outside [0, 1)"),
    "eps-zero": (lambda f: f.train("--train.eps=0"), "train.eps=0.0 must be positive"),
    "loss-scale-inf": (lambda f: f.train("--train.initial_loss_scale=inf"), "initial_loss_scale=inf"),
    "min-loss-scale-zero": (lambda f: f.train("--train.min_loss_scale=0"), "min_loss_scale=0.0 must be positive"),
    "min-loss-scale-above-initial": (lambda f: f.train("--train.min_loss_scale=1e9"),
                                     "is above train.initial_loss_scale"),
    "max-skipped-negative": (lambda f: f.train("--train.max_skipped_steps=-1"), "max_skipped_steps=-1"),
    "seed-negative": (lambda f: f.train("--run.seed=-1"), "run.seed=-1"),
    "log-steps-zero": (lambda f: f.train("--metrics.log_steps=0"), "metrics.log_steps=0 must be positive"),
    "peak-tflops-nan": (lambda f: f.train("--metrics.peak_tflops=nan"), "metrics.peak_tflops=nan"),
    "pad-token-outside-vocab": (lambda f: f.train("--model.pad_token_id=300"), "pad_token_id=300"),
    # checkpoint keys
    "save-steps-negative": (lambda f: f.train("--checkpoint.save_steps=-1"), "checkpoint.save_steps=-1"),
    "keep-max-negative": (lambda f: f.train("--checkpoint.keep_max=-1"), "checkpoint.keep_max=-1"),
    "resume-path-missing": (lambda f: f.train(f"--checkpoint.resume={f.root / 'gone'}"), "no checkpoint at"),
    "resume-path-a-file": (lambda f: f.train(f"--checkpoint.resume={f.file('x.bin', 'x')}"), "no checkpoint at"),
    "resume-empty-dir": (lambda f: f.train(f"--checkpoint.resume={f.file('e/.keep', '').parent}"),
                         "no checkpoint at"),
    # sizes beyond memory: refused before anything is built
    "hidden-1e9": (lambda f: f.train("--model.hidden_size=1e9"), "model.hidden_size=1000000000"),
    "vocab-1e12": (lambda f: f.train("--model.vocab_size=1e12"), "vocab_size=1000000000000"),
    "layers-1e12": (lambda f: f.train("--model.decoder_layers=1e12"), "decoder_layers=1000000000000"),
    "ffn-1e12": (lambda f: f.train("--model.ffn_hidden_size=1e12"), "ffn_hidden_size=1000000000000"),
    "seq-length-1e11": (lambda f: f.train("--model.seq_length=1e11"), "seq_length=100000000000"),
    "encoder-layers-1e12": (lambda f: f.train("--model.kind=transformer", "--model.encoder_layers=1e12"),
                            "encoder_layers=1000000000000"),
    "batch-beyond-memory": (lambda f: f.train("--train.global_batch_size=1e11", "--model.seq_length=4096"),
                            "train.global_batch_size=100000000000"),
    "hidden-zero": (lambda f: f.train("--model.hidden_size=0"), "model.hidden_size=0 must be positive"),
    "heads-not-dividing": (lambda f: f.train("--model.num_heads=3"), "not divisible by model.num_heads=3"),
    # names and layouts
    "kind-unknown": (lambda f: f.train("--model.kind=bert"), "model.kind='bert' is not one of"),
    "activation-unknown": (lambda f: f.train("--model.hidden_act=swish"), "model.hidden_act='swish'"),
    "dtype-unknown": (lambda f: f.train("--model.dtype=float64"), "model.dtype='float64'"),
    "precision-unknown": (lambda f: f.train("--train.mixed_precision=fp8"), "mixed_precision='fp8'"),
    "world-size-mismatch": (lambda f: f.train("--parallel.data_parallel=2"), "does not equal the world size 1"),
    "layer-stages-without-pipeline": (lambda f: f.train("--parallel.layer_stages=[0,1]"),
                                      "parallel.layer_stages=[0, 1] must give"),
    "recompute-list-wrong-length": (lambda f: f.train('--parallel.recompute=["full"]'),
                                    "parallel.recompute list has 1 entries"),
    "schedule-unknown": (lambda f: f.train("--parallel.pipeline_schedule=bogus"), "pipeline_schedule='bogus'"),
    "zero-stage-5": (lambda f: f.train("--parallel.zero_stage=5"), "parallel.zero_stage=5"),
    # data files
    "data-kind-unknown": (lambda f: f.train("--data.kind=images"), "data.kind='images' is not one of"),
    "data-path-unset": (lambda f: f.train("--data.kind=text"), "needs data.path"),
    "text-missing": (lambda f: f.data("text", f.root / "none.txt"), "none.txt does not exist"),
    "text-missing-small-vocab": (lambda f: f.data("text", f.root / "none.txt", "--model.vocab_size=64"),
                                 "none.txt does not exist"),
    "text-empty": (lambda f: f.data("text", f.file("empty.txt", "")), "empty.txt is empty"),
    "text-binary": (lambda f: f.data("text", f.file("bin.txt", bytes(range(256)))), "bin.txt is binary"),
    "text-not-utf8": (lambda f: f.data("text", f.file("latin.txt", "caf\xe9\n".encode("latin-1"))),
                      "latin.txt is not UTF-8 text"),
    "text-is-a-directory": (lambda f: f.data("text", f.root), "is a directory"),
    "text-too-short": (lambda f: f.data("text", f.file("short.txt", "hi\n")), "fewer than model.seq_length + 1"),
    "text-small-vocab-no-tokenizer": (lambda f: f.data("text", f.file("ok.txt", "hello world\n" * 50),
                                                       "--model.vocab_size=64"), "model.vocab_size=64 tokens, too few"),
    "tokenizer-corrupt": (lambda f: f.data("text", f.file("ok.txt", "hello world\n" * 50),
                                           f"--data.tokenizer={f.file('tok.json', '{not json')}"),
                          "tok.json is not a tokenizer.json"),
    "npy-not-numpy": (lambda f: f.data("text", f.file("ids.npy", "not an array")), "ids.npy is not a .npy array"),
    "npy-empty": (lambda f: f.data("text", f.file("ids.npy", b"")), "ids.npy is empty"),
    "translation-missing": (lambda f: f.data("translation", f.root / "pairs.txt", "--model.kind=transformer"),
                            "pairs.txt does not exist"),
    "translation-empty": (lambda f: f.data("translation", f.file("pairs.txt", ""), "--model.kind=transformer"),
                          "pairs.txt is empty"),
    "translation-binary": (lambda f: f.data("translation", f.file("pairs.txt", b"\x00\x01" * 64),
                                            "--model.kind=transformer"), "pairs.txt is binary"),
    "translation-no-tabs": (lambda f: f.data("translation", f.file("pairs.txt", "no tab here\n" * 40),
                                             "--model.kind=transformer"), "expected 'source<TAB>target'"),
    "eval-path-missing": (lambda f: f.data("translation", f.file("pairs.txt", "a b\tc d\n" * 40),
                                           "--model.kind=transformer", f"--data.eval_path={f.root / 'ev.txt'}"),
                          "data.eval_path="),
    "cifar-missing": (lambda f: f.data("cifar10", f.root / "cifar", "--model.kind=resnet"), "does not exist"),
    "cifar-is-a-file": (lambda f: f.data("cifar10", f.file("cifar.bin", "x"), "--model.kind=resnet"), "is a file"),
    "cifar-no-batches": (lambda f: f.data("cifar10", f.file("cifar/readme", "x").parent, "--model.kind=resnet"),
                         "has no data_batch_*.bin"),
    "cifar-truncated": (lambda f: f.data("cifar10", f.file("cifar/data_batch_1.bin", b"\x01" * 5000).parent,
                                         "--model.kind=resnet"), "not a whole number of 3073-byte"),
    # directories
    "run-dir-under-a-file": (lambda f: f.train(f"--run.dir={f.file('plain', 'x') / 'run'}"),
                             "cannot be a directory"),
    "run-dir-is-a-file": (lambda f: f.train(f"--run.dir={f.file('plain', 'x')}"), "cannot be a directory"),
    "checkpoint-dir-under-a-file": (lambda f: f.train("--checkpoint.save_steps=1",
                                                      f"--checkpoint.dir={f.file('plain', 'x') / 'ck'}"),
                                    "checkpoint.dir="),
    # corpora and tokenizers
    "sgm-missing": (lambda f: ["preprocess", "wmt14", "--src", str(f.root / "a.en.sgm"), "--ref",
                               str(f.root / "b.fr.sgm"), "--out", str(f.root / "out")], "a.en.sgm does not exist"),
    "sgm-binary": (lambda f: ["preprocess", "wmt14", "--src", str(f.file("a.en.sgm", b"\x00\x01\x02")), "--ref",
                              str(f.file("b.fr.sgm", "<refset></refset>")), "--out", str(f.root / "o")],
                   "a.en.sgm is binary"),
    "sgm-not-utf8": (lambda f: ["preprocess", "wmt14", "--src", str(f.file("a.en.sgm", b"caf\xe9")), "--ref",
                                str(f.file("b.fr.sgm", "<refset></refset>")), "--out", str(f.root / "o")],
                     "a.en.sgm is not UTF-8"),
    "archive-not-a-tar": (lambda f: ["preprocess", "wmt14", "--archive", str(f.file("t.tgz", "not a tar")),
                                     "--out", str(f.root / "o")], "t.tgz is not a readable tar archive"),
    "tokenizer-input-missing": (lambda f: ["tokenizer", "train", "--input", str(f.root / "none.txt"),
                                           "--vocab-size", "300", "--out", str(f.root / "t.json")], "none.txt"),
    "tokenizer-vocab-too-small": (lambda f: ["tokenizer", "train", "--input", str(f.file("in.txt", "a b\n")),
                                             "--vocab-size", "10", "--out", str(f.root / "t.json")],
                                  "vocab_size=10 is too small"),
    "hostfile-not-utf8": (lambda f: ["launch", "--hostfile", str(f.file("hosts", b"node1 slots=2\n\xff\xfe\n")),
                                     "--", *f.train()], "hosts: not UTF-8 text"),
    # checkpoints, through train (an explicit resume of a damaged copy of a saved checkpoint)
    "resume-flipped-shard-byte": (lambda f: f.resume(lambda p: flip_byte(p / SHARD)),
                                  f"{SHARD} fails its checksum"),
    "resume-truncated-shard": (lambda f: f.resume(lambda p: truncate(p / SHARD)), f"{SHARD} has 100 bytes"),
    "resume-missing-shard": (lambda f: f.resume(lambda p: (p / SHARD).unlink()), f"{SHARD} is missing"),
    "resume-missing-index": (lambda f: f.resume(lambda p: (p / ".metadata").unlink()), ".metadata is missing"),
    "resume-flipped-index": (lambda f: f.resume(lambda p: flip_byte(p / ".metadata", 40)), ".metadata"),
    "resume-evil-index": (lambda f: f.resume(evil_pickle), ".metadata"),
    "resume-meta-not-json": (lambda f: f.resume(lambda p: (p / "paratrain.json").write_text("{")),
                             "paratrain.json is corrupt"),
    "resume-meta-edited": (lambda f: f.resume(edit_meta(lambda m: m.update(step=1000))),
                           "paratrain.json fails its checksum"),
    "resume-meta-future-format": (lambda f: f.resume(edit_meta(lambda m: m.update(format=99) or m.pop("checksum"))),
                                  "has format 99"),
    "resume-meta-missing": (lambda f: f.resume(lambda p: (p / "paratrain.json").unlink()), "is incomplete"),
    "resume-missing-rank-file": (lambda f: f.resume(lambda p: (p / RANK_FILE).unlink()), f"{RANK_FILE} is missing"),
    "resume-flipped-rank-file": (lambda f: f.resume(lambda p: flip_byte(p / RANK_FILE)),
                                 f"{RANK_FILE} fails its checksum"),
    "resume-missing-config-toml": (lambda f: f.resume(lambda p: (p / "config.toml").unlink()),
                                   "config.toml is missing"),
    "resume-other-model": (lambda f: f.resume(lambda p: None, "--model.decoder_layers=1"),
                           "model.decoder_layers: 2 → 1"),
    "resume-other-activation": (lambda f: f.resume(lambda p: None, "--model.hidden_act=relu"),
                                "model.hidden_act: gelu → relu"),
    "resume-other-dtype": (lambda f: f.resume(lambda p: None, "--model.dtype=bfloat16"),
                           "model.dtype: float32 → bfloat16"),
    # checkpoint commands
    "info-nothing": (lambda f: ["checkpoint", "info", str(f.root / "nowhere")], "no checkpoint at"),
    "verify-nothing": (lambda f: ["checkpoint", "verify", str(f.root / "nowhere")], "no checkpoint at"),
    "export-damaged": (lambda f: ["export", str(f.damaged(lambda p: flip_byte(p / SHARD))), str(f.root / "m.st")],
                       f"{SHARD} fails its checksum"),
    # issue 25: what a run writes, checked before the first step
    "prefix-with-a-slash": (lambda f: f.train("--checkpoint.prefix=a/b", "--checkpoint.save_steps=1"),
                            "checkpoint.prefix='a/b' is not a plain name"),
    "prefix-dot-dot": (lambda f: f.train("--checkpoint.prefix=..", "--checkpoint.save_steps=1"),
                       "checkpoint.prefix='..' is not a plain name"),
    "prefix-escaping-without-saves": (lambda f: f.train("--checkpoint.prefix=../../x"),  # a stop saves too
                                      "checkpoint.prefix='../../x'"),
    "prefix-nul": (lambda f: f.toml("checkpoint", 'prefix = "a\\u0000b"'), "checkpoint.prefix='a\\x00b' holds a NUL"),
    "run-name-escapes-runs": (lambda f: f.train("--run.name=../../../x"), "run.name='../../../x' is not a plain name"),
    "run-name-empty": (lambda f: f.train("--run.name="), "run.name='' is not a plain name"),
    "run-dir-nul": (lambda f: f.toml("run", 'dir = "a\\u0000b"'), "run.dir='a\\x00b' holds a NUL character"),
    "run-dir-tilde": (lambda f: f.train("--run.dir=~/x"), "run.dir='~/x': '~' is not expanded here"),
    "checkpoint-dir-nul": (lambda f: f.toml("checkpoint", 'dir = "c\\u0000k"'), "checkpoint.dir='c\\x00k' holds a NUL"),
    "checkpoint-dir-under-a-file-without-saves": (lambda f: f.train(f"--checkpoint.dir={f.file('plain', 'x') / 'ck'}"),
                                                  "plain is a file; choose another checkpoint.dir"),
    # issue 25: tracebacks and silent acceptances of the first probe
    "vocab-size-one": (lambda f: f.train("--model.vocab_size=1"), "model.vocab_size=1 leaves synthetic data no token"),
    "encoder-decoder-task-sort": (lambda f: f.train("--model.kind=transformer", "--data.task=sort"),
                                  "data.task='sort' is not a synthetic task of model.kind='transformer'"),
    "gpt-task-sort": (lambda f: f.train("--data.task=sort"),
                      "data.task='sort' is not a synthetic task of model.kind='gpt'"),
    "gpt-task-copy": (lambda f: f.train("--data.task=copy"), "use 'markov'"),
    "min-lr-above-lr": (lambda f: f.train("--train.min_lr=0.5"), "train.min_lr=0.5 is above train.lr=0.001"),
    "log-format-xml": (lambda f: f.train("--metrics.log_format=xml"), "metrics.log_format='xml' is not one of default"),
    "log-format-capitalised": (lambda f: f.train("--metrics.log_format=MindSpore"), "metrics.log_format='MindSpore'"),
    "aggregation-groups-above-layers": (lambda f: f.train("--parallel.gradient_aggregation_group=99"),
                                        "gradient_aggregation_group=99 must be 0 (one group per layer) or a number of "
                                        "groups of the model's 2 layers"),
    "deepspeed-fp16-enabled-yes": (lambda f: f.deepspeed('{"fp16": {"enabled": "yes"}}'),
                                   "fp16.enabled='yes' must be true or false (a JSON boolean"),
    # issue 25: the second probe
    "layer-stages-not-integers": (lambda f: f.train('--parallel.layer_stages=[0,"a"]'), "layer_stages=[0, 'a'] must"),
    "string-key-given-a-list": (lambda f: f.toml("data", 'path = ["a.txt"]'), "data.path=['a.txt']: expected a string"),
    "resume-given-false": (lambda f: f.toml("checkpoint", "resume = false"),
                           "checkpoint.resume=False: expected a string"),
    "vocab-size-four": (lambda f: f.train("--model.kind=transformer", "--model.vocab_size=4"), "use vocab_size >= 5"),
    "tgt-seq-length-one": (lambda f: f.train("--model.kind=transformer", "--model.tgt_seq_length=1"),
                           "model.tgt_seq_length=1 leaves a synthetic target no token"),
    "min-length-negative": (lambda f: f.train("--model.kind=transformer", "--data.min_length=-1"),
                            "data.min_length=-1 must not be negative"),
    "eval-samples-zero": (lambda f: f.train("--data.eval_samples=0"), "data.eval_samples=0 must be positive"),
    "bucket-size-synthetic": (lambda f: f.train("--data.bucket_size=5"), "data.bucket_size=5 applies to translation"),
    "dynamic-padding-synthetic": (lambda f: f.train("--data.dynamic_padding=true"),
                                  "data.dynamic_padding=True applies"),
    "text-for-the-encoder-decoder": (lambda f: f.data("text", f.file("ok.txt", "hello world\n" * 50),
                                                      "--model.kind=transformer"),
                                     "data.kind='text' has no batches for model.kind='transformer'"),
    "translation-for-gpt": (lambda f: f.data("translation", f.file("pairs.txt", "a b\tc d\n" * 40)),
                            "data.kind='translation' has no batches for model.kind='gpt'"),
    "resnet-on-synthetic": (lambda f: f.train("--model.kind=resnet"), "data.kind='synthetic' has no batches for "
                                                                      "model.kind='resnet'"),
    "tokenizer-to-train-under-a-file": (lambda f: f.data("text", f.file("ok.txt", "hello world\n" * 50),
                                                         f"--data.tokenizer={f.file('plain', 'x') / 'tok.json'}"),
                                        "would be trained and saved there, but data.tokenizer="),
    "npy-ids-beyond-vocab": (lambda f: f.data("text", f.npy("ids.npy", [5, 6, 300, 7] * 20)),
                             "ids.npy holds token id 300 (at index 2), not one of model.vocab_size=300"),
    "npy-negative-ids": (lambda f: f.data("text", f.npy("ids.npy", [5, -1] * 40)), "holds token id -1 (at index 1)"),
    "npy-floats": (lambda f: f.data("text", f.npy("ids.npy", [0.5] * 80)), "ids.npy holds a 1-D float64 array"),
    "npy-two-dimensions": (lambda f: f.data("text", f.npy("ids.npy", [[5, 6]] * 40)), "holds a 2-D int64 array"),
    "deepspeed-bf16-enabled-one": (lambda f: f.deepspeed('{"bf16": {"enabled": 1}}'), "bf16.enabled=1 must be true"),
    "deepspeed-bf16-enabled-false-string": (lambda f: f.deepspeed('{"bf16": {"enabled": "false"}}'),
                                            "bf16.enabled='false' must be true"),
    "deepspeed-adam-w-mode-string": (lambda f: f.deepspeed('{"optimizer": {"type": "Adam", "params": '
                                                           '{"adam_w_mode": "no", "weight_decay": 0.1}}}'),
                                     "optimizer.params.adam_w_mode='no' must be true"),
    "deepspeed-cpu-offload-string": (lambda f: f.deepspeed('{"zero_optimization": {"cpu_offload": "yes"}}'),
                                     "zero_optimization.cpu_offload='yes' must be true"),
    "deepspeed-cpu-offload-is-read": (lambda f: f.deepspeed('{"zero_optimization": {"cpu_offload": true}}'),
                                      "parallel.offload_optimizer='cpu' needs the optimizer state sharded"),
    "deepspeed-block-as-a-value": (lambda f: f.deepspeed('{"fp16": true}'), 'fp16=True must be a block of keys, '
                                                                             'e.g. {"enabled": ...}'),
    "plan-device-memory-unreadable": (lambda f: f.plan("--device-memory", "80XB"), "--device-memory '80XB' is not"),
    "plan-device-memory-zero": (lambda f: f.plan("--device-memory", "0GiB"), "--device-memory '0GiB' is not"),
    "plan-peak-tflops-zero": (lambda f: f.plan("--peak-tflops", "0"), "--peak-tflops must be positive, got 0"),
    "plan-peak-tflops-nan": (lambda f: f.plan("--peak-tflops", "nan"), "--peak-tflops must be positive, got nan"),
    "plan-efficiency-zero": (lambda f: f.plan("--efficiency", "0"), "--efficiency 0 is not a fraction of peak"),
    "plan-efficiency-above-one": (lambda f: f.plan("--efficiency", "2"), "--efficiency 2 is not a fraction of peak"),
    "plan-devices-negative": (lambda f: f.plan("--devices", "-4"), "--devices must be positive, got -4"),
    "plan-global-batch-zero": (lambda f: f.plan("--global-batch", "0"), "--global-batch must be positive, got 0"),
    "plan-top-negative": (lambda f: f.plan("--top", "-1"), "--top must be positive, got -1"),
    "plan-bandwidth-inf": (lambda f: f.plan("--inter-bw", "inf"), "--inter-bw must be positive and finite, got inf"),
    "launch-name-empty": (lambda f: f.launch("--name", ""), "job name '': use letters"),
    "launch-master-port-beyond": (lambda f: f.launch("--master-port", "70000"),
                                  "--master-port 70000 is not a TCP port"),
    "launch-join-timeout-inf": (lambda f: f.launch("--join-timeout", "inf"),
                                "--join-timeout must be positive and finite"),
    "launch-collective-timeout-nan": (lambda f: f.launch("--collective-timeout", "nan"),
                                      "--collective-timeout must be positive, got nan"),
    "launch-master-addr-bad": (lambda f: f.launch("--master-addr", "a b"), "--master-addr: 'a b' is not a valid host"),
    "launch-include-without-hosts": (lambda f: f.launch("--include", "h1"), "--include and --exclude pick hosts"),
    "logs-tail-zero": (lambda f: ["logs", "some-job", "--tail", "0"], "--tail must be a number of lines, 1 or more"),
    "stop-grace-nan": (lambda f: ["stop", "some-job", "--grace", "nan"], "--grace must be 0 or more seconds, got nan"),
    "sample-train-negative": (lambda f: ["preprocess", "sample", "--out", str(f.root / "s"), "--train", "-5"],
                              "--train -5 and --heldout 500 must be 1 or more pairs"),
    "sample-out-under-a-file": (lambda f: ["preprocess", "sample", "--out", str(f.file("plain", "x") / "s")],
                                "plain is a file; choose another --out"),
    "tokenizer-min-frequency-negative": (lambda f: ["tokenizer", "train", "--input", str(f.file("in.txt", "a b\n")),
                                                    "--vocab-size", "300", "--min-frequency", "-1", "--out",
                                                    str(f.root / "t.json")], "--min-frequency -1 must be 0 or more"),
}

# launches of a train command with a bad config: refused before any rank starts
LAUNCH_CASES = {
    "launch-lr-nan": (lambda f: f.train("--train.lr=nan"), "train.lr=nan"),
    "launch-config-missing": (lambda f: f.train(config=f.root / "nope.toml"), "does not exist"),
    "launch-config-a-directory": (lambda f: f.train(config=f.root), "is a directory"),
    "launch-layers-1e12": (lambda f: f.train("--model.decoder_layers=1e12"), "decoder_layers=1000000000000"),
    "launch-data-missing": (lambda f: f.data("text", f.root / "none.txt"), "none.txt does not exist"),
    "launch-world-size": (lambda f: f.train("--parallel.data_parallel=4"), "does not equal the world size 2"),
    "launch-run-dir-under-a-file": (lambda f: f.train(f"--run.dir={f.file('plain', 'x') / 'run'}"),
                                    "cannot be a directory"),
    "launch-resume-missing": (lambda f: f.train(f"--checkpoint.resume={f.root / 'gone'}"), "no checkpoint at"),
    "launch-prefix-escaping": (lambda f: f.train("--checkpoint.prefix=../x"), "checkpoint.prefix='../x'"),
    "launch-run-name-escaping": (lambda f: f.train("--run.name=../x"), "run.name='../x' is not a plain name"),
}


def one_line_refusal(capsys, argv) -> str:
    """Run ``paratrain argv`` in this process: exit 2, one ``paratrain: `` line on stderr, no traceback,
    in under 5 s; returns the line."""
    start = time.perf_counter()
    code = cli.main([str(a) for a in argv])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("paratrain: "), err
    assert elapsed < 5, f"{elapsed:.1f} s"
    return lines[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of the BASE model after 2 steps (and the one after 1 step)."""
    root = tmp_path_factory.mktemp("saved")
    f = Files(root)
    assert cli.main(f.train("--checkpoint.save_steps=1")) == 0
    return root / "run" / "checkpoints"


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_refused_in_one_line(case, tmp_path, saved, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what a case that is not refused writes (runs/, ~/x) stays in its directory
    argv, expected = CASES[case]
    line = one_line_refusal(capsys, argv(Files(tmp_path, saved / "step_00000002")))
    assert expected in line, line


@pytest.mark.parametrize("case", LAUNCH_CASES)
def test_a_launch_with_a_bad_config_starts_no_rank(case, tmp_path, monkeypatch, capsys):
    from paratrain.launch import launcher

    home = use_registry(tmp_path, monkeypatch)
    started = []
    monkeypatch.setattr(launcher, "run_node", lambda *a, **k: started.append(a) or 0)
    argv, expected = LAUNCH_CASES[case]
    words = argv(Files(tmp_path))
    words[4:4] = ["--parallel.data_parallel=2"]  # two ranks, before the case's own overrides
    line = one_line_refusal(capsys, ["launch", "--nproc-per-node", "2", "--name", "bad", "--", *words])
    assert expected in line, line
    assert not started and not (home / "bad").exists()


def test_the_table_is_large_and_every_case_can_pass_the_checks(tmp_path, monkeypatch, capsys):
    """At least 60 bad inputs; and the checks are not refusing everything: the base config trains, a
    list key is accepted on the command line, and a valid launch reaches the point of starting ranks."""
    from paratrain.launch import launcher

    from paratrain.preflight import train_config

    assert len(CASES) + len(LAUNCH_CASES) >= 60
    parallel = train_config(["--parallel.layer_stages=[0,0,1,1]", '--parallel.recompute=["full","none"]']).parallel
    assert parallel.layer_stages == [0, 0, 1, 1] and parallel.recompute == ["full", "none"]
    f = Files(tmp_path)
    # warmup_steps above steps is a schedule cut short (README, train.lr_schedule): not refused
    assert cli.main(f.train("--model.decoder_layers=4", "--parallel.layer_stages=[0,0,0,0]",
                            "--train.warmup_steps=5")) == 0
    use_registry(tmp_path, monkeypatch)
    started = []
    monkeypatch.setattr(launcher, "run_node", lambda *a, **k: started.append(a) or 0)
    assert cli.main(["launch", "--nproc-per-node", "2", "--name", "good", "--",
                     *f.train("--parallel.data_parallel=2")]) == 0
    assert len(started) == 1


def run_paratrain(*argv, cwd, limits=None, timeout=120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PARATRAIN_DEVICE": "cpu"}
    return subprocess.run([PYTHON, "-m", "paratrain", *map(str, argv)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=limits)


@pytest.mark.slow
def test_no_traceback_reaches_the_terminal(tmp_path):
    """As real processes: a directory as config, lr=nan, and a launch of a config refused before any rank."""
    f = Files(tmp_path)
    for argv, expected in [(f.train(config=tmp_path), "is a directory"),
                           (f.train("--train.lr=nan"), "train.lr=nan"),
                           (["launch", "--nproc-per-node", "2", "--",
                             *f.train("--parallel.data_parallel=2", "--model.hidden_size=1e9")],
                            "model.hidden_size=1000000000")]:
        out = run_paratrain(*argv, cwd=tmp_path)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.strip().splitlines() == [out.stderr.strip()] and expected in out.stderr, out.stderr


@pytest.mark.slow
def test_a_file_too_large_during_a_save_names_the_file(tmp_path):
    """A file size limit (ulimit -f) below the checkpoint's shard: one line naming the file, exit 2."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    f = Files(tmp_path)
    out = run_paratrain(*f.train("--checkpoint.save_steps=1"), cwd=tmp_path, limits=limit)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    line = out.stderr.strip()
    assert len(line.splitlines()) == 1, out.stderr
    assert "File too large" in line and str(tmp_path / "run" / "checkpoints") in line and "ulimit" in line


def test_the_file_size_hint_is_given_for_a_file_too_large_only():
    import errno

    from paratrain.checkpoint.core import _write_failed

    final = Path("/ck/step_00000001")
    hints = {code: _write_failed(final, OSError(code, os.strerror(code), str(final / SHARD)))
             for code in (errno.EFBIG, errno.ENOSPC, errno.EACCES, errno.ENOENT)}
    assert "ulimit -f" in hints[errno.EFBIG] and "free space" in hints[errno.ENOSPC]
    for code in (errno.ENOSPC, errno.EACCES, errno.ENOENT):
        assert "ulimit" not in hints[code]
    for code in (errno.EACCES, errno.ENOENT):
        assert "free space" not in hints[code] and "a directory you can write" in hints[code]


# --- MindSpore's Model.train and ModelCheckpoint on a user's net ------------------------------------

@pytest.mark.parametrize("prefix, directory, expected", [
    ("a/b", None, "ModelCheckpoint(prefix='a/b'): use letters"),
    ("..", None, "ModelCheckpoint(prefix='..'): use letters"),
    ("", None, "ModelCheckpoint(prefix=''): use letters"),
    ("ck", lambda root: root / "plain" / "ck", "ModelCheckpoint directory="),
    ("ck", lambda root: "c\0k", "holds a NUL character"),
])
def test_model_checkpoint_checks_its_prefix_and_directory_when_made(tmp_path, prefix, directory, expected):
    from paratrain.errors import UserError
    from paratrain.train import ModelCheckpoint

    (tmp_path / "plain").write_text("x")
    with pytest.raises(UserError) as refused:
        ModelCheckpoint(prefix=prefix, directory=directory(tmp_path) if directory else tmp_path)
    assert expected in str(refused.value) and len(str(refused.value).splitlines()) == 1
    ModelCheckpoint(prefix="ck", directory=tmp_path / "new" / "ck")  # a directory that can be made: made
    assert (tmp_path / "new" / "ck").is_dir()


class SquaredError(torch.nn.Module):
    """A user's net returning its loss; per row with ``reduce=False``."""

    def __init__(self, reduce: bool = True):
        super().__init__()
        self.fc, self.reduce = torch.nn.Linear(4, 1), reduce

    def forward(self, x, y):
        error = (self.fc(x) - y) ** 2
        return error.mean() if self.reduce else error


def batches(*shapes, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(rows, width, generator=g).to(dtype), torch.randn(rows, 1, generator=g))
            for rows, width in shapes]


def fit(net, data):
    from paratrain.train import Model

    Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1)).train(1, data)


@pytest.mark.parametrize("bad, shapes", [
    (batches((8, 5))[0], "([8, 5] float32, [8, 1] float32)"),
    (batches((8, 4), dtype=torch.float64)[0], "([8, 4] float64, [8, 1] float32)"),
    (batches((8, 4))[0][:1], "([8, 4] float32)"),
])
def test_model_train_refuses_a_batch_unlike_the_first_before_its_step(bad, shapes):
    """One line naming the batch index and both shapes; the parameters are those after the batches before it."""
    from paratrain.errors import UserError

    torch.manual_seed(0)
    net = SquaredError()
    reference = copy.deepcopy(net)
    good = batches((8, 4), (8, 4))
    with pytest.raises(UserError) as refused:
        fit(net, [*good, bad])
    assert str(refused.value) == (f"Model.train: batch index 2 of epoch 1 is {shapes}, unlike the first batch "
                                  f"([8, 4] float32, [8, 1] float32): give every batch the first one's tensors, "
                                  f"dtypes and shapes")
    fit(reference, good)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), reference.parameters()))


def test_model_train_takes_a_last_smaller_batch_and_refuses_a_loss_that_is_no_scalar():
    from paratrain.errors import UserError

    fit(SquaredError(), batches((8, 4), (8, 4), (3, 4)))  # MindSpore's batch(drop_remainder=False)
    with pytest.raises(UserError, match=r"^Model.train: batch index 0 of epoch 1: the net returned a tensor of "
                                        r"shape \[8, 1\], not a loss: reduce it to a scalar"):
        fit(SquaredError(reduce=False), batches((8, 4)))


# --- damaged checkpoints and resume="auto" -------------------------------------------------------

def trained(run_dir: Path, steps: int, *overrides: str):
    """A Trainer of the BASE model for ``steps`` steps, saving every step, after ``train()``, and its losses."""
    import tomllib

    from paratrain import config_file
    from paratrain.trainer import Trainer

    cfg = config_file.from_dict(tomllib.loads(BASE), [f"run.dir={run_dir}", f"train.steps={steps}",
                                                      "checkpoint.save_steps=1", *overrides])
    trainer = Trainer(cfg)
    return trainer, [r["loss"] for r in trainer.train()]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """An uninterrupted 4-step run saving every step: (its checkpoints directory, its losses), on one thread as
    the resumed runs compared with it."""
    root = tmp_path_factory.mktemp("four")
    with one_thread():
        _, losses = trained(root / "run", 4)
    return root / "run" / "checkpoints", losses


@pytest.mark.parametrize("damage, named", [
    (lambda p: flip_byte(p / SHARD), f"{SHARD} fails its checksum"),
    (lambda p: truncate(p / SHARD), f"{SHARD} has 100 bytes"),
    (lambda p: (p / RANK_FILE).unlink(), f"{RANK_FILE} is missing"),
])
def test_auto_resume_goes_back_to_the_newest_intact_checkpoint(tmp_path, four_steps, caplog, damage, named):
    """Step 3 damaged: a run of 4 steps resumes from step 2 with a warning naming the file, and its steps 3
    and 4 have the uninterrupted run's losses."""
    checkpoints, losses = four_steps
    run = tmp_path / "run"
    shutil.copytree(checkpoints, run / "checkpoints")
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    damage(run / "checkpoints" / "step_00000003")
    with caplog.at_level(logging.WARNING, logger="paratrain.checkpoint"):
        trainer, resumed = trained(run, 4)
    assert "skipping step_00000003" in caplog.text and named in caplog.text
    assert trainer.checkpointer.resumed_from.name == "step_00000002"
    assert resumed == losses[2:]


def _damaged_share_of_rank_1(root: str):
    """dp2: 3 steps saved every step; then rank 1's shard of step 3 gets a flipped byte (rank 1 hashes it):
    an explicit resume of step 3, then an auto resume of the copy, on both ranks."""
    import torch.distributed as dist

    from paratrain.checkpoint import CheckpointError

    root = Path(root)
    _, whole = trained(root / "run", 3, "parallel.data_parallel=2")
    copy = root / "copy"
    if dist.get_rank() == 0:
        shutil.copytree(root / "run" / "checkpoints", copy / "checkpoints")
        flip_byte(copy / "checkpoints" / "step_00000003" / "__1_0.distcp")
    dist.barrier()
    try:
        trained(root / "other", 3, "parallel.data_parallel=2",
                f"checkpoint.resume={copy / 'checkpoints' / 'step_00000003'}")
        refused = None
    except CheckpointError as exc:
        refused = str(exc)
    trainer, resumed = trained(copy, 3, "parallel.data_parallel=2")  # saves a new step 3 over the damaged one
    return whole, trainer.checkpointer.resumed_from.name, resumed, refused


@pytest.mark.slow
def test_a_shard_damaged_in_another_ranks_share_is_found_on_every_rank(tmp_path):
    from forked_ranks import run_distributed

    for whole, resumed_from, resumed, refused in run_distributed(_damaged_share_of_rank_1, 2, str(tmp_path),
                                                                 timeout=240):
        assert resumed_from == "step_00000002" and resumed == whole[2:]
        assert refused is not None and "__1_0.distcp fails its checksum" in refused


def test_auto_resume_refuses_when_every_checkpoint_is_damaged(tmp_path, four_steps):
    from paratrain.checkpoint import CheckpointError

    run = tmp_path / "run"
    shutil.copytree(four_steps[0], run / "checkpoints")
    for path in (run / "checkpoints").glob("step_*"):
        flip_byte(path / SHARD)
    with pytest.raises(CheckpointError, match="checkpoints in .* are damaged"):
        trained(run, 6)


def test_checkpoint_verify_names_the_damaged_file(tmp_path, four_steps, capsys):
    run = tmp_path / "run"
    shutil.copytree(four_steps[0], run / "checkpoints")
    assert cli.main(["checkpoint", "verify", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.count("ok ") == 3 and "3 intact, 0 damaged" in out  # keep_max = 3
    flip_byte(run / "checkpoints" / "step_00000003" / SHARD)
    (run / "checkpoints" / "step_00000002" / "paratrain.json").unlink()
    assert cli.main(["checkpoint", "verify", str(run / "checkpoints")]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED     checkpoint {run / 'checkpoints' / 'step_00000003'} is damaged: file" in out
    assert f"{SHARD} fails its checksum" in out and "incomplete  " in out and "1 intact, 1 damaged, 1 incomplete" in out
    assert cli.main(["checkpoint", "verify", str(run / "checkpoints" / "step_00000004")]) == 0


def test_a_checkpoint_written_before_checksums_loads_only_when_trusted(tmp_path, four_steps, capsys):
    from paratrain.checkpoint import CheckpointError

    run = tmp_path / "run"
    shutil.copytree(four_steps[0], run / "checkpoints")
    for path in (run / "checkpoints").glob("step_*"):  # as format 1 wrote it: sizes only
        meta = json.loads((path / "paratrain.json").read_text())
        meta.pop("checksum")
        meta.update(format=1, files={name: entry["bytes"] for name, entry in meta["files"].items()})
        (path / "paratrain.json").write_text(json.dumps(meta))
    assert cli.main(["checkpoint", "verify", str(run / "checkpoints" / "step_00000004")]) == 0
    assert "sizes only" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="has format 1, which records no checksums.*trust_unverified"):
        trained(run, 5)
    trainer, losses = trained(run, 5, "checkpoint.trust_unverified=true")
    assert trainer.checkpointer.resumed_from.name == "step_00000004" and len(losses) == 1


def test_every_file_of_a_checkpoint_has_its_checksum(four_steps):
    from paratrain.checkpoint.storage import CHECKSUM, file_checksum

    path = four_steps[0] / "step_00000004"
    meta = json.loads((path / "paratrain.json").read_text())
    on_disk = {p.name for p in path.iterdir()} - {"paratrain.json"}
    assert set(meta["files"]) == on_disk == {SHARD, ".metadata", RANK_FILE, "config.toml"}
    for name, entry in meta["files"].items():  # recorded while writing, equal to the bytes on disk
        assert entry == {"bytes": (path / name).stat().st_size, CHECKSUM: file_checksum(path / name)}


def test_a_changed_model_is_refused_listing_every_key_and_training_keys_may_change(tmp_path, four_steps, caplog):
    from paratrain.checkpoint import CheckpointError

    run = tmp_path / "run"
    shutil.copytree(four_steps[0], run / "checkpoints")
    with pytest.raises(CheckpointError) as refused:
        trained(run, 6, "model.num_heads=2", "model.decoder_layers=3", "model.post_layernorm_residual=true")
    message = str(refused.value)
    assert "3 keys differ" in message
    for line in ("model.num_heads: 4 → 2", "model.decoder_layers: 2 → 3", "model.post_layernorm_residual: False → True"):
        assert f"\n  - {line}" in message
    with caplog.at_level(logging.WARNING, logger="paratrain.checkpoint"):
        trainer, _ = trained(run, 6, "train.lr=0.002", "model.hidden_dropout=0.1")
    assert trainer.checkpointer.resumed_from.name == "step_00000004"
    assert "train.steps: 4 → 6" in caplog.text and "train.lr: 0.001 → 0.002" in caplog.text
    assert "model.hidden_dropout: 0.0 → 0.1" in caplog.text


# --- the fp16 floor ------------------------------------------------------------------------------

def test_loss_scaler_floor_and_skips_in_a_row():
    import torch

    from paratrain.precision import LossScaleFloor, LossScaler

    inf, one = torch.tensor(float("inf")), torch.tensor(1.0)
    scaler = LossScaler(True, init_scale=8.0, min_scale=2.0, max_skipped=0)
    assert scaler.update(inf) and scaler.scale == 4.0
    assert scaler.update(inf) and scaler.scale == 2.0
    scaler.check()
    scaler.update(inf)  # the device keeps the verdict: the next check (a logged step) raises
    with pytest.raises(LossScaleFloor, match="minimum loss scale 2 .*3 step\\(s\\) skipped"):
        scaler.check()
    scaler = LossScaler(True, init_scale=2.0**20, max_skipped=3)
    for _ in range(5):  # good steps reset the count of skips in a row
        assert scaler.update(inf) and scaler.update(inf) and not scaler.update(one)
    assert scaler.update(inf) and scaler.update(inf)
    scaler.check()
    scaler.update(inf)
    scaler.update(one)  # a good step before the check does not hide the three in a row
    with pytest.raises(LossScaleFloor, match="3 fp16 steps in a row overflowed"):
        scaler.check()
    assert LossScaler(False).update(inf) is False  # bf16/fp32 never skip


@pytest.mark.parametrize("overrides, expected", [
    (["--train.initial_loss_scale=16777216", "--train.min_loss_scale=16777216"], "at the minimum loss scale 1.67772e+07"),
    (["--train.initial_loss_scale=1e30", "--train.max_skipped_steps=2"], "2 fp16 steps in a row overflowed"),
])
def test_fp16_floor_stops_training_with_its_exit_code(tmp_path, capsys, overrides, expected):
    from paratrain.precision import LossScaleFloor

    code = cli.main(Files(tmp_path).train("--train.mixed_precision=fp16", "--train.steps=6", *overrides))
    err = capsys.readouterr().err
    assert code == LossScaleFloor.EXIT_CODE == 5 and expected in err and "Traceback" not in err


def test_a_run_that_skipped_steps_says_how_many(tmp_path, capsys):
    f = Files(tmp_path)
    assert cli.main(f.train("--train.mixed_precision=fp16", "--train.steps=8", "--train.initial_loss_scale=1e10")) == 0
    out = capsys.readouterr().out
    skipped = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["skipped_steps"]
    assert skipped > 0 and f"fp16: {skipped} step(s) skipped for overflow" in out


# --- issue 25: damage anywhere in a checkpoint reads as damage, naming the file ------------------------------

def flip_bit(file: Path, offset: int, bit: int | None = None) -> None:
    """Flip bit ``bit`` (by default one that varies with the offset) of byte ``offset`` of ``file``; flipping it
    again restores it."""
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0] ^ (1 << (offset // 64 % 8 if bit is None else bit))
        f.seek(offset)
        f.write(bytes([byte]))


def flip_tensor_name(path: Path) -> None:
    """Flip the lowest bit of a letter inside a tensor name in DCP's index of checkpoint ``path``: a valid index
    of a checkpoint that lacks that tensor, but for its checksum."""
    flip_bit(path / ".metadata", (path / ".metadata").read_bytes().index(b"model.") + 8, bit=0)


def rewrite_meta(change) -> callable:
    """A damage that changes ``paratrain.json`` as ``change(meta)`` does and records a matching checksum (as a
    paratrain that wrote it so would)."""
    def damage(path: Path) -> None:
        from paratrain.checkpoint.storage import write_meta

        meta = json.loads((path / "paratrain.json").read_text())
        meta.pop("checksum")
        change(meta)
        write_meta(path, meta)
    return damage


@pytest.fixture
def loader(tmp_path, four_steps):
    """(a copy of the 4-step run's checkpoints, a Checkpointer of the BASE model that has loaded nothing)."""
    import tomllib

    from paratrain import config_file
    from paratrain.trainer import Trainer

    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.copytree(four_steps[0], checkpoints)
    cfg = config_file.from_dict(tomllib.loads(BASE), [f"run.dir={tmp_path / 'run'}", "train.steps=4",
                                                      "checkpoint.resume=none"])
    return checkpoints, Trainer(cfg).checkpointer


def test_a_bit_flipped_anywhere_in_a_checkpoint_reads_as_damage_naming_the_file(loader, monkeypatch):
    """A bit flipped at every 64th byte of every file of a checkpoint. Loading it (an explicit resume, and each
    checkpoint ``resume = "auto"`` tries) fails with a DamagedCheckpoint, the error auto goes back past,
    naming that file: never another cause, never a load of changed data, never another exception. Every file
    but the shard is checked before DCP reads anything; the shard is hashed while DCP reads it, so each of its
    flips fails its checksum, and the flips in its first bytes (a zip header) and in its last ones (a zip
    directory) go through the whole load. The ``latest`` pointer is a hint: no flip of it changes which
    checkpoints auto tries."""
    import paratrain.checkpoint.core as core
    from paratrain.checkpoint import storage
    from paratrain.checkpoint.storage import DamagedCheckpoint, check_checksums, holds_tensor_data, read_meta

    checkpoints, checkpointer = loader
    path = checkpoints / "step_00000004"
    reads = []
    monkeypatch.setattr(core, "dcp_load", lambda *a, **k: reads.append(a) or storage.dcp_load(*a, **k))
    meta_text = (path / "paratrain.json").read_text()
    meta = read_meta(path)
    files = sorted(path.iterdir())
    assert {f.name for f in files} == {SHARD, ".metadata", RANK_FILE, "config.toml", "paratrain.json"}
    flips = loaded_unchanged = 0
    for file in files:
        size, shard = file.stat().st_size, holds_tensor_data(file.name)
        for offset in range(0, size, 64):
            flip_bit(file, offset)
            flips += 1
            try:
                if shard and 128 <= offset < size - 128:
                    problem = check_checksums(path, meta, [file.name])
                    assert problem is not None and f"file {file} fails its checksum" in problem, (file, offset)
                    continue
                reads.clear()
                try:
                    step = checkpointer.load(path)
                except DamagedCheckpoint as exc:
                    message = str(exc)
                    assert f"checkpoint {path} is damaged: file {file} " in message, (offset, message)
                    assert "\n" not in message
                    assert shard or not reads, f"{file.name} at {offset}: DCP read the shards before it was checked"
                else:  # a flip that leaves the JSON's meaning as it was ("1e-08" -> "1E-08"): nothing changed
                    damaged = (path / "paratrain.json").read_text(errors="replace")
                    assert file.name == "paratrain.json" and json.loads(damaged) == json.loads(meta_text), offset
                    assert step == 4
                    loaded_unchanged += 1
            finally:
                flip_bit(file, offset)
    assert flips > 10_000 and loaded_unchanged < 10
    latest = checkpoints / "latest"
    candidates = checkpointer._agreed_candidates()
    for offset in range(latest.stat().st_size):
        for bit in range(8):
            flip_bit(latest, offset, bit)
            assert checkpointer._agreed_candidates() == candidates
            flip_bit(latest, offset, bit)


def test_auto_resume_goes_back_past_a_flipped_bit_in_any_file(loader, caplog):
    """A bit flipped in each file of the newest checkpoint in turn: ``resume = "auto"`` says in one line which
    checkpoint it skipped and the file, and resumes from the one before it."""
    checkpoints, checkpointer = loader
    checkpointer.cfg.resume = "auto"
    newest = checkpoints / "step_00000004"
    for file in sorted(newest.iterdir()):
        offset = file.stat().st_size // 128 * 64
        flip_bit(file, offset)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="paratrain.checkpoint"):
            assert checkpointer.resume() == 3
        flip_bit(file, offset)
        skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
        assert len(skipped) == 1 and "\n" not in skipped[0], skipped
        assert skipped[0].startswith(f"checkpoint: skipping step_00000004: checkpoint {newest} is damaged: "
                                     f"file {file} ")
        assert checkpointer.resumed_from.name == "step_00000003"


def test_a_flipped_tensor_name_in_the_index_reads_as_damage_on_the_command_line(tmp_path, four_steps, capsys, caplog):
    """The index of step 4 with one tensor name changed: an explicit resume is refused in one line naming
    ``.metadata`` (not "lacks 1 tensors"); ``resume = "auto"`` goes back to step 3, and its step 4 has the
    uninterrupted run's loss."""
    checkpoints, losses = four_steps
    f = Files(tmp_path)
    shutil.copytree(checkpoints, tmp_path / "run" / "checkpoints")
    newest = tmp_path / "run" / "checkpoints" / "step_00000004"
    flip_tensor_name(newest)
    line = one_line_refusal(capsys, f.train(f"--checkpoint.resume={newest}", f"--run.dir={tmp_path / 'other'}"))
    assert f"checkpoint {newest} is damaged: file {newest / '.metadata'} fails its checksum" in line, line
    with caplog.at_level(logging.WARNING, logger="paratrain.checkpoint"):
        assert cli.main(f.train("--train.steps=4", "--checkpoint.save_steps=1", "--metrics.log_steps=1")) == 0
    assert "skipping step_00000004" in caplog.text and "resumed from" in caplog.text
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(4, losses[3])]
    assert cli.main(["checkpoint", "verify", str(newest)]) == 0  # saved again, intact


# an explicit resume of a damaged or partial checkpoint: one line naming the file
DAMAGED_CHECKPOINTS = {
    "index-tensor-name-flipped": (flip_tensor_name, ".metadata fails its checksum"),
    "meta-format-digit-flipped": (lambda p: flip_bit(p / "paratrain.json", (p / "paratrain.json").read_bytes().index(
        b'"format": 2') + 10, bit=0), "paratrain.json fails its checksum"),
    "meta-checksum-removed": (edit_meta(lambda m: m.pop("checksum")), "paratrain.json lacks its checksum"),
    "meta-lacks-a-key": (rewrite_meta(lambda m: m.pop("optimizer_settings")),
                         "paratrain.json has no valid 'optimizer_settings'"),
    "meta-layout-a-list": (rewrite_meta(lambda m: m.update(layout=[1])), "paratrain.json has no valid 'layout'"),
    "meta-lists-a-path": (rewrite_meta(lambda m: m["files"].update({"../x": 1})), "lists '../x', which is not a file"),
    "meta-without-trainer-state": (rewrite_meta(lambda m: m.pop("data")), "holds no data state"),
    "meta-and-index-missing": (lambda p: [(p / n).unlink() for n in ("paratrain.json", ".metadata")],
                               "paratrain.json is missing"),
    "rank-file-truncated": (lambda p: truncate(p / RANK_FILE), f"{RANK_FILE} has 100 bytes"),
    "config-toml-flipped": (lambda p: flip_bit(p / "config.toml", 3), "config.toml fails its checksum"),
}


@pytest.mark.parametrize("case", DAMAGED_CHECKPOINTS)
def test_an_explicit_resume_of_a_damaged_checkpoint_names_the_file(case, tmp_path, saved, capsys):
    damage, expected = DAMAGED_CHECKPOINTS[case]
    f = Files(tmp_path, saved / "step_00000002")
    line = one_line_refusal(capsys, f.resume(damage))
    assert expected in line and str(tmp_path / "damaged" / "step_00000002") in line, line


def test_checkpoint_verify_fails_on_an_incomplete_checkpoint(tmp_path, four_steps, capsys):
    path = tmp_path / "step_00000004"
    shutil.copytree(four_steps[0] / "step_00000004", path)
    for name in ("paratrain.json", ".metadata"):  # then nothing left but its name says it is a checkpoint
        (path / name).unlink()
        assert cli.main(["checkpoint", "verify", str(path)]) == 1
        out = capsys.readouterr().out.strip().splitlines()
        assert out == [f"incomplete  {path}: paratrain.json is missing, its save did not finish "
                       f'(resume = "auto" skips it)'], out


def test_keep_max_zero_keeps_every_checkpoint_and_negative_is_refused(tmp_path, capsys):
    f = Files(tmp_path)
    assert cli.main(f.train("--train.steps=3", "--checkpoint.save_steps=1", "--checkpoint.keep_max=0")) == 0
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "latest", "step_00000001", "step_00000002", "step_00000003"]
    line = one_line_refusal(capsys, f.train("--checkpoint.keep_max=-1"))
    assert "checkpoint.keep_max=-1 must be 0 (keep all)" in line
