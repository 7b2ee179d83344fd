"""Activation recompute: same gradients as without it (dropout included), fewer kept bytes, the
right ops kept and redone, and selective recompute under tensor, sequence, data and pipeline parallelism."""
import functools
from collections import Counter
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from conftest import tiny_config
from forked_ranks import run_distributed
from paratrain.config import ParallelConfig
from paratrain.models import build_model, token_loss_sum
from paratrain.parallel import recompute
from paratrain.parallel.recompute import apply_recompute
from test_plan import saved_bytes

aten = torch.ops.aten
GPT = {"kind": "gpt"}


def batch(cfg, seed=0):
    """Model inputs and labels of 4 sequences, a few pad tokens (0) in the last one."""
    g = torch.Generator().manual_seed(seed)
    m = cfg.model
    lengths = (m.seq_length,) if m.kind == "gpt" else (m.src_seq_length, m.tgt_seq_length)
    names = ("input_ids",) if m.kind == "gpt" else ("src_ids", "tgt_in_ids")
    inputs = {n: torch.randint(1, m.vocab_size, (4, s), generator=g) for n, s in zip(names, lengths)}
    for ids in inputs.values():
        ids[-1, -3:] = 0
    return inputs, torch.randint(1, m.vocab_size, (4, lengths[-1]), generator=g)


def loss_and_grads(cfg, mode, dropout_seed=1):
    """Loss and parameter gradients of one forward + backward under ``mode``."""
    torch.manual_seed(0)
    model = apply_recompute(build_model(cfg.model), ParallelConfig(recompute=mode)).train()
    inputs, labels = batch(cfg)
    torch.manual_seed(dropout_seed)
    loss = token_loss_sum(model(**inputs), labels, 0)
    loss.backward()
    grads = {name.replace("._checkpoint_wrapped_module", ""): p.grad for name, p in model.named_parameters()}
    return loss.item(), grads


@pytest.mark.parametrize("kind", ["gpt", "transformer"])
@pytest.mark.parametrize("attention_dropout", [0.0, 0.1])  # 0.1: SDPA's math path on CPU (bmm, softmax, dropout)
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_gradients_equal_without_recompute_with_dropout(kind, attention_dropout, mode):
    cfg = tiny_config(model={"kind": kind, "hidden_dropout": 0.1, "attention_dropout": attention_dropout})
    want_loss, want = loss_and_grads(cfg, "none")
    got_loss, got = loss_and_grads(cfg, mode)
    assert got_loss == want_loss
    assert got.keys() == want.keys()
    for name, grad in got.items():
        assert torch.allclose(grad, want[name], rtol=0, atol=1e-6), name
    # other dropout masks give another loss: the recompute redrew the forward's masks
    assert loss_and_grads(cfg, "none", dropout_seed=2)[0] != want_loss


def layer_bytes(mode):
    cfg = tiny_config(model={"kind": "gpt", "decoder_layers": 1})
    inputs, labels = batch(cfg)
    loss, kept = saved_bytes(lambda: apply_recompute(build_model(cfg.model), ParallelConfig(recompute=mode)),
                             lambda model: token_loss_sum(model(**inputs), labels, 0))
    loss.backward()
    return kept


def test_selective_keeps_fewer_bytes_than_none_and_more_than_full():
    none, selective, full = layer_bytes("none"), layer_bytes("selective"), layer_bytes("full")
    assert full < selective < none, (full, selective, none)


class OpCounter(TorchDispatchMode):
    """Counts the ops that run while it is active."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def policy_decisions_and_backward_ops(mode, layers=2):
    """Ops selective recompute's policy kept and redid in forward, and the ops that ran in backward."""
    cfg = tiny_config(model={"kind": "gpt", "decoder_layers": layers})
    decisions = {CheckpointPolicy.MUST_SAVE: Counter(), CheckpointPolicy.PREFER_RECOMPUTE: Counter()}
    original = recompute.selective_policy

    def policy(ctx, func, *args, **kwargs):
        decision = original(ctx, func, *args, **kwargs)
        if not ctx.is_recompute:  # torch 2.11 asks again while recomputing in backward
            decisions[decision][func] += 1
        return decision

    with mock.patch.object(recompute, "selective_policy", policy):
        model = apply_recompute(build_model(cfg.model), ParallelConfig(recompute=mode))
    inputs, labels = batch(cfg)
    loss = token_loss_sum(model(**inputs), labels, 0)
    with OpCounter() as backward:
        loss.backward()
    return decisions[CheckpointPolicy.MUST_SAVE], decisions[CheckpointPolicy.PREFER_RECOMPUTE], backward.counts


def test_selective_keeps_matmul_and_attention_outputs_and_redoes_norms_and_gelu():
    attention = aten._scaled_dot_product_flash_attention_for_cpu.default
    saved, redone, backward = policy_decisions_and_backward_ops("selective")
    # per layer: q, k, v, out_proj, fc1, fc2 and one attention kernel
    assert saved == {aten.addmm.default: 2 * 6, attention: 2}
    assert redone[aten.native_layer_norm.default] == 2 * 2 and redone[aten.gelu.default] == 2
    # backward runs the kept ops' backward only, and the redone ops again (the head's norm is outside the layers)
    assert backward[aten.addmm.default] == 0 and backward[attention] == 0
    assert backward[aten.native_layer_norm.default] == 2 * 2 and backward[aten.gelu.default] == 2
    _, _, full_backward = policy_decisions_and_backward_ops("full")
    # full redoes the matmuls too, up to the last tensor backward needs (fc2's input: fc2 itself is not redone)
    assert full_backward[aten.addmm.default] == 2 * 5 and full_backward[attention] == 2
    _, _, none_backward = policy_decisions_and_backward_ops("none")
    assert none_backward[aten.native_layer_norm.default] == 0


def test_attention_kernels_with_dropout_are_recomputed():
    """A kept kernel that drew random numbers would be skipped in the recompute, which replays the
    random stream from the layer's start: every dropout mask after it would change."""
    q = torch.zeros(1, 1, 2, 4)
    policy = functools.partial(recompute.selective_policy, None)
    flash = aten._scaled_dot_product_flash_attention.default
    efficient = aten._scaled_dot_product_efficient_attention.default
    assert policy(flash, q, q, q, 0.0) == CheckpointPolicy.MUST_SAVE
    assert policy(flash, q, q, q, 0.1) == CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(efficient, q, q, q, None, True) == CheckpointPolicy.MUST_SAVE
    assert policy(efficient, q, q, q, None, True, dropout_p=0.1) == CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(aten.mm.default, q, q) == CheckpointPolicy.MUST_SAVE


# --- with the other parallel dimensions (forked gloo workers, like tests/test_parallel.py) -------

STEPS = 4
LAYOUTS = {  # name: (world size, parallel section, model section); compared with one process, dropout 0
    "mp2_selective": (2, {"mp": 2, "recompute": "selective"}, {}),
    "gpt_mp2_sp_selective": (2, {"mp": 2, "sequence_parallel": True, "recompute": "selective"}, GPT),
    "pp2_1f1b_selective_per_layer": (2, {"pp": 2, "micro_batch_num": 2, "recompute": ["selective", "none", "full",
                                                                                       "selective"]}, {}),
    "gpt_dp2_mp2_zero3_sp_selective": (4, {"dp": 2, "mp": 2, "zero_stage": 3, "sequence_parallel": True,
                                           "recompute": "selective"}, GPT),
}
DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
SAME_LAYOUT_WITH_DROPOUT = {  # compared with each other: the recompute redraws the masks on sharded activations
    mode: (2, {"mp": 2, "sequence_parallel": True, "recompute": mode}, {**GPT, **DROPOUT})
    for mode in ("none", "selective")}


def config(tmp_dir, parallel, model):
    return tiny_config(run={"dir": str(tmp_dir)}, parallel=parallel, model=model, train={"steps": STEPS})


def train_losses(configs):
    from paratrain.trainer import Trainer

    return {name: [(r["loss"], r["grad_norm"]) for r in Trainer(cfg).train()] for name, cfg in configs.items()}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_selective_composes_with_parallel_layouts(world, tmp_path):
    layouts = {name: spec for name, spec in {**LAYOUTS, **SAME_LAYOUT_WITH_DROPOUT}.items() if spec[0] == world}
    configs = {name: config(tmp_path / name, parallel, model) for name, (_, parallel, model) in layouts.items()}
    got = run_distributed(train_losses, world, configs, timeout=540)[0]
    for name, (_, _, model) in layouts.items():
        if name in SAME_LAYOUT_WITH_DROPOUT:
            continue
        want = train_losses({name: config(tmp_path / f"{name}_reference", {}, model)})[name]
        for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got[name], want), 1):
            assert loss == pytest.approx(want_loss, rel=1e-4), f"{name}: loss at step {step}"
            assert norm == pytest.approx(want_norm, rel=1e-4), f"{name}: grad norm at step {step}"
    if world == 2:
        flat = {mode: [value for step in got[mode] for value in step] for mode in SAME_LAYOUT_WITH_DROPOUT}
        assert flat["selective"] == pytest.approx(flat["none"], rel=1e-6)
