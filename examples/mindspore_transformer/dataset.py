"""The data of MindSpore's distributed Transformer tutorial with paratrain's MindSpore-shaped dataset: a file of
``source<TAB>target`` lines, split on spaces, as seven columns (source ids, positions and mask, target ids,
positions, memory mask, labels) in batches of whole rows.

A port changes the imports only: ``mindspore.dataset`` -> ``paratrain.dataset``,
``mindspore.dataset.transforms.c_transforms`` -> ``paratrain.dataset.transforms.c_transforms``,
``mindspore.dtype`` -> ``paratrain.dtype``.
"""
from collections import Counter

import numpy as np

import paratrain.dataset as ds
import paratrain.dataset.transforms.c_transforms as C
from paratrain import dtype as mstype


class Tokenzier:
    """Splits on spaces; one vocabulary per side, built from the data: ids 0, 1, 2 are UNK, PAD and EOT, the
    words follow from the most frequent (the tutorial's spelling of the class name)."""

    def __init__(self, vocab=None):
        self.field_vocab = dict(src=dict(), tgt=dict())

    def tokenize(self, sentence):
        return sentence.split()

    def convert_token_to_ids(self, sentence, key):
        vocab = self.field_vocab[key]
        return [vocab.get(word, 0) for word in sentence]

    def build_vocab(self, data, key):
        """The vocabulary of side ``key`` from its sentences ``data``."""
        counts = Counter(word for line in data if line.strip() for word in line.split())
        words = [word for word, _ in counts.most_common()]
        self.special_vocab = ['UNK', 'PAD', 'EOT']
        vocab = {word: i + len(self.special_vocab) for i, word in enumerate(words)}
        vocab.update({word: i for i, word in enumerate(self.special_vocab)})
        self.field_vocab[key] = vocab


class ToyDataset():
    """The pairs of ``file_path`` whose source has more than ``seq_length[0] + 1`` words: the source cut to
    ``seq_length[0]`` ids, the target padded or cut to ``seq_length[1]``, the labels the target shifted by one with
    EOT last."""

    def __init__(self, file_path, seq_length, tokenizer):
        self.file_path = file_path
        self.tokenizer = tokenizer
        self.seq_length = seq_length

    def _read_data(self):
        """The file's (sources, targets)."""
        sources, targets = [], []
        with open(self.file_path, 'r') as fp:
            for line in fp:
                line = line.strip()
                if line:
                    src, tgt = line.split('\t')
                    sources.append(src)
                    targets.append(tgt)
        return sources, targets

    def get_dataset(self, batch_size):
        """The batches of ``batch_size`` rows, the last partial one dropped."""
        src_sentence, target_sentence = self._read_data()
        self.tokenizer.build_vocab(src_sentence, key='src')
        self.tokenizer.build_vocab(target_sentence, key='tgt')
        print('Source vocab size:{}'.format(len(self.tokenizer.field_vocab['src'])))
        print('Target vocab size:{}'.format(len(self.tokenizer.field_vocab['tgt'])))
        type_cast_op = C.TypeCast(mstype.int32)
        type_cast_op_float = C.TypeCast(mstype.float16)
        src_seq, tgt_seq = self.seq_length

        def generator_seq2seq():
            for src, tgt in zip(src_sentence, target_sentence):
                src_words = self.tokenizer.tokenize(src)
                tgt_words = self.tokenizer.tokenize(tgt)
                if len(src_words) <= src_seq + 1:
                    continue
                src_ids = np.array(self.tokenizer.convert_token_to_ids(src_words, key='src')[:src_seq])
                src_position = np.arange(0, src_seq)
                src_attention_mask = np.ones((src_seq, src_seq))
                tgt_words = (tgt_words + ['PAD'] * (tgt_seq - len(tgt_words)))[:tgt_seq]
                tgt_ids = self.tokenizer.convert_token_to_ids(tgt_words, key='tgt')
                tgt_position = np.arange(0, tgt_seq).astype(np.int32)
                memory_mask = np.ones((tgt_seq, src_seq)).astype(np.float16)
                label = tgt_ids[1:] + self.tokenizer.convert_token_to_ids(["EOT"], key="tgt")
                yield (src_ids, src_position, src_attention_mask, np.array(tgt_ids).astype(np.int32), tgt_position,
                       memory_mask, np.array(label).astype(np.int32))

        ts = ds.GeneratorDataset(generator_seq2seq, column_names=['src_ids', 'src_position', 'attention_mask',
                                                                  'tgt_ids', 'tgt_position', 'memory_mask', 'label'])
        ts = ts.map(input_columns="src_ids", operations=type_cast_op)
        ts = ts.map(input_columns="src_position", operations=type_cast_op)
        ts = ts.map(input_columns="attention_mask", operations=type_cast_op_float)
        ts = ts.batch(batch_size, drop_remainder=True)
        return ts
