"""Foundation benchmark: deterministic-mode overhead (paired), checkpoint save and verify throughput.

    .venv/bin/python bench/bench_foundation.py [--pairs 15] [--steps 5] [--json]

Deterministic mode on (samestep.enable + canonical gradient reduction) and off (PyTorch defaults +
plain .grad accumulation) run the reference config's step alternately in one process, with the same
pinned thread count, so machine noise hits both sides alike; the overhead is the median of per-pair
ratios. Checkpoint throughput saves and verifies a ~25M-parameter GPT with its AdamW state.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import samestep
from samestep.loop.data import load_corpus
from samestep.train import load_config
from samestep.train.loop import build


def time_steps(parts, start: int, n: int) -> float:
    t0 = time.perf_counter()
    for s in range(start, start + n):
        parts.step(s)
    return time.perf_counter() - t0


def determinism_overhead(pairs: int, steps: int, threads: int, settings: tuple[str, ...] = ()) -> dict:
    corpus = load_corpus("stdlib")
    on = build(load_config(None, [*settings, f"determinism.threads={threads}"]), corpus=corpus)
    off = build(load_config(None, [*settings, "determinism.enabled=false"]), corpus=corpus)
    torch.set_num_threads(threads)
    ratios, t_on, t_off = [], [], []
    for p in range(pairs + 1):
        with samestep.enable(threads=threads):
            a = time_steps(on, p * steps, steps)
        torch.set_num_threads(threads)
        b = time_steps(off, p * steps, steps)
        if p == 0:  # warm-up pair: allocator and caches
            continue
        t_on.append(a / steps)
        t_off.append(b / steps)
        ratios.append(a / b)
    return {
        "settings": list(settings),
        "threads": threads,
        "pairs": pairs,
        "steps_per_side": steps,
        "step_ms_on": round(1000 * statistics.median(t_on), 2),
        "step_ms_off": round(1000 * statistics.median(t_off), 2),
        "overhead_ratio_median": round(statistics.median(ratios), 4),
    }


def checkpoint_throughput(repeats: int) -> dict:
    cfg = load_config(None, ["model.n_layer=8", "model.n_embd=512", "model.n_head=8", "model.block_size=64"])
    corpus = load_corpus("stdlib")
    parts = build(cfg, corpus=corpus)
    parts.step(0)  # creates the AdamW moments
    saves, verifies, size = [], [], 0
    with tempfile.TemporaryDirectory() as d:
        for r in range(repeats):
            t0 = time.perf_counter()
            path = samestep.save_checkpoint(
                Path(d), r + 1, model=parts.model, optimizer=parts.optimizer, data_cursor=parts.cursor, keep=1
            )
            saves.append(time.perf_counter() - t0)
            size = sum(f.stat().st_size for f in path.iterdir())
            t0 = time.perf_counter()
            samestep.verify_checkpoint(path)
            verifies.append(time.perf_counter() - t0)
    mb = size / 1e6
    return {
        "params": sum(p.numel() for p in parts.model.parameters()),
        "checkpoint_mb": round(mb, 1),
        "save_mb_s": round(mb / statistics.median(saves), 1),
        "verify_mb_s": round(mb / statistics.median(verifies), 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=15)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    # The MoE variant puts the scatter-type combine (samestep.ops.moe_combine vs index_put_) in the step.
    result = {
        "determinism": determinism_overhead(args.pairs, args.steps, args.threads),
        "determinism_moe": determinism_overhead(
            args.pairs, args.steps, args.threads, ("model.moe_experts=4", "model.moe_top_k=2")
        ),
        "checkpoint": checkpoint_throughput(args.repeats),
    }
    if args.json:
        print(json.dumps(result))
    else:
        c = result["checkpoint"]
        for name in ("determinism", "determinism_moe"):
            d = result[name]
            print(
                f"deterministic mode{' (MoE 4 experts, top-2)' if d['settings'] else ''}: {d['step_ms_on']} ms/step "
                f"on vs {d['step_ms_off']} ms/step off ({d['threads']} thread(s)); overhead ratio median of "
                f"{d['pairs']} pairs: {d['overhead_ratio_median']}"
            )
        print(
            f"checkpoint ({c['checkpoint_mb']} MB, {c['params']:,} params): save {c['save_mb_s']} MB/s, "
            f"verify {c['verify_mb_s']} MB/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
