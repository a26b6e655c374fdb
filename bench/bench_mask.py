"""The positional dropout mask (``samestep.rng.positional_keep``, int32 lanes) against its definition over
unsigned 32-bit values held in int64 (``keep_by_int64`` in tests/support/masks.py, the reference
tests/unit/test_rng.py holds the mask to bit for bit), side by side on one thread: the median of alternating
calls each.

    .venv/bin/python bench/bench_mask.py [--shape 2 4 128 128] [--calls 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from samestep.determinism import rng

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.masks import keep_by_int64  # noqa: E402  (the definition the tests hold the mask to)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs="+", default=[2, 4, 128, 128])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape, key, p = tuple(args.shape), rng.key(0, 3, 5, "dropout"), 0.1
    flat = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).view(shape)
    sides = {
        "int32": lambda: rng.positional_keep(key, shape, (0,) * len(shape), shape, p),
        "int64": lambda: keep_by_int64(key, flat, p),
    }
    if not torch.equal(sides["int32"](), sides["int64"]()):
        raise SystemExit("bench_mask: the two masks differ")
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(args.calls):
        for name in list(sides) if i % 2 else list(sides)[::-1]:
            t0 = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - t0)
    result = {
        "shape": list(shape),
        "calls": args.calls,
        **{f"ms_{name}": round(1000 * statistics.median(t), 3) for name, t in times.items()},
    }
    result["ratio"] = round(result["ms_int32"] / result["ms_int64"], 3)
    print(
        json.dumps(result)
        if args.json
        else f"mask of {shape}: int32 lanes {result['ms_int32']} ms vs int64 "
        f"{result['ms_int64']} ms ({result['ratio']}x), median of {args.calls} calls each"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
