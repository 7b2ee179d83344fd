"""paratrain.nn: MindSpore's transformer blocks -- shapes and return values with MindSpore's arguments, mask
semantics, the loss and its reductions, training, lambda_func placement, the declared tensor-parallel plans,
the sharded-shape rule, and the vocab-parallel loss on two processes."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from forked_ranks import run_distributed
from paratrain import config_file
from paratrain.config_rules import validate
from paratrain.errors import UserError
from paratrain.modules.token_loss import TokenMeansTo
from paratrain.nn import (AttentionMask, Cell, CrossEntropyLoss, EmbeddingOpParallelConfig, FeedForward, MoEConfig,
                          MultiHeadAttention, OpParallelConfig, Transformer, TransformerDecoder,
                          TransformerDecoderLayer, TransformerEncoder, TransformerEncoderLayer,
                          TransformerOpParallelConfig, TransformerRecomputeConfig, VocabEmbedding)

B, S, T, H, HEADS, FFN = 2, 6, 5, 16, 4, 32
NO_DROPOUT = dict(attention_dropout_rate=0.0, hidden_dropout_rate=0.0)


def ones(*shape):
    return torch.ones(*shape)


def encoder_layer(**kw):
    return TransformerEncoderLayer(batch_size=B, hidden_size=H, ffn_hidden_size=FFN, num_heads=HEADS, seq_length=S,
                                   **{**NO_DROPOUT, **kw})


def decoder_layer(**kw):
    return TransformerDecoderLayer(hidden_size=H, ffn_hidden_size=FFN, num_heads=HEADS, batch_size=B,
                                   src_seq_length=S, tgt_seq_length=T, **{**NO_DROPOUT, **kw})


def transformer(encoder_layers=2, decoder_layers=2, **kw):
    return Transformer(hidden_size=H, batch_size=B, ffn_hidden_size=FFN, src_seq_length=S, tgt_seq_length=T,
                       encoder_layers=encoder_layers, decoder_layers=decoder_layers, num_heads=HEADS,
                       **{**NO_DROPOUT, **kw})


# --- shapes and return values, with MindSpore's arguments and docstring examples ----------------------------

def test_vocab_embedding_returns_embeddings_and_table():
    model = VocabEmbedding(vocab_size=30, embedding_size=30)
    output, table = model(torch.ones(20, 15, dtype=torch.int32))
    assert output.shape == (20, 15, 30) and table.shape == (30, 30)
    assert table is model.embedding_table and torch.equal(output[0, 0], table[1])
    assert 0.005 < table.std().item() < 0.015  # MindSpore's "normal": sigma 0.01
    assert torch.equal(VocabEmbedding(4, 3, param_init="zeros").embedding_table, torch.zeros(4, 3))
    assert torch.equal(VocabEmbedding(4, 3, param_init=torch.arange(12.0).view(4, 3)).embedding_table,
                       torch.arange(12.0).view(4, 3))


def test_multi_head_attention_and_feed_forward_shapes():
    model = MultiHeadAttention(batch_size=2, hidden_size=15, src_seq_length=20, tgt_seq_length=20, num_heads=3)
    out, (key, value) = model(ones(2, 20, 15), ones(2, 20, 15), ones(2, 20, 15), ones(2, 20, 20))
    assert out.shape == (2, 20, 15) and key.shape == (2, 3, 5, 20) and value.shape == (2, 3, 20, 5)
    out2d, _ = model(ones(40, 15), ones(40, 15), ones(40, 15), ones(2, 20, 20))  # (B*T, H) inputs, as MindSpore
    assert out2d.shape == (40, 15)
    cross = MultiHeadAttention(batch_size=2, hidden_size=15, src_seq_length=4, tgt_seq_length=7, num_heads=3)
    out, (key, value) = cross(ones(2, 4, 15), ones(2, 7, 15), ones(2, 7, 15), ones(2, 4, 7))
    assert out.shape == (2, 4, 15) and key.shape == (2, 3, 5, 7) and value.shape == (2, 3, 7, 5)
    assert FeedForward(hidden_size=15, ffn_hidden_size=30, dropout_rate=0.1)(ones(2, 20, 15)).shape == (2, 20, 15)


def test_blocks_are_the_built_in_models_modules_under_mindspore_names():
    """MultiHeadAttention and FeedForward run paratrain.modules' Attention and FeedForward: the same weights under
    the modules' names give the same outputs (a 0/1 mask as its boolean form)."""
    from paratrain.modules import transformer as shared

    def renamed(block, module):
        names = dict(zip(type(block).names, type(module).names))
        module.load_state_dict({f"{names[k.split('.')[0]]}.{k.split('.')[1]}": v for k, v in block.state_dict().items()})
        return module

    torch.manual_seed(0)
    block = MultiHeadAttention(B, T, S, H, HEADS, **NO_DROPOUT)
    module = renamed(block, shared.Attention(H, HEADS, 0.0))
    query, memory = torch.randn(B, T, H), torch.randn(B, S, H)
    mask = (torch.rand(B, T, S) > 0.4).float()
    mask[..., 0] = 1  # every query attends some key
    output, _ = module(query, memory, attention_mask=mask.bool()[:, None])
    assert torch.allclose(block(query, memory, memory, mask)[0], output, atol=1e-6)
    ffn = FeedForward(H, FFN, 0.0)
    assert torch.equal(ffn(query), renamed(ffn, shared.FeedForward(H, FFN, 0.0, nn.GELU(approximate="tanh")))(query))
    assert isinstance(VocabEmbedding(8, 4), shared.VocabEmbedding)


def test_layers_and_stacks_are_the_built_in_models_under_mindspore_names():
    """TransformerDecoder runs the built-in models' layer and stack (paratrain.modules' TransformerLayer and
    TransformerStack): its weights under the built-in decoder's names give the same output, a 0/1 memory mask
    as its boolean form."""
    from paratrain.config import ModelConfig
    from paratrain.models import transformer as built_in
    from paratrain.modules import transformer as shared

    torch.manual_seed(0)
    stack = TransformerDecoder(num_layers=2, batch_size=B, hidden_size=H, ffn_hidden_size=FFN, src_seq_length=S,
                               tgt_seq_length=T, num_heads=HEADS, hidden_act="relu", **NO_DROPOUT)
    cfg = ModelConfig(hidden_size=H, num_heads=HEADS, ffn_hidden_size=FFN, hidden_act="relu", hidden_dropout=0.0,
                      attention_dropout=0.0)
    decoder = built_in.TransformerDecoder(cfg, 2)
    decoder.norm = None  # MindSpore's stacks end without one
    parts = dict(zip(type(stack.blocks[0]).names, built_in.DecoderLayer.names))
    attention, ffn = (dict(zip(type(a).names, type(b).names)) for a, b in (
        (stack.blocks[0].attention, decoder.layers["0"].self_attn), (stack.blocks[0].output, decoder.layers["0"].ffn)))

    def built_in_name(key):
        _, layer, part, *inner = key.split(".")
        names = attention if "attention" in part else ffn
        return ".".join(["layers", layer, parts[part], *(names.get(n, n) for n in inner)])

    decoder.load_state_dict({built_in_name(key): value for key, value in stack.state_dict().items()})
    x, memory = torch.randn(B, T, H), torch.randn(B, S, H)
    memory_mask = (torch.rand(B, T, S) > 0.4).float()
    memory_mask[..., 0] = 1  # every query attends some key
    want, presents = stack(x, torch.ones(T, T).tril().expand(B, T, T), memory, memory_mask)
    got, none = decoder(x, shared.CAUSAL, memory, memory_mask.bool()[:, None])
    assert torch.allclose(got, want, atol=1e-5) and len(presents) == 2 and none == ()
    assert isinstance(stack, shared.TransformerStack) and isinstance(stack.blocks[0], shared.TransformerLayer)


def test_encoder_layer_post_layernorm_follows_mindspore():
    """MindSpore's encoder post-LN adds the unnormalised input to the attention, normalises with layernorm2, and
    ends with layernorm1; its decoder's keeps the normalised input on the residual (the shared layer's form)."""
    torch.manual_seed(0)
    layer = encoder_layer(post_layernorm_residual=True)
    for norm in (layer.layernorm1, layer.layernorm2):
        torch.nn.init.normal_(norm.weight)
        torch.nn.init.normal_(norm.bias)
    x, mask = torch.randn(B, S, H), torch.ones(B, S, S)
    middle = layer.layernorm2(x + layer.attention(x, x, x, mask)[0])
    want = layer.layernorm1(middle + layer.output(middle))
    got, (key, value) = layer(x, mask)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(layer(x.reshape(B * S, H), mask)[0], want.reshape(B * S, H))


def test_layer_and_stack_shapes():
    out, (key, value) = TransformerEncoderLayer(batch_size=2, hidden_size=8, ffn_hidden_size=64, seq_length=16,
                                                num_heads=2)(ones(2, 16, 8), ones(2, 16, 16))
    assert out.shape == (2, 16, 8) and key.shape == (2, 2, 4, 16) and value.shape == (2, 2, 16, 4)

    layer = TransformerDecoderLayer(batch_size=2, hidden_size=64, ffn_hidden_size=64, num_heads=2, src_seq_length=20,
                                    tgt_seq_length=10)
    out, past = layer(ones(2, 10, 64), ones(2, 10, 10), ones(2, 20, 64), ones(2, 10, 20))
    assert out.shape == (2, 10, 64)
    assert [p.shape for p in past] == [(2, 2, 32, 10), (2, 2, 10, 32), (2, 2, 32, 20), (2, 2, 20, 32)]
    out, past = layer(ones(2, 10, 64), ones(2, 10, 10))  # no encoder output: the cross-attention is skipped
    assert out.shape == (2, 10, 64) and len(past) == 2

    out, past = TransformerEncoder(batch_size=2, num_layers=2, hidden_size=8, ffn_hidden_size=64, seq_length=16,
                                   num_heads=2)(ones(2, 16, 8), ones(2, 16, 16))
    assert out.shape == (2, 16, 8) and len(past) == 2 and past[0][0].shape == (2, 2, 4, 16)
    out, past = TransformerDecoder(batch_size=2, num_layers=1, hidden_size=64, ffn_hidden_size=64, num_heads=2,
                                   src_seq_length=20, tgt_seq_length=10)(ones(2, 10, 64), ones(2, 10, 10),
                                                                         ones(2, 20, 64), ones(2, 10, 20))
    assert out.shape == (2, 10, 64) and len(past) == 1 and [p.shape[-1] for p in past[0]] == [10, 32, 20, 32]


def test_transformer_returns_output_and_presents_in_every_shape():
    model = Transformer(batch_size=2, encoder_layers=1, decoder_layers=2, hidden_size=64, ffn_hidden_size=64,
                        src_seq_length=20, tgt_seq_length=10)
    out, en_past, de_past = model(ones(2, 20, 64), ones(2, 20, 20), ones(2, 10, 64), ones(2, 10, 10), ones(2, 10, 20))
    assert out.shape == (2, 10, 64) and len(en_past) == 1 and len(de_past) == 2
    assert en_past[0][0].shape == (2, 2, 32, 20) and de_past[0][2].shape == (2, 2, 32, 20)

    out, en_past, de_past = transformer(decoder_layers=0)(ones(B, S, H), ones(B, S, S))  # encoder only
    assert out.shape == (B, S, H) and len(en_past) == 2 and de_past is None

    one_stack = transformer(encoder_layers=3, decoder_layers=0)
    assert not any(isinstance(m, MultiHeadAttention) and m.src_seq_length != m.tgt_seq_length
                   for m in one_stack.modules())  # no cross-attention weights to leave untrained


# --- masks ------------------------------------------------------------------------------------------------

def test_attention_mask_is_causal_and_padding():
    assert AttentionMask(seq_length=4)(torch.tensor([[1.0, 1, 1, 0]])).tolist() == [
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]]]  # MindSpore's docstring example
    lengths = [7, 3, 5]
    input_mask = torch.tensor([[1] * n + [0] * (7 - n) for n in lengths])
    expected = torch.tensor([[[float(j <= i and i < n and j < n) for j in range(7)] for i in range(7)]
                             for n in lengths])
    mask = AttentionMask(seq_length=7)(input_mask)
    assert mask.dtype == torch.float32 and torch.equal(mask, expected)


def test_a_padded_key_never_changes_a_real_query():
    torch.manual_seed(0)
    src_len = torch.tensor([S, 3])
    tgt_len = torch.tensor([T, 2])
    src_real = (torch.arange(S)[None] < src_len[:, None]).float()
    tgt_real = (torch.arange(T)[None] < tgt_len[:, None]).float()
    enc_mask = src_real[:, :, None] * src_real[:, None, :]
    dec_mask = AttentionMask(T)(tgt_real)
    memory_mask = tgt_real[:, :, None] * src_real[:, None, :]
    model = transformer().eval()
    src, tgt = torch.randn(B, S, H), torch.randn(B, T, H)
    noisy_src = torch.where(src_real[:, :, None] > 0, src, 100 * torch.randn(B, S, H))
    noisy_tgt = torch.where(tgt_real[:, :, None] > 0, tgt, 100 * torch.randn(B, T, H))
    out = model(src, enc_mask, tgt, dec_mask, memory_mask)[0]
    noisy = model(noisy_src, enc_mask, noisy_tgt, dec_mask, memory_mask)[0]
    real = tgt_real.bool()
    assert torch.equal(out[real], noisy[real])
    assert torch.equal(model(src, enc_mask.bool(), tgt, dec_mask.bool(), memory_mask.bool())[0], out)  # bool masks
    assert not torch.equal(out[~real], noisy[~real])  # the padded rows did change: the check can fail
    assert torch.isfinite(noisy).all()  # a padded query attends nothing and still gets a finite output
    # a later real token does change an earlier one's output without the causal mask: the mask matters
    assert not torch.equal(model(src, enc_mask, tgt, ones(B, T, T), memory_mask)[0][real], out[real])


# --- the loss ---------------------------------------------------------------------------------------------

def test_cross_entropy_loss_is_the_mean_over_masked_tokens():
    torch.manual_seed(0)
    logits = torch.randn(12, 9, requires_grad=True)
    labels = torch.randint(9, (12,), dtype=torch.int32)
    input_mask = (torch.rand(12) > 0.3).float()
    labels[input_mask == 0] = -100  # anything: dropped tokens' labels are never read
    keep = input_mask.bool()
    loss_fn = CrossEntropyLoss()
    loss = loss_fn(logits, labels, input_mask)
    expected = (F.cross_entropy(logits[keep], labels[keep].long(), reduction="sum") / (keep.sum() + 1e-5)).reshape(1)
    torch.testing.assert_close(loss, expected)
    grad, = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(grad, torch.autograd.grad(expected, logits)[0])

    assert loss_fn(logits, labels, torch.zeros(12)).item() == 0.0
    token_means = TokenMeansTo(loss_fn)  # as a placed net's: outside a step, the (sum, count) pair
    assert token_means.found and token_means.count_epsilon == 1e-5
    pair = loss_fn(logits.view(3, 4, 9), labels.view(3, 4), input_mask.view(3, 4))  # (B, T, V) flattened
    assert pair.dtype == torch.float32 and pair.shape == (2,)
    torch.testing.assert_close(pair, torch.stack([F.cross_entropy(logits[keep], labels[keep].long(), reduction="sum"),
                                                  keep.sum().float()]))


def test_cross_entropy_loss_follows_mindspore_value_shape_and_arguments():
    """MindSpore's loss: shape (1,) (``loss[0]`` works), over ``Σmask + 1e-5``, each token's value
    ``-log(softmax + 1e-24)`` (saturating near 55.26) with the plain cross-entropy's gradient; the forward's
    keywords are MindSpore's (``label``)."""
    logits = torch.tensor([[0.0, 200.0], [0.0, 0.0]], requires_grad=True)
    label, mask = torch.tensor([0, 0], dtype=torch.int32), torch.tensor([1.0, 0.0])
    loss = CrossEntropyLoss()(logits=logits, label=label, input_mask=mask)
    assert loss.shape == (1,)
    torch.testing.assert_close(loss[0], -torch.log(torch.tensor(1e-24)) / (1 + 1e-5))
    grad, = torch.autograd.grad(loss[0], logits)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 1.0], [0.0, 0.0]]) / (1 + 1e-5))
    half = CrossEntropyLoss()(torch.zeros(1, 2), torch.tensor([1], dtype=torch.int32), torch.tensor([0.5]))
    torch.testing.assert_close(half, torch.log(torch.tensor([2.0])) * 0.5 / (0.5 + 1e-5))


def _vocab_parallel_loss(logits, labels, input_mask):
    """On each of 2 ranks: the loss and logits gradient with the vocab split in (uneven) halves under
    ``loss_context``, for both reductions, on a mesh of the vocab alone and on a (1, 2) mesh as semi-auto
    strategies make."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from paratrain.config import ParallelConfig
    from paratrain.parallel.loss import loss_context

    dist.init_process_group("gloo")
    out = {}
    for shape in ((2,), (1, 2)):
        mesh = init_device_mesh("cpu", shape)
        placements = [Replicate()] * (len(shape) - 1) + [Shard(logits.ndim - 1)]
        for reduction in ("mean", "sum_and_count"):
            local = logits.chunk(2, dim=-1)[dist.get_rank()].clone().requires_grad_()  # DTensor's split: 5 + 4
            sharded = DTensor.from_local(local, mesh, placements, shape=logits.shape, stride=logits.stride())
            loss_fn = CrossEntropyLoss(OpParallelConfig(model_parallel=2))
            if reduction == "sum_and_count":
                TokenMeansTo(loss_fn)
            with loss_context(ParallelConfig(model_parallel=2)):
                loss = loss_fn(sharded, labels, input_mask)
                loss[0].backward() if reduction == "sum_and_count" else loss.backward()
            out[shape, reduction] = (type(loss).__name__, loss.tolist(), local.grad.tolist())
    return out  # lists: tensors would be passed as shared memory that the exiting worker frees


@pytest.mark.slow
def test_vocab_parallel_cross_entropy_on_two_processes_equals_one():
    torch.manual_seed(0)
    logits = 3 * torch.randn(4, 5, 9)
    labels = torch.randint(9, (4, 5))
    labels[0, :4] = torch.tensor([0, 4, 5, 8])  # both shards and their edges
    input_mask = (torch.rand(4, 5) > 0.25).float()
    ranks = run_distributed(_vocab_parallel_loss, 2, logits, labels, input_mask, timeout=120)
    for reduction in ("mean", "sum_and_count"):
        whole = logits.clone().requires_grad_()
        loss_fn = CrossEntropyLoss()
        if reduction == "sum_and_count":
            TokenMeansTo(loss_fn)
        expected = loss_fn(whole, labels, input_mask)
        (expected[0] if reduction == "sum_and_count" else expected).backward()
        for shape in ((2,), (1, 2)):
            for rank, out in enumerate(ranks):
                kind, loss, grad = out[shape, reduction]
                assert kind == "Tensor"  # a plain tensor, the same on every rank
                torch.testing.assert_close(torch.tensor(loss), expected.detach(), rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(torch.tensor(grad), whole.grad.chunk(2, dim=-1)[rank], rtol=1e-6,
                                           atol=1e-7)


# --- training ---------------------------------------------------------------------------------------------

class CopyNet(nn.Module):
    """A user's net of the tutorial's shape: word table + positions, Transformer, a head on the table, the loss."""

    def __init__(self, vocab: int, length: int, encoder_layers: int, decoder_layers: int):
        super().__init__()
        self.embedding = VocabEmbedding(vocab, 32, param_init="xavier_uniform")
        self.position = VocabEmbedding(length, 32, param_init="xavier_uniform")
        self.transformer = Transformer(hidden_size=32, batch_size=16, ffn_hidden_size=64, src_seq_length=length,
                                       tgt_seq_length=length, encoder_layers=encoder_layers,
                                       decoder_layers=decoder_layers, num_heads=4, **NO_DROPOUT)
        self.norm = nn.LayerNorm(32)
        self.attention_mask = AttentionMask(length)
        self.loss = CrossEntropyLoss()
        for module in self.modules():  # MindSpore's normal(0, 0.01) weights learn attention slowly
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)

    def embed(self, ids):
        words, table = self.embedding(ids)
        return words + self.position(torch.arange(ids.shape[1])[None])[0], table

    def forward(self, src_ids, tgt_in_ids, labels, label_mask):
        src, table = self.embed(src_ids)
        src_real = (src_ids != 0).float()
        if self.transformer.decoder is None:  # decoder-only: one causal sequence
            output = self.transformer(src, self.attention_mask(src_real))[0]
        else:
            tgt, _ = self.embed(tgt_in_ids)
            tgt_real = (tgt_in_ids != 0).float()
            output = self.transformer(src, src_real[:, :, None] * src_real[:, None, :], tgt,
                                      self.attention_mask(tgt_real), tgt_real[:, :, None] * src_real[:, None, :])[0]
        logits = self.norm(output) @ table.t()
        return self.loss(logits.flatten(0, 1), labels.flatten(), label_mask.flatten())


def train_copy(net, batch, steps):
    torch.manual_seed(1)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = net(*batch())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_encoder_decoder_transformer_learns_to_copy():
    torch.manual_seed(0)
    vocab, length = 16, 8

    def batch():
        src = torch.randint(2, vocab, (16, length))
        src[:8, 6:] = 0  # padded rows
        tgt_in = torch.cat([torch.ones(16, 1, dtype=torch.long), src[:, :-1]], 1)  # 1: begin-of-sequence
        tgt_in[:8, 7:] = 0
        return src, tgt_in, src, (src != 0).float()

    losses = train_copy(CopyNet(vocab, length, encoder_layers=1, decoder_layers=1), batch, steps=60)
    assert losses[-1] < 0.5 * losses[0], losses


def test_decoder_only_transformer_learns_to_copy():
    torch.manual_seed(0)
    vocab, half = 16, 5

    def batch():
        x = torch.randint(2, vocab, (16, half))
        seq = torch.cat([x, torch.ones(16, 1, dtype=torch.long), x], 1)  # x, separator, x again
        labels = torch.cat([seq[:, 1:], torch.zeros(16, 1, dtype=torch.long)], 1)
        label_mask = (torch.arange(seq.shape[1]) >= half).float().expand(16, -1)  # predict the second x
        return seq, None, labels, label_mask

    losses = train_copy(CopyNet(vocab, 2 * half + 1, encoder_layers=2, decoder_layers=0), batch, steps=40)
    assert losses[-1] < 0.5 * losses[0], losses


def test_the_forward_traces_with_torch_export():
    """The pipeline runtime splits the forward by tracing it: no data-dependent Python control flow."""
    masks = dict(encoder_masks=ones(B, S, S), decoder_masks=AttentionMask(T)(ones(B, T)), memory_mask=ones(B, T, S))
    for model, args in [(transformer(), (torch.randn(B, S, H), masks["encoder_masks"], torch.randn(B, T, H),
                                         masks["decoder_masks"], masks["memory_mask"])),
                        (transformer(decoder_layers=0), (torch.randn(B, S, H), AttentionMask(S)(ones(B, S))))]:
        exported = torch.export.export(model.eval(), args, strict=False)
        torch.testing.assert_close(exported.module()(*args)[0], model(*args)[0])


def test_a_users_net_splits_into_pipeline_stages():
    from torch.distributed.pipelining import SplitPoint, pipeline

    torch.manual_seed(0)
    net = CopyNet(16, 8, encoder_layers=1, decoder_layers=2)
    src, tgt_in = torch.randint(2, 16, (4, 8)), torch.randint(1, 16, (4, 8))
    args = (src, tgt_in, src, (src != 0).float())
    pipe = pipeline(net, mb_args=args, split_spec={"transformer.decoder.blocks.1": SplitPoint.BEGINNING})
    assert pipe.num_stages == 2
    torch.testing.assert_close(pipe(*args)[0], net(*args))


# --- lambda_func: pipeline stages, recompute, communication groups ----------------------------------------

def test_default_lambda_func_places_layers_as_mindspore():
    config = TransformerOpParallelConfig(pipeline_stage=2, micro_batch_num=2, gradient_aggregation_group=4,
                                         recompute=TransformerRecomputeConfig(recompute=True))
    model = transformer(encoder_layers=4, decoder_layers=4, parallel_config=config)
    blocks = list(model.encoder.blocks) + list(model.decoder.blocks)
    assert [b.pipeline_stage for b in blocks] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [b.comm_fusion for b in blocks] == [1, 1, 2, 2, 3, 3, 4, 4]  # 8 layers in 4 groups
    assert all(b.comm_fusion == b.output.comm_fusion for b in blocks)  # set_comm_fusion reaches the sub-cells
    assert {b.recompute_mode for b in blocks} == {"full"}

    config = TransformerOpParallelConfig(pipeline_stage=3, recompute=False)
    model = transformer(encoder_layers=4, decoder_layers=4, parallel_config=config)
    blocks = list(model.encoder.blocks) + list(model.decoder.blocks)
    assert [b.pipeline_stage for b in blocks] == [0, 0, 1, 1, 2, 2, 2, 2]  # 8 // 3 = 2 a stage, the rest on the last
    assert [b.comm_fusion for b in blocks] == [1, 1, 2, 2, 3, 3, 4, 4]  # MindSpore's default: 4 groups
    assert {b.recompute_mode for b in blocks} == {"none"}

    # a stack on its own counts its own layers; per-layer recompute lists are read with the offset
    encoder = TransformerEncoder(batch_size=B, num_layers=4, hidden_size=H, ffn_hidden_size=FFN, seq_length=S,
                                 num_heads=HEADS, parallel_config=TransformerOpParallelConfig(
                                     pipeline_stage=2, recompute=["full", "none", "selective", "none"]))
    assert [b.pipeline_stage for b in encoder.blocks] == [0, 0, 1, 1]
    assert [b.recompute_mode for b in encoder.blocks] == ["full", "none", "selective", "none"]
    with pytest.raises(UserError, match="3 layers cannot fill pipeline_stage=4"):
        transformer(encoder_layers=1, decoder_layers=2, parallel_config=TransformerOpParallelConfig(pipeline_stage=4))


def test_a_users_lambda_func_is_called_for_every_layer():
    calls = []

    def lambda_func(network, layer_id, offset, parallel_config, layers):
        calls.append((type(network).__name__, layer_id, offset, layers))
        network.pipeline_stage = 1 if layer_id + offset >= 1 else 0

    model = transformer(encoder_layers=2, decoder_layers=3, lambda_func=lambda_func)
    assert calls == [("TransformerEncoderLayer", 0, 0, 2), ("TransformerEncoderLayer", 1, 0, 2),
                     ("TransformerDecoderLayer", 0, 2, 3), ("TransformerDecoderLayer", 1, 2, 3),
                     ("TransformerDecoderLayer", 2, 2, 3)]
    assert [b.pipeline_stage for b in model.encoder.blocks] == [0, 1]


def test_recompute_config_in_the_parallel_config():
    config = TransformerOpParallelConfig(recompute=TransformerRecomputeConfig(recompute=True))
    assert config.recompute_mode(3) == "full" and config.to_dict()["recompute"] == "full"
    assert TransformerOpParallelConfig(recompute=TransformerRecomputeConfig()).recompute_mode(0) == "none"
    from conftest import tiny_config
    cfg = tiny_config()
    cfg.parallel = config
    assert validate(cfg) == []
    assert "recompute = \"full\"" in config_file.to_toml(cfg)


def test_cell_protocol():
    cell = Cell()
    assert (cell.pipeline_stage, cell.recompute_mode, cell.comm_fusion, cell.parallel_plan()) == (0, "none", None, {})
    cell.recompute()
    assert cell.recompute_mode == "full"
    cell.recompute(False)
    assert cell.recompute_mode == "none"
    cell.recompute("selective", mp_comm_recompute=True)  # MindSpore's options are accepted
    assert cell.recompute_mode == "selective"
    with pytest.raises(ValueError, match="'partial'"):
        cell.recompute("partial")
    layer = encoder_layer()
    layer.set_comm_fusion(3, recurse=False)
    assert layer.comm_fusion == 3 and layer.attention.comm_fusion is None


# --- tensor-parallel plans and the sharded-shape rule -----------------------------------------------------

def plans(model: nn.Module) -> dict[str, str]:
    """Every declared split in a model, by the full name of the module it applies to."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, Cell):
            for child, kind in module.parallel_plan().items():
                target = module.get_submodule(child)
                assert isinstance(target, (nn.Linear, nn.Embedding)) and child in dict(module.named_children())
                out[f"{name}.{child}".lstrip(".")] = kind
    return out


def test_parallel_plans_follow_model_parallel_and_vocab_emb_dp():
    attention = {"dense1": "colwise", "dense2": "colwise", "dense3": "colwise", "projection": "rowwise"}
    ffn = {"mapping": "colwise", "projection": "rowwise"}
    mp2, mp1 = OpParallelConfig(model_parallel=2), OpParallelConfig(model_parallel=1)
    assert MultiHeadAttention(B, S, S, H, HEADS, parallel_config=mp2).parallel_plan() == attention
    assert FeedForward(H, FFN, 0.0, parallel_config=mp2).parallel_plan() == ffn
    assert MultiHeadAttention(B, S, S, H, HEADS, parallel_config=mp1).parallel_plan() == {}
    assert FeedForward(H, FFN, 0.0, parallel_config=mp1).parallel_plan() == {}
    layer = decoder_layer(parallel_config=mp2)
    assert layer.parallel_plan() == {} and plans(layer) == {
        **{f"{part}.{k}": v for part in ("attention", "cross_attention") for k, v in attention.items()},
        **{f"output.{k}": v for k, v in ffn.items()}}
    model = transformer(encoder_layers=1, decoder_layers=1, parallel_config=TransformerOpParallelConfig(model_parallel=2))
    assert len(plans(model)) == 4 + 8 + 2 + 2 and plans(model)["decoder.blocks.0.cross_attention.dense2"] == "colwise"
    assert plans(transformer(encoder_layers=1, decoder_layers=1)) == {}

    for config, plan in [(EmbeddingOpParallelConfig(model_parallel=2, vocab_emb_dp=False), {"embedding": "vocab_rows"}),
                         (EmbeddingOpParallelConfig(model_parallel=2, vocab_emb_dp=True), {}),
                         (EmbeddingOpParallelConfig(model_parallel=1, vocab_emb_dp=False), {}),
                         (TransformerOpParallelConfig(model_parallel=2, vocab_emb_dp=False), {"embedding": "vocab_rows"})]:
        assert VocabEmbedding(8, 4, parallel_config=config).parallel_plan() == plan


def shard(model: nn.Module, rank: int, ways: int = 2) -> nn.Module:
    """A copy holding what tensor-parallel rank ``rank`` of ``ways`` holds: colwise Linears cut to their slice of
    output features, rowwise ones to their slice of input features (bias kept on rank 0 only, added once)."""
    model = copy.deepcopy(model)
    for module in list(model.modules()):
        if not isinstance(module, Cell):
            continue
        for name, kind in module.parallel_plan().items():
            linear = getattr(module, name)
            size = (linear.out_features if kind == "colwise" else linear.in_features) // ways
            cut = slice(rank * size, (rank + 1) * size)
            local = nn.Linear(*((linear.in_features, size) if kind == "colwise" else (size, linear.out_features)))
            with torch.no_grad():
                local.weight.copy_(linear.weight[cut] if kind == "colwise" else linear.weight[:, cut])
                local.bias.copy_(linear.bias[cut] if kind == "colwise" else linear.bias * (rank == 0))
            setattr(module, name, local)
    return model


def test_blocks_run_on_one_tensor_parallel_shard():
    torch.manual_seed(0)
    mp2 = OpParallelConfig(model_parallel=2)
    x, memory = torch.randn(B, T, H), torch.randn(B, S, H)
    mask, memory_mask = AttentionMask(T)(ones(B, T)), ones(B, T, S)

    # attention and FFN: each rank's output is a partial sum; the ranks' partials add up to the whole output
    attention = MultiHeadAttention(B, T, S, H, HEADS, 0.0, 0.0, parallel_config=mp2)
    whole, (key, _) = attention(x, memory, memory, memory_mask)
    parts = [shard(attention, rank)(x, memory, memory, memory_mask) for rank in (0, 1)]
    assert parts[0][0].shape == (B, T, H) and parts[0][1][0].shape == (B, HEADS // 2, H // HEADS, S)
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole)
    torch.testing.assert_close(torch.cat([parts[0][1][0], parts[1][1][0]], 1), key)
    ffn = FeedForward(H, FFN, 0.0, parallel_config=mp2)
    torch.testing.assert_close(shard(ffn, 0)(x) + shard(ffn, 1)(x), ffn(x))

    # whole layers and the Transformer run on a shard too (without the all-reduce the values are partial)
    out, present = shard(encoder_layer(parallel_config=mp2), 0)(x.new_ones(B, S, H), ones(B, S, S))
    assert out.shape == (B, S, H) and present[0].shape == (B, HEADS // 2, H // HEADS, S)
    out, present = shard(decoder_layer(parallel_config=mp2), 0)(x, mask, memory, memory_mask)
    assert out.shape == (B, T, H) and [p.shape[1] for p in present] == [HEADS // 2] * 4
    config = TransformerOpParallelConfig(model_parallel=2)
    out, en_past, de_past = shard(transformer(parallel_config=config), 0)(memory, ones(B, S, S), x, mask, memory_mask)
    assert out.shape == (B, T, H) and en_past[1][1].shape == (B, HEADS // 2, S, H // HEADS)
    assert shard(transformer(decoder_layers=0, parallel_config=config), 1)(memory, ones(B, S, S))[0].shape == (B, S, H)


# --- dtypes and refused options ---------------------------------------------------------------------------

def test_dtype_arguments():
    half = encoder_layer(param_init_type="float16", layernorm_compute_type=torch.float32)
    assert {p.dtype for p in half.parameters()} == {torch.float16}
    x = torch.randn(B, S, H)
    out, (key, _) = half(x, ones(B, S, S))
    assert out.dtype == torch.float32 and key.dtype == torch.float16  # outputs in the input's dtype
    assert half.layernorm1(x.half()).dtype == torch.float16
    # layernorm_compute_type: the bf16 LayerNorm of fp32 inputs is rounded, the fp32 one is not
    bf16_norm = encoder_layer(layernorm_compute_type="bfloat16").layernorm1
    assert not torch.equal(bf16_norm(x), F.layer_norm(x, (H,)))
    torch.testing.assert_close(encoder_layer().layernorm1(x), F.layer_norm(x, (H,)))
    assert transformer(softmax_compute_type=torch.float16, param_init_type=torch.bfloat16)(
        ones(B, S, H), ones(B, S, S), ones(B, T, H), ones(B, T, T), ones(B, T, S))[0].dtype == torch.float32


@pytest.mark.parametrize("build, words", [
    (lambda: encoder_layer(use_past=True), "use_past=True"),
    (lambda: transformer(use_past=True), "use_past=True"),
    (lambda: decoder_layer(moe_config=MoEConfig(expert_num=4, num_experts_chosen=5)), "num_experts_chosen=5"),
    (lambda: FeedForward(H, FFN, 0.1, expert_num=2), "expert_num=2"),
    (lambda: encoder_layer(param_init_type="float64"), "param_init_type='float64'"),
    (lambda: encoder_layer(hidden_act="swishy"), "hidden_act='swishy'"),
    (lambda: encoder_layer(hidden_dropout_rate=1.0), "hidden_dropout_rate=1.0"),
    (lambda: encoder_layer(parallel_config=OpParallelConfig(model_parallel=3)),
     "num_heads=4 is not divisible by parallel_config.model_parallel=3: use model_parallel in [1, 2, 4]; "
     "hidden_size=16 is not divisible"),
    (lambda: MultiHeadAttention(B, S, S, 15, 4), "hidden_size=15 is not divisible by num_heads=4"),
    (lambda: VocabEmbedding(9, 4, EmbeddingOpParallelConfig(model_parallel=2, vocab_emb_dp=False)), "vocab_size=9"),
    (lambda: VocabEmbedding(9, 4, param_init="glorot"), "param_init='glorot'"),
    (lambda: TransformerEncoder(B, 1, H, FFN, S, HEADS, parallel_config=OpParallelConfig()), "TransformerOpParallelConfig"),
    (lambda: transformer(encoder_layers=0), "encoder_layers=0 must be positive"),
])
def test_unsupported_options_are_refused_by_name(build, words):
    with pytest.raises(UserError) as caught:
        build()
    assert words in str(caught.value)


def test_activations_follow_mindspore():
    x = torch.linspace(-3, 3, 13)
    ffn = FeedForward(4, 8, 0.0)
    torch.testing.assert_close(ffn.activation(x), F.gelu(x, approximate="tanh"))  # MindSpore's GELU approximates
    torch.testing.assert_close(FeedForward(4, 8, 0.0, hidden_act="fast_gelu").activation(x), x * torch.sigmoid(1.702 * x))
    assert isinstance(FeedForward(4, 8, 0.0, hidden_act="ReLU").activation, nn.ReLU)
    assert isinstance(FeedForward(4, 8, 0.0, hidden_act=nn.SiLU).activation, nn.SiLU)


def test_a_cell_computes_in_construct():
    import paratrain.nn as pnn

    class Twice(pnn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = pnn.Dense(3, 2, has_bias=False)

        def construct(self, x):
            return 2 * self.dense(x)

    net = Twice()
    x = torch.ones(4, 3)
    torch.testing.assert_close(net(x), 2 * x @ net.dense.weight.T)
    with pytest.raises(UserError, match="Empty defines neither construct nor forward"):
        type("Empty", (pnn.Cell,), {})()(x)


def test_dropout_as_mindspore():
    import paratrain.nn as pnn

    dropout = pnn.Dropout(1 - 0.1)
    dropout.dropout.shard(((2, 1, 1),))
    assert dropout.dropout.strategy == ((2, 1, 1),) and dropout.dropout.keep_prob == pytest.approx(0.9)
    x = torch.ones(2, 40, 40)
    torch.manual_seed(0)
    y = dropout(x)
    assert 0.85 < (y != 0).float().mean() < 0.95 and y.max() == pytest.approx(1 / 0.9)
    dropout.eval()
    assert dropout(x) is x
    assert pnn.Dropout(keep_prob=1.0)(x) is x and pnn.Dropout(p=0)(x) is x
    assert pnn.Dropout(p=0.5).dropout.keep_prob == 0.5
    with pytest.raises(UserError, match=r"Dropout\(keep_prob=0\): expected a number in \(0, 1\]"):
        pnn.Dropout(0)
    with pytest.raises(UserError, match=r"Dropout\(p=1\): expected a number in \[0, 1\)"):
        pnn.Dropout(p=1)


def test_trainable_params_have_mindspore_names():
    import paratrain.nn as pnn
    from paratrain.nn import Parameter

    class Net(pnn.Cell):
        def __init__(self):
            super().__init__()
            self.dense, self.layernorm = nn.Linear(3, 3), nn.LayerNorm(3)

        def construct(self, x):
            return self.layernorm(self.dense(x))

    net = Net()
    params = net.trainable_params()
    assert [p.name for p in params] == ["dense.weight", "dense.bias", "layernorm.gamma", "layernorm.beta"]
    assert params[0] is net.dense.weight and isinstance(params[0], Parameter)
    assert copy.deepcopy(params[0]).name == "dense.weight"
    net(torch.ones(2, 3)).sum().backward()  # still the net's own parameters
    assert net.dense.weight.grad is not None
    assert Parameter(torch.zeros(2), name="w").name == "w"


def test_infer_param_pipeline_stage_gives_named_parameters():
    import paratrain.nn as pnn

    net = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    params = pnn.PipelineCell(net, 2).infer_param_pipeline_stage()
    assert [p.name for p in params] == ["0.weight", "0.bias", "1.gamma", "1.beta"]
    assert params[0] is net[0].weight
