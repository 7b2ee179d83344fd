"""What would break on a GPU, caught on the CPU: training with torch's default device set to "meta", so any
tensor paratrain creates without naming its device fails loudly. Each run must give the losses (and BLEU) of
the same run with the normal default device."""
import pytest
import torch

from conftest import tiny_config
from forked_ranks import run_distributed


def _train(cfg):
    from paratrain.trainer import Trainer

    return Trainer(cfg).train()


def _under_meta(cfg):
    torch.set_default_device("meta")
    try:
        return _train(cfg)
    finally:
        torch.set_default_device(None)


def _normal_and_meta(root, parallel, model=None, steps=4, resume_at=None, **sections):
    """(losses of a normal run, losses of the same run under a meta default device); with ``resume_at``
    the meta run is resumed from its own checkpoint of that step and the resumed losses are appended."""
    torch.set_num_threads(1)

    def config(name, **checkpoint):
        return tiny_config(run={"dir": f"{root}/{name}"}, parallel=parallel, model=model or {},
                           train={"steps": steps}, metrics={"progress": False, **sections.get("metrics", {})},
                           checkpoint={"save_steps": resume_at or 0, **checkpoint})

    normal = [r["loss"] for r in _train(config("normal"))]
    meta = [r["loss"] for r in _under_meta(config("meta"))]
    if resume_at:
        resumed = _under_meta(config("resumed", resume=f"{root}/meta/checkpoints/step_{resume_at:08d}"))
        meta += [r["loss"] for r in resumed]
    return normal, meta


def test_one_process_encoder_decoder_with_breakdown_save_and_resume(tmp_path):
    normal, meta = _normal_and_meta(tmp_path, {}, resume_at=2, metrics={"breakdown": True})
    assert meta[:4] == normal and meta[4:] == normal[2:]


@pytest.mark.slow
def test_pipeline_two_stages(tmp_path):
    results = run_distributed(_normal_and_meta, 2, str(tmp_path), {"pp": 2, "micro_batch_num": 2},
                              {"kind": "gpt", "tie_embeddings": True}, timeout=240)
    normal, meta = results[0]
    assert normal == pytest.approx(meta, rel=1e-6)


@pytest.mark.slow
def test_dp2_mp2_zero3_sequence_parallel_save_and_resume(tmp_path):
    parallel = {"dp": 2, "mp": 2, "zero_stage": 3, "sequence_parallel": True}
    results = run_distributed(_normal_and_meta, 4, str(tmp_path), parallel, {"encoder_layers": 1, "decoder_layers": 1},
                              4, 2, timeout=300)
    normal, meta = results[0]
    assert meta[:4] == pytest.approx(normal, rel=1e-6) and meta[4:] == pytest.approx(normal[2:], rel=1e-6)


def test_bleu_evaluation(tmp_path):
    from paratrain.data.sample_corpus import write_sample
    from paratrain.data.tokenizer import train_tokenizer

    files = write_sample(tmp_path / "data", train=32, heldout=4, doc_size=16)
    tokenizer = train_tokenizer([files["train"]["en_fr"]], 300, tmp_path / "data" / "tokenizer.json")

    def config(name):
        return tiny_config(run={"dir": str(tmp_path / name)},
                           model={"vocab_size": tokenizer.vocab_size, "src_seq_length": 24, "tgt_seq_length": 24},
                           train={"steps": 2, "eval_steps": 2},
                           data={"kind": "translation", "path": str(files["train"]["en_fr"]),
                                 "eval_path": str(files["test"]["en_fr"]),
                                 "tokenizer": str(tmp_path / "data" / "tokenizer.json"), "eval_samples": 4,
                                 "too_long": "truncate"},
                           metrics={"progress": False})

    normal, meta = _train(config("normal"))[-1], _under_meta(config("meta"))[-1]
    assert "bleu" in meta and meta["bleu"] == normal["bleu"] and meta["loss"] == normal["loss"]


def test_a_tensor_made_without_a_device_fails_under_meta():
    """The check can fail: a factory without ``device=`` lands on the meta device and cannot be read."""
    torch.set_default_device("meta")
    try:
        with pytest.raises((NotImplementedError, RuntimeError)):
            torch.zeros(3).tolist()
    finally:
        torch.set_default_device(None)
