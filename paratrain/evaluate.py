"""Evaluation while training: a decoder's held-out loss and perplexity; for the encoder-decoder, translation quality
(greedy decoding and corpus BLEU with sacrebleu)."""
from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Iterable

import sacrebleu
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.utils.rnn import pad_sequence

from paratrain.config import MODEL_KINDS
from paratrain.data.synthetic import BOS, EOS, PAD
from paratrain.errors import UserError
from paratrain.data.tokenizer import Tokenizer
from paratrain.models.transformer import Seq2SeqModel
from paratrain.parallel.placed import PlacedModel

MAX_LOG_PPL = 700.0  # exp of more overflows a float: a larger held-out loss's perplexity is reported as exp(700)


def bleu(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU (0-100) of detokenized hypotheses against one reference each (sacrebleu, 13a tokenization)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    return sacrebleu.corpus_bleu(hypotheses, [references]).score


@torch.no_grad()
def greedy_decode(model: Seq2SeqModel, src_ids: torch.Tensor, max_length: int) -> torch.Tensor:
    """Most likely next token, one at a time: src_ids (B, S) -> tokens (B, <= max_length <= tgt_seq_length), PAD
    after EOS. The source is encoded once; each step feeds the decoder only the newest token, the earlier ones'
    keys/values cached (MindSpore's ``use_past``)."""
    model.eval()
    src_pad = src_ids == model.pad_token_id
    memory = model.encode(src_ids)
    caches: dict = {}
    tokens = torch.full((len(src_ids), 1), BOS, dtype=torch.long, device=src_ids.device)
    done = torch.zeros(len(src_ids), dtype=torch.bool, device=src_ids.device)
    for step in range(max_length):
        logits = model.decode(tokens[:, -1:], memory, src_pad, caches=caches, start=step)[:, -1]
        if isinstance(logits, DTensor):  # tensor parallel: the head's output is vocab-sharded
            logits = logits.full_tensor()
        next_token = logits.argmax(-1).masked_fill(done, PAD)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        done |= next_token == EOS
        if done.all():
            break
    return tokens[:, 1:]


def translate(model: Seq2SeqModel, tokenizer: Tokenizer, sentences: list[str], src_seq_length: int,
              tgt_seq_length: int, batch_size: int = 64) -> list[str]:
    """Greedy translations of ``sentences`` (sources longer than src_seq_length tokens are cut)."""
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(sentences), batch_size):
        rows = [torch.tensor(ids[:src_seq_length], dtype=torch.long, device="cpu")
                for ids in tokenizer.encode_batch(sentences[start : start + batch_size])]
        src = pad_sequence(rows, batch_first=True, padding_value=PAD)
        out += tokenizer.decode_batch(greedy_decode(model, src.to(device, non_blocking=True), tgt_seq_length).tolist())
    return out


def translation_tokenizer(cfg) -> Tokenizer:
    """The tokenizer a translation config names (``data.tokenizer``, else tokenizer.json next to data.path);
    unlike training, never trains one: a missing file is a UserError."""
    path = Path(cfg.data.tokenizer or (Path(cfg.data.path).with_name("tokenizer.json") if cfg.data.path else ""))
    if not cfg.data.tokenizer and not cfg.data.path or not path.is_file():
        raise UserError(f"tokenizer {str(path) or '(none configured)'} not found: the checkpoint's config names data."
                        f"tokenizer={cfg.data.tokenizer!r}; pass --data.tokenizer=PATH to the one used in training")
    tokenizer = Tokenizer.load(path)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise UserError(f"tokenizer {path} has {tokenizer.vocab_size} tokens, more than the model's "
                        f"vocab_size={cfg.model.vocab_size}: it is not the tokenizer this model was trained with")
    return tokenizer


def load_translation_model(checkpoint: str | Path, config: str | Path | None = None, overrides: list[str] = (),
                           device: torch.device | str = "cpu"):
    """(plain Seq2SeqModel in eval mode on ``device``, Config, Tokenizer) from a checkpoint (or the newest of a
    checkpoints or run directory), in this one process, with the checkpoint's config (``config``, a TOML file,
    replaces it) and ``overrides`` (``section.key=value``)."""
    from paratrain.checkpoint.full import load_full_tensors
    from paratrain.checkpoint.storage import read_meta, resolve
    from paratrain import config_file
    from paratrain.models import build_model

    path = resolve(checkpoint)
    meta = read_meta(path)
    cfg = config_file.load(config, overrides) if config else config_file.from_dict(meta["config"], overrides)
    if cfg.model.kind not in MODEL_KINDS or not cfg.model.spec.encoder_decoder:
        raise UserError(f"checkpoint {path} holds a {cfg.model.kind!r} model; paratrain translate needs the "
                        f"encoder-decoder (model.kind = \"transformer\")")
    tokenizer = translation_tokenizer(cfg)
    model = build_model(cfg.model)
    try:
        model.load_state_dict(load_full_tensors(path, trust_unverified=cfg.checkpoint.trust_unverified))
    except RuntimeError as exc:
        raise UserError(f"checkpoint {path} does not fit the configured model: {exc}") from None
    return model.to(device).eval(), cfg, tokenizer


class BleuEvaluator:
    """BLEU of greedy translations of held-out ``pairs`` every ``every`` steps: every rank decodes (the
    forward is collective under FSDP and tensor parallelism), only the main rank's record gets ``bleu``."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, pairs: list[tuple[str, str]], every: int,
                 src_seq_length: int, tgt_seq_length: int, is_main: bool):
        self.model, self.tokenizer, self.pairs, self.every = model, tokenizer, pairs, every
        self.lengths, self.is_main = (src_seq_length, tgt_seq_length), is_main

    def due(self, step: int) -> bool:
        """Whether ``step`` (counting from 1) is evaluated: a multiple of ``every``."""
        return step % self.every == 0 and bool(self.pairs)

    def __call__(self, step: int, record: dict) -> None:
        """When ``step`` is ``due``, decode and put ``bleu`` in the main rank's record."""
        if not self.due(step):
            return
        root_sharded = isinstance(self.model, FSDPModule)  # its own parameters (embeddings, head) stay sharded
        if root_sharded:
            self.model.unshard()
        try:
            hypotheses = translate(self.model, self.tokenizer, [s for s, _ in self.pairs], *self.lengths)
        finally:
            if root_sharded:
                self.model.reshard()
            self.model.train()
        if self.is_main:
            record["bleu"] = bleu(hypotheses, [t for _, t in self.pairs])


def bleu_evaluator(cfg, model_parts: list[nn.Module], pipelined: bool, is_main: bool) -> BleuEvaluator | None:
    """The BLEU evaluator a run's config asks for (``train.eval_steps``), or None -- with one warning on the
    main rank when eval_steps is set but cannot apply."""
    from paratrain.data.loader import load_tokenizer
    from paratrain.data.wmt14 import read_pairs

    if cfg.train.eval_steps <= 0:
        return None
    why = None
    if not cfg.model.spec.encoder_decoder or cfg.data.kind != "translation":
        why = (f"BLEU needs the encoder-decoder on a translation dataset (model.kind={cfg.model.kind!r}, "
               f"data.kind={cfg.data.kind!r})")
    elif pipelined:
        why = "BLEU is not computed under pipeline parallelism (parallel.pipeline_stage > 1)"
    elif not cfg.data.eval_path:
        why = "BLEU needs held-out pairs: set data.eval_path"
    if why:
        if is_main:
            warnings.warn(f"train.eval_steps={cfg.train.eval_steps}: {why}; no BLEU in this run", stacklevel=2)
        return None
    return BleuEvaluator(model_parts[0], load_tokenizer(cfg), read_pairs(cfg.data.eval_path)[: cfg.data.eval_samples],
                         cfg.train.eval_steps, cfg.model.src_seq_length, cfg.model.tgt_seq_length, is_main)


class HeldOutLoss:
    """A decoder's held-out loss every ``every`` steps: the summed token loss of ``batches`` (this rank's rows of
    each held-out global batch: ``paratrain.data.loader.HeldOutBatches``) over their tokens but ``ignore_index``,
    added up over the data-parallel ranks -- the training loss's token mean, over every held-out batch. Every rank
    runs the forwards (``TokenSumLoss.held_out_loss_sum``); only the main rank's record gets ``eval_loss`` and
    ``eval_ppl`` (its exponential)."""

    def __init__(self, placed: PlacedModel, batches: Iterable[dict[str, torch.Tensor]], every: int, is_main: bool):
        self.placed, self.batches, self.every, self.is_main = placed, batches, every, is_main

    def due(self, step: int) -> bool:
        """Whether ``step`` (counting from 1) is evaluated: a multiple of ``every``."""
        return step % self.every == 0

    def __call__(self, step: int, record: dict) -> None:
        """When ``step`` is ``due``, measure the held-out loss and put it in the main rank's record."""
        if not self.due(step):
            return
        sums, counts = [], []
        for batch in self.batches:
            sums.append(self.placed.loss.held_out_loss_sum(self.placed, batch).double())
            counts.append((batch["labels"] != self.placed.loss.ignore_index).sum().double())
        loss_sum, count = self.placed.layout.all_reduce_dp(torch.stack([torch.stack(sums).sum(),
                                                                        torch.stack(counts).sum()])).tolist()
        if self.is_main:
            record["eval_loss"] = loss_sum / max(count, 1.0)
            record["eval_ppl"] = math.exp(min(record["eval_loss"], MAX_LOG_PPL))


def build_evaluator(cfg, placed: PlacedModel, is_main: bool) -> HeldOutLoss | BleuEvaluator | None:
    """The evaluation ``train.eval_steps`` asks for: a decoder's held-out loss on ``data.eval_path`` (synthetic data:
    windows it never trains on), the first ``data.eval_batches`` global batches; the encoder-decoder's BLEU
    (``bleu_evaluator``); None when off."""
    from paratrain.data.loader import HeldOutBatches, build_dataset

    if cfg.model.spec.encoder_decoder:
        return bleu_evaluator(cfg, placed.parts, placed.pipeline is not None, is_main)
    if cfg.train.eval_steps <= 0:
        return None
    layout = placed.layout
    batches = HeldOutBatches(build_dataset(cfg, "eval_path"), cfg.train.global_batch_size, cfg.data.eval_batches,
                             layout.dp_rank, layout.dp_size, layout.device)
    return HeldOutLoss(placed, batches, cfg.train.eval_steps, is_main)
