"""Step metrics: throughput, MFU, memory, the time breakdown (``timer``, ``flops``), their sinks
(``logger``: console, JSONL, TensorBoard, progress bar), and ``paratrain plot`` / ``paratrain summary``
(``report``). Imported lazily so the command line does not load torch to list its commands."""
from __future__ import annotations

import importlib

_MODULES = {"MetricsLogger": "logger", "format_record": "logger", "StepTimer": "timer"}
__all__ = list(_MODULES)


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'paratrain.metrics' has no attribute {name!r}")
    return getattr(importlib.import_module(f"paratrain.metrics.{_MODULES[name]}"), name)
