import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paratrain.config import ModelConfig
from paratrain.data.synthetic import PAD
from paratrain.modules import linear_cross_entropy
from paratrain.models.transformer import (CAUSAL, EncoderLayer, GPTModel, Seq2SeqModel, VocabEmbedding,
                                          attention_mask, token_loss_sum)
from paratrain.modules.transformer import Attention, pipeline_blocks

CFG = ModelConfig(vocab_size=40, hidden_size=32, num_heads=4, ffn_hidden_size=64, encoder_layers=2,
                  decoder_layers=2, src_seq_length=10, tgt_seq_length=9, seq_length=12, hidden_dropout=0.0,
                  attention_dropout=0.0)


def test_vocab_embedding_returns_table():
    emb = VocabEmbedding(10, 4)
    out, table = emb(torch.tensor([[1, 2]]))
    assert out.shape == (1, 2, 4) and table.shape == (10, 4)
    assert torch.equal(out[0, 1], table[2])


def test_causal_attention_needs_no_padding_mask_at_the_end():
    """Causal self-attention runs as SDPA's is_causal (the flash kernel on GPU): with padding at the end of
    each sequence its outputs at real tokens equal those under the explicit padding x causal mask."""
    key_pad = torch.tensor([[False, False, True]])
    assert attention_mask(key_pad, causal=True, query_length=3) is CAUSAL
    padding = attention_mask(key_pad, causal=False, query_length=3)
    assert padding.shape == (1, 1, 3, 3) and padding[0, 0].tolist() == [[True, True, False]] * 3
    torch.manual_seed(0)
    layer = EncoderLayer(CFG).eval()
    pad = torch.tensor([[False] * 7 + [True] * 2, [False] * 4 + [True] * 5])
    x = torch.randn(2, 9, CFG.hidden_size)
    explicit = torch.ones(9, 9, dtype=torch.bool).tril()[None, None] & ~pad[:, None, None, :]
    want, got = layer(x, explicit)[0], layer(x, CAUSAL)[0]
    assert torch.allclose(got[~pad], want[~pad], atol=1e-6)
    assert not torch.allclose(got[pad], want[pad], atol=1e-3)  # pad positions differ: the check can fail


def test_pad_positions_do_not_change_non_pad_outputs():
    torch.manual_seed(0)
    model = Seq2SeqModel(CFG).eval()
    src = torch.tensor([[5, 6, 7, 8, PAD, PAD, PAD, PAD, PAD, PAD], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])
    tgt = torch.tensor([[1, 9, 10, 11, PAD, PAD, PAD, PAD, PAD], [1, 9, 10, 11, 12, 13, 14, 15, 16]])
    padded = model(src, tgt)[0, :4]
    unpadded = model(src[:1, :4], tgt[:1, :4])[0]
    assert torch.allclose(padded, unpadded, atol=1e-5)
    # without the padding mask the pad tokens would be attended to: the check above can fail
    model.pad_token_id = -1
    assert not torch.allclose(model(src, tgt)[0, :4], unpadded, atol=1e-5)


def test_future_target_tokens_do_not_change_earlier_logits():
    torch.manual_seed(0)
    model = Seq2SeqModel(CFG).eval()
    src = torch.randint(4, 40, (2, 10))
    tgt = torch.randint(4, 40, (2, 9))
    changed = tgt.clone()
    changed[:, 5:] = torch.randint(4, 40, (2, 4))
    a, b = model(src, tgt), model(src, changed)
    assert torch.allclose(a[:, :5], b[:, :5], atol=1e-6)
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = GPTModel(ModelConfig(**{**CFG.__dict__, "kind": "gpt"})).eval()
    ids = torch.randint(4, 40, (2, 12))
    changed = ids.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 36 + 4
    a, b = model(ids), model(changed)
    assert a.shape == (2, 12, 40)
    assert torch.allclose(a[:, :7], b[:, :7], atol=1e-6) and not torch.allclose(a[:, 7:], b[:, 7:])


def test_encoder_layer_equals_torch_pre_ln_layer():
    cfg = ModelConfig(hidden_size=32, num_heads=4, ffn_hidden_size=64, hidden_dropout=0.0, attention_dropout=0.0,
                      hidden_act="relu")
    torch.manual_seed(0)
    ours = EncoderLayer(cfg).eval()
    ref = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_()
        a = ours.attn
        ref.self_attn.in_proj_weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        ref.self_attn.in_proj_bias.copy_(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
        ref.self_attn.out_proj.weight.copy_(a.out_proj.weight)
        ref.self_attn.out_proj.bias.copy_(a.out_proj.bias)
        for mine, theirs in ((ours.ffn.fc1, ref.linear1), (ours.ffn.fc2, ref.linear2),
                             (ours.attn_branch.norm, ref.norm1), (ours.ffn_branch.norm, ref.norm2)):
            theirs.weight.copy_(mine.weight)
            theirs.bias.copy_(mine.bias)
    x = torch.randn(3, 7, 32)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = True
    got = ours(x, attention_mask(pad, False, 7))[0]
    want = ref(x, src_key_padding_mask=pad)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_layer_parameter_names_are_those_of_saved_checkpoints():
    """The built-in layers name their parts as checkpoints saved by earlier versions do."""
    encoder_layer = {"attn_branch.norm.weight", "attn.q_proj.weight", "attn.out_proj.bias", "ffn_branch.norm.bias",
                     "ffn.fc1.weight", "ffn.fc2.bias"}
    decoder_layer = {"self_attn_branch.norm.weight", "self_attn.k_proj.bias", "cross_attn_branch.norm.bias",
                     "cross_attn.v_proj.weight", "ffn_branch.norm.weight", "ffn.fc2.weight"}
    want = {f"{stack}.1.{name}" for stack, names in (("transformer.encoder.layers", encoder_layer),
                                                     ("transformer.decoder.layers", decoder_layer)) for name in names}
    assert want | {"transformer.encoder.norm.weight"} <= set(dict(Seq2SeqModel(CFG).named_parameters()))
    gpt = dict(GPTModel(ModelConfig(**{**CFG.__dict__, "kind": "gpt"})).named_parameters())
    assert {f"layers.0.{name}" for name in encoder_layer} | {"norm.bias"} <= set(gpt)


def test_tied_embeddings_share_one_tensor():
    model = Seq2SeqModel(ModelConfig(**{**CFG.__dict__, "tie_embeddings": True}))
    assert model.head.weight is model.src_embed.word.embedding.weight is model.tgt_embed.word.embedding.weight


def test_loss_ignores_pad_and_blocks_are_ordered():
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[1, 2, PAD], [3, PAD, PAD]])
    full = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    assert torch.allclose(token_loss_sum(logits, labels, PAD), full[labels.flatten() != PAD].sum())
    model = Seq2SeqModel(CFG)
    blocks = pipeline_blocks(model)
    assert blocks[0] == ("transformer.encoder.layers.0", 0, 0)
    assert blocks[-1] == ("transformer.decoder.layers.1", 1, 2)
    assert all(model.get_submodule(name) is not None for name, _, _ in blocks)


def _loss_and_grads(model, labels, fused: bool, *inputs):
    model.zero_grad(set_to_none=True)
    loss = model(*inputs, labels=labels) if fused else token_loss_sum(model(*inputs), labels, model.head.ignore_index)
    (loss * 0.3).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind, tied", [("gpt", True), ("gpt", False), ("transformer", True)])
def test_head_loss_by_chunks_equals_the_loss_of_whole_logits(kind, tied, monkeypatch):
    """Passing labels: the same summed loss and the same gradients of every parameter (the tied table's
    included), computed a few rows at a time; here 7 rows a chunk, so the last chunk is ragged."""
    monkeypatch.setattr(linear_cross_entropy, "CHUNK_BYTES", 4 * CFG.vocab_size * 7)
    torch.manual_seed(0)
    cfg = ModelConfig(**{**CFG.__dict__, "kind": kind, "tie_embeddings": tied})
    model = (GPTModel if kind == "gpt" else Seq2SeqModel)(cfg)
    if kind == "gpt":
        inputs = (torch.randint(1, CFG.vocab_size, (3, CFG.seq_length), device="cpu"),)
        labels = torch.randint(1, CFG.vocab_size, (3, CFG.seq_length), device="cpu")
    else:
        inputs = (torch.randint(1, CFG.vocab_size, (3, CFG.src_seq_length), device="cpu"),
                  torch.randint(1, CFG.vocab_size, (3, CFG.tgt_seq_length), device="cpu"))
        labels = torch.randint(1, CFG.vocab_size, (3, CFG.tgt_seq_length), device="cpu")
    labels[0, -4:] = cfg.ignore_index  # padding (the encoder-decoder's) does not count
    whole, whole_grads = _loss_and_grads(model, labels, False, *inputs)
    chunked, chunked_grads = _loss_and_grads(model, labels, True, *inputs)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-5)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_head_loss_by_chunks_under_bf16_autocast_is_close_to_whole_logits():
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 32, device="cpu", requires_grad=True)
    weight = torch.randn(40, 32, device="cpu", requires_grad=True)
    labels = torch.randint(0, 40, (2, 9), device="cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = token_loss_sum((hidden @ weight.T).float(), labels, -100)
        chunked = linear_cross_entropy.linear_token_loss_sum(hidden, weight, labels, -100)
    expected = torch.autograd.grad(whole, (hidden, weight))
    got = torch.autograd.grad(chunked, (hidden, weight))
    assert chunked.dtype == torch.float32 and got[1].dtype == weight.dtype
    torch.testing.assert_close(chunked, whole, rtol=1e-2, atol=1e-2)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=5e-2, atol=5e-2)


def _project_separately(attention):
    """Hooks that keep ``attention``'s q, k and v projections apart (a hooked Linear is not joined)."""
    return [getattr(attention, name).register_forward_pre_hook(lambda module, args: None)
            for name in attention.names[:3]]


def _matmuls(run) -> int:
    """The matmuls (mm, addmm) ``run()`` dispatches, forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
            return func(*args, **(kwargs or {}))

    with Count():
        run()
    return Count.calls


@pytest.mark.parametrize("face", ["built_in", "mindspore"])
def test_self_attention_under_autocast_projects_q_k_v_in_one_matmul_with_the_three_linears_results(face):
    from paratrain import nn as msnn

    torch.manual_seed(0)
    if face == "built_in":
        attention = GPTModel(ModelConfig(kind="gpt", vocab_size=32, hidden_size=32, num_heads=4, ffn_hidden_size=64,
                                         decoder_layers=1, seq_length=8, attention_dropout=0.0)).layers["0"].attn
    else:
        attention = msnn.MultiHeadAttention(batch_size=2, src_seq_length=8, tgt_seq_length=8, hidden_size=32,
                                            num_heads=4, hidden_dropout_rate=0.0, attention_dropout_rate=0.0)
    x = torch.randn(2, 8, 32)

    def step():
        attention.zero_grad(set_to_none=True)
        query = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = attention(query, attention_mask=torch.ones(2, 8, 8))[0] if face == "mindspore" else \
                attention(query, attention_mask=CAUSAL)[0]
        out.float().square().sum().backward()
        return out.detach().float(), query.grad, [p.grad for p in attention.parameters()]

    joined = _matmuls(step)
    got = step()
    hooks = _project_separately(attention)
    apart = _matmuls(step)
    want = step()
    for hook in hooks:
        hook.remove()
    # forward: q, k, v then the output projection; backward: two matmuls for each (input's and weight's gradients)
    assert (joined, apart) == (2 + 2 * 2, 4 + 4 * 2)
    for g, w in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]], strict=True):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-3)  # bf16 matmuls of other shapes


def test_projections_stay_apart_where_joining_would_keep_a_copy_more_or_for_cross_attention():
    torch.manual_seed(0)
    attention = Attention(32, 4, 0.0)
    x = torch.randn(2, 8, 32)
    assert attention.projected_together(x) is None  # fp32: backward keeps the weights themselves, not casts
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention.projected_together(x) is not None  # autocast casts the weights: joined
        assert _matmuls(lambda: attention(x, torch.randn(2, 5, 32))) == 4  # cross-attention: q, k, v, out apart
    attention.to(torch.bfloat16)  # parameters in the compute dtype (as FSDP gathers them): no cast to join
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention.projected_together(x.bfloat16()) is None


@pytest.mark.parametrize("act, want", [("gelu", F.gelu), ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh")),
                                       ("relu", F.relu)])
def test_hidden_act_names_the_feed_forwards_activation(act, want):
    """model.hidden_act: "gelu" is the exact GELU (the MindSpore face's "gelu" is its tanh form: "gelu_tanh")."""
    from paratrain.models.transformer import feed_forward

    torch.manual_seed(0)
    ffn = feed_forward(ModelConfig(**{**CFG.__dict__, "kind": "gpt", "hidden_act": act}), 0)
    x = torch.randn(3, CFG.hidden_size, device="cpu")
    torch.testing.assert_close(ffn(x), ffn.fc2(want(ffn.fc1(x))), rtol=0, atol=0)
