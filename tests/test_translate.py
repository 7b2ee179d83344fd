"""paratrain translate on a checkpoint, BLEU at train.eval_steps, and refusals (issue 6 item 5)."""
import json

import pytest

from conftest import tiny_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny encoder-decoder trained 5 steps on a tiny generated corpus: BLEU every 2 steps, log every 3,
    checkpoints at step 4 and at the last step, 5."""
    from paratrain.data.sample_corpus import write_sample
    from paratrain.data.tokenizer import train_tokenizer
    from paratrain.trainer import Trainer

    root = tmp_path_factory.mktemp("translate")
    files = write_sample(root / "data", train=48, heldout=6, doc_size=16)
    tokenizer = train_tokenizer([files["train"]["en_fr"]], 300, root / "data" / "tokenizer.json")
    cfg = tiny_config(run={"dir": str(root / "run")},
                      model={"vocab_size": tokenizer.vocab_size, "src_seq_length": 24, "tgt_seq_length": 24},
                      train={"steps": 5, "eval_steps": 2},
                      data={"kind": "translation", "path": str(files["train"]["en_fr"]),
                            "eval_path": str(files["test"]["en_fr"]), "tokenizer": str(root / "data" / "tokenizer.json"),
                            "eval_samples": 4, "too_long": "truncate"},
                      metrics={"log_steps": 3, "progress": False},
                      checkpoint={"save_steps": 4})
    history = Trainer(cfg).train()
    return {"root": root, "run": root / "run", "history": history, "files": files}


def test_bleu_logged_at_eval_steps_only(trained, capsys):
    records = [json.loads(line) for line in (trained["run"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3, 4, 5]  # eval steps 2, 4 logged besides log_steps=3 and the last
    assert [r["step"] for r in records if "bleu" in r] == [2, 4]
    assert all(0 <= r["bleu"] <= 100 for r in records if "bleu" in r)
    assert [r["step"] for r in trained["history"] if "bleu" in r] == [2, 4]


def test_translate_cli_writes_one_line_per_input_line(trained, tmp_path, capsys):
    from paratrain.cli import main
    from paratrain.data.wmt14 import read_pairs

    sources = [s for s, _ in read_pairs(trained["files"]["test"]["en_fr"])][:3]
    src = tmp_path / "in.en"
    src.write_text(sources[0] + "\n\n" + "\n".join(sources[1:]) + "\n", encoding="utf-8")
    out = tmp_path / "out.fr"
    assert main(["translate", "--checkpoint", str(trained["run"]), "--input", str(src), "--output", str(out)]) == 0
    lines = out.read_text(encoding="utf-8").split("\n")
    assert lines[-1] == "" and len(lines[:-1]) == 4 and lines[1] == ""
    checkpoint = trained["run"] / "checkpoints" / "step_00000005"
    assert main(["translate", "--checkpoint", str(checkpoint), "--input", str(src)]) == 0
    # the newest checkpoint is step 5: the last step is always saved
    assert capsys.readouterr().out == out.read_text(encoding="utf-8")


def test_translate_refuses_missing_checkpoint_and_tokenizer(trained, tmp_path, capsys):
    from paratrain.cli import main

    src = tmp_path / "in.en"
    src.write_text("the cat eats\n")
    assert main(["translate", "--checkpoint", str(tmp_path / "nowhere"), "--input", str(src)]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    assert main(["translate", "--checkpoint", str(trained["run"]), "--input", str(src),
                 "--data.tokenizer", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "missing.json not found" in err and "Traceback" not in err


def test_translate_refuses_gpt_checkpoint(tmp_path, capsys):
    from paratrain.cli import main
    from paratrain.trainer import Trainer

    cfg = tiny_config(run={"dir": str(tmp_path / "gpt")}, model={"kind": "gpt"}, train={"steps": 1},
                      metrics={"progress": False}, checkpoint={"save_steps": 1})
    Trainer(cfg).train()
    src = tmp_path / "in.en"
    src.write_text("the cat eats\n")
    assert main(["translate", "--checkpoint", str(tmp_path / "gpt"), "--input", str(src)]) == 2
    err = capsys.readouterr().err
    assert "holds a 'gpt' model" in err and "encoder-decoder" in err and "Traceback" not in err


def test_eval_steps_without_translation_data_warns_once(tmp_path):
    from paratrain.trainer import Trainer

    cfg = tiny_config(run={"dir": str(tmp_path / "syn")}, train={"steps": 2, "eval_steps": 1},
                      metrics={"progress": False})
    with pytest.warns(UserWarning, match="BLEU needs the encoder-decoder on a translation dataset") as caught:
        history = Trainer(cfg).train()
    assert len([w for w in caught if "BLEU" in str(w.message)]) == 1
    assert not any("bleu" in r for r in history)
