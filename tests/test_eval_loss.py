"""A decoder's held-out loss every train.eval_steps: equal to the loss of the model's weights on the held-out windows,
the same on dp2, tp2 and pp2 as on one process, training unchanged by it, in metrics.jsonl, on the console line and
in TensorBoard at the evaluated steps only; bad eval settings refused before start."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from forked_ranks import run_distributed
from test_data_documents import VOCAB, corpus, word_tokenizer  # noqa: F401  (corpus: the training documents)
from paratrain import config_file, preflight
from paratrain.config import ConfigError
from paratrain.data import DataError
from paratrain.data.loader import HeldOutBatches, build_dataset
from paratrain.data.synthetic import EOS

SEQ, BATCH, EVAL_BATCHES = 8, 4, 2


def held_out_lines(seed: int, lines: int) -> list[list[int]]:
    """Token ids of held-out lines (documents) of 3-12 words, more than EVAL_BATCHES global batches of windows."""
    rng = np.random.default_rng(seed)
    return [list(rng.integers(4, VOCAB, int(rng.integers(3, 13)))) for _ in range(lines)]


def words(ids: list[int]) -> str:
    return " ".join(f"w{t}" for t in ids)


def train(cfg) -> list[dict]:
    from paratrain.trainer import Trainer

    return Trainer(cfg).train()


def gpt_config(tmp_path, name: str, eval_steps: int):
    return config_file.from_dict({
        "run": {"dir": str(tmp_path / name)},
        "model": {"kind": "gpt", "vocab_size": VOCAB, "hidden_size": 32, "num_heads": 4, "ffn_hidden_size": 48,
                  "decoder_layers": 2, "seq_length": SEQ, "hidden_dropout": 0.1, "attention_dropout": 0.1},
        "data": {"kind": "text", "path": str(tmp_path / "train.txt"), "eval_path": str(tmp_path / "eval.txt"),
                 "tokenizer": str(tmp_path / "tokenizer.json"), "eval_batches": EVAL_BATCHES},
        "train": {"steps": 4, "global_batch_size": BATCH, "lr": 1e-2, "warmup_steps": 0, "eval_steps": eval_steps},
        "metrics": {"log_steps": 3, "tensorboard": True, "progress": False}})


@pytest.mark.timeout(120)
def test_held_out_loss_is_the_weights_loss_on_the_windows_and_leaves_training_alone(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from paratrain.trainer import Trainer

    word_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "train.txt").write_text("".join(words(line) + "\n" for line in held_out_lines(1, 20)))
    lines = held_out_lines(2, 30)
    (tmp_path / "eval.txt").write_text("".join(words(line) + "\n" for line in lines))

    trainer = Trainer(gpt_config(tmp_path, "eval", eval_steps=2))
    history = trainer.train()
    console = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    without = train(gpt_config(tmp_path, "plain", eval_steps=0))
    # dropout 0.1: evaluation in train mode, or drawing random numbers, would change the later steps' losses
    assert [r["loss"] for r in history] == [r["loss"] for r in without]

    # the last step's held-out loss from the final weights: the lines' ids with EOS after each, cut into windows
    # of SEQ + 1 tokens that share one token, the first EVAL_BATCHES global batches, the token mean of them all
    stream = torch.tensor([t for line in lines for t in [*line, EOS]], dtype=torch.long, device="cpu")
    windows = torch.stack([stream[i * SEQ: i * SEQ + SEQ + 1] for i in range(EVAL_BATCHES * BATCH)])
    assert len(stream) > (EVAL_BATCHES * BATCH + 1) * SEQ + 1  # the file holds more: only the first batches count
    model = trainer.model.eval()
    with torch.no_grad():
        logits = model(windows[:, :-1])
    want = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
    assert history[-1]["eval_loss"] == pytest.approx(want, rel=1e-5)

    logged = [json.loads(line) for line in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [2, 3, 4]  # log_steps=3: step 2 is logged for its evaluation
    assert [r["step"] for r in logged if "eval_loss" in r] == [2, 4]
    assert all(r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"])) for r in logged if "eval_loss" in r)
    assert logged[0]["eval_loss"] != logged[2]["eval_loss"]  # measured again, on weights trained further
    assert [" | eval_loss " in line and " | eval_ppl " in line for line in console] == [True, False, True]
    events = EventAccumulator(str(tmp_path / "eval"))
    events.Reload()
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars("eval_loss")] == \
        [(r["step"], r["eval_loss"]) for r in logged if "eval_loss" in r]


def evaluated_runs(configs: list) -> list[list[dict]]:
    """Each config trained in turn on this rank (one launch for several layouts): the records of every step."""
    return [train(cfg) for cfg in configs]


@pytest.mark.timeout(240)
def test_held_out_loss_on_dp2_tp2_pp2_and_zbv_equals_one_process(corpus, tmp_path):  # noqa: F811
    held_out = tmp_path / "held_out"
    held_out.mkdir()
    (held_out / "a.jsonl").write_text("".join(json.dumps({"text": words(doc)}) + "\n"
                                              for doc in held_out_lines(3, 16)))

    def config(name, layout):
        return config_file.from_dict({
            "run": {"dir": str(tmp_path / name)}, "parallel": layout, "metrics": {"log_steps": 1, "progress": False},
            "model": {"kind": "llama", "vocab_size": VOCAB, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
                      "ffn_hidden_size": 48, "decoder_layers": 4, "seq_length": SEQ, "hidden_dropout": 0.0,
                      "attention_dropout": 0.0},
            "data": {"kind": "documents", "path": str(corpus), "eval_path": str(held_out), "document_mask": True,
                     "tokenizer": str(tmp_path / "tokenizer.json"), "eval_batches": EVAL_BATCHES},
            "train": {"steps": 4, "global_batch_size": BATCH, "lr": 1e-2, "warmup_steps": 0, "eval_steps": 2}})

    want = train(config("one", {}))
    layouts = {"dp2": {"data_parallel": 2}, "tp2": {"model_parallel": 2},
               "pp2": {"pipeline_stage": 2, "micro_batch_num": 2, "pipeline_schedule": "1f1b"},
               # two stages a rank, the second handing gradients to the first on the rank: none in eval
               "pp2 zbv": {"pipeline_stage": 2, "virtual_pipeline_stage": 2, "micro_batch_num": 2,
                           "pipeline_schedule": "zbv_zero_bubble"}}
    runs = run_distributed(evaluated_runs, 2, [config(name, layout) for name, layout in layouts.items()],
                           timeout=220)[0]
    assert [r["step"] for r in want if "eval_loss" in r] == [2, 4]
    for name, got in zip(layouts, runs):
        for key in ("loss", "eval_loss"):
            pairs = [(g[key], w[key]) for g, w in zip(got, want) if key in w]
            assert len(pairs) == (4 if key == "loss" else 2) and all(key in g for g in got if g["step"] % 2 == 0)
            assert max(abs(g - w) / w for g, w in pairs) <= 1e-4, (name, key, pairs)


def refusals(tmp_path, **sections) -> str:
    """What ``paratrain train`` says before any process starts for a gpt config with ``sections``."""
    base = {"run": {"dir": str(tmp_path / "run")}, "model": {"kind": "gpt", "vocab_size": VOCAB, "seq_length": SEQ},
            "train": {"eval_steps": 2}}
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    with pytest.raises(ConfigError) as raised:
        preflight.check(config_file.from_dict(base), 1)
    return str(raised.value)


@pytest.mark.timeout(60)
def test_bad_eval_settings_are_refused_before_start(tmp_path):
    word_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "train.txt").write_text("w4 w5 w6\n")
    text = {"kind": "text", "path": str(tmp_path / "train.txt"), "tokenizer": str(tmp_path / "tokenizer.json")}
    assert "train.eval_steps=2 with data.kind='text' needs held-out data: set data.eval_path" in \
        refusals(tmp_path, data=text)
    missing = refusals(tmp_path, data=text | {"eval_path": str(tmp_path / "nowhere.txt")})
    assert f"data.eval_path={tmp_path / 'nowhere.txt'} does not exist" in missing
    assert "is a directory" in refusals(tmp_path, data=text | {"eval_path": str(tmp_path)})
    (tmp_path / "held_out.csv").write_text("w4 w5\n")
    documents = {"kind": "documents", "path": str(tmp_path / "train.txt"), "tokenizer": text["tokenizer"]}
    wrong_kind = refusals(tmp_path, data=documents | {"eval_path": str(tmp_path / "held_out.csv")})
    assert "data.eval_path=" in wrong_kind and "is a .csv file: give .jsonl / .parquet / .txt documents" in wrong_kind
    assert "synthetic data holds out windows" in refusals(tmp_path, data={"eval_path": str(tmp_path / "train.txt")})
    assert "data.eval_batches=0 must be positive" in refusals(tmp_path, data={"eval_batches": 0})
    resnet = refusals(tmp_path, model={"kind": "resnet"}, data={"kind": "cifar10", "path": str(tmp_path)})
    assert "train.eval_steps=2: model.kind='resnet' has no held-out evaluation" in resnet

    (tmp_path / "short.txt").write_text("w4 w5 w6 w7 w8 w9\n" * 3)  # 21 tokens: 2 windows of SEQ
    cfg = config_file.from_dict({"model": {"kind": "gpt", "vocab_size": VOCAB, "seq_length": SEQ},
                                 "data": text | {"eval_path": str(tmp_path / "short.txt")}})
    with pytest.raises(DataError, match="holds 2 windows of model.seq_length tokens, fewer than train.global_batch"):
        HeldOutBatches(build_dataset(cfg, "eval_path"), 4, EVAL_BATCHES)


@pytest.mark.timeout(30)
def test_synthetic_held_out_windows_are_no_training_step_s_and_split_over_ranks():
    cfg = config_file.from_dict({"model": {"kind": "gpt", "vocab_size": VOCAB, "seq_length": SEQ},
                                 "train": {"eval_steps": 2}})
    source = build_dataset(cfg, "eval_path")
    whole = [batch["input_ids"] for batch in HeldOutBatches(source, BATCH, EVAL_BATCHES)]
    halves = [[batch["input_ids"] for batch in HeldOutBatches(source, BATCH, EVAL_BATCHES, rank, 2)] for rank in (0, 1)]
    assert len(whole) == EVAL_BATCHES
    assert all(torch.equal(torch.cat([halves[0][i], halves[1][i]]), batch) for i, batch in enumerate(whole))
    trained = {tuple(row.tolist()) for step in range(50) for row in source.batch_rows(step, 0, BATCH)["input_ids"]}
    assert not trained & {tuple(row.tolist()) for batch in whole for row in batch}
