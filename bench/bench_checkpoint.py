"""Checkpoint throughput of a sharded run: each rank writing its own FSDP2 shards, against gathering the
whole state and writing it from rank 0 (the unsharded path), 2 processes, alternately.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 2 bench/bench_checkpoint.py [--rounds 5] [--json]

Each round saves the reference config's sharded state both ways into a scratch directory and loads each
back into the sharded model and optimizer (the load reads every shard file, checks every digest,
and re-shards). Reported on rank 0: the median seconds of each and the bytes each rank wrote, and the
sharded/gathered ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

import samestep
from samestep.checkpoint import load_checkpoint, save_checkpoint
from samestep.loop.data import load_corpus
from samestep.train import load_config
from samestep.train.loop import build


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    samestep.enable(threads=1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    parts = build(
        load_config(None, ["determinism.threads=1", "parallel.fsdp=true"]),
        world=world,
        rank=rank,
        corpus=load_corpus("stdlib"),
    )
    parts.step(0)  # optimizer state exists
    shared = [tempfile.mkdtemp(prefix="bench_ckpt_") if rank == 0 else None]
    dist.broadcast_object_list(shared)
    root = Path(shared[0])
    times: dict[str, list[float]] = {"save_sharded": [], "save_gathered": [], "load_sharded": [], "load_gathered": []}
    for r in range(args.rounds):

        def gathered() -> None:
            model, optimizer = parts.savable()
            save_checkpoint(root / "gathered", r + 1, model=model, optimizer=optimizer, keep=1)

        times["save_sharded"].append(
            _timed(
                lambda: save_checkpoint(
                    root / "sharded", r + 1, model=parts.model, optimizer=parts.optimizer, keep=1, sharded=True
                )
            )
        )
        times["save_gathered"].append(_timed(gathered))
        model, optimizer = parts.loadable()
        for kind in ("sharded", "gathered"):
            times[f"load_{kind}"].append(
                _timed(
                    lambda kind=kind: load_checkpoint(root / kind, model=model, optimizer=optimizer, restore_rng=False)
                )
            )
    written = {
        kind: sum(
            f.stat().st_size
            for f in (root / kind / f"step_{args.rounds:06d}").iterdir()
            if kind == "gathered" or f".rank_{rank:05d}." in f.name
        )
        for kind in ("sharded", "gathered")
    }
    med = {k: round(statistics.median(v), 4) for k, v in times.items()}
    result = {
        "world_size": world,
        "rounds": args.rounds,
        "seconds": med,
        "save_ratio": round(med["save_sharded"] / med["save_gathered"], 3),
        "load_ratio": round(med["load_sharded"] / med["load_gathered"], 3),
        "rank0_bytes_written": written,
    }
    if rank == 0:
        print(
            json.dumps(result)
            if args.json
            else f"{world} processes, median of {args.rounds}: save sharded {med['save_sharded']} s vs gathered "
            f"{med['save_gathered']} s ({result['save_ratio']}x); load {med['load_sharded']} s vs "
            f"{med['load_gathered']} s ({result['load_ratio']}x); rank 0 wrote {written['sharded']:,} B of its "
            f"shards vs {written['gathered']:,} B of the whole checkpoint"
        )
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()
    samestep.disable()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
