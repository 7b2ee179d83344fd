"""MindSpore's parallel modes that place a user's net otherwise than ``paratrain.parallel.user.place_net``:
``hybrid_parallel`` (``hybrid``), ``semi_auto_parallel`` of ``paratrain.ops`` on their strategies (``semi_auto``)
and ``auto_parallel``'s choice of those strategies (``auto``). ``paratrain.train.Model`` picks one from the
context; each builds on the placement pieces of ``paratrain.parallel``."""
from __future__ import annotations

from torch import nn

from paratrain.config import ParallelConfig
from paratrain.errors import UserError

# what a net placed whole (hybrid) or op by op (semi-auto, auto) does not take: option -> (its default, why)
NOT_OFFERED = {
    "sequence_parallel": (False, "its ops run on whole (or strategy-split) sequences"),
    "expert_parallel": (1, "it holds no paratrain.nn MoE blocks to split"),
    "recompute": ("none", "its layers are not placed one by one"),
    "offload_optimizer": ("none", "its parameters are not FSDP-sharded"),
    "offload_param": ("none", "its parameters are not FSDP-sharded"),
}


def refuse_options(config: ParallelConfig, net: nn.Module, mode: str, problems: list[str] = ()) -> None:
    """Raise one UserError naming, with the reason, every option of ``config`` that ``mode`` does not honour
    (``NOT_OFFERED``, a layer's own ``recompute_mode``, and the caller's ``problems``)."""
    problems = [f"{option}={getattr(config, option)!r}: {why}" for option, (default, why) in NOT_OFFERED.items()
                if getattr(config, option) != default] + list(problems)
    if any(getattr(m, "recompute_mode", "none") != "none" for m in net.modules()):
        problems.append(f"a layer's recompute_mode: {NOT_OFFERED['recompute'][1]}")
    if problems:
        raise UserError(f"{mode} does not offer " + "; ".join(problems) + ": leave these options at their "
                        f"defaults (a net of paratrain.nn blocks without ops has them under semi_auto_parallel)")
