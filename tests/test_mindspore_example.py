"""examples/mindspore_transformer: the tutorial's model.py and train.py ported to paratrain train with
Model.train and print the one-process losses under data x model parallel and under a PipelineCell, and
ModelCheckpoint writes the tutorial's checkpoint names."""
import pytest

from conftest import ROOT
from multiprocess import example_losses, run_distributed

EXAMPLE = ROOT / "examples" / "mindspore_transformer"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from paratrain.data.sample_corpus import write_sample
    from paratrain.data.tokenizer import train_tokenizer

    folder = tmp_path_factory.mktemp("sample")
    files = write_sample(folder, train=64, heldout=4, doc_size=16)
    train_tokenizer([files["train"]["en_fr"]], 300, folder / "tokenizer.json")
    return folder


def run_example(argv: list[str]) -> list[float]:
    """The example's main() in this process; the losses its Model.train computed, one per step."""
    return example_losses(EXAMPLE / "train.py", argv)


def _argv(data, out, *layout):
    return ["--steps", "4", "--batch", "8", "--hidden", "32", "--layers", "1", "--length", "16", "--dropout", "0",
            "--lr", "3e-3", "--data", str(data), "--out", str(out), *layout]


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):
    return run_distributed(run_example, 1, _argv(data, tmp_path_factory.mktemp("one")), timeout=240)[0]


@pytest.mark.slow
@pytest.mark.parametrize("world, layout", [
    (4, ["--mp", "2"]), (2, ["--pp", "2", "--micro", "2"]),
    (8, ["--mp", "2", "--pp", "2", "--micro", "4"]),  # the tutorial's run: blocks built for 2-row micro-batches
], ids=["dp2_mp2", "pipeline_cell_pp2", "dp2_mp2_pp2_micro4"])
def test_example_prints_the_one_process_losses(data, tmp_path, one_process, world, layout):
    got = run_distributed(run_example, world, _argv(data, tmp_path, *layout), timeout=300)[0]
    assert one_process[-1] < one_process[0]
    assert got == pytest.approx(one_process, rel=1e-4)


def test_model_checkpoint_writes_the_tutorial_names(data, tmp_path):
    run_distributed(run_example, 1, _argv(data, tmp_path) + ["--save-steps", "2"], timeout=240)
    assert sorted(p.name for p in tmp_path.glob("transformer-*")) == ["transformer-1_2", "transformer-1_4"]
