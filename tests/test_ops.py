"""paratrain.ops: each op's strategies on 2 and 4 processes give one process's output and gradients; the
strategies refused before the first step, each naming the op, its strategy and the rule."""
import pytest
import torch
from torch import nn

from forked_ranks import run_distributed
from paratrain import ops
from paratrain.ops import StrategyError
from paratrain.train.parallel_modes.semi_auto import check_strategies, parameter_placements, record_calls


class Probe(nn.Module):
    """One op on parameters (whose gradients are compared) and batch tensors; the loss is the sum of squares
    of its output (float outputs)."""

    def __init__(self, op, params: dict[str, torch.Tensor], args: list):
        super().__init__()
        self.op, self.args = op, args
        self.p = nn.ParameterDict({k: nn.Parameter(v.clone()) for k, v in params.items()})

    def forward(self, *batch):
        values = [self.p[a[1:]] if isinstance(a, str) and a.startswith("@") else batch[a.index]
                  if isinstance(a, B) else a for a in self.args]
        self.out = self.op(*values)
        return (self.out.float() ** 2).sum() if self.out.is_floating_point() else self.out.sum().float()


class B:
    """The batch's ``index``-th tensor, as an op argument."""

    def __init__(self, index: int):
        self.index = index


def g(*shape, seed=0, positive=False):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return t.abs() + 0.5 if positive else t


IDX = torch.tensor([3, 0, 5, 1, 2, 5, 4, 0])
# name: (op factory, parameters, args ("@name" a parameter, B(i) the batch's i-th tensor, else as is),
#        batch, {world: [strategies]})
CASES = {
    "matmul": (lambda: ops.MatMul(), {"x": g(8, 6), "w": g(6, 4, seed=1)}, ["@x", "@w"], (),
               {2: [((2, 1), (1, 1)), ((1, 2), (2, 1)), ((1, 1), (1, 2))],
                4: [((2, 1), (1, 2)), ((1, 2), (2, 2)), ((1, 2), (2, 1)), ((4, 1), (1, 1))]}),
    "matmul_t": (lambda: ops.MatMul(transpose_a=True, transpose_b=True), {"x": g(6, 8), "w": g(4, 6, seed=1)},
                 ["@x", "@w"], (), {2: [((2, 1), (1, 2))], 4: [((2, 2), (1, 2))]}),
    "batch_matmul": (lambda: ops.BatchMatMul(), {"x": g(2, 4, 6), "w": g(2, 6, 4, seed=1)}, ["@x", "@w"], (),
                     {2: [((2, 1, 1), (2, 1, 1)), ((1, 1, 2), (1, 2, 1))], 4: [((2, 1, 2), (2, 2, 1)),
                                                                            ((1, 2, 1), (1, 1, 2))]}),
    "add": (lambda: ops.Add(), {"x": g(8, 6), "b": g(6, seed=1)}, ["@x", "@b"], (),
            {2: [((2, 1), (1,)), ((1, 2), (2,))], 4: [((2, 2), (2,)), ((4, 1), (1,))]}),
    "sub": (lambda: ops.Sub(), {"x": g(8, 6), "y": g(8, 6, seed=1)}, ["@x", "@y"], (),
            {2: [((2, 1), (2, 1))], 4: [((2, 2), (2, 2))]}),
    "mul": (lambda: ops.Mul(), {"x": g(8, 6), "y": g(1, 6, seed=1)}, ["@x", "@y"], (),
            {2: [((1, 2), (1, 2))], 4: [((4, 1), (1, 1)), ((2, 2), (1, 2))]}),
    "real_div": (lambda: ops.RealDiv(), {"x": g(8, 6), "y": g(8, 6, seed=1, positive=True)}, ["@x", "@y"], (),
                 {2: [((2, 1), (2, 1))], 4: [((1, 2), (1, 2))]}),
    "bias_add": (lambda: ops.BiasAdd(), {"x": g(8, 6), "b": g(6, seed=1)}, ["@x", "@b"], (),
                 {2: [((1, 2), (2,))], 4: [((2, 2), (2,))]}),
    "exp": (lambda: ops.Exp(), {"x": g(8, 6)}, ["@x"], (), {2: [((2, 1),)], 4: [((2, 2),), ((1, 2),)]}),
    "log": (lambda: ops.Log(), {"x": g(8, 6, positive=True)}, ["@x"], (), {2: [((1, 2),)], 4: [((4, 1),)]}),
    "relu": (lambda: ops.ReLU(), {"x": g(8, 6)}, ["@x"], (), {2: [((2, 1),)], 4: [((2, 2),)]}),
    "reduce_sum": (lambda: ops.ReduceSum(keep_dims=True), {"x": g(8, 6)}, ["@x", -1], (),
                   {2: [((1, 2),)], 4: [((2, 2),)]}),
    "reduce_mean": (lambda: ops.ReduceMean(), {"x": g(8, 6)}, ["@x", 0], (), {2: [((2, 1),)], 4: [((2, 2),)]}),
    "reduce_max": (lambda: ops.ReduceMax(), {"x": g(8, 6)}, ["@x", -1], (), {2: [((1, 2),)], 4: [((2, 2),)]}),
    "reduce_all": (lambda: ops.ReduceSum(), {"x": g(8, 6)}, ["@x"], (), {2: [((2, 1),)], 4: [((2, 2),)]}),
    "softmax": (lambda: ops.Softmax(), {"x": g(8, 6)}, ["@x"], (), {2: [((2, 1),)], 4: [((4, 1),)]}),
    "one_hot": (lambda: ops.OneHot(), {}, [B(0), 6, B(1), B(2)], (IDX, torch.tensor(1.0), torch.tensor(0.0)),
                {2: [((2, 1), (), ()), ((1, 2), (), ())], 4: [((2, 2), (), ()), ((4, 1), (), ())]}),
    "not_equal": (lambda: ops.NotEqual(), {}, [B(0), B(1)], (IDX, IDX.flip(0)), {2: [((2,), (2,))], 4: [((4,), (4,))]}),
    "gather": (lambda: ops.Gather(), {"t": g(10, 6)}, ["@t", B(0), 0], (IDX,),
               {2: [((1, 2), (1,)), ((1, 1), (2,))], 4: [((1, 2), (2,)), ((2, 1), (2,))]}),
    "reshape": (lambda: ops.Reshape(), {"x": g(8, 6)}, ["@x", (4, 12)], (), {2: [((2, 1),)], 4: [((4, 1),)]}),
    "transpose": (lambda: ops.Transpose(), {"x": g(8, 6)}, ["@x", (1, 0)], (), {2: [((1, 2),)], 4: [((2, 2),)]}),
    "default_dp": (lambda: ops.MatMul(), {"w": g(6, 4, seed=1)}, [B(0), "@w"], (g(8, 6),), {2: [None], 4: [None]}),
}


def reference(name):
    factory, params, args, batch, _ = CASES[name]
    probe = Probe(factory(), params, args)
    loss = probe(*batch)
    if loss.requires_grad:
        loss.backward()
    return probe.out.detach(), {k: p.grad for k, p in probe.p.items()}


def run_cases(world):
    from paratrain.config import ParallelConfig
    from paratrain.mesh import Layout
    from paratrain.train.parallel_modes.semi_auto import place_semi_auto

    results, layout = {}, Layout(ParallelConfig(), world)
    for name, (factory, params, args, batch, strategies) in CASES.items():
        for i, strategy in enumerate(strategies[world]):
            op = factory()
            if strategy is not None:
                op.shard(strategy)
            placed = place_semi_auto(Probe(op, params, args), ParallelConfig(), layout, example_batch=batch)
            placed.forward_backward(batch)
            probe = placed.model
            grads = {k: p.grad.full_tensor().tolist() for k, p in probe.p.items()}
            results[name, i] = probe.out.detach().full_tensor().tolist(), grads  # plain lists cross processes
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_each_op_on_its_strategies_gives_one_process_outputs_and_gradients(world):
    results = run_distributed(run_cases, world, world, timeout=240)[0]
    assert len(results) == sum(len(c[4][world]) for c in CASES.values())
    for (name, i), (out, grads) in results.items():
        ref_out, ref_grads = reference(name)
        out = torch.tensor(out)
        assert out.shape == ref_out.shape, (name, i)
        assert torch.allclose(out.float(), ref_out.float(), atol=1e-5), (name, i)
        for key, grad in grads.items():
            assert torch.allclose(torch.tensor(grad), ref_grads[key], atol=1e-5), (name, i, key)


def test_one_process_runs_the_plain_op_and_ignores_strategies():
    x, w = g(4, 3), g(3, 2, seed=1)
    assert torch.equal(ops.MatMul().shard(((2, 1), (1, 2)))(x, w), x @ w)
    assert torch.equal(ops.AllReduce()(x), x)
    one_hot = ops.OneHot()(torch.tensor([2, 0]), 3, torch.tensor(5.0), torch.tensor(-1.0))
    assert one_hot.tolist() == [[-1.0, -1.0, 5.0], [5.0, -1.0, -1.0]]


class Refused(nn.Module):
    """A net whose ops break every rule of item 2."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(g(6, 4))
        self.w2 = nn.Parameter(g(4, 4))
        self.indivisible = ops.MatMul().shard(((3, 1), (1, 1)))        # 3 does not divide 8 rows
        self.too_many = ops.MatMul().shard(((1, 1), (1, 4)))           # fine alone: 4 devices ...
        self.contraction = ops.MatMul().shard(((1, 2), (1, 1)))        # K split 2 ways in x, 1 in w
        self.shared = ops.MatMul().shard(((1, 2), (2, 1)))             # w2 split by rows here ...
        self.shared_again = ops.MatMul().shard(((1, 1), (1, 2)))       # ... and by columns here
        self.wrong_rank = ops.ReLU().shard(((2,),))
        self.softmax = ops.Softmax().shard(((1, 2),))

    def forward(self, x):
        a = self.indivisible(x, self.w) + self.too_many(x, self.w) + self.contraction(x, self.w)
        b = self.shared(a, self.w2) + self.shared_again(a, self.w2)
        return self.softmax(self.wrong_rank(b)).sum()


def test_every_refusal_names_the_op_its_strategy_and_the_rule():
    net = Refused()
    calls = record_calls(net, (g(8, 6),))
    with pytest.raises(StrategyError) as err:
        check_strategies(calls, 6)
    problems = err.value.problems
    assert problems == [
        "indivisible (MatMul) strategy ((3, 1), (1, 1)): 3 slices do not divide dimension 0 of input 0 (size 8)",
        "too_many (MatMul) strategy ((1, 1), (1, 4)): its device matrix uses 4 devices, which does not divide "
        "device_num=6",
        "contraction (MatMul) strategy ((1, 2), (1, 1)): the contraction dimension is split 2 ways in the first "
        "input and 1 in the second: they must be equal",
        "wrong_rank (ReLU) strategy ((2,),): input 0 has 2 dimensions to split (shape [8, 4]) but its tuple has 1 "
        "entries",
        "softmax (Softmax) strategy ((1, 2),): the softmax axis 1 cannot be split (it is split 2 ways)",
    ]
    for name in ("indivisible", "too_many", "contraction", "wrong_rank", "softmax"):
        getattr(net, name).strategy = None
    factors = check_strategies(calls, 4)
    with pytest.raises(StrategyError) as err:
        parameter_placements(calls, factors)
    assert err.value.problems == [
        "shared_again (MatMul) strategy ((1, 1), (1, 2)): parameter w2 is split (1, 2) here but (2, 1) by shared "
        "(MatMul) strategy ((1, 2), (2, 1)): a parameter shared by two ops needs one strategy for it"]


def test_device_matrices_that_cannot_share_a_numbering_are_refused():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(g(6, 6))
            self.a = ops.MatMul().shard(((2, 1), (1, 3)))
            self.b = ops.MatMul().shard(((3, 1), (1, 2)))

        def forward(self, x):
            return self.b(self.a(x, self.w), self.w).sum()

    with pytest.raises(StrategyError, match="cannot share one numbering of device_num=6"):
        check_strategies(record_calls(Two(), (g(6, 6),)), 6)


def test_shard_takes_tuples_of_positive_ints():
    with pytest.raises(Exception, match="positive slice counts"):
        ops.MatMul().shard(((0, 1), (1, 1)))
    with pytest.raises(Exception, match="positive slice counts"):
        ops.MatMul().shard((2, 1))


def test_cast_dropout_and_shape():
    x = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    assert ops.Cast()(x, torch.float16).dtype == torch.float16
    assert ops.shape(x) == (2, 3) and ops.shape(x)[-1] == 3
    torch.manual_seed(0)
    dropout = ops.Dropout(keep_prob=0.75).shard(((2, 1, 1),))
    assert dropout.strategy == ((2, 1, 1),)
    y, mask = dropout(torch.ones(4, 50, 50))
    assert set(mask.unique().tolist()) == {0.0, 1.0} and 0.7 < mask.mean() < 0.8
    torch.testing.assert_close(y, mask / 0.75)
    y, mask = ops.Dropout(keep_prob=1.0)(torch.ones(3))
    assert mask.tolist() == [1.0, 1.0, 1.0] and y.tolist() == [1.0, 1.0, 1.0]
    from paratrain.errors import UserError

    with pytest.raises(UserError, match=r"Dropout\(keep_prob=0\): expected a number in \(0, 1\]"):
        ops.Dropout(keep_prob=0)
    with pytest.raises(UserError, match=r"Dropout\(keep_prob='0.5'\): expected a number in \(0, 1\]"):
        ops.Dropout(keep_prob="0.5")


def test_a_scalar_inputs_empty_tuple_is_accepted_as_mindspore_writes_it():
    class NotPad(nn.Module):
        def __init__(self):
            super().__init__()
            self.no_equal = ops.NotEqual().shard(((2, 1), ()))

        def forward(self, ids):
            return self.no_equal(ids, 1)

    net = NotPad()
    assert check_strategies(record_calls(net, (torch.ones(4, 3, dtype=torch.int32),)), 2) == (2,)
    assert net.no_equal.strategy == ((2, 1),)  # one tuple per tensor input
    net.no_equal.shard(((2, 1), (2,)))  # a split of a scalar is still refused
    with pytest.raises(StrategyError, match=r"it gives 2 tuples for 1 tensor inputs"):
        check_strategies(record_calls(net, (torch.ones(4, 3, dtype=torch.int32),)), 2)
