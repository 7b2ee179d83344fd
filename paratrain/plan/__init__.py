"""Planner: per-rank memory and step-time cost model, layout search, dry run at scale.

``cost`` (model-state and activation bytes), ``search`` (evaluate, rank, ``choose_layout``, ``resolve_auto``),
``dryrun`` (the real sharding on the meta device under a fake process group), ``commands`` (``paratrain plan``);
FLOPs come from ``paratrain.metrics.flops``. Names are imported lazily, so that the command line does not load torch
to list its commands.
"""
import importlib

_EXPORTS = {
    "Hardware": "plan.cost", "candidates": "plan.search", "choose_layout": "plan.search", "evaluate": "plan.search",
    "resolve_auto": "plan.search", "search": "plan.search", "model_params": "plan.cost", "stage_states": "plan.cost",
    "model_flops": "metrics.flops",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"paratrain.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'paratrain.plan' has no attribute {name!r}")
