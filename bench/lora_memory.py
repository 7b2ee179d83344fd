"""Full fine-tuning against LoRA on the same model, side by side in one run: peak memory and step time.

Every side trains the same random Llama from one Hugging Face directory on the same token batches (the model,
data, steps and flags of ``bench/llama_hf.py``, which this script reuses: default hidden 512, 4 layers, vocab
32000, seq 256, global batch 8, fp32, fused AdamW), through ``paratrain.trainer.Trainer`` with ``model.from_hf``:
``full`` trains every weight, ``lora_r<R>`` trains adapters of rank R (alpha 2R, every projection) on the frozen
base. Each side is its own torchrun job (``--ranks``: data parallel), 1 thread a rank over gloo, ``--repeats``
times in alternating order; peak RSS over the timed steps as bench/llama_hf.py measures it.

Reported per rank count and side: step time, tokens/s, peak RSS (max over ranks and repeats), the trainable
parameters, and the ratios against ``full`` (memory: lower is LoRA's gain).

    python bench/lora_memory.py [--lora-ranks 8,16] [--quick] [--json PATH] [--ranks 1] [llama_hf.py's flags]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import llama_hf  # noqa: E402


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.Namespace]:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--lora-ranks", default="8,16", help="adapter ranks, comma-separated")
    mine, rest = own.parse_known_args(argv)
    mine.lora_ranks = [int(r) for r in mine.lora_ranks.split(",")]
    a = llama_hf.parse_args(rest + (["--ranks", "1"] if "--ranks" not in rest else []))
    if "--out" not in rest:
        a.out = ROOT / "runs/bench/lora_memory"
    return mine, a


def sides(lora_ranks: list[int]) -> dict[str, dict | None]:
    """Side name -> its [lora] section (None: full fine-tuning)."""
    return {"full": None, **{f"lora_r{r}": {"rank": r, "alpha": 2 * r} for r in lora_ranks}}


def trainable_params(model_dir: str, lora: dict | None) -> int:
    """The parameters the side trains, counted on the model built on the meta device."""
    import torch

    from paratrain import config_file
    from paratrain.lora import add_adapters
    from paratrain.models import build_model

    cfg = config_file.from_dict({"model": {"from_hf": model_dir}, **({"lora": lora} if lora else {})})
    with torch.device("meta"):
        model = build_model(cfg.model)
        if lora:
            add_adapters(model, cfg.lora)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def main(argv=None) -> int:
    mine, a = parse_args(argv)
    common = llama_hf.prepare(a)
    tokens = a.batch * a.length
    runs = {ranks: {side: [] for side in sides(mine.lora_ranks)} for ranks in a.ranks}
    names = list(sides(mine.lora_ranks))
    for repeat in range(a.repeats):
        for ranks in a.ranks:
            for side in names[::-1] if repeat % 2 else names:
                tag = f"{side}_{ranks}r_{repeat}"
                print(f"[repeat {repeat + 1}/{a.repeats}] {side} on {ranks} rank(s)", flush=True)
                job = {**common, "side": "paratrain", "lora": sides(mine.lora_ranks)[side],
                       "run_dir": str(a.out / "runs" / tag), "out_dir": str(a.out / tag)}
                runs[ranks][side].append(llama_hf.launch(job, ranks, a.timeout))
    report = {"params": common["params"], "tokens_per_step": tokens, "by_ranks": {}}
    for ranks, by_side in runs.items():
        got = {side: llama_hf.summary(side_runs, tokens) for side, side_runs in by_side.items()}
        for side, entry in got.items():
            entry["trainable_params"] = trainable_params(common["model"]["dir"], sides(mine.lora_ranks)[side])
            entry["peak_rss_vs_full"] = entry["peak_rss_mb"] / got["full"]["peak_rss_mb"]
            entry["step_vs_full"] = entry["step_s"] / got["full"]["step_s"]
        report["by_ranks"][str(ranks)] = got
    print(f"\nfull fine-tuning vs LoRA ({report['params'] / 1e6:.1f} M parameters, {tokens} tokens a step)")
    print(f"{'ranks':>5} {'side':>9} {'trainable':>11} {'step s':>7} {'tok/s':>7} {'peak MB':>8} {'mem/full':>8} "
          f"{'time/full':>9}")
    for ranks, got in report["by_ranks"].items():
        for side, e in got.items():
            print(f"{ranks:>5} {side:>9} {e['trainable_params']:>11,} {e['step_s']:7.3f} {e['tokens_per_s']:7.0f} "
                  f"{e['peak_rss_mb']:8.0f} {e['peak_rss_vs_full']:8.2f} {e['step_vs_full']:9.2f}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
