"""Nothing lost: the last step is always saved, and SIGTERM/SIGINT makes every rank stop at the same step,
save it and end with the stopped-and-saved code; the resumed run continues as if uninterrupted."""
import os
import signal

import pytest

from conftest import tiny_config
from multiprocess import run_distributed


def _config(run_dir, steps=6, **checkpoint):
    return tiny_config(run={"dir": str(run_dir)}, model={"encoder_layers": 1, "decoder_layers": 1},
                       parallel={"dp": int(os.environ.get("WORLD_SIZE", "1"))}, train={"steps": steps},
                       metrics={"log_steps": 100, "progress": False}, checkpoint=checkpoint)


def test_the_last_step_is_saved(tmp_path):
    from paratrain.trainer import Trainer

    Trainer(_config(tmp_path, steps=5, save_steps=2)).train()
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert saved == ["step_00000002", "step_00000004", "step_00000005"]


def _stop_and_resume(root, signal_rank, signal_step):
    """Uninterrupted losses; the losses of a run that ``signal_rank`` SIGTERMs during step ``signal_step``;
    the step it stopped at; the losses of its resumed run."""
    import torch

    from paratrain.trainer import Trainer

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    whole = [r["loss"] for r in Trainer(_config(f"{root}/whole")).train()]
    stopped = Trainer(_config(f"{root}/stopped"))
    step = stopped.train_step

    def train_step():
        if rank == signal_rank and stopped.step + 1 == signal_step:
            os.kill(os.getpid(), signal.SIGTERM)
        return step()
    stopped.train_step = train_step
    first = [r["loss"] for r in stopped.train()]
    resumed = [r["loss"] for r in Trainer(_config(f"{root}/stopped")).train()]
    return whole, first, stopped.stopped_at, resumed


def test_sigterm_saves_and_the_resumed_run_continues(tmp_path):
    whole, first, stopped_at, resumed = _stop_and_resume(str(tmp_path), 0, 3)
    assert stopped_at == 3 and first == whole[:3] and resumed == whole[3:]


@pytest.mark.slow
def test_every_rank_stops_at_the_same_step(tmp_path):
    results = run_distributed(_stop_and_resume, 2, str(tmp_path), 1, 2, timeout=240)
    for whole, first, stopped_at, resumed in results:
        assert stopped_at == 3  # the step after the one rank 1 was signalled in: agreed one step later
        assert first == pytest.approx(whole[:3], rel=1e-6) and resumed == pytest.approx(whole[3:], rel=1e-6)
