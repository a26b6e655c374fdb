"""What tensor parallelism's fixed chunks cost on one device: the reference run's step (or ``--preset``'s) with
parallel.tp_chunks=N (every decoder linear in N chunks, the path a run keeps at any TP degree) against plain
layers (parallel.tp_chunks=0), side by side in one process, taking turns.

    .venv/bin/python bench/bench_chunks.py [--preset small] [--chunks 8] [--pairs 9] [--steps 2] [--json]
                                           [--set model.n_embd=1024 ...]

Both sides run in deterministic mode with one intra-op thread; reported: each side's median step time and the
median of the per-round ratios (chunked / plain). ``--set`` changes the configuration of both sides (a width, to
tell a cost per layer call from a cost per FLOP: the first falls as the width grows, the second does not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch.distributed as dist

import samestep
from samestep.data import load_corpus
from samestep.train import load_config
from samestep.train.loop import build


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default=None)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="K=V", help="a config key for both sides")
    args = ap.parse_args()
    samestep.enable(threads=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the mesh of one
    base = load_config(None, args.set, preset=args.preset)
    corpus = load_corpus(base.data.source, base.data.path or None)
    sides = {name: build(load_config(None, [*args.set, f"parallel.tp_chunks={c}"], preset=args.preset),
                         corpus=corpus) for name, c in (("plain", 0), ("chunked", args.chunks))}
    for trainer in sides.values():
        trainer.model.train()
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for p in range(args.pairs + 1):
        for name in names[p % 2:] + names[:p % 2]:  # each round starts with the other side
            t0 = time.perf_counter()
            for s in range(args.steps):
                sides[name].step(p * args.steps + s)
            if p:  # round 0 warms up
                times[name].append((time.perf_counter() - t0) / args.steps)
    result = {"preset": args.preset or "reference", "set": args.set, "chunks": args.chunks, "pairs": args.pairs,
              "step_ms_plain": round(1000 * statistics.median(times["plain"]), 1),
              "step_ms_chunked": round(1000 * statistics.median(times["chunked"]), 1),
              "ratio_median": round(statistics.median(a / b for a, b in zip(times["chunked"], times["plain"])), 4)}
    print(json.dumps(result) if args.json else
          f"{' '.join([result['preset'], *args.set])}: {args.chunks} chunks {result['step_ms_chunked']} ms/step vs "
          f"plain layers {result['step_ms_plain']} ms/step; ratio median of {args.pairs} rounds: "
          f"{result['ratio_median']}")
    dist.destroy_process_group()
    samestep.disable()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
