"""The tutorial's ``train.py`` with paratrain: one process per device, the layout from the device count.

    paratrain launch --nproc-per-node 8 -- examples/mindspore_transformer/train.py --mp 2 --pp 2 --micro 4

MindSpore -> paratrain: ``mindspore.communication`` -> ``paratrain.communication``,
``ms.set_auto_parallel_context`` -> ``paratrain.set_auto_parallel_context``, ``mindspore.nn.PipelineCell``
-> ``paratrain.nn.PipelineCell``, ``mindspore.train`` -> ``paratrain.train``, ``nn.AdamWeightDecay`` ->
``paratrain.nn.AdamWeightDecay`` on the same decay groups. The data is paratrain's English-French sample corpus
(generated on first use, WMT14's .sgm path and BPE), in global batches every rank reads whole.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

import paratrain
from paratrain import communication as D
from paratrain.nn import AdamWeightDecay, PipelineCell, TransformerOpParallelConfig
from paratrain.train import CheckpointConfig, LossMonitor, Model, ModelCheckpoint, TimeMonitor

from model import Net  # noqa: E402  (the script's own folder is importable, as with `python train.py`)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mp", type=int, default=1, help="model_parallel")
    p.add_argument("--pp", type=int, default=1, help="pipeline_stage")
    p.add_argument("--micro", type=int, default=1, help="micro_batch_num (PipelineCell's micro_size)")
    p.add_argument("--batch", type=int, default=16, help="global batch size")
    p.add_argument("--steps", type=int, default=40, help="batches per epoch")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2, help="encoder layers = decoder layers")
    p.add_argument("--length", type=int, default=24, help="source and target length")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dropout", type=float, default=0.1, help="every dropout rate (0 to compare layouts)")
    p.add_argument("--data", type=Path, default=Path("runs/data/sample"), help="the sample corpus folder")
    p.add_argument("--out", type=Path, default=Path("runs/mindspore_transformer"), help="checkpoints go here")
    p.add_argument("--save-steps", type=int, default=20)
    return p.parse_args(argv)


def translation_batches(a: argparse.Namespace, vocab_size: int) -> list[tuple[torch.Tensor, ...]]:
    """``a.steps`` global batches of (src ids, src positions, src mask, tgt ids, tgt positions, tgt mask, labels)."""
    from paratrain.data.datasets import TranslationDataset
    from paratrain.data.synthetic import PAD
    from paratrain.data.tokenizer import Tokenizer

    pairs, tokenizer_path = a.data / "train" / "sample.en_fr.txt", a.data / "tokenizer.json"
    dataset = TranslationDataset(pairs, Tokenizer.load(tokenizer_path), a.length, a.length, "truncate")
    positions = torch.arange(a.length, device="cpu").expand(a.batch, a.length).contiguous()
    out = []
    for step in range(a.steps):
        indices = np.arange(step * a.batch, (step + 1) * a.batch) % len(dataset)
        rows = dataset.rows(indices, indices)
        src_mask = (rows["src_ids"] != PAD).float()
        tgt_mask = (rows["tgt_in_ids"] != PAD).float()
        out.append((rows["src_ids"], positions, src_mask, rows["tgt_in_ids"], positions, tgt_mask, rows["labels"]))
    return out


def prepare_data(folder: Path, vocab_size: int = 1000) -> None:
    """The sample corpus and its BPE tokenizer, made once (rank 0 in a launched job; the others wait)."""
    from paratrain.data.sample_corpus import write_sample
    from paratrain.data.tokenizer import train_tokenizer

    if D.get_rank() == 0 and not (folder / "tokenizer.json").is_file():
        files = write_sample(folder)
        train_tokenizer([files["train"]["en_fr"]], vocab_size, folder / "tokenizer.json")
    if D.get_group_size() > 1:
        torch.distributed.barrier()


def build(a: argparse.Namespace, vocab_size: int):
    """The parallel config from the device count (data_parallel = devices / mp / pp), the net, the optimizer."""
    device_num = D.get_group_size()
    paratrain.set_auto_parallel_context(parallel_mode=paratrain.ParallelMode.SEMI_AUTO_PARALLEL, full_batch=True,
                                        device_num=device_num, pipeline_stages=a.pp)
    config = TransformerOpParallelConfig(data_parallel=device_num // a.mp // a.pp, model_parallel=a.mp,
                                         pipeline_stage=a.pp, micro_batch_num=a.micro, vocab_emb_dp=False)
    torch.manual_seed(1)
    # as the tutorial: the blocks are built for one micro-batch's rows, the dataset gives whole batches
    net = Net(batch=a.batch // a.micro, src_len=a.length, tgt_len=a.length, hidden_size=a.hidden, vocab_size=vocab_size,
              en_layer=a.layers, de_layer=a.layers, parallel_config=config, dropout=a.dropout)
    decay = [p for n, p in net.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in net.named_parameters() if p.ndim <= 1]
    optimizer = AdamWeightDecay([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                learning_rate=a.lr)
    if a.pp > 1:
        net = PipelineCell(net, a.micro)
    return Model(net, optimizer=optimizer)


def main(argv=None, extra_callbacks=()) -> Model:
    a = parse_args(argv)
    D.init()
    prepare_data(a.data)
    from paratrain.data.tokenizer import Tokenizer

    vocab_size = Tokenizer.load(a.data / "tokenizer.json").vocab_size
    model = build(a, vocab_size)
    checkpoint = ModelCheckpoint(prefix="transformer", directory=str(a.out),
                                 config=CheckpointConfig(save_checkpoint_steps=a.save_steps, keep_checkpoint_max=2))
    model.train(a.epochs, translation_batches(a, vocab_size),
                callbacks=[TimeMonitor(), LossMonitor(), checkpoint, *extra_callbacks], dataset_sink_mode=False)
    return model


if __name__ == "__main__":
    main()
