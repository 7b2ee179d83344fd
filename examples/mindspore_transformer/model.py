"""The translation network of MindSpore's distributed Transformer tutorial, written with paratrain's MindSpore face.

A port changes the imports only: ``mindspore.nn`` -> ``paratrain.nn``, ``mindspore.ops`` -> ``paratrain.ops``,
``mindspore.dtype`` -> ``paratrain.dtype`` and the ``nn.transformer`` blocks from ``paratrain.nn``. Nothing here
calls a collective: the blocks declare their split over ``model_parallel``, ``pipeline_func`` puts the layers on
pipeline stages, and the op strategies split the batch dimension over ``data_parallel`` only.
"""
import paratrain.nn as nn
import paratrain.ops as ops
from paratrain import dtype as mstype
from paratrain.nn import AttentionMask, CrossEntropyLoss, Transformer, VocabEmbedding
from paratrain.nn import Dense as Linear


class EmbeddingLayer(nn.Cell):
    """Word plus position embedding with dropout: ids, positions (B, T) -> (B, T, H) and the word table (V, H)."""

    def __init__(self, vocab_size, position_size, embedding_size, parallel_config, dropout_rate=0.1):
        super().__init__()
        self.word_embedding = VocabEmbedding(vocab_size=vocab_size, embedding_size=embedding_size,
                                             parallel_config=parallel_config)
        self.position_embedding = VocabEmbedding(vocab_size=position_size, embedding_size=embedding_size,
                                                 parallel_config=parallel_config)
        dp = parallel_config.data_parallel
        self.add = ops.Add().shard(((dp, 1, 1), (dp, 1, 1)))
        self.dropout = nn.Dropout(1 - dropout_rate)
        self.dropout.dropout.shard(((dp, 1, 1),))

    def construct(self, input_ids, input_position):
        word_embedding, word_table = self.word_embedding(input_ids)
        position_embedding, _ = self.position_embedding(input_position)
        embed = self.dropout(self.add(word_embedding, position_embedding))
        return embed, word_table


class Net(nn.Cell):
    """An encoder-decoder Transformer and its head: the seven columns of ``dataset.py``'s batches -> the mean
    cross-entropy over the target tokens that are not PAD (``return_loss``), else the logits (B * T, vocab).
    ``dropout_rate`` (not in the tutorial) is the embeddings' dropout; 0 makes every layout's losses equal."""

    def __init__(self, batch, src_len, tgt_len, hidden_size, vocab_size, en_layer, de_layer, parallel_config,
                 return_loss=False, dropout_rate=0.1):
        super().__init__()
        embedding_config = parallel_config.embedding_dp_mp_config
        self.src_embedding = EmbeddingLayer(vocab_size=vocab_size, embedding_size=hidden_size, position_size=src_len,
                                            parallel_config=embedding_config, dropout_rate=dropout_rate)
        self.tgt_embedding = EmbeddingLayer(vocab_size=vocab_size, embedding_size=hidden_size, position_size=tgt_len,
                                            parallel_config=embedding_config, dropout_rate=dropout_rate)
        layers_per_stage = (en_layer + de_layer) // parallel_config.pipeline_stage
        self.src_embedding.pipeline_stage = 0
        self.tgt_embedding.pipeline_stage = 0
        self.return_loss = return_loss

        def pipeline_func(network, layer_id, offset, parallel_config, layers):
            # as the tutorial: at most two stages, four gradient fusion groups
            stage = min((layer_id + offset) // layers_per_stage, 1)
            network.pipeline_stage = stage
            spread = max((layer_id + offset) // 4, 1)
            network.set_comm_fusion((layer_id + offset) // spread + 1)
            print(f"pipeline id is:{stage}", flush=True)

        self.base1 = Transformer(encoder_layers=en_layer, decoder_layers=de_layer, batch_size=batch,
                                 src_seq_length=src_len, tgt_seq_length=tgt_len, hidden_size=hidden_size, num_heads=8,
                                 attention_dropout_rate=0.0, hidden_dropout_rate=0.0, lambda_func=pipeline_func,
                                 ffn_hidden_size=hidden_size, parallel_config=parallel_config)
        self.attention_mask = AttentionMask(seq_length=tgt_len)
        self.head = Linear(in_channels=hidden_size, out_channels=vocab_size, has_bias=False)
        self.head.matmul.shard(((1, 1), (1, 1)))
        self.head.pipeline_stage = parallel_config.pipeline_stage - 1
        self.loss = CrossEntropyLoss(parallel_config=parallel_config.dp_mp_config)
        self.no_equal = ops.NotEqual().shard(((1, 1), ()))

    def construct(self, encoder_input, encoder_position, encoder_mask, decoder_input, decoder_position,
                  memory_mask_input, y):
        encoder_embed, _ = self.src_embedding(encoder_input, encoder_position)
        decoder_embed, _ = self.tgt_embedding(decoder_input, decoder_position)
        not_pad = ops.Cast()(self.no_equal(decoder_input, 1), mstype.float32)  # PAD is id 1
        decoder_mask = self.attention_mask(not_pad)
        decoder_output, _, _ = self.base1(encoder_embed, encoder_mask, decoder_embed, decoder_mask, memory_mask_input)
        predict = self.head(decoder_output)
        predict = ops.Reshape()(predict, (-1, ops.shape(predict)[-1]))
        if not self.return_loss:
            return predict
        return self.loss(predict, ops.Reshape()(y, (-1,)), ops.Reshape()(not_pad, (-1,)))
