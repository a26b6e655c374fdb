"""Fault-check benchmark: the reference run's step time with a check on, against without, side by side.

    .venv/bin/python bench/bench_checks.py [--every 1 10] [--pairs 9] [--steps 8] [--json]
    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 2 bench/bench_checks.py [--json]

One process: the recompute check (``train.sdc_check_every=N``, each N) against none. Under torchrun:
the cross-rank check (every rank checksums its state and reduced gradients on its receipt thread, and the
ranks compare them at the next update) against none, as ``samestep train`` runs them. Two copies of the
run take blocks of ``--steps`` steps alternately; the cost is the median of per-pair ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import samestep
from samestep.loop.data import load_corpus
from samestep.records.receipt_writer import ReceiptWriter
from samestep.train import load_config
from samestep.train.checks import CrossRankCheck
from samestep.train.loop import build


def _pairs(checked, plain, pairs: int, steps: int, after=None, barrier=lambda: None) -> dict:
    """Blocks of ``steps`` steps of ``checked`` then ``plain``; ``after(parts, step, result)`` runs after each
    checked step."""
    ratios = []
    for p in range(pairs + 1):
        barrier()
        t0 = time.perf_counter()
        for s in range(p * steps, (p + 1) * steps):
            result = checked.step(s)
            if after is not None:
                after(s, result)
        barrier()
        t1 = time.perf_counter()
        for s in range(p * steps, (p + 1) * steps):
            plain.step(s)
        barrier()
        if p:  # the first pair warms the allocator and caches
            ratios.append((t1 - t0) / (time.perf_counter() - t1))
    return {"ratio_median": round(statistics.median(ratios), 4), "pairs": pairs, "steps_per_side": steps}


def recompute_costs(everies: list[int], pairs: int, steps: int) -> dict:
    corpus = load_corpus("stdlib")
    out = {}
    with samestep.enable(threads=1):
        for n in everies:
            checked = build(load_config(None, [f"train.sdc_check_every={n}"]), corpus=corpus)
            plain = build(load_config(None, []), corpus=corpus)
            out[f"sdc_check_every={n}"] = _pairs(checked, plain, pairs, steps)
    return out


def cross_rank_cost(pairs: int, steps: int) -> dict:
    import torch.distributed as dist

    samestep.enable(threads=1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    corpus = load_corpus("stdlib")
    cfg = load_config(None, [])
    checked, plain = (build(cfg, world=world, rank=rank, corpus=corpus) for _ in range(2))
    writer = ReceiptWriter(None, rank, "bench")
    check = CrossRankCheck(writer, torch.device("cpu"), Path("."), "stop")
    checked.reduced = []
    own = [0.0, 0]  # the training thread's time in the check's calls (and waiting for the sums), and steps

    def before_update(*_: object) -> None:  # what writer.watch and check.watch register, timed
        t = time.perf_counter()
        check.check()
        own[0] += time.perf_counter() - t

    def after(s: int, result: tuple) -> None:
        t = time.perf_counter()
        writer.add(
            s + 1, lambda: None, result[0], result[1], {"grads": checked.reduced, "params": checked.named_params}
        )
        own[0] += time.perf_counter() - t
        own[1] += 1

    checked.optimizer.register_step_pre_hook(before_update)
    result = _pairs(checked, plain, pairs, steps, after, dist.barrier)
    check.final()
    writer.close()
    dist.destroy_process_group()
    result["training_thread_ms"] = round(1000 * own[0] / own[1], 3)
    return {"cross_rank_check": result, "world_size": world} if rank == 0 else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, nargs="+", default=[1, 10])
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        result = cross_rank_cost(args.pairs, args.steps)
    else:
        result = recompute_costs(args.every, args.pairs, args.steps)
    if result:
        print(
            json.dumps(result)
            if args.json
            else "\n".join(
                f"{name}: {r['ratio_median']:.4f}x "
                f"(median of {r['pairs']} pairs of {r['steps_per_side']} steps)"
                + (
                    f"; the training thread's own time {r['training_thread_ms']} ms a step"
                    if "training_thread_ms" in r
                    else ""
                )
                for name, r in result.items()
                if isinstance(r, dict)
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
