"""MindSpore's distributed Transformer tutorial (``train.py``) with paratrain: one process, or one per device.

    python examples/mindspore_transformer/train.py
    paratrain launch --nproc-per-node 8 -- examples/mindspore_transformer/train.py --distribute true --mp 2 \\
        --pipeline_stage 2 --micro_batch_num 4

A port changes the imports only (``mindspore`` -> ``paratrain``). Every layout prints the losses of one process
(``LossMonitor``) when the dropout is 0. Three options are paratrain's, not the tutorial's: ``--sample_pairs``
writes a sample English-French corpus to ``--file_path`` when that file is missing, ``--dropout_rate`` sets
the embeddings' dropout (the tutorial's 0.1) and ``--seed`` the seed of the initial values (``set_seed``).
``ModelCheckpoint`` writes into the working directory.
"""
import argparse
import os
from pathlib import Path

import paratrain.communication as D
from paratrain import Model, ParallelMode, reset_auto_parallel_context, set_auto_parallel_context
from paratrain import CheckpointConfig, LossMonitor, ModelCheckpoint, TimeMonitor, set_seed
from paratrain.nn import AdamWeightDecay, PipelineCell, TransformerOpParallelConfig

from dataset import ToyDataset, Tokenzier
from model import Net


def set_weight_decay(params):
    """A decay of 0.1 for every parameter but the LayerNorms' and the biases, which are not decayed."""
    def decay_filter(x):
        return 'layernorm' not in x.name.lower() and "bias" not in x.name.lower()

    decay_params = list(filter(decay_filter, params))
    other_params = list(filter(lambda x: not decay_filter(x), params))
    return [{'params': decay_params, 'weight_decay': 1e-1}, {'params': other_params, 'weight_decay': 0.0},
            {'order_params': params}]


def write_sample_pairs(path, count):
    """``count`` sample English<TAB>French pairs at ``path`` (paratrain's addition: the tutorial's data is WMT14).
    Every rank writes the same text and renames it into place, so no rank reads a partial file."""
    from paratrain.data.sample_corpus import generate_pairs

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text("".join(f"{en}\t{fr}\n" for en, fr in generate_pairs(count, seed=0)), encoding="utf-8")
    os.replace(partial, path)


def main():
    parser = argparse.ArgumentParser(description="Transformer training")
    parser.add_argument('--train', type=int, default=1, help="1: train (the net returns its loss), 0: predict")
    parser.add_argument("--file_path", type=str, default="./output/wmt14.fr_en.txt",
                        help="the source<TAB>target pairs")
    parser.add_argument("--distribute", type=str, default="false", choices=["true", "false"],
                        help="run on every process of the job")
    parser.add_argument("--micro_batch_num", type=int, default=1, help="the micro-batches of a step")
    parser.add_argument('--src_len', required=False, type=int, default=10, help='the source sequence length')
    parser.add_argument('--tgt_len', required=False, type=int, default=10, help='the target sequence length')
    parser.add_argument('--vocab_size', required=False, type=int, default=20000, help='the vocabulary size')
    parser.add_argument('--d_model', required=False, type=int, default=128, help='the hidden size')
    parser.add_argument('--encoder_layer', required=False, type=int, default=1, help='the encoder layers')
    parser.add_argument('--decoder_layer', required=False, type=int, default=1, help='the decoder layers')
    parser.add_argument('--pipeline_stage', required=False, type=int, default=1, help='the pipeline stages')
    parser.add_argument('--batch_size', required=False, type=int, default=32, help='the global batch size')
    parser.add_argument('--lr', required=False, type=float, default=0.0001, help='the learning rate')
    parser.add_argument('--mp', required=False, type=int, default=1, help='the model parallel ways')
    # paratrain's additions
    parser.add_argument('--sample_pairs', type=int, default=4000,
                        help='pairs of a sample corpus written to --file_path when it is missing (0: never)')
    parser.add_argument('--dropout_rate', type=float, default=0.1, help="the embeddings' dropout rate")
    parser.add_argument('--seed', type=int, default=1, help="set_seed's seed: the same initial values on every rank")
    args_opt = parser.parse_args()
    set_seed(args_opt.seed)

    if args_opt.sample_pairs and not os.path.exists(args_opt.file_path):
        write_sample_pairs(args_opt.file_path, args_opt.sample_pairs)
    if args_opt.distribute == 'true':
        D.init()
        device_num = D.get_group_size()
        rank_id = D.get_rank()
        dp = device_num // args_opt.mp // args_opt.pipeline_stage
        print("rank_id is {}, device_num is {}, dp is {}".format(rank_id, device_num, dp))
        gradient_accumulation_shard = dp > 1 and args_opt.pipeline_stage > 1
        reset_auto_parallel_context()
        set_auto_parallel_context(
            parallel_mode=ParallelMode.SEMI_AUTO_PARALLEL, gradients_mean=False, full_batch=True,
            loss_repeated_mean=True, device_num=device_num, enable_parallel_optimizer=True,
            parallel_optimizer_config={"gradient_accumulation_shard": gradient_accumulation_shard})
    else:
        dp = 1

    parallel_config = TransformerOpParallelConfig(pipeline_stage=args_opt.pipeline_stage,
                                                  micro_batch_num=args_opt.micro_batch_num,
                                                  model_parallel=args_opt.mp, data_parallel=dp)
    # the blocks are built for the rows of one micro-batch, the dataset gives whole batches
    batch = args_opt.batch_size // args_opt.micro_batch_num if args_opt.pipeline_stage else args_opt.batch_size
    net = Net(batch=batch, src_len=args_opt.src_len, tgt_len=args_opt.tgt_len, vocab_size=args_opt.vocab_size,
              hidden_size=args_opt.d_model, en_layer=args_opt.encoder_layer, de_layer=args_opt.decoder_layer,
              parallel_config=parallel_config, return_loss=args_opt.train, dropout_rate=args_opt.dropout_rate)

    tokenizer = Tokenzier()
    task = ToyDataset(file_path=args_opt.file_path, tokenizer=tokenizer,
                      seq_length=(args_opt.src_len, args_opt.tgt_len))
    dataset = task.get_dataset(batch_size=args_opt.batch_size)

    if args_opt.pipeline_stage > 1:
        net = PipelineCell(net, args_opt.micro_batch_num)
        param = net.infer_param_pipeline_stage()
        print(f"params is:{param}", flush=True)
        group_params = set_weight_decay(param)
    else:
        group_params = set_weight_decay(net.trainable_params())
    opt = AdamWeightDecay(group_params, learning_rate=args_opt.lr)
    model = Model(net) if not args_opt.train else Model(net, optimizer=opt)

    callback_size = 1
    # each rank saves its own slices
    ckpt_config = CheckpointConfig(save_checkpoint_steps=callback_size, keep_checkpoint_max=4, integrated_save=False)
    ckpoint_cb = ModelCheckpoint(prefix="test", config=ckpt_config)
    callback = [TimeMonitor(callback_size), LossMonitor(callback_size), ckpoint_cb]
    model.train(1, dataset, callbacks=callback, dataset_sink_mode=False)


if __name__ == "__main__":
    main()
