"""Mixture of experts: the block against a per-token reference, its config and validation, expert parallelism
against one process (forked gloo workers), checkpoints across expert layouts."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from paratrain.modules.moe import MoE, expert_capacity


def naive_moe(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Token by token: route, count each expert's slots within the group, add each kept choice's FFN output."""
    hidden = x.shape[-1]
    tokens = x.reshape(-1, hidden)
    size = moe.group_size or tokens.shape[0]
    e, k = moe.expert_num, moe.k
    capacity = math.ceil(moe.capacity_factor * size * k / e)
    out = torch.zeros_like(tokens)
    aux, dropped = 0.0, 0
    w1, b1, w2, b2 = moe.experts.w1, moe.experts.b1, moe.experts.w2, moe.experts.b2
    groups = tokens.shape[0] // size
    for g in range(groups):
        rows = tokens[g * size:(g + 1) * size]
        probs = torch.softmax(rows @ moe.router.weight.T, -1)
        top_p, top_e = probs.topk(k, -1)
        gates = top_p / top_p.sum(-1, keepdim=True) if k > 1 else top_p
        used = [0] * e
        for choice in range(k):
            for t in range(size):
                expert = int(top_e[t, choice])
                if used[expert] >= capacity:
                    dropped += 1
                    continue
                used[expert] += 1
                h = moe.experts.activation(rows[t] @ w1[expert] + b1[expert])
                out[g * size + t] += gates[t, choice] * (h @ w2[expert] + b2[expert])
        first = torch.zeros(e)
        for t in range(size):
            first[int(top_e[t, 0])] += 1 / size
        aux = aux + moe.aux_loss_factor * e * (first * probs.mean(0)).sum() / groups
    return out.reshape(x.shape), aux, dropped / (tokens.shape[0] * k)


@pytest.mark.parametrize("k,capacity_factor,group_size", [(1, 1.0, None), (2, 1.0, 6), (2, 4.0, None),
                                                          (3, 0.5, 4)])
def test_block_matches_per_token_reference(k, capacity_factor, group_size):
    torch.manual_seed(0)
    moe = MoE(8, 16, expert_num=4, activation=nn.GELU(), num_experts_chosen=k, capacity_factor=capacity_factor,
              aux_loss_factor=0.1, group_size=group_size)
    x = torch.randn(2, 6, 8, requires_grad=True)
    out, aux = moe(x)
    ref, ref_aux, ref_dropped = naive_moe(moe, x)
    assert out.shape == x.shape and aux.shape == ()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux, torch.as_tensor(ref_aux, dtype=aux.dtype), atol=1e-6, rtol=1e-5)
    assert moe.dropped.item() == pytest.approx(ref_dropped)
    if capacity_factor < 1:
        assert ref_dropped > 0
    grads = torch.autograd.grad((out ** 2).sum() + aux, [x, *moe.parameters()])
    ref_grads = torch.autograd.grad((ref ** 2).sum() + ref_aux, [x, *moe.parameters()])
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_capacity_is_mindspores():
    assert expert_capacity(tokens=64, expert_num=8, num_experts_chosen=2, capacity_factor=1.1) == 18
    assert expert_capacity(tokens=5, expert_num=8, num_experts_chosen=1, capacity_factor=1.0) == 1
