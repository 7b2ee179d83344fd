"""Checkpoints: sliced per rank through DCP, atomic, exact resume, reload under any layout, export.

``Checkpointer`` (used by the trainer), ``export`` (one safetensors file, plain parameter
names), ``info``, ``load_full_tensors``; ``storage`` holds the on-disk format. Names are
imported lazily so that ``paratrain.checkpoint.commands`` (the CLI) does not import torch.
"""
import importlib

_EXPORTS = {
    "Checkpointer": "core", "export": "full", "format_info": "full", "info": "full",
    "load_full_tensors": "full", "CheckpointError": "storage", "newest_complete": "storage", "resolve": "storage",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"paratrain.checkpoint.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'paratrain.checkpoint' has no attribute {name!r}")
