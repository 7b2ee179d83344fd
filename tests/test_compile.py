"""``train.compile = true``: each layer compiled with torch.compile (inductor on the CPU) trains with the
losses of the eager model. Run in a child process: inductor's compile workers must not be inherited by the
processes later tests fork."""
import pytest

from conftest import tiny_config
from multiprocess import run_distributed


def _losses(root, compile_layers):
    from paratrain.trainer import Trainer

    cfg = tiny_config(run={"dir": f"{root}/{compile_layers}"}, model={"kind": "gpt", "decoder_layers": 2},
                      train={"steps": 3, "compile": compile_layers}, metrics={"progress": False})
    trainer = Trainer(cfg)
    compiled = [layer._compiled_call_impl is not None for layer in trainer.model.layers.values()]
    return [r["loss"] for r in trainer.train()], compiled


@pytest.mark.slow
def test_compiled_layers_give_the_eager_losses(tmp_path):
    (eager, not_compiled), = run_distributed(_losses, 1, str(tmp_path), False, timeout=240)
    (compiled, all_compiled), = run_distributed(_losses, 1, str(tmp_path), True, timeout=240)
    assert all_compiled == [True, True] and not_compiled == [False, False]
    assert compiled == pytest.approx(eager, rel=1e-4)
