"""Mixed precision: fp32 master weights, bf16/fp16 compute, dynamic loss scaling for fp16; fp8 Linears
(torchao's float8 training) on GPUs that have fp8 tensor cores."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from paratrain.device import DTYPES


def resolve_mixed_precision(mixed_precision: str, device: torch.device) -> str:
    """``train.mixed_precision`` for a run on ``device``: ``auto`` is "bf16" on a GPU (fp32 master weights,
    bf16 compute: tensor cores, flash attention) and "none" (fp32) elsewhere; other values as given."""
    if mixed_precision != "auto":
        return mixed_precision
    return "bf16" if device.type == "cuda" else "none"


def compute_dtype(mixed_precision: str) -> torch.dtype:
    """The dtype autocast computes in and FSDP2 gathers parameters in: fp8 runs the rest of the model in bf16."""
    return DTYPES["bf16" if mixed_precision == "fp8" else mixed_precision]


def autocast(mixed_precision: str, device: torch.device):
    """Forward in bf16/fp16 where safe (matmuls), fp32 elsewhere; parameters stay fp32."""
    if mixed_precision == "none":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=compute_dtype(mixed_precision))


FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with fp8 tensor cores (torch._scaled_mm)
FP8_ALIGNMENT = 16  # torch._scaled_mm's dimensions are multiples of 16
HEAD_NAMES = ("head", "lm_head", "output", "classifier")  # a Linear so named is an output head: it stays bf16


def fp8_unavailable(device: torch.device) -> str | None:
    """Why fp8 training cannot run on ``device`` (no fp8 tensor cores, or torchao's float8 training does not
    import with this torch), or None when it can."""
    if device.type != "cuda":
        return (f"the device is the {device.type.upper()}, and fp8 matmuls need an NVIDIA GPU of compute "
                f"capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or more (Ada, Hopper)")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} has compute capability {capability[0]}.{capability[1]}, and "
                f"fp8 matmuls need {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or more (Ada, Hopper)")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except Exception as exc:  # noqa: BLE001 -- any failure to import is the reason to report
        why = (str(exc).splitlines() or [""])[0]
        return (f"torchao's float8 training does not import with torch {torch.__version__} "
                f"({type(exc).__name__}: {why}): pip install 'paratrain[fp8]' (torchao)")
    return None


def fp8_linear_names(model: nn.Module) -> list[str]:
    """The Linear layers of ``model`` that train in fp8: plain ``nn.Linear`` (a subclass, such as the fused
    output head, keeps its own forward) with both dimensions multiples of 16, except one named as an output
    head (``HEAD_NAMES``), whose logits fp8 would coarsen."""
    return [name for name, module in model.named_modules()
            if type(module) is nn.Linear and name.rpartition(".")[2] not in HEAD_NAMES
            and module.in_features % FP8_ALIGNMENT == 0 and module.out_features % FP8_ALIGNMENT == 0]


def convert_to_fp8(model: nn.Module) -> list[str]:
    """Swap ``model``'s ``fp8_linear_names`` for torchao's ``Float8Linear`` in place (the same parameters,
    so state-dict keys and checkpoints are unchanged; matmuls in fp8 with dynamic tensor-wise scales, the
    inner dimension padded to 16 where a batch's token count is not); returns their names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen = set(fp8_linear_names(model))
    convert_to_float8_training(model, config=Float8LinearConfig(pad_inner_dim=True),
                               module_filter_fn=lambda module, name: name in chosen)
    return sorted(chosen)


class LossScaleFloor(RuntimeError):
    """fp16 training cannot go on: its gradients overflowed at the minimum loss scale, or in too many steps
    in a row. ``paratrain train`` exits with :data:`EXIT_CODE`."""

    EXIT_CODE = 5


class LossScaler:
    """Dynamic loss scale for fp16: the loss is multiplied by ``scale`` before backward; a step whose
    gradients overflow is skipped and the scale halved, down to ``min_scale``; after ``growth_interval``
    good steps in a row it doubles.

    As DeepSpeed's ``DynamicLossScaler``: with ``hysteresis`` h > 1 only the h-th overflow halves the scale,
    the allowance refilled when it doubles (after every good step with ``consecutive_hysteresis``). An
    overflow at ``min_scale``, or ``max_skipped`` in a row (0: no limit), make :meth:`check` raise
    :class:`LossScaleFloor`. ``enabled=False`` (bf16, fp32): scale 1, nothing skipped; ``dynamic=False``
    (MindSpore's ``FixedLossScaleManager``): the scale stays ``init_scale``.

    The scale and counters are tensors on ``device``, updated there: no step waits for the device; the
    host reads them when it reads a step's values anyway (``check``, ``summary``, ``state_dict``).
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0 ** 16, growth_interval: int = 1000,
                 min_scale: float = 1.0, max_skipped: int = 100, hysteresis: int = 1,
                 consecutive_hysteresis: bool = False, device: torch.device | str = "cpu", dynamic: bool = True):
        self.enabled, self.dynamic, self.growth_interval = enabled, dynamic, growth_interval
        self.min_scale, self.max_skipped = min_scale, max_skipped
        self.hysteresis, self.consecutive_hysteresis = hysteresis, consecutive_hysteresis
        self.device = torch.device(device)
        self.load_state_dict({"scale": init_scale if enabled else 1.0, "good_steps": 0, "skipped_steps": 0})

    def divisor(self, grad_scale: torch.Tensor | float | None = None) -> torch.Tensor | None:
        """What the gradients are divided by to be those of the loss: the loss scale, over ``grad_scale`` (a
        normalisation known after the backward, ``paratrain.engine``) when given; None when both are 1."""
        if not self.enabled and grad_scale is None:
            return None
        return self.scale if grad_scale is None else self.scale / grad_scale

    def overflow(self, grad_norm: torch.Tensor) -> torch.Tensor | None:
        """Whether a step of this (unscaled) gradient norm overflowed and is skipped: a bool tensor on the device;
        None when disabled."""
        return ~torch.isfinite(grad_norm.to(self.device)) if self.enabled else None

    def update(self, grad_norm: torch.Tensor) -> torch.Tensor | bool:
        """Update the scale after a step of this gradient norm; returns ``overflow`` (False when disabled)."""
        overflow = self.overflow(grad_norm)
        if overflow is None:
            return False
        self.skipped_steps = self.skipped_steps + overflow
        if not self.dynamic:
            return overflow
        halve = overflow & (self.hysteresis_left <= 1)
        self.floor_hit |= halve & (self.scale <= self.min_scale)
        self.skipped_in_a_row = torch.where(overflow, self.skipped_in_a_row + 1, 0)
        self.most_in_a_row = torch.maximum(self.most_in_a_row, self.skipped_in_a_row)
        self.good_steps = torch.where(overflow, 0, self.good_steps + 1)
        grow = ~overflow & (self.good_steps % self.growth_interval == 0)
        refill = grow | ~overflow if self.consecutive_hysteresis else grow
        spent = torch.where(overflow & ~halve, self.hysteresis_left - 1, self.hysteresis_left)
        self.hysteresis_left = torch.where(refill, self.hysteresis, spent)
        self.scale = torch.where(halve, (self.scale / 2).clamp(min=self.min_scale),
                                 torch.where(grow, self.scale * 2, self.scale))
        return overflow

    def check(self) -> None:
        """Raise :class:`LossScaleFloor` if an overflow came at the minimum scale or ``max_skipped``
        overflowed steps came in a row (reads the device)."""
        if not self.enabled:
            return
        floor_hit, most_in_a_row = torch.stack([self.floor_hit.double(), self.most_in_a_row.double()]).tolist()
        if floor_hit:
            raise LossScaleFloor(f"fp16 gradients overflow at the minimum loss scale {self.min_scale:g} "
                                 f"(train.min_loss_scale; {self.summary()}): lower train.lr, or train in bf16")
        if self.max_skipped and most_in_a_row >= self.max_skipped:
            raise LossScaleFloor(f"{self.max_skipped} fp16 steps in a row overflowed "
                                 f"(train.max_skipped_steps={self.max_skipped}; {self.summary()}): "
                                 f"lower train.lr, or train in bf16")

    def summary(self) -> str:
        return f"{int(self.skipped_steps)} step(s) skipped for overflow, loss scale {float(self.scale):g}"

    def state_dict(self) -> dict:
        names = ("scale", "good_steps", "skipped_steps", "skipped_in_a_row", "hysteresis_left")
        values = torch.stack([getattr(self, name).double() for name in names]).tolist()
        return {name: value if name == "scale" else int(value) for name, value in zip(names, values)}

    def load_state_dict(self, state: dict) -> None:
        def on_device(value, dtype=torch.int64):
            return torch.tensor(value, dtype=dtype, device=self.device)

        self.scale = on_device(float(state["scale"]), torch.float32)
        self.good_steps, self.skipped_steps = on_device(state["good_steps"]), on_device(state["skipped_steps"])
        self.skipped_in_a_row = on_device(state.get("skipped_in_a_row", 0))  # absent from checkpoints before it
        self.hysteresis_left = on_device(state.get("hysteresis_left", self.hysteresis))
        self.most_in_a_row = self.skipped_in_a_row.clone()
        self.floor_hit = on_device(False, torch.bool)
