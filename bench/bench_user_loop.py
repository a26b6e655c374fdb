"""Tracing overhead in a loop of the user's own, around a model samestep did not write: a small Hugging
Face GPT-2 (2 layers, 64 wide), beside the reference loop's figures (bench/bench_trace.py).

    .venv/bin/python bench/bench_user_loop.py [--pairs 9] [--steps 8] [--levels step,module,op] [--json]

Each level is measured as bench_trace measures the reference loop: blocks of ``steps`` untraced then
``steps`` traced steps of two copies of the same model, alternating, the digest worker drained between
blocks outside the timing; the median of the per-pair ratios and its bootstrap 95% interval. The traced
loop is what the README shows, through ``samestep.Run`` (its optimizer hooks record the gradients and the
state; no checkpoint inside the timing). Per-record microseconds: the traced step's extra time over the
records it writes.
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
from bench_trace import median_ci  # the same bootstrap interval as the reference loop's figures

import samestep
from samestep.analysis.records import records

BATCH, SEQ, VOCAB, MICROBATCHES = 8, 64, 256, 2


def model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=64,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg)


def batch(step: int, mb: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH // MICROBATCHES, SEQ), generator=samestep.rng.generator(0, step, mb, "b"))


def one_step(m: torch.nn.Module, opt: torch.optim.Optimizer, step: int, run: samestep.Run | None) -> None:
    total = torch.zeros(())
    for mb in range(MICROBATCHES):
        ids = batch(step, mb)
        if run is None:
            loss = m(input_ids=ids, labels=ids).loss / MICROBATCHES
            loss.backward()
        else:
            with run.microbatch(mb):
                loss = m(input_ids=ids, labels=ids).loss / MICROBATCHES
                loss.backward()
        total += loss.detach()
    if run is not None:
        run.metric("loss", total)
    opt.step()
    opt.zero_grad(set_to_none=True)


def overhead(level: str, pairs: int, steps: int, root: Path) -> dict:
    base = model()
    base_opt = torch.optim.AdamW(base.parameters(), lr=1e-3)
    traced = model()
    opt = torch.optim.AdamW(traced.parameters(), lr=1e-3)
    warm = 2  # the first steps of each side, untimed: the traced side starts its digest worker there
    total = warm + pairs * steps
    ratios, t_off, t_on = [], [], []
    with samestep.Run(root / level, model=traced, optimizer=opt, level=level, checkpoint_every=total + 1) as run:
        # A step of Run closes when the loop asks for the next one: one step past the timed ones closes them.
        loop = iter(run.steps(total + 1))
        for s in range(warm):
            one_step(base, base_opt, s, None)
            one_step(traced, opt, next(loop), run)
        for p in range(pairs):
            t0 = time.perf_counter()
            for s in range(steps):
                one_step(base, base_opt, warm + p * steps + s, None)
            t1 = time.perf_counter()
            for s in range(steps):
                one_step(traced, opt, next(loop), run)
            t2 = time.perf_counter()
            run.recorder.flush()  # the digests of what is staged, outside the timing
            ratios.append((t2 - t1) / (t1 - t0))
            t_off.append((t1 - t0) / steps)
            t_on.append((t2 - t1) / steps)
        for _ in loop:  # the step past the timed ones (empty), then the checkpoint
            pass
    n = sum(b.num_rows for b in records(root / level, 0, set(range(1, total + 1)), []))
    per_step = n / total
    extra = statistics.median(t_on) - statistics.median(t_off)
    return {
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_ci95": median_ci(ratios),
        "step_ms_untraced": round(1000 * statistics.median(t_off), 2),
        "step_ms_traced": round(1000 * statistics.median(t_on), 2),
        "records_per_step": round(per_step, 1),
        "us_per_record": round(1e6 * extra / per_step, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--levels", default="step,module,op")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with samestep.enable(threads=1), tempfile.TemporaryDirectory() as d:
        out = {level: overhead(level, a.pairs, a.steps, Path(d)) for level in a.levels.split(",")}
    if a.json:
        print(json.dumps(out))
    else:
        for level, r in out.items():
            print(
                f"{level:7s} {r['ratio_median']:.3f}x  95% [{r['ratio_ci95'][0]}, {r['ratio_ci95'][1]}]  "
                f"{r['step_ms_untraced']} -> {r['step_ms_traced']} ms/step  {r['records_per_step']} records/step  "
                f"{r['us_per_record']} us/record"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
