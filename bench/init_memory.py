"""Peak host memory of model initialisation per rank: the whole model built on every rank, then sharded
(paratrain before the meta-device init), against paratrain's init (built on the meta device, only this
rank's shards materialised, ``paratrain.parallel.deferred_init``).

N forked gloo ranks shard a GPT over data parallelism with ZeRO 3 (each rank keeps 1/N of the
parameters). Each rank reports its peak resident memory (``ru_maxrss``) above what it used before
initialising (torch imported, process group up), and the two ways must give the same local
shards (checked on a fingerprint of every shard). One way per process group of workers, so one
way's peak cannot hide the other's.

    python bench/init_memory.py [--ranks 8] [--hidden 1024] [--layers 16] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tests/forked_ranks.py: forked gloo workers

from forked_ranks import run_distributed  # noqa: E402

MiB = 2 ** 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8, help="processes (data parallel, ZeRO 3)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--timeout", type=float, default=900.0)
    return p.parse_args(argv)


def config(a: argparse.Namespace):
    from paratrain import config_file

    return config_file.from_dict({
        "model": {"kind": "gpt", "vocab_size": a.vocab, "hidden_size": a.hidden, "num_heads": 16,
                  "ffn_hidden_size": 4 * a.hidden, "decoder_layers": a.layers, "seq_length": 128,
                  "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "parallel": {"dp": a.ranks, "zero_stage": 3},
        "train": {"global_batch_size": a.ranks},
    })


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def initialise(a: argparse.Namespace, deferred: bool) -> dict:
    """On every rank: build and shard the model one way; peak memory above the start and a shard fingerprint."""
    import torch
    from torch.distributed.tensor import DTensor

    from paratrain.distributed import init_from_env
    from paratrain.mesh import Layout
    from paratrain.models import build_model
    from paratrain.parallel import parallelize, place
    from paratrain.parallel.deferred_init import record_init

    torch.set_num_threads(1)
    _, world = init_from_env()
    cfg = config(a)
    layout = Layout(cfg.parallel, world)
    before, start = _peak_mib(), time.perf_counter()
    torch.manual_seed(0)
    if deferred:
        record = record_init(lambda: build_model(cfg.model))
        parts = place(record.model, cfg.parallel, layout, parallelize, init=record).parts
    else:
        parts = parallelize(build_model(cfg.model), cfg.parallel, layout).parts
    seconds = time.perf_counter() - start
    local = [p.to_local() if isinstance(p, DTensor) else p for p in parts[0].parameters()]
    return {"peak_above_start_mib": _peak_mib() - before, "seconds": seconds,
            "local_mib": sum(t.numel() * t.element_size() for t in local) / MiB,
            "fingerprint": [float(t.detach().double().sum()) for t in local]}


def main(argv=None) -> int:
    a = parse_args(argv)
    from paratrain.plan import model_params

    cfg = config(a)
    model_mib = model_params(cfg.model) * 4 / MiB
    largest_mib = a.vocab * a.hidden * 4 / MiB
    os.environ.setdefault("PARATRAIN_DEVICE", "cpu")
    results = {way: run_distributed(initialise, a.ranks, a, way == "meta-device", timeout=a.timeout)
               for way in ("whole-model", "meta-device")}
    same = all(w["fingerprint"] == m["fingerprint"] for w, m in zip(results["whole-model"], results["meta-device"]))
    rows = {way: {"peak_above_start_mib_max": max(r["peak_above_start_mib"] for r in ranks),
                  "seconds_max": max(r["seconds"] for r in ranks), "local_mib": ranks[0]["local_mib"]}
            for way, ranks in results.items()}
    out = {"ranks": a.ranks, "model_mib": model_mib, "share_mib": model_mib / a.ranks, "largest_tensor_mib": largest_mib,
           "same_shards": same, "ways": rows, "load_average": os.getloadavg(),
           "ratio_meta_over_whole": rows["meta-device"]["peak_above_start_mib_max"]
           / rows["whole-model"]["peak_above_start_mib_max"]}
    print(f"GPT {model_mib:,.0f} MiB fp32 on {a.ranks} ranks (ZeRO 3: {model_mib / a.ranks:,.0f} MiB each; largest "
          f"tensor {largest_mib:,.0f} MiB); same shards both ways: {same}")
    print(f"{'way':<14}{'peak above start (max rank)':>30}{'seconds':>10}")
    for way, r in rows.items():
        print(f"{way:<14}{r['peak_above_start_mib_max']:>26,.0f} MiB{r['seconds_max']:>10.1f}")
    print(f"meta-device / whole-model peak: {out['ratio_meta_over_whole']:.3f} "
          f"(load {out['load_average'][0]:.1f})")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
