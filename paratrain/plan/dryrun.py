"""Dry run at scale: paratrain's real sharding applied on the meta device under a fake process group.

For each pipeline stage, a child process joins a fake process group (``torch.testing._internal. distributed.fake_pg``:
collectives return at once, nothing is sent) as that stage's first rank (tensor- and data-parallel rank 0, which holds
the largest shards), builds the model on the meta device and runs ``paratrain.parallel.parallelize`` exactly as the
trainer does. The local shards of the parameters then give the rank's parameter bytes with no memory and no devices;
gradients take the same placement and AdamW adds two states of the same size and a 4-byte step per tensor it steps (at
zero stage 1 on replicas, those of the parameters this rank owns).
"""
from __future__ import annotations

import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.distributed as dist

from paratrain.config import Config


def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    t = t._local_tensor if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def dry_run_rank(cfg: Config, rank: int, world_size: int) -> dict:
    """Model-state bytes of global ``rank`` from the real sharding on the meta device."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from paratrain.device import DTYPES
    from paratrain.lora import add_adapters, hold_base_in
    from paratrain.mesh import Layout
    from paratrain.models import build_model
    from paratrain.parallel import parallelize
    from paratrain.parallel.data import parameter_owners
    from paratrain.plan.cost import layer_costs, tokens_per_rank

    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; run the dry run alone")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        layout = Layout(cfg.parallel, world_size)
        with torch.device("meta"):
            model = add_adapters(build_model(cfg.model), cfg.lora)
        model = model.to(DTYPES[cfg.model.dtype])
        if cfg.lora.enabled and cfg.lora.base_dtype != "float32":
            hold_base_in(model, DTYPES[cfg.lora.base_dtype])
        parts = parallelize(model, cfg.parallel, layout, model_config=cfg.model, layer_costs=layer_costs(cfg.model),
                            tokens_per_rank=tokens_per_rank(cfg, layout.dp_size)).parts
        params = list({id(p): p for part in parts for p in part.parameters()}.values())
        trained = [p for p in params if p.requires_grad]
        nbytes, grads = sum(_local_bytes(p) for p in params), sum(_local_bytes(p) for p in trained)
        owner = parameter_owners(trained, layout.config, layout)
        stepped = trained if owner is None else [p for p, o in zip(trained, owner) if o == layout.dp_rank]
        optimizer = 2 * sum(_local_bytes(p) for p in stepped) + 4 * len(stepped)
        return {"rank": rank, "pp_rank": layout.pp_rank, "params": nbytes, "grads": grads,
                "optimizer": optimizer, "tensors": len(params), "total": nbytes + grads + optimizer}
    finally:
        dist.destroy_process_group()


def dry_run(cfg: Config, world_size: int | None = None) -> list[dict]:
    """Per pipeline stage (its first rank), the model-state bytes counted on the meta device.

    Each stage runs in a child process: torch.distributed keeps state from a fake process group
    (seen: a later real tensor-parallel run in the same process then trained with wrong values).
    """
    p = cfg.parallel
    world_size = world_size or p.world_size
    stride = world_size // p.pipeline_stage
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as child:
        return [child.submit(dry_run_rank, cfg, stage * stride, world_size).result()
                for stage in range(p.pipeline_stage)]
