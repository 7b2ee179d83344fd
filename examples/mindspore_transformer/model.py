"""The tutorial's translation network, written with paratrain's MindSpore-shaped blocks.

A port of MindSpore's ``model.py``: ``mindspore.nn.transformer`` -> ``paratrain.nn``, ``nn.Cell`` ->
``torch.nn.Module``, ``construct`` -> ``forward``. Nothing here calls a collective: the blocks declare
how they split over ``model_parallel``, ``lambda_func`` (the default) places the layers on pipeline
stages, and the head is put on the last stage by hand, as in the tutorial.
"""
import torch
from torch import nn

from paratrain.nn import AttentionMask, CrossEntropyLoss, Transformer, VocabEmbedding


class EmbeddingLayer(nn.Module):
    """Word and position embeddings: ids, positions (B, T) -> (B, T, H) and the word table (V, H)."""

    def __init__(self, vocab_size: int, seq_length: int, hidden_size: int, parallel_config, dropout: float = 0.1):
        super().__init__()
        self.word_embedding = VocabEmbedding(vocab_size=vocab_size, embedding_size=hidden_size,
                                             parallel_config=parallel_config.embedding_dp_mp_config)
        self.position_embedding = VocabEmbedding(vocab_size=seq_length, embedding_size=hidden_size,
                                                 parallel_config=parallel_config.embedding_dp_mp_config)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids, input_position):
        word_embedding, word_table = self.word_embedding(input_ids)
        position_embedding, _ = self.position_embedding(input_position)
        return self.dropout(word_embedding + position_embedding), word_table


class Net(nn.Module):
    """source ids, target ids and their masks (B, S), (B, T) -> the mean cross-entropy over target tokens."""

    def __init__(self, batch: int, src_len: int, tgt_len: int, hidden_size: int, vocab_size: int,
                 en_layer: int, de_layer: int, parallel_config, dropout: float = 0.1):
        super().__init__()
        self.src_embedding = EmbeddingLayer(vocab_size, src_len, hidden_size, parallel_config, dropout)
        self.tgt_embedding = EmbeddingLayer(vocab_size, tgt_len, hidden_size, parallel_config, dropout)
        self.transformer = Transformer(encoder_layers=en_layer, decoder_layers=de_layer, batch_size=batch,
                                       src_seq_length=src_len, tgt_seq_length=tgt_len, hidden_size=hidden_size,
                                       num_heads=8, ffn_hidden_size=hidden_size * 4, attention_dropout_rate=dropout,
                                       hidden_dropout_rate=dropout, parallel_config=parallel_config)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.head.pipeline_stage = parallel_config.pipeline_stage - 1
        self.attention_mask = AttentionMask(seq_length=tgt_len)
        self.loss = CrossEntropyLoss(parallel_config=parallel_config.dp_mp_config)
        self.vocab_size = vocab_size

    def forward(self, src_ids, src_position, src_mask, tgt_ids, tgt_position, tgt_mask, labels):
        encoder_input, _ = self.src_embedding(src_ids, src_position)
        decoder_input, _ = self.tgt_embedding(tgt_ids, tgt_position)
        encoder_mask = src_mask[:, None, :] * src_mask[:, :, None]
        memory_mask = tgt_mask[:, :, None] * src_mask[:, None, :]
        output, _, _ = self.transformer(encoder_input, encoder_mask, decoder_input,
                                        self.attention_mask(tgt_mask), memory_mask)
        logits = self.head(output).reshape(-1, self.vocab_size)
        return self.loss(logits, labels.reshape(-1), tgt_mask.reshape(-1).to(torch.float32))
