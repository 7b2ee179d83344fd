"""examples/mindspore_basics: the distributed-basics tutorial's nets print the one-process losses under data,
semi-auto, auto and hybrid parallel on 2 and 4 processes; the data-parallel ResNet-50 script's loss falls on
2 processes and with synchronized batch norm equals one process's over the same global batch;
``gradients_mean`` and ``parameter_broadcast`` take effect; the script runs under ``paratrain launch``."""
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from forked_ranks import example_losses, loss_recorder, run_distributed

EXAMPLES = ROOT / "examples" / "mindspore_basics"
NETS = EXAMPLES / "parallel_nets.py"
RESNET = EXAMPLES / "resnet50_distributed_training.py"
NET_ARGS = ["--batch", "16", "--steps", "6"]


def net_losses(mode: str) -> list[float]:
    return example_losses(NETS, ["--mode", mode, *NET_ARGS])


@pytest.fixture(scope="module")
def one_process_nets():
    """The losses on one process of the data and the hybrid modes: the same computation (every mode's is)."""
    return {mode: run_distributed(net_losses, 1, mode)[0] for mode in ("data", "hybrid")}


@pytest.mark.slow
@pytest.mark.parametrize("mode, world", [("data", 2), ("semi_auto", 2), ("semi_auto", 4), ("auto", 2),
                                         ("hybrid", 2), ("hybrid", 4)])
def test_the_tutorial_nets_print_the_one_process_losses(one_process_nets, mode, world):
    expected = one_process_nets["data"]
    assert one_process_nets["hybrid"] == expected  # the one-device nets are the same computation
    assert expected[-1] < expected[0]
    results = run_distributed(net_losses, world, mode, timeout=120)
    for losses in results:  # every rank computed the global batch's loss
        assert losses == pytest.approx(expected, rel=1e-5), mode


@pytest.mark.slow
def test_a_batch_that_does_not_split_over_the_ranks_is_refused():
    with pytest.raises(RuntimeError, match=r"UserError: Model.train: batch index 0 of epoch 1: a batch of 9 rows "
                                           r"does not split into 2 equal parts \("
                                           r"data_parallel=2 x micro_batch_num=1\): give a batch size divisible by 2"):
        run_distributed(example_losses, 2, NETS, ["--mode", "data", "--batch", "9", "--steps", "1"], timeout=120)


def _context_effects():
    """dp2 runs of the tutorial's DataParallelNet: gradients summed (MindSpore's default), and nets built
    differently on each rank under ``parameter_broadcast``."""
    sys.path.insert(0, str(EXAMPLES))
    from parallel_nets import DataParallelNet, regression_batches

    from paratrain import ParallelMode, reset_auto_parallel_context, set_auto_parallel_context
    from paratrain.communication import get_rank, init
    from paratrain.nn import Momentum
    from paratrain.train import Model

    torch.set_num_threads(1)
    init()
    out = {}
    for case, context in (("summed", {"gradients_mean": False}),
                          ("broadcast", {"gradients_mean": True, "parameter_broadcast": True})):
        reset_auto_parallel_context()
        set_auto_parallel_context(parallel_mode=ParallelMode.DATA_PARALLEL, **context)
        net = DataParallelNet()
        if case == "broadcast":
            with torch.no_grad():
                net.weight.mul_(1 + get_rank())  # rank 0's weight is the one-process weight
        losses = loss_recorder()
        model = Model(net, loss_fn=torch.nn.MSELoss(), optimizer=Momentum(net.parameters(), 1e-4, 0.9))
        model.train(1, regression_batches(16, 6), callbacks=[losses])
        out[case] = losses.values
    return out


@pytest.mark.slow
def test_gradients_mean_and_parameter_broadcast_take_effect():
    sys.path.insert(0, str(EXAMPLES))
    from parallel_nets import DataParallelNet, regression_batches

    def one_process(lr):
        net = DataParallelNet()
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
        losses = []
        for x, y in regression_batches(16, 6):
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    out = run_distributed(_context_effects, 2, timeout=120)[0]
    assert out["summed"] == pytest.approx(one_process(2e-4), rel=1e-5)  # 2 ranks' gradients summed: twice the step
    assert out["broadcast"] == pytest.approx(one_process(1e-4), rel=1e-5)  # rank 1 trained rank 0's weight


RESNET_ARGS = ["--sample-images", "48", "--width", "4", "--blocks", "1", "1", "1", "1", "--epochs", "2",
               "--lr", "0.01"]


def resnet_losses(data, batch, *flags):
    return example_losses(RESNET, ["--data", str(data), "--batch", str(batch), *RESNET_ARGS, *flags])


@pytest.mark.slow
def test_resnet50_script_learns_on_2_processes_and_with_sync_bn_gives_one_process_losses(tmp_path):
    one = run_distributed(resnet_losses, 1, tmp_path, 8, "--sync-bn")[0]
    synced = run_distributed(resnet_losses, 2, tmp_path, 4, "--sync-bn", timeout=180)[0]
    local = run_distributed(resnet_losses, 2, tmp_path, 4, "--save-steps", "12", "--sliced", "--out",
                            str(tmp_path / "ckpt"), timeout=180)[0]
    assert len(one) == len(synced) == len(local) == 12  # 48 images: 6 global batches of 8, 2 epochs
    # Compared where rounding has not been amplified: step 1 (the synced forward) and step 2 (one averaged
    # update). A ReLU input within 1e-7 of 0 can change sign with the order of a sum, which moves the gradients
    # below it by 1e-3 (seen at step 1 with MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=SSE41: the step-2 loss off
    # by 3e-6, by step 6 by 1e-3). At step 2, summed gradients are off by 8e-3 and statistics whose gradient
    # is not all-reduced by 1e-3; unsynced statistics are off by 3e-2 at step 1.
    assert synced[:2] == pytest.approx(one[:2], rel=1e-5)
    assert sum(local[-3:]) < sum(local[:3])  # the loss falls with each rank's own batch-norm statistics
    assert local != pytest.approx(one, rel=1e-3)  # ... which are not the global batch's

    from paratrain import load_checkpoint, load_param_into_net
    from paratrain.models.resnet import resnet50

    saved = tmp_path / "ckpt" / "resnet50-2_6"
    assert len(list(saved.glob("*.distcp"))) == 2 and not (saved / "model.safetensors").exists()
    torch.manual_seed(0)
    plain = resnet50(10, 4, num_blocks=(1, 1, 1, 1))  # the script's initial weights
    initial = plain.head.weight.detach().clone()
    # the sliced save (of the net with its loss, names network.*) loads into a plain net under MindSpore's prefix rule
    assert load_param_into_net(plain, load_checkpoint(saved))[0] == []
    assert not torch.allclose(plain.head.weight, initial, atol=1e-4)  # ... with the trained weights


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_paratrain_launch_runs_the_hybrid_net_on_2_processes(tmp_path, one_process_nets):
    env = {**os.environ, "PARATRAIN_HOME": str(tmp_path / "runs"), "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "paratrain", "launch", "--nproc-per-node", "2", "--name", "hybrid",
                          "--", str(NETS), "--mode", "hybrid", *NET_ARGS], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr
    log = (tmp_path / "runs" / "hybrid" / "rank0.log").read_text()
    printed = [float(x) for x in re.findall(r"^epoch: 1 step: \d+, loss is (\S+)$", log, re.M)]
    assert printed == pytest.approx(one_process_nets["data"], rel=1e-5)


def test_sync_batch_norm_takes_mindspore_momentum_and_is_the_only_one_synced_in_a_users_net():
    from torch import nn

    from paratrain.errors import UserError
    from paratrain.nn import SyncBatchNorm
    from paratrain.parallel.data import GlobalBatchNorm, sync_batch_norm

    assert SyncBatchNorm(4).momentum == pytest.approx(0.1)  # MindSpore's 0.9 is torch's 0.1
    for kwargs, match in (({"momentum": 1.5}, "momentum=1.5"), ({"process_groups": [[0, 1]]}, "process_groups"),
                          ({"use_batch_statistics": True}, "use_batch_statistics")):
        with pytest.raises(UserError, match=match):
            SyncBatchNorm(4, **kwargs)
    net = nn.Sequential(nn.BatchNorm2d(4), SyncBatchNorm(4, momentum=0.8))
    sync_batch_norm(net, None, torch.device("cpu"), every_batch_norm=False)
    assert type(net[0]) is nn.BatchNorm2d and type(net[1]) is GlobalBatchNorm
    assert net[1].momentum == pytest.approx(0.2)
    sync_batch_norm(net, None, torch.device("cpu"))  # the trainer's models: every BatchNorm2d
    assert type(net[0]) is GlobalBatchNorm
    on_gpu = nn.Sequential(nn.BatchNorm2d(4), SyncBatchNorm(4, momentum=0.8))
    sync_batch_norm(on_gpu, None, torch.device("cuda"), every_batch_norm=False)  # torch's SyncBatchNorm there
    assert type(on_gpu[0]) is nn.BatchNorm2d and type(on_gpu[1]) is nn.SyncBatchNorm
    assert on_gpu[1].momentum == pytest.approx(0.2)


def test_dtype_names_are_torch_dtypes_without_importing_torch_first():
    import torch

    import paratrain
    from paratrain import dtype as mstype

    assert (mstype.float32, mstype.float16, mstype.int32, mstype.bool_) == (torch.float32, torch.float16,
                                                                            torch.int32, torch.bool)
    assert paratrain.float32 is torch.float32 and paratrain.int64 is torch.int64
    with pytest.raises(AttributeError):
        paratrain.float99
    code = "import sys, paratrain; from paratrain import dtype; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_generator_dataset_maps_and_batches_as_mindspore():
    import numpy as np
    import torch

    import paratrain.dataset as ds
    import paratrain.dataset.transforms.c_transforms as C
    from paratrain import dtype as mstype
    from paratrain.errors import UserError

    def rows():
        for i in range(5):
            yield np.arange(3) + i, np.ones((2, 2)), np.array(i, dtype=np.int32)

    data = ds.GeneratorDataset(rows, column_names=["ids", "mask", "label"])
    data = data.map(input_columns="ids", operations=C.TypeCast(mstype.int32))
    data = data.map(input_columns="mask", operations=C.TypeCast(mstype.float16))
    batches = data.batch(2, drop_remainder=True)
    assert batches.get_dataset_size() == 2 and data.get_dataset_size() == 5
    first = next(iter(batches))
    assert isinstance(first, tuple) and [t.dtype for t in first] == [torch.int32, torch.float16, torch.int32]
    assert first[0].tolist() == [[0, 1, 2], [1, 2, 3]] and first[1].shape == (2, 2, 2)
    assert [len(b[0]) for b in data.batch(2)] == [2, 2, 1]
    assert [type(c) for c in next(batches.create_tuple_iterator(output_numpy=True))] == [np.ndarray] * 3
    with pytest.raises(UserError, match=r"no column 'idz'; the columns are ids, mask, label"):
        data.map(input_columns="idz", operations=C.TypeCast(mstype.int32))
    with pytest.raises(UserError, match=r"TypeCast\(data_type='int32'\): expected a dtype"):
        C.TypeCast("int32")
    with pytest.raises(UserError, match=r"column_types=/schema=\): the columns keep the types the source gives"):
        ds.GeneratorDataset(rows, column_names=["ids", "mask", "label"], column_types=[mstype.int32] * 3)
    shuffled = ds.GeneratorDataset([(np.array(i),) for i in range(8)], column_names=["x"], shuffle=True)
    assert sorted(t.item() for b in shuffled.batch(4) for t in b[0]) == list(range(8))


def test_a_script_importing_mindspore_s_transformer_package_changes_its_package_name_only():
    import paratrain.nn
    from paratrain.nn.transformer import (AttentionMask, CrossEntropyLoss, Transformer,  # noqa: F401
                                          TransformerOpParallelConfig, VocabEmbedding)

    import paratrain.nn.transformer as package

    assert {name: getattr(package, name) for name in package.__all__} == {
        name: getattr(paratrain.nn, name) for name in package.__all__}
