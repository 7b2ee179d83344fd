"""The one entry point of placement for both faces: ``place(model, config, layout, how, ...)``.

``how`` is the placement itself, each returning a ``PlacedModel``: ``parallelize`` (a built-in model: its pipeline
chunks, every parallel dimension on each), ``place_net`` (a user's net by its blocks' plans, its pipeline stages
traced), or a face's own mode that takes the net whole (the MindSpore face's hybrid parallel and op strategies).
What every placement shares is done here, once: the Linear layers made fp8 ones, and this rank's tensors of a
model built on the meta device made with the values a plain build draws.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from paratrain.config import ParallelConfig
from paratrain.mesh import Layout
from paratrain.parallel.deferred_init import InitRecord, materialize
from paratrain.parallel.placed import PlacedModel
from paratrain.precision import convert_to_fp8


def place(model: nn.Module, config: ParallelConfig, layout: Layout, how: Callable[..., PlacedModel], *,
          precision: str = "none", init: InitRecord | None = None, values_first: bool = False,
          params_on: torch.device | None = None, **options) -> PlacedModel:
    """``model`` placed on ``layout`` by ``how(model, config, layout, precision=precision, **options)`` (the module
    docstring). ``precision`` "fp8": its Linear layers are made fp8 ones first (``convert_to_fp8``). ``init``: the
    recorded initialisation of a model on the meta device, whose tensors are made after the placement, only this
    rank's shards (their parameters on ``params_on`` when given: offloaded ones), or before it, whole, when
    ``how`` places the values it is given (``values_first``)."""
    if precision == "fp8":
        convert_to_fp8(model)
    if init is not None and values_first:
        materialize([model], init, layout.device)
    placed = how(model, config, layout, precision=precision, **options)
    if init is not None and not values_first:
        materialize(placed.parts, init, layout.device, params_on)
    return placed
