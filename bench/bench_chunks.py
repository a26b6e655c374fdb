"""What tensor parallelism's fixed chunks cost on one device: the reference run's step (or ``--preset``'s) with
parallel.tp_chunks=N (every decoder linear in N chunks, the path a run keeps at any TP degree) against plain
layers (parallel.tp_chunks=0), side by side in one process, taking turns.

    .venv/bin/python bench/bench_chunks.py [--preset small] [--chunks 8] [--pairs 9] [--steps 2] [--json]
                                           [--set model.n_embd=1024 ...] [--floor]

Both sides run in deterministic mode with one intra-op thread; reported: each side's median step time and the
median of the per-round ratios (chunked / plain). ``--set`` changes the configuration of both sides (a width, to
tell a cost per layer call from a cost per FLOP: the first falls as the width grows, the second does not).

``--floor`` adds two controls, each the chunked side's step with its layers doing the plain layer's arithmetic
(one GEMM each way, in one autograd function on the parameters' shards, as cheap as a layer of samestep's own
can be; other bits, so a control of cost only): "floor" on the same DTensor parameters, "floor_local" with the
parameters left as plain tensors. Chunked over floor is what the chunks cost; floor over floor_local what
DTensor parameters cost; floor_local over plain what the rest of the path costs (the gradient tree, the norm,
the vocabulary-parallel loss and embedding, the masks keyed by position).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import samestep
from samestep.distributed import tp_styles
from samestep.distributed.shards import local_shard, placed, spec_of
from samestep.loop.data import load_corpus
from samestep.train import load_config
from samestep.train.loop import build


class _PlainMath(torch.autograd.Function):
    """A canonical layer's call (``column_linear``'s or ``row_linear``'s arguments) doing the plain layer's
    arithmetic on the parameters' shards, the gradients placed back as the parameters lie."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        w, b = local_shard(weight), local_shard(bias)
        kind = x.device.type
        cd = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype  # autocast's casts
        ctx.specs, ctx.dtypes = (spec_of(weight), spec_of(bias)), (x.dtype, w.dtype)
        x, w, b = x.to(cd), w.to(cd), None if b is None else b.to(cd)
        ctx.save_for_backward(x, w)
        with torch.autocast(kind, enabled=False):
            return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        to_x, to_w = ctx.dtypes
        grad_b = placed(g2.sum(0).to(to_w), ctx.specs[1]) if ctx.needs_input_grad[2] else None
        return (grad @ w).to(to_x), placed((g2.t() @ x2).to(to_w), ctx.specs[0]), grad_b


def _plain_math(x, weight, bias, *_):
    return _PlainMath.apply(x, weight, bias)


@contextlib.contextmanager
def _floor(local: bool):
    """The canonical styles applied with ``_plain_math`` as their layer (and, ``local``, no parameter
    distributed: each stays the plain tensor it was), while a side is built."""
    import torch.distributed.tensor as dtensor

    saved = (tp_styles.column_linear, tp_styles.row_linear, dtensor.distribute_module)
    tp_styles.column_linear, tp_styles.row_linear = _plain_math, lambda *a: _plain_math(*a)
    if local:
        dtensor.distribute_module = lambda module, *_args, **_kwargs: module
    try:
        yield
    finally:
        tp_styles.column_linear, tp_styles.row_linear, dtensor.distribute_module = saved


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default=None)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="K=V", help="a config key for both sides")
    ap.add_argument("--floor", action="store_true", help="the controls: the chunked side with plain arithmetic")
    args = ap.parse_args()
    samestep.enable(threads=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the mesh of one
    base = load_config(None, args.set, preset=args.preset)
    corpus = load_corpus(base.data.source, base.data.path or None)

    def side(chunks: int) -> Any:
        return build(load_config(None, [*args.set, f"parallel.tp_chunks={chunks}"], preset=args.preset), corpus=corpus)

    sides = {"plain": side(0), "chunked": side(args.chunks)}
    for name, local in (("floor", False), ("floor_local", True)) if args.floor else ():
        with _floor(local):
            sides[name] = side(args.chunks)
    for trainer in sides.values():
        trainer.model.train()
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for p in range(args.pairs + 1):
        for name in names[p % len(names) :] + names[: p % len(names)]:  # each round starts with another side
            t0 = time.perf_counter()
            for s in range(args.steps):
                sides[name].step(p * args.steps + s)
            if p:  # round 0 warms up
                times[name].append((time.perf_counter() - t0) / args.steps)
    result = {
        "preset": args.preset or "reference",
        "set": args.set,
        "chunks": args.chunks,
        "pairs": args.pairs,
        "step_ms_plain": round(1000 * statistics.median(times["plain"]), 1),
        "step_ms_chunked": round(1000 * statistics.median(times["chunked"]), 1),
        "ratio_median": round(statistics.median(a / b for a, b in zip(times["chunked"], times["plain"])), 4),
    }
    for name in names[2:]:
        result[f"step_ms_{name}"] = round(1000 * statistics.median(times[name]), 1)
        result[f"ratio_median_{name}"] = round(statistics.median(a / b for a, b in zip(times[name], times["plain"])), 4)
    print(
        json.dumps(result)
        if args.json
        else f"{' '.join([result['preset'], *args.set])}: {args.chunks} chunks {result['step_ms_chunked']} ms/step vs "
        f"plain layers {result['step_ms_plain']} ms/step; ratio median of {args.pairs} rounds: "
        f"{result['ratio_median']}"
        + "".join(
            f"; {name} {result[f'step_ms_{name}']} ms/step, {result[f'ratio_median_{name}']}" for name in names[2:]
        )
    )
    dist.destroy_process_group()
    samestep.disable()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
