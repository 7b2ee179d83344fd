"""MindSpore's distributed-training tutorial net (word and position embeddings, an encoder-decoder Transformer, a
head and CrossEntropyLoss over the decoder's unpadded tokens), built in MindSpore 2.7.0 and in paratrain.nn with
the same weights: its loss, its gradients, and 5 AdamWeightDecay steps on the tutorial's decay groups. At every
step each library's loss and gradients are compared, then both optimizers step on MindSpore's gradients (as in
``test_optimizer``) and the parameters are compared; paratrain's net then takes MindSpore's parameters, so each
step starts from the same weights (an fp32 rounding of 1e-7 in the weights parts the small query and key
gradients by more than 1e-5 a few steps on)."""
import mindspore
import numpy as np
import pytest
import torch
from mindspore import nn as ms_nn
from mindspore import ops
from mindspore.parallel import _transformer as ms_transformer

import paratrain.nn as pnn
from reference import (Gelu, assert_close, assert_same_grads, copy_weights, in_fp32, ms_tensor, ms_value_and_grads,
                       ms_weights, paratrain_name, to_paratrain, torch_value_and_grads)
from test_optimizer import tutorial_groups

B, S, T, H, V, HEADS, PAD = 2, 6, 5, 32, 24, 8, 1  # the tutorial's 8 heads; id 1 pads the decoder's input


def transformer_args(layers: int) -> dict:
    return dict(encoder_layers=layers, decoder_layers=layers, batch_size=B, src_seq_length=S, tgt_seq_length=T,
                hidden_size=H, num_heads=HEADS, attention_dropout_rate=0.0, hidden_dropout_rate=0.0,
                ffn_hidden_size=H)


def embeddings(library, positions: int) -> tuple:
    """The tutorial's EmbeddingLayer's word and position tables, ``library``'s VocabEmbeddings (its dropout is 0)."""
    return (library.VocabEmbedding(vocab_size=V, embedding_size=H),
            library.VocabEmbedding(vocab_size=positions, embedding_size=H))


class MsNet(ms_nn.Cell):
    """The tutorial's Net with ``return_loss=True``, stand-alone."""

    def __init__(self, layers: int):
        super().__init__()
        self.src_word, self.src_position = embeddings(ms_transformer, S)
        self.tgt_word, self.tgt_position = embeddings(ms_transformer, T)
        self.base1 = ms_transformer.Transformer(**transformer_args(layers), hidden_act=Gelu)
        self.attention_mask = ms_transformer.AttentionMask(seq_length=T)
        self.head = ms_nn.Dense(in_channels=H, out_channels=V, has_bias=False)
        self.loss = ms_transformer.CrossEntropyLoss()

    def construct(self, encoder_input, encoder_position, encoder_mask, decoder_input, decoder_position, memory_mask,
                  y):
        input_mask = ops.cast(ops.not_equal(decoder_input, PAD), mindspore.float32)
        source = self.src_word(encoder_input)[0] + self.src_position(encoder_position)[0]
        target = self.tgt_word(decoder_input)[0] + self.tgt_position(decoder_position)[0]
        output, _, _ = self.base1(source, encoder_mask, target, self.attention_mask(input_mask), memory_mask)
        logits = self.head(output).reshape(-1, V)
        return self.loss(logits, y.reshape(-1), input_mask.reshape(-1))


class Net(pnn.Cell):
    """``MsNet`` in paratrain."""

    def __init__(self, layers: int):
        super().__init__()
        self.src_word, self.src_position = embeddings(pnn, S)
        self.tgt_word, self.tgt_position = embeddings(pnn, T)
        self.base1 = pnn.Transformer(**transformer_args(layers))
        self.attention_mask = pnn.AttentionMask(seq_length=T)
        self.head = torch.nn.Linear(H, V, bias=False)
        self.loss = pnn.CrossEntropyLoss()

    def forward(self, encoder_input, encoder_position, encoder_mask, decoder_input, decoder_position, memory_mask, y):
        input_mask = (decoder_input != PAD).float()
        source = self.src_word(encoder_input)[0] + self.src_position(encoder_position)[0]
        target = self.tgt_word(decoder_input)[0] + self.tgt_position(decoder_position)[0]
        output, _, _ = self.base1(source, encoder_mask, target, self.attention_mask(input_mask), memory_mask)
        logits = self.head(output).reshape(-1, V)
        return self.loss(logits, y.reshape(-1), input_mask.reshape(-1))


def batch(rng) -> list[np.ndarray]:
    """The tutorial's inputs: source ids and positions, the source mask, target ids (padded) and positions, the
    memory mask, the labels."""
    source = rng.integers(2, V, (B, S))
    target = rng.integers(2, V, (B, T))
    target[1, T - 2:] = PAD
    source_mask = np.ones((B, S, S), np.float32)
    memory_mask = np.ones((B, T, S), np.float32)
    positions = np.arange(max(S, T))[None].repeat(B, 0)
    return [source, positions[:, :S], source_mask, target, positions[:, :T], memory_mask, rng.integers(0, V, (B, T))]


@pytest.mark.parametrize("layers", [1, 2])
def test_tutorial_net(layers):
    ms_net, net = in_fp32(MsNet(layers)), Net(layers)
    copy_weights(ms_net, net)
    rng = np.random.default_rng(0)
    ms_optimizer = ms_nn.AdamWeightDecay(tutorial_groups(ms_net.trainable_params(), lambda p: p.name),
                                         learning_rate=1e-2)
    optimizer = pnn.AdamWeightDecay(tutorial_groups(net.trainable_params(), lambda p: p.param_name),
                                    learning_rate=1e-2)
    ms_names = {p.name: name for name, p in ms_net.parameters_and_names()}
    what = f"tutorial net ({layers} + {layers} layers)"
    for step in range(5):
        inputs = batch(rng)
        ms_loss, ms_grads, _ = ms_value_and_grads(ms_net, ms_net, inputs)
        loss, grads, _ = torch_value_and_grads(net, net, inputs)
        assert loss.shape == ms_loss.shape
        assert_close(f"{what}: loss", loss, ms_loss)
        assert_same_grads(f"{what}: gradients", grads, ms_grads)
        ms_optimizer(tuple(mindspore.Tensor(to_paratrain(ms_names[p.name], ms_grads[paratrain_name(ms_names[p.name])]))
                           for p in ms_optimizer.parameters))
        for name, p in net.named_parameters():
            p.grad = torch.from_numpy(ms_grads[name].copy())
        optimizer.step()
        parameters = dict(net.named_parameters())
        for name, value in ms_weights(ms_net).items():
            assert_close(f"{what}: parameters after AdamWeightDecay", parameters[name].detach().numpy(), value,
                         name=name)
        copy_weights(ms_net, net)
