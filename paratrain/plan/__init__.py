"""Planner: per-rank memory and step-time cost model, layout search, dry run at scale.

``cost`` (model-state and activation bytes), ``search`` (evaluate, rank, ``choose_layout``,
``resolve_auto``), ``dryrun`` (the real sharding on the meta device under a fake process group),
``commands`` (``paratrain plan``); FLOPs come from ``paratrain.metrics.flops``. Names are imported
lazily, so that the command line does not load torch to list its commands.
"""
import importlib

_EXPORTS = {
    "Hardware": "cost", "candidates": "search", "choose_layout": "search", "evaluate": "search",
    "resolve_auto": "search", "search": "search", "model_params": "cost", "stage_states": "cost",
}
__all__ = [*_EXPORTS, "model_flops"]


def __getattr__(name):
    if name == "model_flops":
        from paratrain.metrics.flops import model_flops
        return model_flops
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"paratrain.plan.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'paratrain.plan' has no attribute {name!r}")
