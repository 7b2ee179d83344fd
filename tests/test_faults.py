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
import json
import logging
import os
import resource
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PYTHON
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
    "keep-max-zero": (lambda f: f.train("--checkpoint.keep_max=0"), "checkpoint.keep_max=0 must be at least 1"),
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
    "resume-meta-future-format": (lambda f: f.resume(edit_meta(lambda m: m.update(format=99))), "has format 99"),
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
def test_bad_input_is_refused_in_one_line(case, tmp_path, saved, capsys):
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
    assert cli.main(f.train("--model.decoder_layers=4", "--parallel.layer_stages=[0,0,0,0]")) == 0
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


# --- damaged checkpoints and resume="auto" -------------------------------------------------------

def trained(run_dir: Path, steps: int, *overrides: str):
    """A Trainer of the BASE model for ``steps`` steps, saving every step, after ``train()``, and its losses."""
    import tomllib

    from paratrain.config import Config
    from paratrain.trainer import Trainer

    cfg = Config.from_dict(tomllib.loads(BASE), [f"run.dir={run_dir}", f"train.steps={steps}",
                                                 "checkpoint.save_steps=1", *overrides])
    trainer = Trainer(cfg)
    return trainer, [r["loss"] for r in trainer.train()]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """An uninterrupted 4-step run saving every step: (its checkpoints directory, its losses)."""
    root = tmp_path_factory.mktemp("four")
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
    from multiprocess import run_distributed

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


def test_a_checkpoint_written_before_checksums_still_loads(tmp_path, four_steps, capsys):
    run = tmp_path / "run"
    shutil.copytree(four_steps[0], run / "checkpoints")
    for path in (run / "checkpoints").glob("step_*"):  # as format 1 wrote it: sizes only
        meta = json.loads((path / "paratrain.json").read_text())
        meta.pop("checksum")
        meta.update(format=1, files={name: entry["bytes"] for name, entry in meta["files"].items()})
        (path / "paratrain.json").write_text(json.dumps(meta))
    assert cli.main(["checkpoint", "verify", str(run / "checkpoints" / "step_00000004")]) == 0
    assert "sizes only" in capsys.readouterr().out
    trainer, losses = trained(run, 5)
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
