"""MindSpore's older ``mindspore.dataset.transforms.c_transforms``: the same transforms as
``paratrain.dataset.transforms``."""
from paratrain.dataset.transforms import TypeCast

__all__ = ["TypeCast"]
