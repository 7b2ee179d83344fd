"""Checkpoints: exact resume, resharding across layouts, killed saves, damaged files, export.

A run "stopped after the step-4 checkpoint" is the same 8-step config whose training
loop is interrupted right after that save (so its LR schedule is the 8-step one).
The 4-process layouts run in one group of forked workers (start-up dominates).
"""
import functools
import logging
import multiprocessing
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from forked_ranks import run_distributed
from paratrain.checkpoint import CheckpointError, export, info, load_full_tensors
from paratrain.run_lock import LOCK_FILE
from paratrain.trainer import Trainer

STEPS, SAVE = 8, 4
MODEL = {"encoder_layers": 1, "decoder_layers": 1, "vocab_size": 256}  # dp4 zero 3: the tokens travel


class Stop(Exception):
    pass


def config(run_dir, parallel=None, **checkpoint):
    return tiny_config(run={"dir": str(run_dir)}, model=MODEL, parallel=parallel or {},
                       train={"steps": STEPS}, metrics={"log_steps": 100},
                       checkpoint={"save_steps": SAVE, **checkpoint})


def losses(history):
    return [r["loss"] for r in history]


def train_stopped_after(cfg, step=SAVE):
    """Train ``cfg`` but stop right after the checkpoint of ``step`` is written."""
    trainer = Trainer(cfg)
    save = trainer.checkpointer.maybe_save

    def save_then_stop(s):
        save(s)
        if s == step:
            raise Stop
    trainer.checkpointer.maybe_save = save_then_stop
    with pytest.raises(Stop):
        trainer.train()


def ckpt(run_dir, step):
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


# --- one process ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Uninterrupted 8 steps (checkpoints at 4 and 8), and the same run stopped at 4 and resumed."""
    root = tmp_path_factory.mktemp("one")
    full = Trainer(config(root / "full", integrated_save=True))
    full_losses = losses(full.train())
    train_stopped_after(config(root / "stopped"))
    resumed = Trainer(config(root / "stopped"))
    start = resumed.step
    resumed_losses = losses(resumed.train())
    return {"root": root, "full": full, "full_losses": full_losses, "resumed": resumed, "start": start,
            "resumed_losses": resumed_losses}


def test_resume_same_layout_is_bit_exact(one_process):
    r = one_process
    assert r["start"] == SAVE
    assert r["full_losses"][-1] < r["full_losses"][0]  # it trains
    assert r["resumed_losses"] == r["full_losses"][SAVE:]
    full, resumed = r["full"].model.state_dict(), r["resumed"].model.state_dict()
    assert full.keys() == resumed.keys()
    for name in full:
        assert torch.equal(full[name], resumed[name]), name
    opt_full, opt_resumed = r["full"].optimizer.state_dict(), r["resumed"].optimizer.state_dict()
    for i, state in opt_full["state"].items():
        for k, v in state.items():
            assert torch.equal(v, opt_resumed["state"][i][k]), (i, k)
    assert r["resumed"].scheduler.get_last_lr() == r["full"].scheduler.get_last_lr()


def test_keep_max_latest_and_layout(one_process, tmp_path):
    root = one_process["root"] / "full" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000008"
    summary = info(root)  # a checkpoint dir resolves to the newest
    assert summary["step"] == 8 and summary["layout"]["world_size"] == 1 and summary["integrated"]
    assert "model.head.weight" in summary["tensors"]
    trainer = Trainer(config(tmp_path, keep_max=2, resume="none"))
    for step in (1, 2, 3):
        trainer.checkpointer.save(step)
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name != LOCK_FILE)  # the run's lock
    assert saved == ["latest", "step_00000002", "step_00000003"]


def test_export_loads_into_plain_model_with_same_logits(one_process, tmp_path):
    from safetensors.torch import load_file

    from paratrain.models import build_model
    trainer = one_process["full"]
    out = export(ckpt(one_process["root"] / "full", 8), tmp_path / "model.safetensors")
    plain = build_model(trainer.cfg.model)
    plain.load_state_dict(load_file(str(out)))  # strict: every parameter name present
    inputs = {k: v for k, v in trainer.data.batch(0).items() if k != "labels"}
    trainer.model.eval(), plain.eval()
    with torch.no_grad():
        want, got = trainer.model(**inputs), plain(**inputs)
    assert torch.equal(got, want)
    integrated = load_file(str(ckpt(one_process["root"] / "full", 8) / "model.safetensors"))
    exported = load_file(str(out))
    assert integrated.keys() == exported.keys()
    assert all(torch.equal(integrated[k], exported[k]) for k in exported)


def test_readable_by_dcp_to_torch_save(one_process, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    path = ckpt(one_process["root"] / "full", 8)
    dcp_to_torch_save(path, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    model = load_full_tensors(path)
    assert {k for k in whole if k.startswith("model.")} == {"model." + k for k in model}
    for k, v in model.items():
        assert torch.equal(whole["model." + k], v), k
    assert any(k.startswith("optim.state.") and k.endswith(".exp_avg") for k in whole)


def test_cli_info_and_export(one_process, tmp_path, capsys):
    from paratrain.cli import main
    path = ckpt(one_process["root"] / "full", 4)
    assert main(["checkpoint", "info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "step           4" in out and "head.weight" in out and "dp 1 x mp 1" in out
    assert main(["export", str(path), str(tmp_path / "m.safetensors")]) == 0
    from safetensors.torch import load_file
    assert torch.equal(load_file(str(tmp_path / "m.safetensors"))["head.weight"], load_full_tensors(path)["head.weight"])
    assert main(["checkpoint", "info", str(tmp_path / "nowhere")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err


def _killed_save(run_dir):
    """Child process: train with checkpoints, killed while writing the step-8 checkpoint.

    One thread (a forked child of a process that used the thread pool must not use it); the
    losses of its steps go to losses.json so the resumed run can be compared bit for bit."""
    import json

    import paratrain.checkpoint.core as core
    torch.set_num_threads(1)
    seen = []

    def fault(self, stage, step):
        if stage == "shards_written" and step == 8:
            (Path(run_dir) / "losses.json").write_text(json.dumps(seen))
            os._exit(9)
    core.Checkpointer._fault_point = fault
    trainer = Trainer(config(run_dir))
    step = trainer.train_step
    trainer.train_step = lambda: seen.append(step()) or seen[-1]
    trainer.train()


def test_killed_save_resumes_from_previous(tmp_path, caplog):
    import json
    proc = multiprocessing.get_context("fork").Process(target=_killed_save, args=(tmp_path,))
    proc.start()
    try:
        proc.join(timeout=150)
        assert proc.exitcode == 9
    finally:
        if proc.is_alive():
            proc.kill()
    before_kill = [r["loss"] for r in json.loads((tmp_path / "losses.json").read_text())]
    root = tmp_path / "checkpoints"
    assert (root / ".tmp-step_00000008" / ".metadata").is_file()  # shards written, never committed
    assert (root / "latest").read_text().strip() == "step_00000004"
    # and a step directory left without its paratrain.json (e.g. copied by hand, half-way)
    shutil.copytree(ckpt(tmp_path, 4), root / "step_00000012")
    (root / "step_00000012" / "paratrain.json").unlink()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the killed run
    try:
        with caplog.at_level(logging.WARNING, logger="paratrain.checkpoint"):
            trainer = Trainer(config(tmp_path))
        assert trainer.step == 4
        text = caplog.text
        assert ".tmp-step_00000008" in text and "step_00000012" in text and "resumed from" in text
        assert losses(trainer.train()) == before_kill[SAVE:]
    finally:
        torch.set_num_threads(threads)


def test_damaged_checkpoint_errors_name_the_file(one_process, tmp_path):
    src = ckpt(one_process["root"] / "full", 4)
    path = tmp_path / "step_00000004"
    shutil.copytree(src, path)
    (path / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is missing"):
        Trainer(config(tmp_path / "run", resume=str(path)))
    shutil.copy(src / "__0_0.distcp", path)
    with open(path / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp has 1000 bytes"):
        Trainer(config(tmp_path / "run", resume=str(path)))
    shutil.copy(src / "__0_0.distcp", path)
    (path / "rank_00000.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors is missing"):
        Trainer(config(tmp_path / "run", resume=str(path)))


def test_metadata_never_unpickles_foreign_objects(one_process, tmp_path):
    from paratrain.checkpoint.storage import read_dcp_metadata
    path = tmp_path / "ckpt"
    shutil.copytree(ckpt(one_process["root"] / "full", 4), path)
    assert read_dcp_metadata(path).state_dict_metadata  # PyTorch's own index is accepted

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))
    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"\.metadata is unreadable.*refusing to load posix.system"):
        read_dcp_metadata(path)
    with pytest.raises(CheckpointError, match=r"\.metadata"):  # and the size check catches it first
        Trainer(config(tmp_path / "run", resume=str(path)))
    assert not (tmp_path / "pwned").exists()


# --- four processes: same layout and resharding -----------------------------------------------

def _four_ranks(root):
    """dp2 x mp2: uninterrupted, stopped + resumed; then dp4 zero 3 resumed from the dp2 x mp2 step 4."""
    dp2mp2 = {"dp": 2, "mp": 2}
    full = losses(Trainer(config(f"{root}/full", dp2mp2)).train())
    train_stopped_after(config(f"{root}/stopped", dp2mp2))
    resumed = Trainer(config(f"{root}/stopped", dp2mp2))
    start = resumed.step
    resumed_losses = losses(resumed.train())
    zero3 = Trainer(config(f"{root}/zero3", {"dp": 4, "zero_stage": 3}, resume=f"{root}/full/checkpoints/step_00000004"))
    pipeline = Trainer(config(f"{root}/pp2", {"dp": 2, "pp": 2, "micro_batch_num": 2, "zero_stage": 1},
                              resume=f"{root}/full/checkpoints/step_00000004"))
    zero1 = Trainer(config(f"{root}/zero1", {"dp": 4, "zero_stage": 1},
                           resume=f"{root}/full/checkpoints/step_00000004"))
    return {"full": full, "start": start, "resumed": resumed_losses, "zero3_start": zero3.step,
            "zero3": losses(zero3.train()), "pp2_start": pipeline.step, "pp2": losses(pipeline.train()),
            "zero1": losses(zero1.train())}


@functools.cache
def four_ranks(root):
    return run_distributed(_four_ranks, 4, root, timeout=300)[0]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    root = tmp_path_factory.mktemp("four")
    return root, four_ranks(str(root))


@pytest.mark.slow
def test_resume_dp2_mp2_is_bit_exact(four):
    root, r = four
    assert r["start"] == SAVE
    assert r["resumed"] == r["full"][SAVE:]
    final_full, final_resumed = load_full_tensors(ckpt(root / "full", 8)), load_full_tensors(ckpt(root / "stopped", 8))
    assert final_full.keys() == final_resumed.keys()
    for name in final_full:
        assert torch.equal(final_full[name], final_resumed[name]), name
    assert info(ckpt(root / "full", 4))["layout"]["model_parallel"] == 2


@pytest.mark.slow
def test_reshard_dp2_mp2_to_dp4_zero3_pp2_zero1_and_one_process(four, one_process, tmp_path):
    root, r = four
    want = r["full"][SAVE:]
    assert r["zero3_start"] == SAVE and r["pp2_start"] == SAVE
    assert r["zero3"] == pytest.approx(want, rel=1e-4)
    assert r["pp2"] == pytest.approx(want, rel=1e-4)  # pipeline stages load their layers by whole-model names
    assert r["zero1"] == pytest.approx(want, rel=1e-4)
    single = Trainer(config(tmp_path, resume=str(ckpt(root / "full", 4))))  # no process group at all
    assert single.step == SAVE
    assert losses(single.train()) == pytest.approx(want, rel=1e-4)
    assert r["full"] == pytest.approx(one_process["full_losses"], rel=1e-4)  # the layouts agree at all


@pytest.mark.slow
def test_zero1_owners_save_every_parameters_optimizer_state_once(four):
    """dp4 zero 1 resumed from dp2 x mp2 saves its step 8 with each optimizer state written by its owner
    alone: the same tensors, whole, as the dp2 x mp2 run's."""
    root, _ = four
    want = load_full_tensors(ckpt(root / "full", 8), prefix="optim.")
    got = load_full_tensors(ckpt(root / "zero1", 8), prefix="optim.")
    assert got.keys() == want.keys() and any(k.endswith("exp_avg_sq") for k in got)
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=1e-3, atol=1e-6), key


def test_pipeline_chunks_keep_original_names(one_process, tmp_path):
    """Chunks as a pipeline stage holds them (copies of the model with the other layers removed,
    the word table held by both) save and load through the same code, by original names."""
    import copy
    from torch import nn

    from paratrain.checkpoint import Checkpointer
    from paratrain.optim import build_optimizer, build_scheduler
    from paratrain.precision import LossScaler
    full = one_process["full"]
    first, last = copy.deepcopy(full.model), copy.deepcopy(full.model)
    first.transformer.decoder.layers, first.head = nn.ModuleDict(), None
    last.transformer.encoder.layers, last.src_embed.position = nn.ModuleDict(), None
    for chunk in (first, last):
        for p in chunk.parameters():
            p.data.zero_()
    stage = nn.ModuleList([first, last])
    cfg = config(tmp_path)
    optimizer = build_optimizer(stage, cfg.train)
    checkpointer = Checkpointer(cfg, full.layout, [first, last], optimizer, build_scheduler(optimizer, cfg.train),
                                {"loss_scaler": LossScaler(False), "data": full.data})
    checkpointer.load(ckpt(one_process["root"] / "full", 8))
    want = full.model.state_dict()
    for chunk in (first, last):
        for name, value in chunk.state_dict().items():
            assert torch.equal(value, want[name]), name
    saved = checkpointer.save(9)
    assert set(load_full_tensors(saved)) == set(want)
    resumed = Trainer(config(tmp_path / "run", resume=str(saved)))
    assert resumed.step == 9
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, want[name]), name
    assert resumed.optimizer.state_dict()["state"][0]["exp_avg"].abs().sum() > 0


def test_checkpoint_prefix_names_keeps_and_resumes_mindspore_style(tmp_path):
    trainer = Trainer(config(tmp_path, keep_max=2, resume="none", prefix="net"))
    (tmp_path / "checkpoints" / "step_00000009").mkdir(parents=True)  # another naming: neither pruned nor resumed
    for step in (1, 2, 3):
        trainer.checkpointer.save(step)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name != LOCK_FILE)
    assert names == ["latest", "net-1_2", "net-1_3", "step_00000009"]
    assert Trainer(config(tmp_path, prefix="net")).step == 3


def test_model_checkpoint_keep_max_zero_keeps_every_checkpoint(tmp_path):
    """ModelCheckpoint's ``keep_checkpoint_max=0`` keeps all, a count that many (``checkpoint.keep_max = 0`` from
    a TOML config: tests/test_faults.py)."""
    from test_train_api import Net, dataset, decay_optimizer

    from paratrain.train import CheckpointConfig, Model, ModelCheckpoint
    for keep, kept in ((0, ["test-1_1", "test-1_2", "test-1_3"]), (1, ["test-1_3"])):
        torch.manual_seed(0)
        net, directory = Net(), tmp_path / f"keep{keep}"
        policy = CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=keep, integrated_save=False)
        Model(net, optimizer=decay_optimizer(net)).train(
            1, dataset(3), callbacks=[ModelCheckpoint(prefix="test", directory=directory, config=policy)])
        assert sorted(p.name for p in directory.iterdir()) == ["latest", *kept]


def test_load_checkpoint_checks_an_integrated_model_file(one_process, tmp_path):
    """``paratrain.load_checkpoint`` of a checkpoint's model.safetensors checks it against its recorded checksum;
    a file that is no safetensors file is refused naming it."""
    from paratrain import load_checkpoint
    from paratrain.errors import UserError
    path = tmp_path / "step_00000008"
    shutil.copytree(ckpt(one_process["root"] / "full", 8), path)
    assert load_checkpoint(path / "model.safetensors").keys() == load_full_tensors(path).keys()
    data = bytearray((path / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 1
    (path / "model.safetensors").write_bytes(data)
    with pytest.raises(CheckpointError, match=rf"file {path / 'model.safetensors'} fails its checksum"):
        load_checkpoint(path / "model.safetensors")
    (tmp_path / "loose.safetensors").write_bytes(b"\x10" + bytes(7) + b"{}")
    with pytest.raises(UserError, match=r"loose\.safetensors is not a readable safetensors file"):
        load_checkpoint(tmp_path / "loose.safetensors")


def test_a_user_nets_checkpoint_records_what_it_is_and_resumes(tmp_path, capsys):
    """A MindSpore-style net's checkpoint records model kind "user", not the sizes of a built-in transformer it
    is not; it resumes (also one saved before, which recorded a default transformer), and `paratrain checkpoint
    info` and `export` read it."""
    import json

    from test_train_api import Net, dataset, decay_optimizer

    from paratrain.checkpoint.storage import write_meta
    from paratrain.cli import main
    from paratrain.train import CheckpointConfig, Model, ModelCheckpoint

    def train(directory, resume="none"):
        torch.manual_seed(0)
        net = Net()
        policy = CheckpointConfig(save_checkpoint_steps=2, integrated_save=False)
        Model(net, optimizer=decay_optimizer(net)).train(
            1, dataset(3), callbacks=[ModelCheckpoint(prefix="u", directory=directory, config=policy)], resume=resume)
        return load_full_tensors(directory / "u-1_3")

    whole = train(tmp_path / "a")
    meta_file = tmp_path / "a" / "u-1_2" / "paratrain.json"
    meta = json.loads(meta_file.read_text())
    assert meta["config"]["model"] == {"kind": "user"}
    assert "[model]\nkind = \"user\"\n\n" in (tmp_path / "a" / "u-1_2" / "config.toml").read_text()
    meta["config"]["model"] = {"kind": "transformer", "hidden_size": 64}  # as saved before
    write_meta(meta_file.parent, meta)
    resumed = train(tmp_path / "a", resume=str(tmp_path / "a" / "u-1_2"))
    assert resumed.keys() == whole.keys() and all(torch.equal(resumed[k], whole[k]) for k in whole)
    assert main(["checkpoint", "info", str(tmp_path / "a" / "u-1_3")]) == 0
    assert "fc1.weight" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "a" / "u-1_3"), str(tmp_path / "m.safetensors")]) == 0
