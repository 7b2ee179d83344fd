"""MindSpore's ``mindspore.dtype`` names (``from paratrain import dtype as mstype``) as the torch dtypes they are:
``mstype.float32`` is ``torch.float32``, ``mstype.half`` is ``torch.float16``; also top-level, ``paratrain.float32``.
Looked up on first use, so that ``import paratrain`` stays without torch."""
from __future__ import annotations

# MindSpore's name -> torch's
TORCH_NAMES = {
    "bool_": "bool", "bool": "bool", "int8": "int8", "byte": "int8", "int16": "int16", "short": "int16",
    "int32": "int32", "intc": "int32", "int64": "int64", "long": "int64", "intp": "int64", "uint8": "uint8",
    "uint16": "uint16", "uint32": "uint32", "uint64": "uint64", "float16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "float32": "float32", "single": "float32", "float64": "float64", "double": "float64",
    "complex64": "complex64", "cfloat": "complex64", "complex128": "complex128", "cdouble": "complex128",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
}
__all__ = sorted(TORCH_NAMES)


def __getattr__(name: str):
    if name in TORCH_NAMES:
        import torch

        return getattr(torch, TORCH_NAMES[name])
    raise AttributeError(f"module 'paratrain.dtype' has no attribute {name!r}")
