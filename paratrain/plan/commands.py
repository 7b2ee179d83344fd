"""``paratrain plan``: rank the layouts of a model on a cluster, or count one layout's bytes in a dry run."""
from __future__ import annotations

import json
import math
import re
import sys

UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2 ** 10, "mib": 2 ** 20,
         "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(text: str) -> float:
    """"80GiB", "80GB", "80 gb", "85899345920" -> bytes; a UserError for anything else or a size of 0."""
    from paratrain.errors import UserError

    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in UNITS or float(match.group(1)) == 0:
        raise UserError(f"--device-memory {text!r} is not a memory size: write e.g. 80GiB or 80GB")
    return float(match.group(1)) * UNITS[match.group(2).lower()]


def register(sub) -> None:
    p = sub.add_parser("plan", help="predict memory and step time of layouts and rank them",
                       description="Rank layouts (data/model/pipeline/context parallel, micro-batches, ZeRO, "
                                   "recompute, sequence parallel) of a model on N devices by predicted step time; "
                                   "or, with --dry-run, count one layout's per-rank bytes on the meta device.")
    p.add_argument("--config", help="TOML config (its [model], [train] and [parallel] are used); "
                                    "override keys as --model.hidden_size=... ")
    p.add_argument("--deepspeed", help="DeepSpeed JSON config mapped onto the config's keys (as paratrain train)")
    p.add_argument("--devices", type=int, help="number of devices (default: the config's dp x cp x mp x pp)")
    p.add_argument("--devices-per-node", type=int, default=8)
    p.add_argument("--device-memory", default="80GiB", help="memory of one device, e.g. 80GiB or 40GB")
    p.add_argument("--peak-tflops", type=float, default=312.0, help="peak dense TFLOP/s of one device")
    p.add_argument("--efficiency", type=float, default=0.5, help="fraction of peak the matmuls reach")
    p.add_argument("--intra-bw", type=float, default=200.0, help="GB/s per device inside a node (NVLink)")
    p.add_argument("--inter-bw", type=float, default=25.0, help="GB/s per device across nodes (network)")
    p.add_argument("--global-batch", type=int, help="global batch size (default: train.global_batch_size)")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--json", action="store_true", help="print every layout considered as a JSON list")
    p.add_argument("--dry-run", action="store_true",
                   help="build the config's own layout on the meta device under a fake process group of "
                        "--devices ranks and compare its per-rank bytes to the cost model")
    p.set_defaults(func=cmd_plan, overrides=True)


def check_args(args) -> None:
    """Refuse counts and hardware figures that cannot be (a UserError naming the flag)."""
    from paratrain.errors import UserError

    for flag in ("devices", "devices_per_node", "global_batch", "top", "peak_tflops", "intra_bw", "inter_bw"):
        value = getattr(args, flag)
        if value is not None and not 0 < value < math.inf:
            finite = " and finite" if value > 0 else ""
            raise UserError(f"--{flag.replace('_', '-')} must be positive{finite}, got {value:g}")
    if not 0 < args.efficiency <= 1:
        raise UserError(f"--efficiency {args.efficiency:g} is not a fraction of peak in (0, 1]: e.g. 0.5")
    parse_bytes(args.device_memory)


def cmd_plan(args) -> int:
    from paratrain.config import MODEL_KINDS, ConfigError
    from paratrain.deepspeed_config import load_config

    check_args(args)
    batch = [] if args.global_batch is None else [f"train.global_batch_size={args.global_batch}"]
    cfg = load_config(args.config, [*args.overrides, *batch], args.deepspeed, args.devices)
    planned = [kind for kind, spec in MODEL_KINDS.items() if spec.stacks]
    if cfg.model.kind not in planned:
        raise ConfigError([f"model.kind={cfg.model.kind!r} cannot be planned: the planner costs Transformer layers, "
                           f"of model.kind {' or '.join(map(repr, planned))}"])
    devices = args.devices or cfg.parallel.world_size
    if args.dry_run:
        return _dry_run(cfg, devices, args.json)
    from paratrain.plan.search import Hardware, search

    hw = Hardware(devices, args.devices_per_node, parse_bytes(args.device_memory), args.peak_tflops * 1e12,
                  args.intra_bw * 1e9, args.inter_bw * 1e9, args.efficiency)
    rows = search(cfg, hw)
    if args.json:
        json.dump(rows, sys.stdout, indent=None, default=str)
        sys.stdout.write("\n")
        return 0
    print_table(cfg, hw, rows, args.top)
    return 0


def print_table(cfg, hw, rows: list[dict], top: int) -> None:
    from paratrain.plan import cost

    m, params = cfg.model, cost.model_params(cfg.model, cfg.lora)
    trained = f" ({cost.model_params(m, cfg.lora, trainable=True):,} in LoRA adapters, the rest frozen)" if (
        cfg.lora.enabled) else ""
    print(f"model: {m.kind}, {params / 1e9:.3g} B parameters ({params:,}){trained}, {m.num_layers} layers, hidden "
          f"{m.hidden_size}; {hw.devices} devices ({hw.devices_per_node} per node, {hw.device_memory / cost.GiB:.0f} "
          f"GiB, {hw.peak_flops / 1e12:g} TFLOP/s); global batch {cfg.train.global_batch_size}")
    head = (f"{'#':>4} {'dp':>5} {'mp':>3} {'pp':>3} {'cp':>3} {'micro':>5} {'mbs':>4} {'zero':>4} {'recompute':>9} "
            f"{'sp':>3} {'schedule':>16} {'offload':>9} {'mem GiB':>8} {'step s':>8} {'MFU':>6}  feasible")
    print(head)
    print("-" * len(head))

    def line(r):
        mem, step = (f"{r[k]:8.3g}" if r[k] is not None else f"{'-':>8}" for k in ("memory_gib", "step_time_s"))
        mfu = f"{r['mfu'] * 100:5.1f}%" if r["mfu"] is not None else f"{'-':>6}"
        v = r["virtual_pipeline_stage"]
        sched = r["pipeline_schedule"] + (f"(v={v})" if v > 1 else "")
        offload = "+".join(k for k, name in (("opt", "offload_optimizer"), ("param", "offload_param"))
                           if r[name] == "cpu") or "-"
        print(f"{r['rank']:>4} {r['data_parallel']:>5} {r['model_parallel']:>3} {r['pipeline_stage']:>3} "
              f"{r['context_parallel']:>3} "
              f"{r['micro_batch_num']:>5} {r['micro_batch_size']:>4} {r['zero_stage']:>4} {r['recompute']:>9} "
              f"{'yes' if r['sequence_parallel'] else 'no':>3} {sched:>16} {offload:>9} {mem} {step} {mfu}  "
              f"{'yes' if r['feasible'] else 'no'}")

    feasible = [r for r in rows if r["feasible"]]
    for r in feasible[:top]:
        line(r)
    infeasible = [r for r in rows if not r["feasible"]]
    print(f"\n{len(feasible)} feasible of {len(rows)} layouts considered.")
    if infeasible:
        print("Best infeasible layouts (least memory first) and why:")
        for r in infeasible[:min(top, 5)]:
            line(r)
            print(f"       reason: {r['reason']}")


def _dry_run(cfg, devices: int, as_json: bool) -> int:
    from paratrain.plan import cost
    from paratrain.plan.dryrun import dry_run

    counted = dry_run(cfg, devices)
    predicted = cost.stage_states(cfg.model, cfg.parallel, lora=cfg.lora)
    keys = ("params", "grads", "optimizer")
    rows = [{"rank": c["rank"], "pp_rank": c["pp_rank"], **{k: c[k] for k in keys},
             **{f"predicted_{k}": getattr(p, k) for k in keys}, "equal": all(c[k] == getattr(p, k) for k in keys)}
            for c, p in zip(counted, predicted)]
    if as_json:
        print(json.dumps(rows))
    else:
        print(f"dry run on {devices} fake ranks (meta device), first rank of each pipeline stage:")
        print(f"{'rank':>6} {'stage':>5} {'params B':>14} {'predicted':>14} {'optimizer B':>14} {'predicted':>14}"
              f"  equal")
        for r in rows:
            print(f"{r['rank']:>6} {r['pp_rank']:>5} {r['params']:>14} {r['predicted_params']:>14} "
                  f"{r['optimizer']:>14} {r['predicted_optimizer']:>14}  {r['equal']}")
    return 0 if all(r["equal"] for r in rows) else 1
