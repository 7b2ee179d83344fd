"""``train.compile = true``: each layer compiled with torch.compile (inductor on the CPU) trains with the
losses of the eager model, and paratrain.nn layers so compiled follow the eager ones under padded masks. Run in a
child process: inductor's compile workers must not be inherited by the processes later tests fork."""
import pytest
import torch

from conftest import tiny_config
from forked_ranks import run_distributed


def _eager_then_compiled(fn, *args):
    """``fn(*args, False)``, then ``fn(*args, True)``, in one process (one child started, not two): the eager
    reference runs first, before anything is compiled."""
    return fn(*args, False), fn(*args, True)


def _losses(root, kind, compile_layers):
    from paratrain.trainer import Trainer

    grouped = {"num_kv_heads": 2} if kind == "llama" else {}
    cfg = tiny_config(run={"dir": f"{root}/{compile_layers}"}, model={"kind": kind, "decoder_layers": 2, **grouped},
                      train={"steps": 3, "compile": compile_layers}, metrics={"progress": False})
    trainer = Trainer(cfg)
    compiled = [layer._compiled_call_impl is not None for layer in trainer.model.layers.values()]
    return [r["loss"] for r in trainer.train()], compiled


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_compiled_layers_give_the_eager_losses(tmp_path, kind):
    ((eager, not_compiled), (compiled, all_compiled)), = run_distributed(_eager_then_compiled, 1, _losses,
                                                                          str(tmp_path), kind, timeout=280)
    assert all_compiled == [True, True] and not_compiled == [False, False]
    assert compiled == pytest.approx(eager, rel=1e-4)


def _user_net_losses(compile_layers):
    """(losses, whether each layer of the net is compiled) of a user's net with full recompute over 3 steps,
    placed by ``place_net`` (``compile_layers``: MindSpore's GRAPH_MODE)."""
    import torch

    from paratrain.config import ParallelConfig
    from paratrain.mesh import Layout
    from test_user_net import Net, _batches, train_placed

    torch.manual_seed(0)
    net, config = Net(layers=2), ParallelConfig(recompute="full")
    steps = train_placed(net, config, Layout(config, 1), _batches(3), compile_layers=compile_layers)
    return [loss for loss, _ in steps], [block._compiled_call_impl is not None for block in net.blocks]


@pytest.mark.slow
def test_a_user_nets_layers_compiled_under_recompute_give_the_eager_losses():
    """GRAPH_MODE compiles each layer of a user's net after recompute wraps it, as ``train.compile`` does."""
    ((eager, not_compiled), (compiled, all_compiled)), = run_distributed(_eager_then_compiled, 1, _user_net_losses,
                                                                          timeout=280)
    assert all_compiled == [True, True] and not_compiled == [False, False]
    assert compiled == pytest.approx(eager, rel=1e-4)


def _padded_mask_outputs(compile_layers):
    """A paratrain.nn encoder's outputs and input gradients over masks of causal x key padding whose shortest
    sequence changes from batch to batch (how many rows run as is_causal: paratrain.nn.layers.recognise_mask)."""
    import torch

    from paratrain.nn import TransformerEncoder

    torch.manual_seed(0)
    rows, length, hidden = 2, 16, 32
    encoder = TransformerEncoder(batch_size=rows, num_layers=2, hidden_size=hidden, ffn_hidden_size=64,
                                 seq_length=length, num_heads=4, attention_dropout_rate=0.0, hidden_dropout_rate=0.0)
    if compile_layers:
        for block in encoder.blocks:
            block.compile()
    results = []
    for shortest in (length, 12, 10, 7, 0, 3):
        keep = (torch.arange(length)[None] < torch.tensor([length, shortest])[:, None]).float()
        mask = torch.ones(length, length).tril().expand(rows, length, length) * keep[:, None, :]
        x = torch.randn(rows, length, hidden, requires_grad=True)
        out = encoder(x, mask)[0]
        out.square().sum().backward()
        results.append((out.tolist(), x.grad.tolist()))  # plain lists: a tensor would not outlive its process
    return results


@pytest.mark.slow
def test_compiled_layers_under_padded_masks_of_changing_lengths_give_the_eager_outputs():
    ((eager, compiled),) = run_distributed(_eager_then_compiled, 1, _padded_mask_outputs, timeout=280)
    for got, want in zip(compiled, eager, strict=True):
        for tensor, reference in zip(got, want, strict=True):
            torch.testing.assert_close(torch.tensor(tensor), torch.tensor(reference), rtol=1e-4, atol=1e-5)
