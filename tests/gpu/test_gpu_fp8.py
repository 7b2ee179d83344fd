"""fp8 on a GPU with fp8 tensor cores (compute capability 8.9 or more: Ada, Hopper): the small GPT and the Llama of its
sizes train 50 steps with their projections in torchao's float8 Linears and their losses stay within 2 % of the same
run in bf16.
Skipped on an older GPU; fails, with the reason, where torchao's float8 training cannot run with this torch."""
import pytest
import torch

from gpu.gpt import GPT, LLAMA, gpt_config
from gpu.spawn import run_spawned
from paratrain.precision import FP8_CAPABILITY, fp8_unavailable
from paratrain.trainer import Trainer

STEPS, LOSS_RTOL = 50, 2e-2


def train(cfg) -> dict:
    """Worker: the logged losses, and how many plain and fp8 Linears the model has."""
    trainer = Trainer(cfg)
    kinds = [type(m).__name__ for m in trainer.model.modules()]
    return {"losses": [float(r["loss"]) for r in trainer.train()], "linears": kinds.count("Linear"),
            "fp8_linears": kinds.count("Float8Linear")}


def run(tmp_path, mixed_precision: str, model: dict) -> dict:
    cfg = gpt_config(tmp_path / mixed_precision / "run", STEPS, model=model)
    cfg.train.mixed_precision = mixed_precision
    (result,) = run_spawned(train, 1, cfg, root=tmp_path / mixed_precision, timeout=240)
    return result


@pytest.mark.timeout(540)
@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
def test_fp8_trains_within_2_percent_of_bf16(tmp_path, model):
    if torch.cuda.get_device_capability(0) < FP8_CAPABILITY:
        pytest.skip(f"{torch.cuda.get_device_name(0)}: compute capability {torch.cuda.get_device_capability(0)}, "
                    f"no fp8 tensor cores")
    why = fp8_unavailable(torch.device("cuda", 0))
    assert why is None, why
    bf16, fp8 = run(tmp_path, "bf16", model), run(tmp_path, "fp8", model)
    # the projections (multiples of 16) are all fp8; the head is a Linear subclass, kept
    assert bf16["fp8_linears"] == fp8["linears"] == 0 and fp8["fp8_linears"] == bf16["linears"] >= 4 * 2
    assert fp8["losses"][-1] < fp8["losses"][0] - 0.5, fp8["losses"]
    for step, (got, want) in enumerate(zip(fp8["losses"], bf16["losses"], strict=True)):
        assert got == pytest.approx(want, rel=LOSS_RTOL), f"logged loss {step}: fp8 {got}, bf16 {want}"
