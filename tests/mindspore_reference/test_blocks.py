"""Each block of MindSpore 2.7.0's ``nn.transformer`` against paratrain.nn's, at fp32 with the same weights:
its outputs (the presents too) and the gradients of a weighted sum of its output, for its parameters and its
inputs."""
import mindspore
import numpy as np
import pytest
import torch
from mindspore.parallel import _transformer as ms_transformer

import paratrain.nn as pnn
from reference import (Gelu, assert_close, assert_same_grads, copy_weights, in_fp32, ms_tensor, ms_value_and_grads,
                       torch_tensor, torch_value_and_grads)

B, S, T, H, HEADS, F, V = 2, 4, 6, 16, 2, 32, 20  # batch, source and target lengths, hidden, heads, ffn, vocab
FP32 = dict(layernorm_compute_type=mindspore.float32, softmax_compute_type=mindspore.float32,
            param_init_type=mindspore.float32)
NO_DROPOUT = dict(attention_dropout_rate=0.0, hidden_dropout_rate=0.0)


def padding_mask(rows: int, columns: int) -> np.ndarray:
    """(B, rows, columns) 0/1: causal where square, the second sequence's last two keys padded. No query row is
    masked whole: both libraries add -10000 to the scores of such a row in fp32, rounding them to 1e-3, so its
    softmax (and the gradients through it) agree only to about 1e-4."""
    mask = np.ones((B, rows, columns), np.float32)
    if rows == columns:
        mask *= np.tril(np.ones((rows, columns), np.float32))
    mask[1, :, columns - 2:] = 0
    return mask


def flat(outputs) -> list:
    """The tensors of a block's (nested) return tuple in order, Nones left out."""
    if isinstance(outputs, (tuple, list)):
        return [t for output in outputs for t in flat(output)]
    return [] if outputs is None else [outputs]


def compare(what: str, ms_net, net, inputs: list[np.ndarray], grad_inputs=(0,)) -> None:
    """``net`` (paratrain) given ``ms_net``'s weights computes ``ms_net``'s outputs from ``inputs``, and the
    gradients of ``sum(output * weights)`` (``output`` the first returned) for the parameters and
    ``inputs[grad_inputs]``."""
    in_fp32(ms_net)
    copy_weights(ms_net, net)
    ms_outputs = [t.asnumpy() for t in flat(ms_net(*(ms_tensor(x) for x in inputs)))]
    outputs = [t.detach().numpy() for t in flat(net(*(torch_tensor(x) for x in inputs)))]
    assert len(outputs) == len(ms_outputs)
    for i, (output, ms_output) in enumerate(zip(outputs, ms_outputs)):
        assert output.dtype == ms_output.dtype, (i, output.dtype, ms_output.dtype)
        assert_close(f"{what}: output" if i == 0 else f"{what}: other outputs", output, ms_output)
    weights = np.random.default_rng(1).standard_normal(ms_outputs[0].shape).astype(np.float32)
    ms_weights, weights = ms_tensor(weights), torch_tensor(weights)
    ms_value, ms_grads, ms_input_grads = ms_value_and_grads(
        ms_net, lambda *xs: (flat(ms_net(*xs))[0] * ms_weights).sum(), inputs, grad_inputs)
    value, grads, input_grads = torch_value_and_grads(
        net, lambda *xs: (flat(net(*xs))[0] * weights).sum(), inputs, grad_inputs)
    assert_close(f"{what}: output", value, ms_value)
    assert_same_grads(f"{what}: parameter gradients", grads, ms_grads)
    for grad, ms_grad in zip(input_grads, ms_input_grads, strict=True):
        assert_close(f"{what}: input gradients", grad, ms_grad)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_vocab_embedding(rng):
    ids = rng.integers(0, V, (B, T))
    ms_net = ms_transformer.VocabEmbedding(vocab_size=V, embedding_size=H)
    compare("VocabEmbedding", ms_net, pnn.VocabEmbedding(vocab_size=V, embedding_size=H), [ids], grad_inputs=())


def test_attention_mask(rng):
    input_mask = (rng.random((B, T)) > 0.3).astype(np.float32)
    ms_mask = ms_transformer.AttentionMask(seq_length=T)(ms_tensor(input_mask)).asnumpy()
    mask = pnn.AttentionMask(seq_length=T)(torch_tensor(input_mask)).numpy()
    assert mask.dtype == ms_mask.dtype
    assert_close("AttentionMask", mask, ms_mask)


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_multi_head_attention(rng, cross):
    keys = S if cross else T
    args = dict(batch_size=B, src_seq_length=T, tgt_seq_length=keys, hidden_size=H, num_heads=HEADS,
                **NO_DROPOUT)
    ms_net = ms_transformer.MultiHeadAttention(**args, compute_dtype=mindspore.float32,
                                               softmax_compute_type=mindspore.float32,
                                               param_init_type=mindspore.float32)
    query = rng.standard_normal((B, T, H)).astype(np.float32)
    key = rng.standard_normal((B, keys, H)).astype(np.float32) if cross else query
    inputs, grads = ([query, key, key, padding_mask(T, keys)], (0, 1)) if cross else (
        [query, query, query, padding_mask(T, T)], (0,))
    compare(f"MultiHeadAttention ({'cross' if cross else 'self'})", ms_net, pnn.MultiHeadAttention(**args), inputs,
            grads)


FLAT = pytest.mark.parametrize("shape", [(B, T, H), (B * T, H)], ids=["(B, T, H)", "(B*T, H)"])


@FLAT
def test_feed_forward(rng, shape):
    ms_net = ms_transformer.FeedForward(hidden_size=H, ffn_hidden_size=F, dropout_rate=0.0, hidden_act=Gelu)
    net = pnn.FeedForward(hidden_size=H, ffn_hidden_size=F, dropout_rate=0.0, hidden_act="gelu")
    compare(f"FeedForward {shape}", ms_net, net, [rng.standard_normal(shape).astype(np.float32)])


POST_LN = pytest.mark.parametrize("post_layernorm_residual", [False, True], ids=["pre-LN", "post-LN"])


def named(block: str, post_layernorm_residual: bool) -> str:
    """The name of a block's comparisons."""
    return f"{block} ({'post' if post_layernorm_residual else 'pre'}-LN)"


@POST_LN
@pytest.mark.parametrize("block, layers", [("TransformerEncoderLayer", {}), ("TransformerEncoder", {"num_layers": 2})],
                         ids=["layer", "stack"])
def test_encoder(rng, block, layers, post_layernorm_residual):
    args = dict(batch_size=B, hidden_size=H, ffn_hidden_size=F, num_heads=HEADS, seq_length=S,
                post_layernorm_residual=post_layernorm_residual, **layers, **NO_DROPOUT)
    ms_net = getattr(ms_transformer, block)(**args, hidden_act=Gelu, **FP32)
    inputs = [rng.standard_normal((B, S, H)).astype(np.float32), padding_mask(S, S)]
    compare(named(block, post_layernorm_residual), ms_net, getattr(pnn, block)(**args), inputs)


@pytest.mark.parametrize("block", ["MultiHeadAttention", "TransformerEncoderLayer"])
def test_tokens_flattened_to_rows(rng, block):
    """Inputs of (B*T, H) rows, which both libraries take with the batch given by the mask."""
    x = rng.standard_normal((B * T, H)).astype(np.float32)
    if block == "MultiHeadAttention":
        args = dict(batch_size=B, src_seq_length=T, tgt_seq_length=T, hidden_size=H, num_heads=HEADS, **NO_DROPOUT)
        ms_net = ms_transformer.MultiHeadAttention(**args, compute_dtype=mindspore.float32)
        inputs = [x, x, x, padding_mask(T, T)]
    else:
        args = dict(batch_size=B, hidden_size=H, ffn_hidden_size=F, num_heads=HEADS, seq_length=T, **NO_DROPOUT)
        ms_net = ms_transformer.TransformerEncoderLayer(**args, hidden_act=Gelu, **FP32)
        inputs = [x, padding_mask(T, T)]
    compare(f"{block} (B*T, H)", ms_net, getattr(pnn, block)(**args), inputs)


def decoder_inputs(rng) -> list[np.ndarray]:
    """hidden_stats (B, T, H), decoder_mask (B, T, T), encoder_output (B, S, H), memory_mask (B, T, S)."""
    return [rng.standard_normal((B, T, H)).astype(np.float32), padding_mask(T, T),
            rng.standard_normal((B, S, H)).astype(np.float32), padding_mask(T, S)]


@POST_LN
@pytest.mark.parametrize("block, layers", [("TransformerDecoderLayer", {}), ("TransformerDecoder", {"num_layers": 2})],
                         ids=["layer", "stack"])
def test_decoder(rng, block, layers, post_layernorm_residual):
    args = dict(batch_size=B, hidden_size=H, ffn_hidden_size=F, num_heads=HEADS, src_seq_length=S,
                tgt_seq_length=T, post_layernorm_residual=post_layernorm_residual, **layers, **NO_DROPOUT)
    ms_net = getattr(ms_transformer, block)(**args, hidden_act=Gelu, **FP32)
    compare(named(block, post_layernorm_residual), ms_net, getattr(pnn, block)(**args), decoder_inputs(rng),
            grad_inputs=(0, 2))


@POST_LN
def test_transformer(rng, post_layernorm_residual):
    args = dict(hidden_size=H, batch_size=B, ffn_hidden_size=F, src_seq_length=S, tgt_seq_length=T,
                encoder_layers=2, decoder_layers=2, num_heads=HEADS, post_layernorm_residual=post_layernorm_residual,
                **NO_DROPOUT)
    ms_net = ms_transformer.Transformer(**args, hidden_act=Gelu, **FP32)
    hidden, decoder_mask, encoder_inputs, memory_mask = decoder_inputs(rng)
    inputs = [encoder_inputs, padding_mask(S, S), hidden, decoder_mask, memory_mask]
    compare(named("Transformer", post_layernorm_residual), ms_net, pnn.Transformer(**args), inputs,
            grad_inputs=(0, 2))


def test_transformer_without_decoder(rng):
    """``decoder_layers=0``: the encoder's output, no decoder presents."""
    args = dict(hidden_size=H, batch_size=B, ffn_hidden_size=F, src_seq_length=S, tgt_seq_length=T,
                encoder_layers=2, decoder_layers=0, num_heads=HEADS, **NO_DROPOUT)
    ms_net = ms_transformer.Transformer(**args, hidden_act=Gelu, **FP32)
    inputs = [rng.standard_normal((B, S, H)).astype(np.float32), padding_mask(S, S)]
    compare("Transformer (no decoder)", ms_net, pnn.Transformer(**args), inputs)
