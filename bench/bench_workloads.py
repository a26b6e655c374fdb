"""Workload benchmark: what deterministic mode costs on the Llama bf16 preset, eager and compiled, what
torch.compile buys under deterministic mode, and what samestep's kernels cost a compiled model.

    .venv/bin/python bench/bench_workloads.py [--pairs 7] [--steps 3] [--threads 1] [--json]
    .venv/bin/python bench/bench_workloads.py --kernels-only   # the compiled kernels section alone

Each ratio is the median of per-pair ratios, the two sides alternating in one process with the same
pinned thread count (bench_foundation.determinism_overhead): on = samestep.enable() + the canonical
gradient reduction, off = PyTorch's defaults + plain accumulation. Compiled models compile during a
warm-up pair that is not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_foundation import determinism_overhead, time_steps  # noqa: E402

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
        comp_ms, eager_ms, ratio = _alternate(pairs, steps, compiled, eager)
    return {
        "pairs": pairs,
        "steps_per_side": steps,
        "threads": threads,
        "compile_s": round(compile_s, 1),
        "step_ms_eager": eager_ms,
        "step_ms_compiled": comp_ms,
        "compiled_over_eager_median": ratio,
    }


def _alternate(
    pairs: int, steps: int, first, second, first_in=contextlib.nullcontext, second_in=contextlib.nullcontext
):
    """The two sides' median step times (ms) and the median of the pairs' ratios first / second, the sides
    alternating ``steps`` steps at a time, each inside its context (``first_in()``, ``second_in()``)."""
    ratios, t_first, t_second = [], [], []
    for p in range(1, pairs + 1):
        with first_in():
            a = time_steps(first, p * steps, steps)
        with second_in():
            b = time_steps(second, p * steps, steps)
        ratios.append(a / b)
        t_first.append(a / steps)
        t_second.append(b / steps)
    ms = (round(1000 * statistics.median(t), 1) for t in (t_first, t_second))
    return (*ms, round(statistics.median(ratios), 4))


def _compiled(threads: int, corpus):
    """A compiled preset model's trainer (its first step compiles)."""
    return build(load_config(None, [*PRESET, f"determinism.threads={threads}", "train.compile=true"]), corpus=corpus)


def _params(trainer) -> str:
    return samestep.digest(torch.cat([p.detach().float().reshape(-1) for p in trainer.model.parameters()]))


def kernels_compiled(pairs: int, steps: int, threads: int) -> dict:
    """Compiled step time under ``samestep.enable(kernels=True)`` vs compiled PyTorch (both deterministic),
    alternating, with Dynamo's graph count under kernels (0 would be a model run eagerly); then the kernels
    side's bits: two fresh runs at ``threads`` and one at 2 threads must give the same parameters."""
    from torch._dynamo.utils import counters

    corpus = load_corpus("stdlib")
    torch._dynamo.reset()
    counters.clear()
    with samestep.enable(threads=threads, kernels=True):
        routed = _compiled(threads, corpus)
        routed.step(0)  # compiles
    graphs = counters["stats"]["unique_graphs"]
    with samestep.enable(threads=threads):
        plain = _compiled(threads, corpus)
        plain.step(0)
    routed_ms, plain_ms, ratio = _alternate(
        pairs,
        steps,
        routed,
        plain,
        lambda: samestep.enable(threads=threads, kernels=True),
        lambda: samestep.enable(threads=threads),
    )
    bits = []
    for n in (threads, threads, 2):
        torch._dynamo.reset()
        with samestep.enable(threads=n, kernels=True):
            fresh = _compiled(n, corpus)
            for s in range(2):
                fresh.step(s)
        bits.append(_params(fresh))
    return {
        "pairs": pairs,
        "steps_per_side": steps,
        "threads": threads,
        "graphs_under_kernels": graphs,
        "step_ms_kernels": routed_ms,
        "step_ms_pytorch": plain_ms,
        "kernels_over_pytorch_median": ratio,
        "same_bits_twice_and_at_2_threads": len(set(bits)) == 1,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--kernels-only", action="store_true", help="only the compiled kernels section")
    args = ap.parse_args()
    torch.manual_seed(0)
    kernels = kernels_compiled(args.pairs, args.steps, args.threads)
    if args.kernels_only:
        print(json.dumps(kernels) if args.json else _kernels_line(kernels))
        return 0 if kernels["same_bits_twice_and_at_2_threads"] and kernels["graphs_under_kernels"] else 1
    result = {
        "kernels_compiled": kernels,
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
        print(_kernels_line(kernels))
    return 0


def _kernels_line(k: dict) -> str:
    return (
        f"compiled under kernels vs compiled PyTorch (deterministic): {k['step_ms_kernels']} vs "
        f"{k['step_ms_pytorch']} ms/step, ratio {k['kernels_over_pytorch_median']}; {k['graphs_under_kernels']} "
        f"graphs under kernels; same bits twice and at 2 threads: {k['same_bits_twice_and_at_2_threads']}"
    )


if __name__ == "__main__":
    sys.exit(main())
