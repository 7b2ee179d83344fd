"""Pipeline parallelism: layers split into stages, micro-batches run by torch.distributed.pipelining.

Each rank holds one model chunk per virtual stage: a copy of the whole model with
everything not on that chunk removed, so parameter names stay those of the whole
model (checkpoints load under any layout). A chunk carries across its boundary
float tensors only: the hidden state (GPT, encoder) or the encoder output and the
decoder state (encoder-decoder); token ids reach every stage as keyword arguments.

The word table of the encoder-decoder is shared by the source embedding (first
stage), the target embedding (the stage of the first decoder layer) and, when tied,
the head (last stage): each holder keeps a copy and their gradients are summed.
"""
from __future__ import annotations

import copy
import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                    ScheduleInterleavedZeroBubble, ScheduleLoopedBFS,
                                                    ScheduleZBVZeroBubble)
from torch.distributed.tensor import DTensor

from paratrain.config import ParallelConfig
from paratrain.mesh import Layout
from paratrain.parallel.loss import whole
from paratrain.models.transformer import GPTModel, Seq2SeqModel, pipeline_blocks

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "looped_bfs": ScheduleLoopedBFS, "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
             "zbv_zero_bubble": ScheduleZBVZeroBubble}


def layer_chunks(blocks: list[tuple], config: ParallelConfig) -> list[int]:
    """The chunk (virtual stage, 0..pp*v-1) of every layer, for ``pipeline_blocks``' (name, layer_id, offset).

    Default: an even split in which the embeddings and the head count as one layer
    each; else the user's ``layer_stages`` list or function.
    """
    chunks = config.pipeline_stage * config.virtual_pipeline_stage
    if callable(config.layer_stages):
        return [config.layer_stages(layer_id, offset, config) for _, layer_id, offset in blocks]
    if config.layer_stages:
        return list(config.layer_stages)
    for units, first in ((len(blocks) + 2, 1), (len(blocks), 0)):  # fall back to layers only if a chunk is empty
        bounds = [round(c * units / chunks) for c in range(chunks + 1)]
        owner = [next(c for c in range(chunks) if bounds[c] <= u + first < bounds[c + 1]) for u in range(len(blocks))]
        if set(owner) == set(range(chunks)):
            return owner
    raise ValueError(f"cannot split {len(blocks)} layers into {chunks} pipeline chunks")


def chunk_rank(chunk: int, config: ParallelConfig) -> int:
    """The pipeline rank of a chunk: round robin, or V-shaped for the zero-bubble V schedule."""
    pp = config.pipeline_stage
    if config.pipeline_schedule == "zbv_zero_bubble" and chunk >= pp:
        return 2 * pp - 1 - chunk
    return chunk % pp


def chunk_parts(owner: list[int], chunk: int, tied: bool, num_encoder_layers: int | None = None) -> set[str]:
    """What besides its layers a chunk holds: embeddings, norms, head, a copy of the word table.

    ``owner``: the chunk of every layer; ``num_encoder_layers``: None for a decoder-only model.
    """
    last = max(owner)
    parts = set()
    if chunk == 0:
        parts |= {"input_embed", "word"}
    if chunk == last:
        parts |= {"head"} | ({"word"} if tied else set())
    if num_encoder_layers is not None and chunk == owner[num_encoder_layers]:
        parts |= {"target_embed", "encoder_norm", "word"}
    return parts


def _prune(model: nn.Module, keep_layers: set[str], parts: set[str]) -> nn.Module:
    """Remove from ``model`` (in place) every layer and part the chunk does not hold."""
    for name, _, _ in pipeline_blocks(model):
        if name not in keep_layers:
            parent, _, key = name.rpartition(".")
            delattr(model.get_submodule(parent), key)
    if isinstance(model, Seq2SeqModel):
        embed = model.src_embed
        model.transformer.encoder.norm = model.transformer.encoder.norm if "encoder_norm" in parts else None
        model.transformer.decoder.norm = model.transformer.decoder.norm if "head" in parts else None
        model.tgt_embed = model.tgt_embed if "target_embed" in parts else None
    else:
        embed = model.embed
        model.norm = model.norm if "head" in parts else None
    if "input_embed" not in parts:  # keep only the word table, under its usual name, if this chunk has a copy
        embed.position = None
        if "word" not in parts:
            setattr(model, "src_embed" if isinstance(model, Seq2SeqModel) else "embed", None)
    model.head = model.head if "head" in parts else None
    return model


class GPTStage(nn.Module):
    """One chunk of a GPTModel: hidden (b, S, H) from the previous chunk (none on the first) and
    input_ids (b, S) -> hidden, or logits (b, S, V) on the last chunk."""

    def __init__(self, model: GPTModel, first: bool):
        super().__init__()
        self.model, self.first = model, first

    def forward(self, *hidden, input_ids):
        m = self.model
        mask = m.causal_mask(input_ids == m.pad_token_id, input_ids.shape[1])
        x = m.embed(input_ids) if self.first else hidden[0]
        for layer in m.layers.values():
            x = layer(x, mask)
        return m.head(m.norm(x)) if m.head is not None else x


class Seq2SeqStage(nn.Module):
    """One chunk of a Seq2SeqModel. Carries (encoder state,) inside the encoder and
    (encoder output, decoder state) inside the decoder; src_ids (b, S) and
    tgt_in_ids (b, T) come to every chunk; the last returns logits (b, T, V)."""

    def __init__(self, model: Seq2SeqModel, first: bool):
        super().__init__()
        self.model, self.first = model, first

    def forward(self, *hidden, src_ids, tgt_in_ids):
        m, t = self.model, self.model.transformer
        src_pad, tgt_pad = src_ids == m.pad_token_id, tgt_in_ids == m.pad_token_id
        if self.first:
            hidden = (m.src_embed(src_ids),)
        if len(t.encoder.layers):
            x, mask = hidden[0], t.padding_mask(src_pad, src_pad.shape[1])
            for layer in t.encoder.layers.values():
                x = layer(x, mask)
            hidden = (x,)
        if m.tgt_embed is not None:  # this chunk starts the decoder
            hidden = (t.encoder.norm(hidden[0]), m.tgt_embed(tgt_in_ids))
        if len(t.decoder.layers):
            memory, x = hidden
            self_mask = t.causal_mask(tgt_pad, tgt_pad.shape[1])
            memory_mask = t.padding_mask(src_pad, tgt_pad.shape[1])
            for layer in t.decoder.layers.values():
                x = layer(x, memory, self_mask, memory_mask)
            hidden = (memory, x)
        return m.head(t.decoder.norm(hidden[1])) if m.head is not None else hidden


def _layers_as_dicts(model: nn.Module) -> None:
    """ModuleList -> ModuleDict with the same keys, so removing layers keeps the names of the rest."""
    for stack in (model.transformer.encoder, model.transformer.decoder) if isinstance(model, Seq2SeqModel) else (model,):
        stack.layers = nn.ModuleDict(dict(stack.layers.named_children()))


def _word_table(model: nn.Module) -> nn.Parameter | None:
    embed = model.src_embed if isinstance(model, Seq2SeqModel) else model.embed
    return embed.word.embedding.weight if embed is not None else None


class Pipeline:
    """This rank's model chunks, their PipelineStages and the schedule that runs a step over micro-batches.

    ``parallelize_chunk(chunk, stage_module)`` applies the other dimensions to each chunk;
    ``loss_fn(logits, labels, **loss_kwargs)`` runs on the last stage per micro-batch.
    """

    def __init__(self, model: nn.Module, config: ParallelConfig, layout: Layout, parallelize_chunk, loss_fn):
        self.config, self.layout = config, layout
        _layers_as_dicts(model)
        blocks = pipeline_blocks(model)
        owner = layer_chunks(blocks, config)
        names = [name for name, _, _ in blocks]
        num_chunks = config.pipeline_stage * config.virtual_pipeline_stage
        tied = model.head.weight is _word_table(model)
        encoder_layers = model.num_encoder_layers if isinstance(model, Seq2SeqModel) else None
        parts = [chunk_parts(owner, c, tied, encoder_layers) for c in range(num_chunks)]
        self.word_holders = sorted({chunk_rank(c, config) for c in range(num_chunks) if "word" in parts[c]})
        stage_class = Seq2SeqStage if isinstance(model, Seq2SeqModel) else GPTStage
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.chunks, stages = [], []
        for c in (c for c in range(num_chunks) if chunk_rank(c, config) == layout.pp_rank):
            chunk = _prune(copy.deepcopy(model), {n for n, o in zip(names, owner) if o == c}, parts[c])
            stage_module = stage_class(chunk, first=c == 0)
            parallelize_chunk(chunk, stage_module)
            self.chunks.append((c, chunk))
            stages.append(PipelineStage(stage_module, c, num_chunks, device, group=layout.pp_group))
        schedule = SCHEDULES[config.pipeline_schedule]
        single = schedule in (ScheduleGPipe, Schedule1F1B)
        self.schedule = schedule(stages[0] if single else stages, n_microbatches=config.micro_batch_num,
                                 loss_fn=loss_fn, scale_grads=False)
        self.has_last = any(c == num_chunks - 1 for c, _ in self.chunks)
        self.word_group = self._word_group()
        self.modules = nn.ModuleList(chunk for _, chunk in self.chunks)

    def _word_group(self):
        """Group of the pipeline ranks holding a copy of the word table, at this rank's dp/tp coordinate."""
        if len(self.word_holders) < 2:
            return None
        grid = self.layout.mesh.mesh  # (pp, dp_replicate, dp_shard, tp) -> global rank
        mine = None
        for index in itertools.product(*(range(n) for n in grid.shape[1:])):  # same order on every rank
            ranks = [int(grid[(stage, *index)]) for stage in self.word_holders]
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        return mine

    def counted_in_norm(self) -> set[int]:
        """Parameters counted in the global gradient norm: word-table copies other than chunk 0's are left out."""
        counted = set()
        for index, chunk in self.chunks:
            table = _word_table(chunk)
            counted |= {id(p) for p in chunk.parameters() if p is not table or index == 0}
        return counted

    def step(self, batch: dict[str, torch.Tensor], loss_kwargs: dict) -> torch.Tensor:
        """Forward and backward over ``micro_batch_num`` micro-batches; the summed loss on the last stage, else 0."""
        ids = {k: v for k, v in batch.items() if k != "labels"}
        losses = [] if self.has_last else None
        self.schedule.step(**ids, target=batch["labels"] if self.has_last else None, losses=losses,
                           loss_kwargs=loss_kwargs)
        self._sum_word_table_grads()
        return torch.stack([whole(loss.detach()).float() for loss in losses]).sum() if losses else torch.zeros(())

    def _sum_word_table_grads(self) -> None:
        copies = [p for _, chunk in self.chunks if (p := _word_table(chunk)) is not None and p.grad is not None]
        if len(copies) < 2 and self.word_group is None:
            return
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in copies]
        total = torch.stack(local).sum(0)
        if self.word_group is not None:
            dist.all_reduce(total, group=self.word_group)
        for grad in local:
            grad.copy_(total)
