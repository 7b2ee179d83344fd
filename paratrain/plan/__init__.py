"""Planner: per-rank memory and step-time cost model, layout search, dry run at scale.

``cost`` (model-state and activation bytes, FLOPs), ``search`` (evaluate, rank, ``choose_layout``),
``dryrun`` (the real sharding on the meta device under a fake process group), ``commands``
(``paratrain plan``).
"""
from paratrain.plan.cost import model_flops, model_params, stage_states
from paratrain.plan.search import Hardware, candidates, choose_layout, evaluate, search

__all__ = ["Hardware", "candidates", "choose_layout", "evaluate", "search", "model_flops", "model_params",
           "stage_states"]
