"""Kernel benchmark: samestep.ops vs PyTorch's default and deterministic paths, side by side.

    .venv/bin/python bench/bench_kernels.py [--repeats 5] [--threads 2] [--device cpu|cuda] [--json]

Sizes of a real model: embedding backward of 64k tokens x 768 dims into 50k rows (the backward of
``weight[idx]``, i.e. index_put_ accumulate, and of nn.Embedding), and an MoE combine of 16k tokens,
8 experts, top-2. Each variant is timed in alternation with the others; medians are reported, and
ratios samestep / default and samestep / deterministic. ``distinct_results`` counts the different
output digests over all rounds of each variant: more than 1 means that path is not run-to-run
deterministic at this size (PyTorch's default index_put_ accumulate is the real case, on CPU with 2
threads and on GPU with atomics). On CUDA (samestep's Triton kernels) every timing waits for the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import samestep.ops as ops
from samestep.digests import digest


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, device: str) -> tuple[float, str]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, digest(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = args.device
    g = torch.Generator().manual_seed(0)
    V, D, N = 50_000, 768, 65_536
    idx = torch.randint(0, V, (N,), generator=g).to(dev)
    grad = torch.randn(N, D, generator=g).to(dev)
    T, E, K = 16_384, 8, 2
    rows = torch.randn(T * K, D, generator=g).to(dev)
    # Routed rows arrive grouped by expert: each token's K rows sit in K of the E groups.
    expert = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).reshape(-1)
    tok = torch.arange(T).repeat_interleave(K)[torch.argsort(expert, stable=True)].to(dev)
    w = torch.rand(T * K, generator=g).to(dev)

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, device=dev)

    cases = {
        "index_put_accumulate": {
            "samestep": lambda: ops.index_put(zeros(V, D), (idx,), grad, accumulate=True),
            "torch": lambda: zeros(V, D).index_put_((idx,), grad, accumulate=True),
        },
        "embedding_backward": {
            "samestep": lambda: ops.embedding_backward(grad, idx, V),
            "torch": lambda: torch.ops.aten.embedding_dense_backward(grad, idx, V, -1, False),
        },
        "moe_combine": {
            "samestep": lambda: ops.moe_combine(rows, tok, w, T),
            "torch": lambda: zeros(T, D).index_put_((tok,), rows * w.unsqueeze(-1), accumulate=True),
        },
    }
    result = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "threads": args.threads}
    for name, variants in cases.items():
        runs = {"samestep": [], "torch_default": [], "torch_deterministic": []}
        for _ in range(args.repeats + 1):
            torch.use_deterministic_algorithms(False)
            runs["torch_default"].append(_time(variants["torch"], dev))
            torch.use_deterministic_algorithms(True)
            runs["torch_deterministic"].append(_time(variants["torch"], dev))
            torch.use_deterministic_algorithms(False)
            runs["samestep"].append(_time(variants["samestep"], dev))
        med = {k: statistics.median(t for t, _ in v[1:]) for k, v in runs.items()}  # the first round warms up
        result[name] = {**{f"{k}_ms": round(1000 * v, 2) for k, v in med.items()},
                        "vs_default": round(med["samestep"] / med["torch_default"], 3),
                        "vs_deterministic": round(med["samestep"] / med["torch_deterministic"], 3),
                        "distinct_results": {k: len({d for _, d in v}) for k, v in runs.items()}}
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
