"""Mixture of experts (MindSpore's ``MoE``, GShard / Switch Transformer): a router sends each token to its
``k`` best of ``E`` expert FFNs, each expert taking at most ``capacity`` tokens of a group.

Shapes: N tokens of hidden size H, cut into G groups of S tokens (``group_size``; one group: all the tokens of
the call); E experts of ffn size F; k experts chosen per token; C = ceil(capacity_factor * S * k / E) slots per
expert and group. Plain single-device modules: expert parallelism (``paratrain.parallel.expert``) hooks the
``Experts`` module from outside, sending its (E, G*C, H) input to the ranks holding the experts.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.errors import UserError


def expert_capacity(tokens: int, expert_num: int, num_experts_chosen: int, capacity_factor: float) -> int:
    """Slots per expert for a group of ``tokens`` tokens, as MindSpore's ``calculate_expert_capacity``."""
    return math.ceil(capacity_factor * tokens * num_experts_chosen / expert_num)


class Experts(nn.Module):
    """``E`` independent FFNs run as batched matmuls: x (E, M, H) -> activation(x w1 + b1) w2 + b2, (E, M, H).

    ``w1`` (E, H, F), ``b1`` (E, F), ``w2`` (E, F, H), ``b2`` (E, H). Under expert or tensor parallelism the
    parameters are DTensors (sharded on E over the expert-parallel ranks, on F over the tensor-parallel ones)
    and so is ``x``: the same forward runs on this rank's experts and slice of F.
    """

    def __init__(self, expert_num: int, hidden_size: int, ffn_hidden_size: int, activation: nn.Module,
                 dropout: float = 0.0, std: float = 0.02, dtype: torch.dtype = torch.float32):
        super().__init__()
        e, h, f = expert_num, hidden_size, ffn_hidden_size
        # on the default device, as torch's own layers make theirs: the meta device under a deferred build
        self.w1 = nn.Parameter(torch.empty(e, h, f, dtype=dtype).normal_(std=std))
        self.b1 = nn.Parameter(torch.zeros(e, f, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(e, f, h, dtype=dtype).normal_(std=std))
        self.b2 = nn.Parameter(torch.zeros(e, h, dtype=dtype))
        self.activation = activation
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.dropout(self.activation(torch.baddbmm(self.b1.unsqueeze(1), x, self.w1)))
        return torch.baddbmm(self.b2.unsqueeze(1), hidden, self.w2)


class MoE(nn.Module):
    """A mixture-of-experts FFN: x (..., H) -> ``(output (..., H), aux_loss ())``, as MindSpore's MoE.

    Each token goes to its ``num_experts_chosen`` (k) most probable experts (softmax of the ``router``'s
    logits, float32), the outputs weighted by those probabilities (renormalised to sum 1 when k > 1).
    Within a group of ``group_size`` tokens (MindSpore's ``expert_group_size``; default: the call's tokens cut
    into ``groups`` groups, MindSpore's data-parallel groups) each expert takes ``capacity`` tokens: first
    choices before second choices, earlier tokens first; a token over capacity gets nothing from that expert
    (with no expert at all, 0: only the residual carries it). ``aux_loss`` is MindSpore's (Switch Transformer's) load-balancing loss,
    ``aux_loss_factor * E * sum_e f_e * P_e`` averaged over the groups: f_e the fraction of tokens whose first
    choice is e, P_e their mean router probability for e. Under ``AuxLossInBackward`` the output carries the
    aux loss into backward itself (the training loss need not add it); ``moe_totals`` reports the mean
    aux loss and fraction of (token, choice) assignments over capacity of the forwards since it last did.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, expert_num: int, activation: nn.Module,
                 num_experts_chosen: int = 1, capacity_factor: float = 1.1, aux_loss_factor: float = 0.05,
                 group_size: int | None = None, groups: int = 1, dropout: float = 0.0,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.expert_num, self.k = expert_num, num_experts_chosen
        self.capacity_factor, self.aux_loss_factor = capacity_factor, aux_loss_factor
        self.group_size, self.groups = group_size, groups
        self.router = nn.Linear(hidden_size, expert_num, bias=False, dtype=dtype)
        nn.init.normal_(self.router.weight, std=0.02)
        self.experts = Experts(expert_num, hidden_size, ffn_hidden_size, activation, dropout, dtype=dtype)
        self.seen = None  # (aux loss, dropped fraction, forwards) summed over the forwards

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, hidden = x.shape, x.shape[-1]
        tokens = x.reshape(-1, hidden)
        size = self.group_size or tokens.shape[0] // self.groups
        if not size or tokens.shape[0] % size:
            raise UserError(f"MoE: {tokens.shape[0]} tokens do not split into groups of {size or 0} "
                            f"(expert_group_size={self.group_size}, {self.groups} data-parallel groups): give a "
                            f"batch whose tokens are a multiple of the group size")
        groups = tokens.reshape(-1, size, hidden)  # (G, S, H)
        slot, gate, aux = self.route(groups)
        e = self.expert_num
        c = expert_capacity(size, e, self.k, self.capacity_factor)
        g = groups.shape[0]
        # every (token, choice) to its slot of (G, E*C + 1): the last slot collects the dropped ones
        chosen = groups.repeat(1, self.k, 1)  # (G, k*S, H), choices in the order of ``route``
        index = slot[..., None].expand(-1, -1, hidden)
        buffer = groups.new_zeros(g, e * c + 1, hidden).scatter(1, index, chosen)
        out = self.experts(buffer[:, :-1].reshape(g, e, c, hidden).transpose(0, 1).reshape(e, g * c, hidden))
        out = out.reshape(e, g, c, hidden).transpose(0, 1).reshape(g, e * c, hidden)
        out = torch.cat([out, out.new_zeros(g, 1, hidden)], dim=1).gather(1, index)  # (G, k*S, H)
        combined = (out.float() * gate[..., None]).reshape(g, self.k, size, hidden).sum(1).to(x.dtype)
        return combined.reshape(shape), aux

    def route(self, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """groups (G, S, H) -> ``(slot (G, k*S), gate (G, k*S), aux_loss ())``, choices ordered first choices of
        every token, then second choices...: ``slot`` e*C + position in expert e, or E*C when over capacity,
        ``gate`` the combine weight (0 when dropped)."""
        g, size, _ = groups.shape
        e, k = self.expert_num, self.k
        capacity = expert_capacity(size, e, k, self.capacity_factor)
        probs = self.router(groups).float().softmax(-1)  # (G, S, E)
        gate, expert = probs.topk(k, dim=-1)  # (G, S, k)
        if k > 1:
            gate = gate / gate.sum(-1, keepdim=True)
        gate, expert = gate.transpose(1, 2).reshape(g, k * size), expert.transpose(1, 2).reshape(g, k * size)
        one_hot = F.one_hot(expert, e)  # (G, k*S, E)
        position = ((one_hot.cumsum(1) - 1) * one_hot).sum(-1)
        kept = position < capacity
        slot = torch.where(kept, expert * capacity + position, e * capacity)
        first = one_hot[:, :size].float().mean(1)  # (G, E): fraction of first choices per expert
        aux = self.aux_loss_factor * e * (first * probs.mean(1)).sum(-1).mean()
        seen = torch.stack([aux.detach(), 1.0 - kept.float().mean(), torch.ones((), device=aux.device)])
        self.seen = seen if self.seen is None else self.seen + seen
        return slot, gate * kept, aux


class AttachAuxLoss(torch.autograd.Function):
    """``output`` unchanged, with a block's load-balancing loss joined to its backward (Megatron-Core's
    ``MoEAuxLossAutoScaler``): backward passes ``output``'s gradient through and gives ``aux_loss`` the gradient
    ``scale``, the factor the step multiplies a micro-batch's loss by. The aux loss of a block on any pipeline
    stage so reaches the gradients without passing through the final loss."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
        ctx.scale, ctx.aux = scale, (aux_loss.dtype, aux_loss.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dtype, device = ctx.aux
        return grad, torch.as_tensor(ctx.scale, dtype=dtype, device=device), None


class AuxLossInBackward:
    """The forward hook a placement puts on every MoE block of ``modules``: while ``scale`` is set (``during``: a
    training step's forwards), each block's output carries its aux loss into backward with the gradient ``scale``
    (``AttachAuxLoss``); otherwise the outputs are left as they are."""

    def __init__(self, modules: list[nn.Module]):
        self.scale: torch.Tensor | float | None = None
        for block in (m for module in modules for m in module.modules() if isinstance(m, MoE)):
            block.register_forward_hook(self)

    def __call__(self, block: nn.Module, args, output: tuple[torch.Tensor, torch.Tensor]):
        if self.scale is None:
            return None
        combined, aux = output
        return AttachAuxLoss.apply(combined, aux, self.scale), aux

    @contextlib.contextmanager
    def during(self, scale: torch.Tensor | float):
        """Within it the blocks' aux losses join backward with the gradient ``scale``: a training step sets it once,
        for all the blocks and micro-batches."""
        self.scale = scale
        try:
            yield
        finally:
            self.scale = None


def moe_totals(model: nn.Module) -> torch.Tensor | None:
    """(aux loss summed over the blocks, dropped fraction summed over the blocks, blocks) of ``model``'s MoE
    blocks, the aux and dropped each the mean over the forwards since the last call (micro-batches; a device
    tensor); None without any that ran."""
    blocks = [m for m in model.modules() if isinstance(m, MoE) and m.seen is not None]
    if not blocks:
        return None
    means = torch.stack([m.seen[:2] / m.seen[2] for m in blocks])
    for m in blocks:
        m.seen = None
    return torch.cat([means.sum(0), torch.full((1,), len(blocks), dtype=means.dtype, device=means.device)])
