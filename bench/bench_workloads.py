"""Workload benchmark: what deterministic mode costs on the Llama bf16 preset, eager and compiled, and
what torch.compile buys under deterministic mode.

    .venv/bin/python bench/bench_workloads.py [--pairs 7] [--steps 3] [--threads 1] [--json]

Each ratio is the median of per-pair ratios, the two sides alternating in one process with the same
pinned thread count (bench_foundation.determinism_overhead): on = samestep.enable() + the canonical
gradient reduction, off = PyTorch's defaults + plain accumulation. Compiled models compile during a
warm-up pair that is not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_foundation import determinism_overhead  # noqa: E402

import samestep  # noqa: E402
from samestep.loop.data import load_corpus  # noqa: E402
from samestep.train import load_config  # noqa: E402
from samestep.train.config import PRESETS  # noqa: E402
from samestep.train.loop import build  # noqa: E402

PRESET = tuple(
    f"{section}.{key}={value}" for section, values in PRESETS["small"].items() for key, value in values.items()
)


def compile_speedup(pairs: int, steps: int, threads: int) -> dict:
    """Eager vs compiled step time of the preset, both in deterministic mode, alternating."""
    corpus = load_corpus("stdlib")
    with samestep.enable(threads=threads):
        eager = build(load_config(None, [*PRESET, f"determinism.threads={threads}"]), corpus=corpus)
        compiled = build(
            load_config(None, [*PRESET, f"determinism.threads={threads}", "train.compile=true"]), corpus=corpus
        )
        t0 = time.perf_counter()
        compiled.step(0)  # compiles
        compile_s = time.perf_counter() - t0
        eager.step(0)
        ratios, t_eager, t_comp = [], [], []
        for p in range(1, pairs + 1):
            t0 = time.perf_counter()
            for s in range(p * steps, (p + 1) * steps):
                compiled.step(s)
            c = time.perf_counter() - t0
            t0 = time.perf_counter()
            for s in range(p * steps, (p + 1) * steps):
                eager.step(s)
            e = time.perf_counter() - t0
            ratios.append(c / e)
            t_eager.append(e / steps)
            t_comp.append(c / steps)
    return {
        "pairs": pairs,
        "steps_per_side": steps,
        "threads": threads,
        "compile_s": round(compile_s, 1),
        "step_ms_eager": round(1000 * statistics.median(t_eager), 1),
        "step_ms_compiled": round(1000 * statistics.median(t_comp), 1),
        "compiled_over_eager_median": round(statistics.median(ratios), 4),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    result = {
        "determinism_eager": determinism_overhead(args.pairs, args.steps, args.threads, PRESET),
        "determinism_compiled": determinism_overhead(
            args.pairs, args.steps, args.threads, (*PRESET, "train.compile=true")
        ),
        "compile": compile_speedup(args.pairs, args.steps, args.threads),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for name in ("determinism_eager", "determinism_compiled"):
            d = result[name]
            print(
                f"{name}: {d['step_ms_on']} ms/step on vs {d['step_ms_off']} off; overhead median of "
                f"{d['pairs']} pairs: {d['overhead_ratio_median']}"
            )
        c = result["compile"]
        print(
            f"compiled vs eager (deterministic): {c['step_ms_compiled']} vs {c['step_ms_eager']} ms/step, "
            f"ratio {c['compiled_over_eager_median']} (compile {c['compile_s']} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
