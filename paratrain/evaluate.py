"""Translation quality: greedy decoding with the encoder-decoder and corpus BLEU with sacrebleu."""
from __future__ import annotations

import sacrebleu
import torch

from paratrain.data.synthetic import BOS, EOS, PAD
from paratrain.data.tokenizer import Tokenizer
from paratrain.models.transformer import Seq2SeqModel


def bleu(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU (0-100) of detokenized hypotheses against one reference each, sacrebleu's default 13a tokenization."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    return sacrebleu.corpus_bleu(hypotheses, [references]).score


@torch.no_grad()
def greedy_decode(model: Seq2SeqModel, src_ids: torch.Tensor, max_length: int) -> torch.Tensor:
    """Most likely next token, one at a time: src_ids (B, S) -> tokens (B, <= max_length), PAD after EOS.

    The source is encoded once; each step feeds only the newest token to the
    decoder, whose self-attention keeps earlier keys/values in a cache
    (MindSpore's ``use_past``). ``max_length`` is at most the model's tgt_seq_length.
    """
    model.eval()
    t = model.transformer
    src_pad = src_ids == model.pad_token_id
    memory = t.encoder(model.src_embed(src_ids), t.padding_mask(src_pad, src_ids.shape[1]))
    memory_mask = t.padding_mask(src_pad, 1)
    caches = [{} for _ in t.decoder.layers]
    tokens = torch.full((len(src_ids), 1), BOS, dtype=torch.long, device=src_ids.device)
    done = torch.zeros(len(src_ids), dtype=torch.bool, device=src_ids.device)
    for step in range(max_length):
        hidden = t.decoder(model.tgt_embed(tokens[:, -1:], start=step), memory, None, memory_mask, caches)
        next_token = model.head(hidden[:, -1]).argmax(-1).masked_fill(done, PAD)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        done |= next_token == EOS
        if done.all():
            break
    return tokens[:, 1:]


def translate(model: Seq2SeqModel, tokenizer: Tokenizer, sentences: list[str], src_seq_length: int,
              tgt_seq_length: int, batch_size: int = 64) -> list[str]:
    """Greedy translations of ``sentences`` (sources longer than src_seq_length tokens are cut)."""
    out = []
    for start in range(0, len(sentences), batch_size):
        rows = [ids[:src_seq_length] for ids in tokenizer.encode_batch(sentences[start : start + batch_size])]
        src = torch.full((len(rows), max(map(len, rows))), PAD, dtype=torch.long)
        for i, ids in enumerate(rows):
            src[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        out += tokenizer.decode_batch(greedy_decode(model, src, tgt_seq_length).tolist())
    return out


def evaluate_bleu(model: Seq2SeqModel, tokenizer: Tokenizer, pairs: list[tuple[str, str]], src_seq_length: int,
                  tgt_seq_length: int) -> dict:
    """BLEU of greedy translations of the sources in ``pairs`` against their targets, and a few examples."""
    hypotheses = translate(model, tokenizer, [s for s, _ in pairs], src_seq_length, tgt_seq_length)
    return {"bleu": bleu(hypotheses, [t for _, t in pairs]),
            "examples": [{"source": s, "reference": t, "hypothesis": h} for (s, t), h in list(zip(pairs, hypotheses))[:3]]}
