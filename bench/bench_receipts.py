"""Receipts benchmark: the reference run's step time with a receipt of every step, against without.

    .venv/bin/python bench/bench_receipts.py [--pairs 9] [--steps 8] [--variant V] [--switch-interval S] [--json]

Two copies of the reference run (deterministic mode, one thread, as ``samestep train`` runs it) take
blocks of ``--steps`` steps alternately in one process; one of them writes a receipt after each step
(``samestep.records.receipt_writer.ReceiptWriter``: the state checksum on its own thread, the optimizer's next step
waiting for it), as ``samestep train`` does. The cost is the median of per-pair ratios; the training
thread's own time is what it spends in the receipt calls and waiting for the receipt thread.

``--variant`` replaces what the receipt thread computes, as controls that say where the cost is:
``checksum`` (the receipt, the default), ``sha256`` (the receipt by SHA-256), ``none`` (the state tree taken,
nothing computed), ``walk`` (the tree walked and each tensor's key read, nothing hashed), ``buffer`` (one
XXH3-128 of a separate contiguous buffer of the state's size: the bytes alone, no Python per tensor), and
``inline`` (the receipt made on the training thread: no overlap, no second core). ``--switch-interval``
sets the interpreter's (``sys.setswitchinterval``, 5 ms by default): how long a thread that wants the
interpreter lock waits before the one holding it is asked to let go.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import samestep
from samestep.hashing import checksums
from samestep.loop.data import load_corpus
from samestep.records import receipts
from samestep.records.receipt_writer import ReceiptWriter
from samestep.records.receipts import genesis
from samestep.train import load_config
from samestep.train.loop import build


def _variant(name: str, nbytes: int):
    """What the receipt thread computes in place of ``state_checksum`` (see the module docstring)."""
    import torch
    import xxhash

    from samestep.hashing.state import flatten, tensor_bytes

    buffer = tensor_bytes(torch.zeros(nbytes // 4))

    def walk(tree, *_):
        tensors = {}
        flatten(tree, "state", tensors)
        return str([(t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for t in tensors.values()][:0])

    return {
        "none": lambda tree, *_: "-",
        "walk": walk,
        "buffer": lambda tree, *_: xxhash.xxh3_128(buffer).hexdigest(),
        "sha256": lambda tree, hash_, memo=None: checksums.state_checksum(tree, "sha256"),
    }[name]


def receipts_overhead(pairs: int, steps: int, variant: str = "checksum") -> dict:
    corpus = load_corpus("stdlib")
    cfg = load_config(None, [])
    plain, receipted = build(cfg, corpus=corpus), build(cfg, corpus=corpus)
    ratios, t_on, t_off = [], [], []
    if variant not in ("checksum", "inline"):
        state_bytes = sum(t.numel() * t.element_size() for t in receipted.model.state_dict().values()) * 3
        receipts.state_checksum = _variant(variant, state_bytes)  # this process's writer only
    with tempfile.TemporaryDirectory() as tmp, samestep.enable(threads=cfg.determinism.threads):
        writer = ReceiptWriter(tmp, 0, genesis(cfg.to_dict(), corpus.fingerprint))
        own = [0.0]  # the training thread's time in the receipt calls and in waiting for the thread

        def timed_wait(*_: object) -> None:
            t = time.perf_counter()
            writer.wait()
            own[0] += time.perf_counter() - t

        receipted.optimizer.register_step_pre_hook(timed_wait)
        for p in range(pairs + 1):
            t0 = time.perf_counter()
            for s in range(p * steps, (p + 1) * steps):
                loss, norm, _ = receipted.step(s)
                t = time.perf_counter()
                writer.add(s + 1, receipted.receipt_state(s + 1), loss, norm)
                if variant == "inline":
                    writer.wait()
                own[0] += time.perf_counter() - t
            writer.wait()  # the last receipt of the block is in its time
            a = time.perf_counter() - t0
            if p == 0:
                own[0] = writer.cpu_seconds = 0.0
            t0 = time.perf_counter()
            for s in range(p * steps, (p + 1) * steps):
                plain.step(s)
            b = time.perf_counter() - t0
            if p:  # the first pair warms the allocator and caches
                ratios.append(a / b)
                t_on.append(a / steps)
                t_off.append(b / steps)
        writer.close()
    return {
        "pairs": pairs,
        "steps_per_side": steps,
        "training_thread_ms": round(1000 * own[0] / (pairs * steps), 3),
        "step_ms_receipts": round(1000 * statistics.median(t_on), 2),
        "step_ms_plain": round(1000 * statistics.median(t_off), 2),
        "receipts_ratio_median": round(statistics.median(ratios), 4),
        "variant": variant,
        "receipt_thread_cpu_ms": round(1000 * writer.cpu_seconds / (pairs * steps), 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--variant", default="checksum", choices=["checksum", "sha256", "none", "walk", "buffer", "inline"])
    ap.add_argument("--switch-interval", type=float, default=None, metavar="S")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    result = receipts_overhead(args.pairs, args.steps, args.variant)
    print(
        json.dumps(result)
        if args.json
        else f"receipts ({args.variant}): {result['receipts_ratio_median']:.4f}x ({result['step_ms_receipts']} vs "
        f"{result['step_ms_plain']} "
        f"ms a step, median of {args.pairs} pairs of {args.steps} steps); the training thread's own time "
        f"{result['training_thread_ms']} ms a step, the receipt thread's CPU {result['receipt_thread_cpu_ms']} ms "
        "a step"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
