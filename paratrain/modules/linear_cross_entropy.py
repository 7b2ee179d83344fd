"""The output head and the cross-entropy in one, a few rows at a time: the logits are never whole.

Computing logits (N, V) and then the loss keeps, at the start of backward, the log-softmax (N, V), its gradient and
temporaries of the same size: for a 32k vocabulary and 512 tokens a rank, 65 MB each, at the moment the activations of
every layer are also alive (the step's peak). Here each chunk of rows computes its logits, its loss and, at once, the
gradients of the hidden states and of the head weight (softmax minus one-hot is the gradient of a summed
cross-entropy), then frees them; backward only scales the saved gradients. Same FLOPs (the head's forward and both
backward matmuls), a chunk's logits at a time (``chunk_rows``).

The matmuls run in the compute dtype (bf16 under autocast), the weight gradient's too, its chunks summed in fp32;
under fp16 the weight gradient is computed in fp32, as a chunk's sum over many rows may exceed fp16's range.

With vocab-sharded logits there is no such head: ``token_cross_entropy`` takes the logits as they
come, through PyTorch's ``loss_parallel`` (``paratrain.parallel.loss.loss_context``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


# fp32 logits of one chunk of rows on the CPU: 524 rows at a 32k vocabulary. Every chunk is ten ops and
# a pass over the whole (V, H) weight gradient (its matmul accumulates into it), so small chunks cost
# memory traffic: at 16 MB (131 rows) bench/peers.py's 512 rows a rank took four passes over the 65 MB
# gradient and 4x the ops, for 48 MB less at the peak
CHUNK_BYTES = 64 << 20
GPU_CHUNK_BYTES = 256 << 20  # on a GPU: a 16k-token micro-batch at a 32k vocabulary in 8 chunks


def chunk_rows(vocab_size: int, device_type: str) -> int:
    """Rows of hidden states per chunk: fp32 logits of :data:`CHUNK_BYTES` on the CPU; on a GPU larger
    chunks (:data:`GPU_CHUNK_BYTES`), since each chunk is ten kernels launched from Python and small
    ones leave the GPU waiting on the host."""
    return max(1, (GPU_CHUNK_BYTES if device_type == "cuda" else CHUNK_BYTES) // (4 * vocab_size))


def _chunks(tensor: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    """``tensor`` split into chunks of ``rows`` rows; itself when it has no more."""
    return tensor.split(rows) if tensor.shape[0] > rows else (tensor,)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, column, ignore_index: int, rows_of_ranks=None):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        sharded = rows_of_ranks is not None  # the rows of every rank against this rank's vocabulary rows
        with torch.autocast(device, enabled=False):
            x, w = hidden.to(dtype), weight.to(dtype)
            if sharded:
                x, column = rows_of_ranks.gather(x), rows_of_ranks.gather(column)
            hidden_grads = []  # each chunk's
            grad_weight = None  # fp32, made by the first chunk's matmul, the others' added to it
            loss = None
            keep = column != ignore_index  # (N, 1): True for a target, False for a pad
            # a pad row's softmax would enter both gradients: its hidden state is zeroed for the weight's,
            # its hidden gradient after the loop -- two (N, H) passes, not one over the (N, V) logits; so
            # any class serves as a pad row's target in the softmax's gradient
            kept = x * keep
            vocab = weight.shape[0]
            local = column - rows_of_ranks.vocab_start if sharded else column
            targets = local if not sharded and 0 <= ignore_index < vocab else local.clamp(0, vocab - 1)
            # sharded: minus one where a row's target is one of this rank's vocabulary rows (and not a pad), else zero:
            # the one-hot this rank subtracts from the softmax, and the rows whose loss it adds up (unsharded, the
            # loop gets ``targets`` in its place and does not read it)
            minus_mine = (targets == local).logical_and_(keep).mul(-1.0) if sharded else targets
            labels = targets if sharded else column.view(-1)  # (N,), as nll_loss takes them: unsharded only
            for part, label, target, part_minus_mine, part_kept in zip(*(
                    _chunks(t, chunk_rows(vocab, device)) for t in (x, labels, targets, minus_mine, kept))):
                logits = (part @ w.T).float()
                if sharded:  # the log-softmax over the whole vocabulary, in place
                    logits.sub_(rows_of_ranks.whole_vocabulary(torch.logsumexp(logits, 1, keepdim=True)))
                else:  # in place: no second (N, V) buffer, and one exp pass fewer than logsumexp then sub_
                    torch.log_softmax(logits, 1, out=logits)
                if sharded:  # the loss of the rows whose target is one of this rank's
                    part_loss = torch.gather(logits, 1, target).mul_(part_minus_mine).sum()
                else:
                    part_loss = F.nll_loss(logits, label, ignore_index=ignore_index, reduction="sum")
                loss = part_loss if loss is None else loss.add_(part_loss)
                grad = logits.exp_()  # the softmax, in place
                if sharded:  # minus the one-hot targets
                    grad.scatter_add_(1, target, part_minus_mine)
                else:
                    grad.scatter_(1, target, -1.0, reduce="add")
                low = grad.to(dtype)
                hidden_grads.append(low @ w)
                if dtype == torch.bfloat16:  # a bf16 matmul (fp32 range), the chunks summed in fp32
                    chunk = low.T @ part_kept
                    grad_weight = chunk.float() if grad_weight is None else grad_weight.add_(chunk)
                elif grad_weight is None:
                    grad_weight = grad.T @ part_kept.float()
                else:
                    grad_weight.addmm_(grad.T, part_kept.float())
            grad_hidden = (hidden_grads[0] if len(hidden_grads) == 1 else torch.cat(hidden_grads)).mul_(keep)
            if sharded:  # this rank's rows' hidden gradient, summed over the ranks' vocabulary rows
                grad_hidden = rows_of_ranks.summed_own(grad_hidden)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes, ctx.ranks = (hidden.dtype, weight.dtype), rows_of_ranks.ranks if sharded else 1
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        # vocab-sharded: the weight's gradient came from every rank's rows, each rank's loss having the same
        # gradient, which counts the data-parallel average (paratrain.parallel.micro_batches.StepLoss)
        scale = grad_loss if ctx.ranks == 1 else grad_loss / ctx.ranks
        return grad_hidden.to(hidden_dtype) * grad_loss, grad_weight.mul_(scale).to(weight_dtype), None, None, None


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Summed cross-entropy over the non-pad targets: logits (B, T, V), labels (B, T) -> scalar
    (or logits (B, C), labels (B,) for a classifier).

    Divided by the non-pad token count of the global batch it gives the loss of
    that batch whatever the split into ranks and micro-batches.
    """
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=ignore_index, reduction="sum")


def linear_token_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          ignore_index: int, rows_of_ranks=None) -> torch.Tensor:
    """Summed cross-entropy of the head ``hidden @ weight.T`` over the targets that are not ``ignore_index``:
    hidden (..., H), weight (V, H), labels (...) -> scalar; equal to ``token_loss_sum(head(hidden), labels)``.
    Backward may run once (the saved gradients are scaled in place).

    With ``rows_of_ranks`` (``paratrain.parallel.vocab.RowsOfRanks``: its collectives), ``weight`` is this rank's
    rows of a table row-sharded over ranks that all call it with hidden states of the same shape: each rank gets
    the loss of every rank's targets that are among its vocabulary rows (the ranks' losses sum to that of all their
    tokens), and the weight's gradient holds every rank's rows over their number."""
    return _LinearCrossEntropy.apply(hidden.flatten(0, -2), weight, labels.reshape(-1, 1), ignore_index, rows_of_ranks)


class OutputHead(torch.nn.Linear):
    """The bias-free output head: hidden (..., H) -> logits (..., V), or with ``labels`` (...) their summed token loss
    over the targets that are not ``ignore_index``, without whole logits (``linear_token_loss_sum``). Either way it is
    a module call, so hooks on the head run (FSDP2 gathers its weight when it is a unit of its own)."""

    def __init__(self, hidden_size: int, vocab_size: int, ignore_index: int):
        super().__init__(hidden_size, vocab_size, bias=False)
        self.ignore_index = ignore_index

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(hidden)
        return linear_token_loss_sum(hidden, self.weight, labels, self.ignore_index)


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each token's cross-entropy, float32 (N,), of logits (..., V) and labels (...): a plain tensor.
    bf16 and fp16 logits are never copied whole to fp32 (``_LowPrecisionCrossEntropy``).

    Logits that are a DTensor sharded on V over one mesh dimension (and replicated on any other) are
    reduced vocab-parallel by ``loss_parallel``, so forward and backward must run under it
    (``paratrain.parallel.loss.loss_context``); the result is then the same on every rank. Logits
    placed any other way (rows split by a semi-auto strategy) are gathered whole first."""
    logits = logits.reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1).long()
    if type(logits) is torch.Tensor and logits.dtype in (torch.bfloat16, torch.float16):
        return _LowPrecisionCrossEntropy.apply(logits, labels)
    logits = logits.float()
    vocab_dims = [i for i, p in enumerate(logits.placements) if p.is_shard(1)] if isinstance(logits, DTensor) else []
    if isinstance(logits, DTensor) and (len(vocab_dims) != 1 or not all(
            p.is_replicate() for i, p in enumerate(logits.placements) if i != vocab_dims[0])):
        logits = logits.full_tensor()  # rows split by an op strategy (semi-auto): the whole batch's on every rank
    if not isinstance(logits, DTensor):
        return F.cross_entropy(logits, labels, reduction="none")
    mesh = logits.device_mesh
    if mesh.ndim > 1:  # torch 2.11's loss_parallel takes a one-dimensional mesh only: the vocab's
        vocab_mesh = DeviceMesh.from_group(mesh.get_group(vocab_dims[0]), mesh.device_type)
        logits = DTensor.from_local(logits.to_local(), vocab_mesh, [Shard(1)], shape=logits.shape,
                                    stride=logits.stride())
    return F.cross_entropy(logits, labels, reduction="none").to_local()


class _LowPrecisionCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(logits.float(), labels, reduction="none")`` of bf16/fp16 logits (N, V), a chunk of rows
    at a time in fp32 (``chunk_rows``): forward keeps each row's log-sum-exp, backward recomputes the softmax
    from the logits and writes their gradient in their dtype. No fp32 (N, V) copy lives from forward to
    backward, nor its fp32 gradient; the logits themselves are saved instead (half the bytes). A label of -100
    (``F.cross_entropy``'s ``ignore_index``) has loss and gradient 0."""

    @staticmethod
    def forward(ctx, logits, labels):
        ignored = labels == -100
        targets = labels.masked_fill(ignored, 0)[:, None]
        rows = chunk_rows(logits.shape[1], logits.device.type)
        with torch.autocast(logits.device.type, enabled=False):
            lse = torch.cat([torch.logsumexp(part.float(), 1) for part in _chunks(logits, rows)])
            loss = (lse - logits.gather(1, targets).squeeze(1).float()).masked_fill_(ignored, 0.0)
        ctx.save_for_backward(logits, targets, lse, ignored)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        logits, targets, lse, ignored = ctx.saved_tensors
        scale = grad_loss.float().masked_fill(ignored, 0.0)[:, None]
        rows = chunk_rows(logits.shape[1], logits.device.type)
        grad = torch.empty_like(logits)
        with torch.autocast(logits.device.type, enabled=False):
            for part, part_grad, part_lse, part_targets, part_scale in zip(*(
                    _chunks(t, rows) for t in (logits, grad, lse[:, None], targets, scale))):
                softmax = part.float().sub_(part_lse).exp_()
                softmax.scatter_add_(1, part_targets, torch.full_like(part_scale, -1.0))
                part_grad.copy_(softmax.mul_(part_scale))
        return grad, None
