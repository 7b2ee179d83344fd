"""Planner: per-rank memory and step-time cost model, layout search, dry run at scale.

``cost`` (model-state and activation bytes, FLOPs), ``search`` (evaluate, rank, ``choose_layout``),
``dryrun`` (the real sharding on the meta device under a fake process group), ``commands``
(``paratrain plan``).
"""
from paratrain.metrics.flops import model_flops
from paratrain.plan.cost import model_params, stage_states
from paratrain.plan.search import Hardware, candidates, choose_layout, evaluate, resolve_auto, search

__all__ = ["Hardware", "candidates", "choose_layout", "evaluate", "resolve_auto", "search", "model_flops", "model_params",
           "stage_states"]
