"""What samestep.Run costs a loop of one's own as users write it (nanoGPT's shape: a GPT-2, gradient accumulation
over 4 microbatches, AdamW, a cosine schedule, gradient clipping, dropout), side by side with the same loop
without samestep, one process, one intra-op thread on both sides, and the cost taken apart.

    .venv/bin/python bench/bench_own_loop.py [--pairs 7] [--steps 6] [--variants defaults,...] [--json]

Variants, each against the plain loop (two copies of the model, blocks of ``--steps`` steps in turn, the
median of the per-pair ratios; the first blocks warm up, untimed):

- ``mode``: the plain loop under ``samestep.enable(threads=1)`` against the same loop without it (the global
  knobs alone: deterministic algorithms and the rest);
- ``run_bare``: ``samestep.Run(..., level="off", receipts=False)`` with no checkpoint inside the timing: the
  loop checks and the optimizer's hooks;
- ``+receipts``: and a receipt of every step (Run's default);
- ``+checkpoint``: and a checkpoint every step (Run's default, ``checkpoint_every=1``);
- ``defaults``: ``samestep.Run(run_dir, model=, optimizer=, scheduler=)`` as the README writes it: all of the
  above and the step-level trace (``level="step"``).

A Run's plain side runs inside the Run's deterministic mode (it is global), so the Run variants price what Run
adds to a loop already under that mode, and ``mode`` prices the mode: the defaults cost about their product.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

import samestep

MICROBATCHES, ROWS, SEQ, VOCAB = 4, 2, 64, 256

RUN_VARIANTS = {
    "run_bare": {"level": "off", "receipts": False, "checkpoint": False},
    "+receipts": {"level": "off", "receipts": True, "checkpoint": False},
    "+checkpoint": {"level": "off", "receipts": True, "checkpoint": True},
    "defaults": {"level": "step", "receipts": True, "checkpoint": True},
}


def parts() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The model, its AdamW and a cosine schedule with warm-up, as nanoGPT builds them."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=96, n_layer=2, n_head=4)  # dropout 0.1
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(s, 1000) / 1000))
    )
    return model, opt, sched


def step(model, opt, sched, step: int, run: samestep.Run | None) -> None:
    """One optimizer step: the batch of each microbatch drawn inside the step (keyed by step and microbatch)."""
    total = torch.zeros(())
    for mb in range(MICROBATCHES):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=samestep.rng.generator(0, step, mb, "batch"))
        with run.microbatch(mb) if run is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss / MICROBATCHES
            loss.backward()
        total += loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if run is not None:
        run.metric("loss", total)
        run.metric("grad_norm", norm)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _block(fn, first: int, n: int) -> float:
    t0 = time.perf_counter()
    for s in range(first, first + n):
        fn(s)
    return time.perf_counter() - t0


def mode_cost(pairs: int, steps: int) -> dict:
    """The plain loop under ``samestep.enable(threads=1)`` against itself without it, both on one thread."""
    plain, on = parts(), parts()
    ratios = []
    for p in range(pairs + 1):
        torch.set_num_threads(1)
        a = _block(lambda s: step(*plain, s, None), p * steps, steps)
        with samestep.enable(threads=1):
            b = _block(lambda s: step(*on, s, None), p * steps, steps)
        if p:  # the first pair warms up
            ratios.append(b / a)
    return {"ratio_median": round(statistics.median(ratios), 3), "pairs": pairs}


def run_cost(variant: str, pairs: int, steps: int, root: Path) -> dict:
    """A Run of ``variant``'s settings against the plain loop, both inside the Run's deterministic mode."""
    v = RUN_VARIANTS[variant]
    plain, traced = parts(), parts()
    total = (pairs + 1) * steps
    ratios, t_plain, t_run = [], [], []
    model, opt, sched = traced
    # the plain side's dropout runs between a Run step's update and its end (the step closes when the loop asks
    # for the next), which Run rightly takes for a draw after the update; the sides' bits are not compared here
    warnings.filterwarnings("ignore", message=".*drew from torch's global generator after its update")
    with samestep.Run(
        root / variant,
        model=model,
        optimizer=opt,
        scheduler=sched,
        level=v["level"],
        receipts=v["receipts"],
        checkpoint_every=1 if v["checkpoint"] else total + 2,
    ) as run:
        loop = iter(run.steps(total + 1))  # a step closes when the loop asks for the next: one past the timed ones
        for p in range(pairs + 1):
            a = _block(lambda s: step(*plain, s, None), p * steps, steps)
            b = _block(lambda s: step(*traced, next(loop), run), p * steps, steps)
            if run.recorder is not None:
                run.recorder.flush()  # the digests of what is staged, outside the timing
            if p:  # the first pair warms up
                ratios.append(b / a)
                t_plain.append(a / steps)
                t_run.append(b / steps)
        for _ in loop:
            pass
    return {
        "ratio_median": round(statistics.median(ratios), 3),
        "step_ms_plain": round(1000 * statistics.median(t_plain), 2),
        "step_ms_run": round(1000 * statistics.median(t_run), 2),
        "pairs": pairs,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--variants", default="mode," + ",".join(RUN_VARIANTS))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name in a.variants.split(","):
            out[name] = mode_cost(a.pairs, a.steps) if name == "mode" else run_cost(name, a.pairs, a.steps, Path(d))
    if a.json:
        print(json.dumps(out))
    else:
        for name, r in out.items():
            times = f"  {r['step_ms_plain']} -> {r['step_ms_run']} ms/step" if "step_ms_run" in r else ""
            print(f"{name:12s} {r['ratio_median']:.3f}x of plain{times}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
