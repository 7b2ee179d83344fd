"""BLEU and greedy decoding of the encoder-decoder."""
import pytest
import torch

from paratrain.config import ModelConfig
from paratrain.data.synthetic import BOS, EOS, PAD
from paratrain.evaluate import bleu, greedy_decode
from paratrain.models.transformer import Seq2SeqModel


def test_bleu():
    refs = ["Le petit chat noir mange la pomme.", "Nous avons vu les grandes maisons blanches."]
    assert bleu(refs, refs) == pytest.approx(100)
    assert 0 < bleu(["Le petit chat mange la pomme.", "Nous avons vu les maisons."], refs) < 60
    with pytest.raises(ValueError, match="1 hypotheses but 2 references"):
        bleu(refs[:1], refs)


def _model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, hidden_size=32, num_heads=4, ffn_hidden_size=64, encoder_layers=2,
                      decoder_layers=2, src_seq_length=10, tgt_seq_length=12, hidden_dropout=0.0,
                      attention_dropout=0.0)
    return Seq2SeqModel(cfg)


def test_greedy_decode_matches_teacher_forced_argmax():
    model = _model()
    src = torch.randint(4, 40, (3, 10))
    src[1, 6:] = PAD
    tokens = greedy_decode(model, src, max_length=12)
    assert tokens.shape[0] == 3 and tokens.shape[1] <= 12
    tgt_in = torch.cat([torch.full((3, 1), BOS), tokens[:, :-1]], dim=1)
    predicted = model(src, tgt_in).argmax(-1)
    for row in range(3):
        ids = tokens[row].tolist()
        n = ids.index(EOS) + 1 if EOS in ids else len(ids)
        assert predicted[row, :n].tolist() == ids[:n]
        assert all(t == PAD for t in ids[n:])


class AlwaysEos(torch.nn.Module):
    def forward(self, hidden, labels=None):
        return torch.nn.functional.one_hot(torch.full(hidden.shape[:-1], EOS), 40).float()


def test_greedy_decode_stops_at_eos():
    model = _model()
    model.head = AlwaysEos()
    assert greedy_decode(model, torch.randint(4, 40, (2, 10)), max_length=12).tolist() == [[EOS], [EOS]]
