"""Training-step time: paratrain's encoder-decoder against ``torch.nn.Transformer`` at equal sizes.

Both sides do the same work per step: word + learned position embeddings (one
word table shared by source and target), a pre-LN 6+6 layer encoder-decoder,
a bias-free vocab head, token cross-entropy, backward, global-norm gradient
clipping and an AdamW step with weight decay. The paratrain side is exactly
what ``paratrain.trainer.Trainer.train_step`` does: ``Seq2SeqModel`` from a
``ModelConfig``, ``token_loss_sum / token count``, ``clip_grad_norm`` and the
optimizer of ``paratrain.optim.build_optimizer``. The torch side is what a
plain PyTorch user writes (``nn.Transformer(batch_first=True, norm_first=True)``,
``F.cross_entropy``, ``torch.optim.AdamW`` with its defaults).

The two are alternated step by step (the machine is shared and noisy, so only
the ratio measured in one run means much); each reports the median step time
after warm-up. Achieved GFLOP/s come from an analytic matmul FLOP count
(forward x 3 for forward + backward); the peak is a 2048^2 fp32 matmul
measured in the same run.

    python bench/step_time.py [--json PATH] [--steps N] [--layers L] [--hidden H] ...
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paratrain.config import ModelConfig, TrainConfig  # noqa: E402
from paratrain.metrics.flops import model_flops  # noqa: E402
from paratrain.models import Seq2SeqModel, token_loss_sum  # noqa: E402
from paratrain.optim import build_optimizer, clip_grad_norm  # noqa: E402

PAD = 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--steps", type=int, default=5, help="timed steps of each model (median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each model first")
    p.add_argument("--layers", type=int, default=6, help="encoder layers = decoder layers")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=64, help="source and target length")
    p.add_argument("--activation", choices=("relu", "gelu"), default="relu")
    p.add_argument("--torch-optimizer", choices=("default", "foreach", "fused"), default="default",
                   help="AdamW implementation of the torch side (default: what torch picks, a for-loop on CPU)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--peak-size", type=int, default=2048, help="matmul size for the peak GFLOP/s")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# --- the torch.nn.Transformer side -------------------------------------------------------------

class TorchSeq2Seq(nn.Module):
    """What a PyTorch user writes: embeddings + ``nn.Transformer`` + head (same sizes as paratrain's)."""

    def __init__(self, a: argparse.Namespace):
        super().__init__()
        self.word = nn.Embedding(a.vocab, a.hidden)
        self.src_pos = nn.Embedding(a.length, a.hidden)
        self.tgt_pos = nn.Embedding(a.length, a.hidden)
        with warnings.catch_warnings():  # "enable_nested_tensor is True, but ... norm_first was True"
            warnings.simplefilter("ignore")
            self.transformer = nn.Transformer(a.hidden, a.heads, a.layers, a.layers, a.ffn, dropout=0.0,
                                              activation=a.activation, batch_first=True, norm_first=True)
        self.head = nn.Linear(a.hidden, a.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, src, tgt):
        pos = torch.arange(src.shape[1])
        causal = torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool).triu(1)  # True: masked out
        src_pad, tgt_pad = src == PAD, tgt == PAD
        hidden = self.transformer(self.word(src) + self.src_pos(pos), self.word(tgt) + self.tgt_pos(pos),
                                  tgt_mask=causal, tgt_is_causal=True, src_key_padding_mask=src_pad,
                                  tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
        return self.head(hidden)


def torch_step_fn(a, train_cfg):
    model = TorchSeq2Seq(a)
    impl = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[a.torch_optimizer]
    opt = torch.optim.AdamW(model.parameters(), lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2),
                            eps=train_cfg.eps, weight_decay=train_cfg.weight_decay, **impl)

    def step(src, tgt_in, labels):
        model.train()
        logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=PAD)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return model, step


# --- the paratrain side (mirrors Trainer.train_step with micro_batch_num = 1) ------------------

def model_config(a) -> ModelConfig:
    """The encoder-decoder both sides build."""
    return ModelConfig(kind="transformer", vocab_size=a.vocab, hidden_size=a.hidden, num_heads=a.heads,
                       ffn_hidden_size=a.ffn, encoder_layers=a.layers, decoder_layers=a.layers,
                       src_seq_length=a.length, tgt_seq_length=a.length, hidden_dropout=0.0,
                       attention_dropout=0.0, hidden_act=a.activation, pad_token_id=PAD)


def paratrain_step_fn(a, train_cfg):
    model = Seq2SeqModel(model_config(a))
    opt = build_optimizer(model, train_cfg)

    def step(src, tgt_in, labels):
        model.train()
        num_tokens = (labels != PAD).sum()
        loss = token_loss_sum(model(src, tgt_in).float(), labels, PAD) / num_tokens
        loss.backward()
        clip_grad_norm(model.parameters(), train_cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return model, step


# --- peak ----------------------------------------------------------------------------------------

def peak_gflops(n: int, repeats: int = 5) -> float:
    x, y = torch.randn(n, n), torch.randn(n, n)
    torch.mm(x, y)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(x, y)
        times.append(time.perf_counter() - start)
    return 2 * n ** 3 / min(times) / 1e9


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    train_cfg = TrainConfig()
    sides = {"paratrain": paratrain_step_fn(a, train_cfg), "torch": torch_step_fn(a, train_cfg)}
    gen = torch.Generator().manual_seed(a.seed)
    src, tgt = (torch.randint(1, a.vocab, (a.batch, a.length + 1), generator=gen) for _ in range(2))
    batch = (src[:, :-1], tgt[:, :-1], tgt[:, 1:])

    peaks = [peak_gflops(a.peak_size)]
    for _ in range(a.warmup):
        for _, step in sides.values():
            step(*batch)
    times = {name: [] for name in sides}
    for i in range(a.steps):
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]  # alternate who goes first
        for name in order:
            start = time.perf_counter()
            sides[name][1](*batch)
            times[name].append(time.perf_counter() - start)
    peaks.append(peak_gflops(a.peak_size))

    flops = model_flops(model_config(a), a.batch, (a.length, a.length))  # paratrain's one FLOP count
    p_s, t_s = statistics.median(times["paratrain"]), statistics.median(times["torch"])
    # a step of each side ran back to back under the same load: the median of those pairs' ratios is the
    # figure least moved by other processes on a shared machine
    paired = statistics.median(p / t for p, t in zip(times["paratrain"], times["torch"]))
    result = {
        "paratrain_s": p_s, "torch_s": t_s, "ratio": p_s / t_s, "paired_ratio": paired,
        "gflops": flops / p_s / 1e9, "torch_gflops": flops / t_s / 1e9, "peak_gflops": max(peaks),
        "step_gflop": flops / 1e9,
        "params": count(sides["paratrain"][0]), "torch_params": count(sides["torch"][0]),
        "paratrain_times_s": times["paratrain"], "torch_times_s": times["torch"],
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "threads": torch.get_num_threads(), "torch_version": torch.__version__,
    }
    print_table(result)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


def print_table(r: dict) -> None:
    c = r["config"]
    title = (f"train step, {c['layers']}+{c['layers']} layers d{c['hidden']} ffn{c['ffn']} h{c['heads']} "
             f"V{c['vocab']} B{c['batch']} L{c['length']} fp32 {c['activation']}, {r['threads']} threads, "
             f"{r['step_gflop']:.4g} GFLOP/step, peak {r['peak_gflops']:.1f} GFLOP/s")
    rows = [("paratrain", r["paratrain_s"], r["gflops"], r["params"]),
            ("torch.nn.Transformer", r["torch_s"], r["torch_gflops"], r["torch_params"])]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for name, s, g, n in rows:
            print(f"{name:22s} {s:8.3f} s  {g:7.1f} GFLOP/s  {100 * g / r['peak_gflops']:5.1f} % peak  {n / 1e6:.1f} M")
        print(f"ratio paratrain/torch = {r['ratio']:.3f}, median of paired steps {r['paired_ratio']:.3f}")
        return
    table = Table(title=title)
    for col in ("model", "median step (s)", "GFLOP/s", "% of peak", "params (M)"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, s, g, n in rows:
        table.add_row(name, f"{s:.3f}", f"{g:.1f}", f"{100 * g / r['peak_gflops']:.1f}", f"{n / 1e6:.1f}")
    table.caption = (f"ratio paratrain/torch = {r['ratio']:.3f} (medians of {len(r['torch_times_s'])} alternated "
                     f"steps); median ratio of back-to-back pairs {r['paired_ratio']:.3f}")
    Console().print(table)


if __name__ == "__main__":
    main()
