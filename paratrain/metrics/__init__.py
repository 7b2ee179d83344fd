"""Step metrics: throughput, MFU, memory, the time breakdown (``timer``, ``flops``), their sinks
(``logger``: console, JSONL, TensorBoard, progress bar), and ``paratrain plot`` / ``paratrain summary``
(``report``). Imported lazily so the command line does not load torch to list its commands."""
from __future__ import annotations

__all__ = ["MetricsLogger", "StepTimer", "format_record"]


def __getattr__(name: str):
    if name in ("MetricsLogger", "format_record"):
        from paratrain.metrics import logger
        return getattr(logger, name)
    if name == "StepTimer":
        from paratrain.metrics.timer import StepTimer
        return StepTimer
    raise AttributeError(f"module 'paratrain.metrics' has no attribute {name!r}")
