"""Context parallelism (``parallel.context_parallel``): the load-balanced sequence split, Ulysses attention, and
the losses of gpt and llama on cp 2 and 4 (Ulysses and ring attention), alone and with tensor (and sequence), data
(ZeRO 1 and 3) and pipeline parallelism, on packed documents, their held-out loss, and across checkpoints saved
under one cp size and resumed under another, each against one process in the same test; the layouts refused before
any process starts; and the planner's view of it."""
from __future__ import annotations

import json

import pytest
import torch

from forked_ranks import run_distributed
from paratrain import config_file
from paratrain.config import ConfigError
from paratrain.config_rules import validate
from paratrain.modules.transformer import DocumentMask
from paratrain.parallel.context import local_positions, ulysses_attention

CPU = torch.device("cpu")

VOCAB, SEQ, STEPS = 64, 16, 4
GPT = {"kind": "gpt", "num_kv_heads": 0}


def config(tmp_path, name: str, parallel: dict, model: dict | None = None, data: dict | None = None,
           checkpoint: dict | None = None, steps: int = STEPS, eval_steps: int = 0):
    """A tiny decoder (fp32, no dropout) training ``steps`` steps of 4 sequences of ``SEQ`` tokens, its held-out loss
    measured every ``eval_steps`` (0: never)."""
    return config_file.from_dict({
        "run": {"dir": str(tmp_path / name)}, "parallel": parallel, "metrics": {"log_steps": 1},
        "model": {"kind": "llama", "vocab_size": VOCAB, "hidden_size": 32, "num_heads": 8, "num_kv_heads": 4,
                  "ffn_hidden_size": 48, "decoder_layers": 2, "seq_length": SEQ, "hidden_dropout": 0.0,
                  "attention_dropout": 0.0, **(model or {})},
        "data": data or {"kind": "synthetic"},
        "checkpoint": checkpoint or {"dir": str(tmp_path / name / "ckpt")},
        "train": {"steps": steps, "global_batch_size": 4, "lr": 1e-2, "warmup_steps": 0, "eval_steps": eval_steps}})


def trainer_losses(cfg) -> list[float]:
    """The step losses, then the held-out losses (``train.eval_steps``)."""
    from paratrain.trainer import Trainer

    records = Trainer(cfg).train()
    return [r["loss"] for r in records] + [r["eval_loss"] for r in records if "eval_loss" in r]


def each_losses(cfgs: list) -> list[list[float]]:
    """The losses of each config trained in turn in this process group."""
    return [trainer_losses(cfg) for cfg in cfgs]


def assert_same(got: list[float], want: list[float], layout: dict | None = None) -> None:
    assert len(got) == len(want) and max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-4, (layout, got, want)


def problems(tmp_path, parallel: dict, model: dict | None = None, world_size: int | None = None) -> str:
    """Every rule ``config`` with these settings breaks, one a line ("" when none)."""
    try:
        return "\n".join(validate(config(tmp_path, "x", parallel, model), world_size))
    except ConfigError as exc:
        return str(exc)


@pytest.mark.timeout(60)
def test_each_rank_keeps_a_head_and_a_tail_chunk():
    for n in (1, 2, 4):
        kept = [local_positions(SEQ, n, r, CPU) for r in range(n)]
        assert torch.equal(torch.cat(kept).sort().values, torch.arange(SEQ))  # every token on one rank
        chunk = SEQ // (2 * n)
        for r, positions in enumerate(kept):
            assert positions.tolist() == [*range(r * chunk, (r + 1) * chunk),
                                          *range((2 * n - 1 - r) * chunk, (2 * n - r) * chunk)]


@pytest.mark.timeout(60)
def test_layouts_that_cannot_split_the_sequence_are_refused(tmp_path):
    said = problems(tmp_path, {"context_parallel": 2}, {"seq_length": 18}, world_size=2)
    assert "model.seq_length=18 is not divisible by 2 x parallel.context_parallel=2 = 4" in said
    assert "use seq_length=20" in said
    said = problems(tmp_path, {"cp": 4, "cp_method": "ulysses"}, {"num_heads": 4, "num_kv_heads": 2})
    assert "2 a rank, not both divisible by 4: use context_parallel in [2]" in said
    said = problems(tmp_path, {"cp": 2, "model_parallel": 2}, {"num_heads": 8, "num_kv_heads": 2,
                                                               "attention_dropout": 0.1})
    assert "parallel.cp_method='auto' picks ring attention here (4 query and 1 key/value heads a rank are not both " \
           "divisible by parallel.context_parallel=2): ring attention has no attention dropout" in said
    assert problems(tmp_path, {"cp": 2, "model_parallel": 2}, {"num_heads": 8, "num_kv_heads": 2}, 4) == ""
    said = problems(tmp_path, {"cp": 2, "sequence_parallel": True, "model_parallel": 2}, GPT)
    assert "sequence_parallel=true and model.kind='gpt': the learned positions" in said
    said = problems(tmp_path, {"cp": 2, "sequence_parallel": True, "model_parallel": 4}, {"seq_length": 12})
    assert "model.seq_length=12 over parallel.context_parallel=2 leaves 6 tokens a rank, not divisible by " \
           "parallel.model_parallel=4 with sequence_parallel=true: use a seq_length multiple of 8" in said
    said = problems(tmp_path, {"cp": 2}, {"kind": "transformer", "src_seq_length": 16, "tgt_seq_length": 16,
                                          "num_kv_heads": 0, "encoder_layers": 1})
    assert "the encoder-decoder is not split along the sequence (its cross-attention" in said
    said = problems(tmp_path, {"cp": 2, "data_parallel": 2}, world_size=2)
    assert "data_parallel=2 x context_parallel=2 x model_parallel=1 x pipeline_stage=1 = 4 does not equal the " \
           "world size 2" in said
    said = problems(tmp_path, {"cp": 2}, {**GPT, "moe": {"expert_num": 2}})
    assert "parallel.context_parallel=2 with model.moe (expert_num=2) is not supported yet" in said
    assert problems(tmp_path, {"cp": 2}, world_size=2) == ""


@pytest.mark.timeout(60)
def test_a_users_net_is_refused(tmp_path):
    from paratrain.config import ParallelConfig
    from paratrain.errors import UserError
    from paratrain.mesh import Layout
    from paratrain.parallel.user import place_net

    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    config = ParallelConfig(context_parallel=2)
    with pytest.raises(UserError, match="context_parallel=2 on a user's net is not offered: its attention is not"):
        place_net(net, config, Layout(config), (torch.zeros(2, 4, device="cpu"),))


@pytest.mark.timeout(150)
def test_ulysses_attention_equals_whole_sequence_attention():
    """Forward and backward of q, k, v on 2 ranks (grouped-query heads, with and without a document mask) against
    SDPA over the whole sequence in one process."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, SEQ, 8), torch.randn(2, 2, SEQ, 8), torch.randn(2, 2, SEQ, 8)
    documents = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
    want = {}
    for masked in (False, True):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        mask = {"attn_mask": DocumentMask(documents).mask} if masked else {"is_causal": True}
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, enable_gqa=True, **mask)
        (out * out).sum().backward()
        want[masked] = (out, *[x.grad for x in leaves])
    results = run_distributed(_ulysses_rank, 2, q, k, v, documents, timeout=120)
    for masked in (False, True):
        for parts, whole in zip(zip(*[r[masked] for r in results]), want[masked]):  # output, then q, k, v grads
            joined = torch.empty_like(whole)
            for rank, part in enumerate(parts):
                joined[:, :, local_positions(SEQ, 2, rank, CPU)] = torch.from_numpy(part)
            torch.testing.assert_close(joined, whole, rtol=1e-5, atol=1e-6)


def _ulysses_rank(q, k, v, documents):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    keep = local_positions(SEQ, 2, dist.get_rank(), CPU)
    out = {}
    for masked in (False, True):
        leaves = [x[:, :, keep].clone().requires_grad_() for x in (q, k, v)]
        got = ulysses_attention(*leaves, group=dist.group.WORLD, document_ids=documents[:, keep] if masked else None)
        (got * got).sum().backward()  # the whole sequence's sum of squares: each rank adds its tokens'
        out[masked] = [x.numpy() for x in (got.detach(), *[x.grad for x in leaves])]  # by value through the queue
    return out


def packed_corpus(folder) -> dict:
    """``data`` of a jsonl of 40 documents of 2-14 words each and a tokenizer of one token a word, packed with their
    own masks (``data.document_mask``)."""
    from test_data_documents import VOCAB as WORDS, word_tokenizer

    rng = torch.Generator().manual_seed(0)
    folder.mkdir()
    lines = []
    for _ in range(40):
        words = torch.randint(4, WORDS, (int(torch.randint(2, 15, (1,), generator=rng)),), generator=rng)
        lines.append(json.dumps({"text": " ".join(f"w{w}" for w in words.tolist())}) + "\n")
    (folder / "docs.jsonl").write_text("".join(lines))
    word_tokenizer(folder / "tokenizer.json")
    return {"kind": "documents", "path": str(folder / "docs.jsonl"), "document_mask": True,
            "tokenizer": str(folder / "tokenizer.json")}


@pytest.mark.timeout(300)
def test_cp2_equals_one_process_for_gpt_llama_packed_documents_and_resumes_across_cp_sizes(tmp_path):
    """One launch of 2 ranks: llama (saving a checkpoint at step 2, and its held-out loss), gpt, llama on packed
    documents with their masks (Ulysses and ring attention), and llama resumed from the one-process run's step 2;
    then one process resumes the cp2 run's step 2."""
    saving = {"save_steps": 2, "keep_max": 0}
    documents = packed_corpus(tmp_path / "corpus")
    want = {"llama": trainer_losses(config(tmp_path, "one", {}, checkpoint={**saving, "dir": str(tmp_path / "one")},
                                           eval_steps=2)),
            "gpt": trainer_losses(config(tmp_path, "gpt1", {}, GPT)),
            "documents": trainer_losses(config(tmp_path, "documents1", {}, data=documents))}
    split = [config(tmp_path, "llama2", {"cp": 2}, checkpoint={**saving, "dir": str(tmp_path / "two")}, eval_steps=2),
             config(tmp_path, "gpt2", {"cp": 2}, GPT),
             config(tmp_path, "documents2", {"cp": 2}, data=documents),
             config(tmp_path, "documents_ring2", {"cp": 2, "cp_method": "ring"}, data=documents),
             config(tmp_path, "resumed2", {"cp": 2}, checkpoint={"resume": str(tmp_path / "one" / "step_00000002")})]
    got = run_distributed(each_losses, 2, split, timeout=280)[0]
    assert_same(got[0], want["llama"])
    assert_same(got[1], want["gpt"])
    assert_same(got[2], want["documents"])
    assert_same(got[3], want["documents"])
    assert_same(got[4], want["llama"][2:STEPS])
    resumed = trainer_losses(config(tmp_path, "resumed1", {},
                                    checkpoint={"resume": str(tmp_path / "two" / "step_00000002")}))
    assert_same(resumed, want["llama"][2:STEPS])


@pytest.mark.timeout(300)
def test_llama_on_cp4_and_cp2_with_tp2_sequence_parallel_dp2_zero_and_pp2_equals_one_process(tmp_path):
    """Ulysses, and ring attention on cp4 (the query heads 8 and key/value heads 4 of ``config``)."""
    want = trainer_losses(config(tmp_path, "one", {}))
    layouts = [{"cp": 4}, {"cp": 4, "cp_method": "ring"}, {"cp": 2, "model_parallel": 2},
               {"cp": 2, "model_parallel": 2, "sequence_parallel": True, "vocab_emb_dp": False},
               {"cp": 2, "data_parallel": 2, "zero_stage": 3}, {"cp": 2, "data_parallel": 2, "zero_stage": 1},
               {"cp": 2, "pipeline_stage": 2, "micro_batch_num": 2, "pipeline_schedule": "gpipe"}]
    got = run_distributed(each_losses, 4, [config(tmp_path, f"layout{i}", layout)
                                           for i, layout in enumerate(layouts)], timeout=280)[0]
    for layout, losses in zip(layouts, got):
        assert_same(losses, want, layout)


@pytest.mark.timeout(120)
def test_the_planner_divides_activations_by_cp_and_proposes_it_for_long_sequences():
    import dataclasses

    from paratrain.plan.cost import Hardware
    from paratrain.plan.search import evaluate, search

    cfg = config_file.from_dict({
        "model": {"kind": "llama", "vocab_size": 32000, "hidden_size": 2048, "num_heads": 16, "num_kv_heads": 8,
                  "ffn_hidden_size": 5632, "decoder_layers": 16, "seq_length": 32768},
        "train": {"global_batch_size": 8, "mixed_precision": "bf16"}})

    def hardware(devices: int, gib: int) -> Hardware:
        return Hardware(devices, 8, gib * 2 ** 30, 312e12, 200e9, 25e9, 0.5)

    rows = {cp: evaluate(cfg, dataclasses.replace(cfg.parallel, data_parallel=1, context_parallel=cp), hardware(cp, 80))
            for cp in (1, 2, 4)}
    for cp in (2, 4):
        assert rows[cp]["breakdown"]["activations"] == pytest.approx(rows[1]["breakdown"]["activations"] / cp)
        assert rows[cp]["breakdown"]["cp_comm_s"] > 0 == rows[1]["breakdown"]["cp_comm_s"]
    roomy, tight = (search(cfg, hardware(8, gib)) for gib in (80, 16))
    assert roomy[0]["context_parallel"] == 1  # the sequence fits whole: its all-to-alls would only cost time
    assert tight[0]["feasible"] and tight[0]["context_parallel"] > 1
    short = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, seq_length=1024))
    assert {r["context_parallel"] for r in search(short, hardware(8, 16))} == {1}
