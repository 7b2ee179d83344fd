"""MindSpore's auto parallel: strategies chosen for the ops that have none, before semi-auto placement.

- ``search_mode="dynamic_programming"`` (the default): every MatMul call without a strategy (a
  ``Dense``'s included) gets the ``((a, b), (b, c))`` with ``a * b * c = device_num`` that minimises,
  over the chain of MatMuls in call order, the step time per device by the planner's cost model
  (``paratrain.plan.cost.Hardware``: the matmuls and their collectives, ``matmul_cost``, and the time to
  re-lay one MatMul's output as the next one's input, ``relayout_bytes``), then the bytes each device
  holds; the Viterbi pass over the chain is exact for those sums. A ``Dense``'s ``bias_add`` follows its
  MatMul's output split. Then the strategies spread as below.
- ``search_mode="sharding_propagation"``: strategies set on some ops spread forward to the elementwise,
  unary, ``BiasAdd``, ``Softmax`` and ``MatMul`` ops that read their outputs, where the split fits; the
  rest stay data-parallel.

Rank 0 prints each chosen strategy; ``strategy_ckpt_save_file`` receives every op's strategy (JSON)
and ``strategy_ckpt_load_file`` sets them again instead of choosing.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch.distributed as dist

from paratrain.context import get_auto_parallel_context
from paratrain.errors import UserError
from paratrain.ops.math import BiasAdd, Exp, Log, MatMul, ReLU, Softmax, _Elementwise
from paratrain.ops.primitive import Primitive
from paratrain.ops.strategy import Strategy
from paratrain.plan import cost
from paratrain.train.parallel_modes.semi_auto import Call

FORMAT = "paratrain-strategy-1"
BYTES = cost.DTYPE_BYTES["float32"]
FOLLOWING = (BiasAdd, Softmax, Exp, Log, ReLU)  # one output split as their first input


def _strategy(op: MatMul, a: int, b: int, c: int) -> Strategy:
    x = (b, a) if op.transpose_a else (a, b)
    w = (c, b) if op.transpose_b else (b, c)
    return x, w


def matmul_cost(m: int, k: int, n: int, a: int, b: int, c: int, hw: cost.Hardware) -> tuple[float, float]:
    """(seconds of a step on a device, bytes held per device) of (m, k) x (k, n) split ((a, b), (b, c)), by the
    planner's cost model: the forward and backward matmuls, and the all-reduces of the output over b (forward),
    of the input gradient over c and of the weight gradient over a (backward); a device holds its weight
    slice's model state and its slices of input and output."""
    out, inp, weight = m * n / (a * c) * BYTES, m * k / (a * b) * BYTES, k * n / (b * c) * BYTES
    seconds = (hw.compute_time(3 * 2 * m * k * n / (a * b * c)) + hw.collective_time("all_reduce", out, b, hw.devices)
               + hw.collective_time("all_reduce", inp, c, hw.devices)
               + hw.collective_time("all_reduce", weight, a, hw.devices))
    return seconds, cost.state_bytes(weight) + inp + out


def relayout_bytes(m: int, k: int, produced: tuple[int, int] | None, wanted: tuple[int, int]) -> float:
    """Bytes a device receives to turn an (m, k) tensor split ``produced`` into one split ``wanted``: none when
    they agree or it is the chain's input (None), else (at most) its slice under ``wanted``."""
    return 0.0 if produced in (None, wanted) else m * k * BYTES / (wanted[0] * wanted[1])


def _split_of(op: Primitive, strategy: Strategy) -> tuple[int, ...] | None:
    """How the output of ``op`` under ``strategy`` is split (None: not derived here)."""
    if type(op) is MatMul:
        a, _, _, c = op._abc(strategy)
        return a, c
    if isinstance(op, _Elementwise):
        return op.layout(strategy, []).device_matrix
    if isinstance(op, FOLLOWING):
        return strategy[0]
    return None


def _follow(op: Primitive, call: Call, index: int, split: tuple[int, ...]) -> Strategy | None:
    """A strategy for ``op`` whose input ``index`` is split ``split``, the other inputs fitted to it (dimensions
    aligned from the right, size-1 ones whole); None for an op that does not follow its input."""
    if type(op) is MatMul:
        if index != 0:
            return None
        a, b = (split[1], split[0]) if op.transpose_a else split
        return _strategy(op, a, b, 1)
    if isinstance(op, BiasAdd):
        return (split, (split[1],)) if index == 0 else None
    if isinstance(op, _Elementwise):
        end = len(call.shapes[index])
        return tuple(tuple(split[end - len(shape) + t] if end - len(shape) + t >= 0 and size > 1 else 1
                           for t, size in enumerate(shape)) for shape in call.shapes)
    if isinstance(op, FOLLOWING):
        return (split,)
    return None


class StrategyChooser:
    """``choose(calls)`` for ``place_semi_auto``: sets a strategy on the ops that have none, as ``search_mode``
    says, or from ``load_file``; saves all to ``save_file``; rank 0 prints what it chose."""

    def __init__(self, device_num: int, search_mode: str = "dynamic_programming", load_file: str = "",
                 save_file: str = "", hw: cost.Hardware | None = None):
        self.device_num, self.search_mode = device_num, search_mode
        self.load_file, self.save_file = load_file, save_file
        self.hw = hw or cost.Hardware.default(device_num, device_num)
        self.chosen: dict[str, tuple[Primitive, Strategy]] = {}

    @classmethod
    def from_context(cls, device_num: int) -> "StrategyChooser":
        return cls(device_num, *(get_auto_parallel_context(option) for option in
                                 ("search_mode", "strategy_ckpt_load_file", "strategy_ckpt_save_file")))

    def __call__(self, calls: list[Call]) -> None:
        if self.load_file:
            self._load(calls)
        else:
            if self.search_mode == "dynamic_programming":
                self._search(calls)
            self._propagate(calls)
        if not dist.is_initialized() or dist.get_rank() == 0:
            for path, (op, strategy) in self.chosen.items():
                print(f"auto_parallel: {path} ({type(op).__name__}) strategy {strategy}", flush=True)
            if self.save_file:
                self._save(calls)

    def _set(self, call: Call, strategy: Strategy) -> None:
        call.op.strategy = strategy
        self.chosen[call.path] = call.op, strategy

    # --- dynamic programming over the chain of MatMuls ----------------------------------------

    def _candidates(self, call: Call) -> list[tuple[int, int, int]]:
        m, k, _, n = call.op._abc(call.shapes)  # rows, contraction, columns
        return [(a, b, c) for a, b, c in itertools.product(range(1, self.device_num + 1), repeat=3)
                if a * b * c == self.device_num and m % a == 0 and k % b == 0 and n % c == 0]

    def _search(self, calls: list[Call]) -> None:
        chain = [c for c in calls if type(c.op) is MatMul and c.op.strategy is None and self._candidates(c)]
        # candidate of the last op so far -> least (seconds, bytes held) of the chain up to it, and the path to it
        best: dict = {None: ((0.0, 0.0), [])}
        for call in chain:
            m, k, _, n = call.op._abc(call.shapes)  # rows, contraction, columns
            row = {}
            for a, b, c in self._candidates(call):
                seconds, held = matmul_cost(m, k, n, a, b, c, self.hw)
                row[a, b, c] = min((((t + seconds + self.hw.transfer_time(relayout_bytes(
                    m, k, last and (last[0], last[2]), (a, b)), self.device_num), h + held), path + [(a, b, c)])
                                    for last, ((t, h), path) in best.items()), key=lambda e: e[0])
            best = row
        _, path = min(best.values(), key=lambda e: e[0])
        for call, (a, b, c) in zip(chain, path):
            self._set(call, _strategy(call.op, a, b, c))

    # --- propagation ------------------------------------------------------------------------

    def _propagate(self, calls: list[Call]) -> None:
        splits: dict[int, tuple[int, ...]] = {}
        for call in calls:
            op = call.op
            if op.strategy is None:
                for index, tensor in enumerate(call.inputs):
                    if tensor not in splits or call.params[index] is not None:
                        continue
                    strategy = _follow(op, call, index, splits[tensor])
                    if strategy is not None and not op.problems(strategy, call.shapes, self.device_num):
                        self._set(call, strategy)
                        break
            if op.strategy is not None:
                split = _split_of(op, op.strategy)
                if split is not None:
                    splits[call.output] = split

    # --- strategy files ---------------------------------------------------------------------

    def _save(self, calls: list[Call]) -> None:
        strategies = {c.path: [list(s) for s in c.op.strategy] for c in calls if c.op.strategy is not None}
        path = Path(self.save_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": FORMAT, "device_num": self.device_num, "strategies": strategies},
                                   indent=1))

    def _load(self, calls: list[Call]) -> None:
        try:
            saved = json.loads(Path(self.load_file).read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"strategy_ckpt_load_file={self.load_file!r}: cannot read it ({exc})") from exc
        if saved.get("format") != FORMAT:
            raise UserError(f"strategy_ckpt_load_file={self.load_file!r} is not a paratrain strategy file")
        if saved["device_num"] != self.device_num:
            raise UserError(f"strategy_ckpt_load_file={self.load_file!r} holds strategies for "
                            f"{saved['device_num']} devices, this job has {self.device_num}")
        by_path = {c.path: c for c in calls}
        unknown = sorted(set(saved["strategies"]) - set(by_path))
        if unknown:
            raise UserError(f"strategy_ckpt_load_file={self.load_file!r} names ops the net does not run: "
                            f"{', '.join(unknown)}")
        for path, strategy in saved["strategies"].items():
            call = by_path[path]
            strategy = tuple(tuple(s) for s in strategy)
            if call.op.strategy is None:
                self._set(call, strategy)
            elif call.op.strategy != strategy:
                raise UserError(f"{path}: the net gives strategy {call.op.strategy}, strategy_ckpt_load_file "
                                f"{strategy}: make them agree or leave one out")
