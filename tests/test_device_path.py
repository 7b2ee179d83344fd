"""The GPU fast path, checked on the CPU: no host synchronisation on steps that are not logged, the next batch
made while a step runs (only this rank's rows), padding checks, one FSDP unit per block and FSDP's mixed
precision, the model initialised shard by shard with the values of a plain build, and CPU runs giving large
freed blocks back to the system."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, host_reads, tiny_config
from forked_ranks import run_distributed


def test_steps_that_are_not_logged_do_not_wait_for_the_device(tmp_path, monkeypatch):
    from paratrain.trainer import Trainer

    trainer = Trainer(tiny_config(run={"dir": str(tmp_path)}, train={"steps": 4},
                                  metrics={"log_steps": 4, "progress": False}))
    reads = host_reads(monkeypatch)
    records = []
    for _ in range(3):
        records.append(trainer.train_step())
        trainer.step += 1
    assert reads == [] and all(isinstance(r["loss"], torch.Tensor) for r in records)
    trainer.train_step()  # step 4 is logged: the four steps' values come to the host in one copy
    assert reads == ["tolist"] and all(isinstance(r["loss"], float) for r in records)


def test_next_batch_is_made_while_the_step_runs_and_only_this_ranks_rows():
    from paratrain.data.loader import ShardedBatches
    from paratrain.data.synthetic import SyntheticLM

    source = SyntheticLM(tiny_config(model={"kind": "gpt"}).model, seed=3)
    whole = ShardedBatches(source, 8)
    rank1 = ShardedBatches(source, 8, dp_rank=1, dp_size=2)
    batch = rank1.batch(5)
    assert rank1._ahead is not None and rank1._ahead[0] == 6  # step 6 is being made
    assert torch.equal(batch["input_ids"], whole.host_rows(5)["input_ids"][4:])
    assert torch.equal(rank1.batch(6)["input_ids"], whole.host_rows(6)["input_ids"][4:])


def test_padding_before_a_token_is_refused():
    from paratrain.data.loader import DataError, ShardedBatches

    class LeftPadded:
        def batch_rows(self, step, start, stop):
            ids = torch.tensor([[0, 0, 5, 6]] * (stop - start), device="cpu")
            return {"input_ids": ids, "labels": ids}

    with pytest.raises(DataError, match="input_ids of step 0 has padding \\(0\\) before a token"):
        ShardedBatches(LeftPadded(), 2, pad_token_id=0).batch(0)


def _data_parallel_units(zero_stage, mixed_precision):
    from torch.distributed._composable.replicate import DDP
    from torch.distributed.fsdp import FSDPModule

    from paratrain.mesh import Layout
    from paratrain.models import build_model
    from paratrain.parallel import parallelize
    from paratrain.distributed import init_from_env

    _, world = init_from_env()
    cfg = tiny_config(model={"kind": "gpt", "decoder_layers": 3}, parallel={"dp": 2, "zero_stage": zero_stage})
    with torch.device("meta"):
        model = build_model(cfg.model)
    (part,) = parallelize(model, cfg.parallel, Layout(cfg.parallel, world), precision=mixed_precision).parts
    units = [name for name, m in part.named_modules() if isinstance(m, FSDPModule)]
    policies = {str(m._get_fsdp_state()._mp_policy.param_dtype) for m in part.modules() if isinstance(m, FSDPModule)}
    shared = {}  # one FSDP state per unit: (its modules' names, whether it stays gathered after forward)
    for name in units:
        group = part.get_submodule(name)._get_fsdp_state()._fsdp_param_group
        if group is not None:
            shared.setdefault(id(group), ([], group.post_forward_mesh_info is None))[0].append(name)
    return units, policies, isinstance(part, DDP), sorted(shared.values())


@pytest.mark.slow
def test_one_fsdp_unit_per_block_and_part_and_mixed_precision_gathers_bf16():
    (units, policies, ddp, groups), _ = run_distributed(_data_parallel_units, 2, 3, "bf16", timeout=120)
    assert units == ["", "embed", "layers.0", "layers.1", "layers.2", "norm", "head"]  # the untied parts too
    assert policies == {"torch.bfloat16"} and not ddp
    # the embeddings gathered with the first block, the final norm and head with the last one, which stays
    # gathered from forward into backward (it runs first there)
    assert groups == [(["embed", "layers.0"], False), (["layers.1"], False), (["layers.2", "norm", "head"], True)]
    (units, policies, ddp, _), _ = run_distributed(_data_parallel_units, 2, 0, "bf16", timeout=120)
    assert units == [] and ddp  # stage 0: DDP's reducer, parameters fp32 (autocast lowers the compute)


def test_shard_by_shard_init_gives_the_plain_build(tmp_path):
    """The trainer builds on the meta device and materialises its parts from the recorded init: the weights
    are those of ``build_model`` after ``torch.manual_seed(seed)``, tied weights still tied."""
    from paratrain.models import build_model
    from paratrain.parallel.deferred_init import DeferredInitError, record_init
    from paratrain.trainer import Trainer

    cfg = tiny_config(run={"dir": str(tmp_path)}, model={"tie_embeddings": True})
    trainer = Trainer(cfg)
    torch.manual_seed(cfg.run.seed)
    plain = build_model(cfg.model)
    got = trainer.model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in plain.state_dict().items())
    assert trainer.model.head.weight is trainer.model.src_embed.word.embedding.weight

    class DrawsOutside(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(3) * 2)  # drawn into a temporary: not replayable
    with pytest.raises(DeferredInitError, match="draws random numbers \\(randn\\)"):
        record_init(DrawsOutside)


HOST_BLOCK = """
import ctypes, sys
import torch
from paratrain.device import configure


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "configured":
    configure(torch.device("cpu"))
big = torch.ones(16 << 20, dtype=torch.uint8)
del big  # glibc's own rule now serves blocks up to 16 MiB from its heap
block = torch.ones(8 << 20, dtype=torch.uint8)
print(libc.mallinfo2().hblkhd >= block.numel())  # the 8 MiB block is a mapping of its own
"""


@pytest.mark.parametrize("setting", ["configured", "glibc"])
def test_a_cpu_run_returns_large_freed_blocks_to_the_system(setting):
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "LD_PRELOAD")}
    out = subprocess.run([sys.executable, "-c", HOST_BLOCK, setting], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(setting == "configured")


def test_parameter_broadcast_runs_on_the_nets_device(monkeypatch):
    """MindSpore's ``parameter_broadcast`` broadcasts the net's tensors where the run computes (NCCL takes only
    GPU tensors), not where the user built the net. The meta device stands in for a GPU."""
    import torch.distributed as dist
    from types import SimpleNamespace

    from paratrain.config import ParallelConfig
    from paratrain.context import ParallelMode, reset_auto_parallel_context, set_auto_parallel_context
    from paratrain.train.placement import place_by_mode

    seen = []
    monkeypatch.setattr(dist, "broadcast", lambda tensor, src: seen.append(tensor.device))
    set_auto_parallel_context(parallel_mode=ParallelMode.HYBRID_PARALLEL, parameter_broadcast=True)
    try:
        place_by_mode(torch.nn.Linear(2, 2, device="cpu"), ParallelConfig(),
              SimpleNamespace(world_size=2, device=torch.device("meta")), ())
    finally:
        reset_auto_parallel_context()
    assert seen == [torch.device("meta")] * 2  # weight and bias


def test_cuda_refused_on_a_cpu_build_and_with_more_ranks_than_gpus(monkeypatch):
    from paratrain.device import check_local_ranks, device
    from paratrain.errors import UserError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(UserError, match="PARATRAIN_DEVICE=cuda but torch .* is a CPU-only build"):
        device("cuda")
    assert device("auto") == torch.device("cpu")
    check_local_ranks(8, "auto")  # no GPU: ranks run on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for choice in ("cuda", "auto"):
        with pytest.raises(UserError, match=r"2 ranks on this host but 1 GPU\(s\) visible.*--nproc-per-node 1"):
            device(choice)
    assert device("cpu") == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert device("cuda") == torch.device("cuda", 0)


TINY_GPT = """
[model]
kind = "gpt"
vocab_size = 64
hidden_size = 32
num_heads = 4
ffn_hidden_size = 64
decoder_layers = 2
seq_length = 16
[train]
steps = 1
global_batch_size = 4
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: PARATRAIN_DEVICE=cuda would train")
@pytest.mark.parametrize("command", [["train"], ["launch", "--nproc-per-node", "2", "--", "train"]])
def test_cuda_without_cuda_is_one_line_and_exit_2(tmp_path, command):
    (tmp_path / "gpt.toml").write_text(TINY_GPT)
    words = [*command, "--config", str(tmp_path / "gpt.toml"), f"--run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "PARATRAIN_DEVICE": "cuda", "PARATRAIN_HOME": str(tmp_path / "jobs")}
    out = subprocess.run([sys.executable, "-m", "paratrain", *words], capture_output=True, text=True, cwd=tmp_path,
                         env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("paratrain: PARATRAIN_DEVICE=cuda but torch") and out.stderr.count("\n") == 1, \
        out.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "jobs").exists()


def _outputs_kept_by_pipeline_stages(tmp_dir):
    from paratrain.trainer import Trainer

    trainer = Trainer(tiny_config(run={"dir": tmp_dir}, model={"kind": "gpt"}, parallel={"pp": 2, "micro_batch_num": 2},
                                  train={"steps": 1}, metrics={"progress": False}))
    trainer.train()
    return [len(stage.output_chunks) for stage in trainer.placed.pipeline.stages]


@pytest.mark.slow
def test_the_last_pipeline_stage_keeps_no_micro_batch_outputs(tmp_path):
    """Only the losses leave a step: the last stage does not hold (and concatenate) every micro-batch's logits."""
    assert run_distributed(_outputs_kept_by_pipeline_stages, 2, str(tmp_path), timeout=120) == [[0], [0]]


def test_head_loss_chunks_are_few_on_a_gpu_and_its_matmuls_run_in_bf16(monkeypatch):
    """The chunked head loss: a 8 x 2048-token micro-batch at a 32k vocabulary is a few large chunks on a GPU
    (each a dozen kernels launched from Python), small ones on the CPU; under bf16 autocast all three
    matmuls of a chunk (logits, hidden and weight gradients) run in bf16, under fp16 the weight
    gradient's in fp32."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from paratrain.modules import linear_cross_entropy

    tokens, vocab = 8 * 2048, 32000
    gpu, cpu = linear_cross_entropy.chunk_rows(vocab, "cuda"), linear_cross_entropy.chunk_rows(vocab, "cpu")
    assert -(-tokens // gpu) <= 8 and 4 * vocab * gpu <= 256 << 20  # chunks, and fp32 logits of one
    assert 4 * vocab * cpu <= 64 << 20 and gpu >= 4 * cpu

    class Matmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm_, torch.ops.aten.addmm):
                self.dtypes.append(tuple(str(a.dtype) for a in args[-2:]))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(linear_cross_entropy, "CHUNK_BYTES", 4 * 40 * 7)  # 7 rows a chunk: 3 chunks of 18 rows
    hidden = torch.randn(2, 9, 32, device="cpu")
    weight = torch.randn(40, 32, device="cpu")
    labels = torch.randint(0, 40, (2, 9), device="cpu")
    for dtype, weight_gradient in ((torch.bfloat16, "torch.bfloat16"), (torch.float16, "torch.float32")):
        with Matmuls() as seen, torch.autocast("cpu", dtype=dtype):
            linear_cross_entropy.linear_token_loss_sum(hidden, weight, labels, -100)
        low = (str(dtype), str(dtype))
        assert seen.dtypes == [low, low, (weight_gradient, weight_gradient)] * 3, seen.dtypes


def test_a_batch_tensor_on_a_cpu_run_is_used_as_it_is():
    from paratrain.device import to_device

    host = torch.arange(4)
    assert to_device(host, torch.device("cpu")) is host  # no copy, no pinning (that is for GPUs)
