"""Checkpoint save/load throughput against the raw sequential write/read speed of the same disk.

One process builds a GPT of the given size through ``Trainer`` (one training step,
so AdamW state exists), then alternates, ``--repeats`` times:

- raw write: the checkpoint's byte count written sequentially to one file in 16 MiB
  blocks, then fsync (DCP fsyncs its files too);
- checkpoint save: ``Checkpointer.save`` (DCP shards + rank file + paratrain.json, temp
  dir, rename, ``latest`` pointer);
- raw read: that file read back sequentially;
- checkpoint load: ``Checkpointer.load`` (verify, DCP read into the live model and
  optimizer, ``set_state_dict``).

Before each read both sides' files are dropped from the page cache with
``posix_fadvise(DONTNEED)`` (fsynced pages are clean, so this works without root),
so reads come from the disk where the kernel honours it. Throughput is bytes on
disk / seconds; the medians and their ratios are reported (the machine is shared
and noisy: only ratios measured in one run mean much).

The cost of checksums: each repeat also saves and loads once more with hashing
patched out (the code as it was before checksums: no hashing while writing, none
before or while loading), right after the real save and load, so both see
the same machine load; the medians of both and their ratio are reported, with
the time to hash every file of the checkpoint once from the page cache (the work
checksums add: inline while saving, in a second thread while loading).

    python bench/checkpoint_io.py [--json PATH] [--hidden 384 --layers 6 --vocab 16000] [--repeats 3]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK = 16 * 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--dir", type=Path, help="where to write (default: a temporary dir under $TMPDIR)")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    return p.parse_args(argv)


def drop_cache(paths) -> None:
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):
            pass
        finally:
            os.close(fd)


def files_under(path: Path) -> list[Path]:
    return [p for p in Path(path).rglob("*") if p.is_file()]


def raw_write(path: Path, nbytes: int) -> float:
    block = os.urandom(BLOCK)
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[:min(left, BLOCK)])
            left -= BLOCK
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def raw_read(path: Path) -> float:
    drop_cache([path])
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(BLOCK)
        while f.readinto(buf):
            pass
    return time.perf_counter() - start


@contextlib.contextmanager
def checksums_off():
    """Save and load without computing or checking checksums (what they cost is the difference)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    from paratrain.checkpoint import core, storage

    class PlainFileSystem(FileSystem):
        entries: dict = {}

    class NoCheck:
        def __init__(self, *args):
            pass

        def result(self):
            return None
    def no_check(*args):
        return None
    saved = (storage.HashingFileSystem, core.ChecksumCheck, core.file_checksum, core.check_checksums,
             storage.check_checksums)
    (storage.HashingFileSystem, core.ChecksumCheck, core.file_checksum, core.check_checksums,
     storage.check_checksums) = PlainFileSystem, NoCheck, lambda path: "", no_check, no_check
    try:
        yield
    finally:
        (storage.HashingFileSystem, core.ChecksumCheck, core.file_checksum, core.check_checksums,
         storage.check_checksums) = saved


def timed_save_load(ckpt, step: int) -> tuple[float, float, Path]:
    """(save seconds, load seconds from a dropped page cache, the checkpoint)."""
    start = time.perf_counter()
    path = ckpt.save(step)
    save_s = time.perf_counter() - start
    drop_cache(files_under(path))
    start = time.perf_counter()
    ckpt.load(path)
    return save_s, time.perf_counter() - start, path


def build_trainer(args, run_dir: Path):
    from paratrain import config_file
    from paratrain.trainer import Trainer

    cfg = config_file.from_dict({
        "run": {"dir": str(run_dir)},
        "model": {"kind": "gpt", "vocab_size": args.vocab, "hidden_size": args.hidden, "num_heads": 8,
                  "ffn_hidden_size": 4 * args.hidden, "decoder_layers": args.layers, "seq_length": args.seq,
                  "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "train": {"global_batch_size": 2, "steps": 1, "lr": 1e-4, "warmup_steps": 0},
        "checkpoint": {"save_steps": 0, "keep_max": 1, "resume": "none"},
        "metrics": {"log_steps": 1000},
    })
    trainer = Trainer(cfg)
    trainer.train()  # one step: optimizer state exists and is saved
    return trainer


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from paratrain.checkpoint.storage import file_checksum

    if args.threads:
        torch.set_num_threads(args.threads)
    base = Path(tempfile.mkdtemp(prefix="ckpt_io_", dir=args.dir))
    try:
        trainer = build_trainer(args, base / "run")
        params = sum(p.numel() for p in trainer.model.parameters())
        ckpt, raw_file = trainer.checkpointer, base / "raw.bin"
        save_s, load_s, write_s, read_s, nbytes = [], [], [], [], 0
        plain_save_s, plain_load_s, hash_s = [], [], []
        for i in range(args.repeats):
            save, load, path = timed_save_load(ckpt, 2 * i + 1)
            save_s.append(save)
            load_s.append(load)
            nbytes = sum(p.stat().st_size for p in files_under(path))
            start = time.perf_counter()
            for file in files_under(path):
                file_checksum(file)
            hash_s.append(time.perf_counter() - start)
            with checksums_off():
                save, load, _ = timed_save_load(ckpt, 2 * i + 2)
            plain_save_s.append(save)
            plain_load_s.append(load)
            write_s.append(raw_write(raw_file, nbytes))
            read_s.append(raw_read(raw_file))
        mb = nbytes / 2**20
        result = {
            "params": params, "checkpoint_bytes": nbytes, "repeats": args.repeats,
            "save_s": save_s, "load_s": load_s, "raw_write_s": write_s, "raw_read_s": read_s,
            "save_mb_s": mb / statistics.median(save_s), "load_mb_s": mb / statistics.median(load_s),
            "raw_write_mb_s": mb / statistics.median(write_s), "raw_read_mb_s": mb / statistics.median(read_s),
            "dir": str(base), "torch_threads": torch.get_num_threads(),
        }
        result["save_ratio"] = result["save_mb_s"] / result["raw_write_mb_s"]
        result["load_ratio"] = result["load_mb_s"] / result["raw_read_mb_s"]
        result.update(save_without_checksums_s=plain_save_s, load_without_checksums_s=plain_load_s,
                      checksum_save_cost=statistics.median(save_s) / statistics.median(plain_save_s) - 1,
                      checksum_load_cost=statistics.median(load_s) / statistics.median(plain_load_s) - 1,
                      hash_s=hash_s, hash_mb_s=mb / statistics.median(hash_s),
                      load_average=os.getloadavg()[0])
        print(f"checkpoint of {params / 1e6:.1f} M parameters + AdamW state: {mb:.1f} MiB on disk "
              f"(median of {args.repeats})")
        print(f"{'':14}{'checkpoint':>14}{'raw disk':>14}{'ratio':>8}")
        print(f"{'write/save':14}{result['save_mb_s']:>10.1f} MB/s{result['raw_write_mb_s']:>10.1f} MB/s"
              f"{result['save_ratio']:>8.2f}")
        print(f"{'read/load':14}{result['load_mb_s']:>10.1f} MB/s{result['raw_read_mb_s']:>10.1f} MB/s"
              f"{result['load_ratio']:>8.2f}")
        print(f"checksums: save {statistics.median(save_s):.3f} s vs {statistics.median(plain_save_s):.3f} s without "
              f"({result['checksum_save_cost']:+.1%}), load {statistics.median(load_s):.3f} s vs "
              f"{statistics.median(plain_load_s):.3f} s without ({result['checksum_load_cost']:+.1%}); "
              f"load average {result['load_average']:.1f} on {os.cpu_count()} cores")
        print(f"hashing the whole checkpoint once from the page cache: {statistics.median(hash_s):.3f} s "
              f"({result['hash_mb_s']:.0f} MB/s)")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
