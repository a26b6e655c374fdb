"""Kernel benchmark: samestep.ops vs PyTorch's default and deterministic paths, side by side.

    .venv/bin/python bench/bench_kernels.py [--repeats 5] [--threads 2] [--device cpu|cuda] [--json] [--cases S]

Sizes of a real model: embedding backward of 64k tokens x 768 dims into 50k rows (the backward of
``weight[idx]``, i.e. index_put_ accumulate, and of nn.Embedding), and an MoE combine of 16k tokens,
8 experts, top-2. Then every op that ``samestep.enable(kernels=True)`` routes, called as a model calls
it (PyTorch's op under the routing mode, ``routed_*``): index_put on a slice (``x[:, idx]`` backward),
put_ (``take``'s backward), index_add_, scatter_add_, scatter_reduce sum and mean, weighted bincount (of
a top-2 MoE's routed rows); the last two also past one tile of sources. Each variant is timed in
alternation with the others, samestep's with deterministic algorithms on, as ``enable(kernels=True)``
runs it; medians are reported, and ratios samestep / default and samestep /
deterministic (where PyTorch has no deterministic kernel, that ratio is null). ``distinct_results`` counts the different
output digests over all rounds of each variant: more than 1 means that path is not run-to-run
deterministic at this size (PyTorch's default index_put_ accumulate is the real case, on CPU with 2
threads and on GPU with atomics). On CUDA (samestep's Triton kernels) every timing waits for the device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch

import samestep.ops as ops
from samestep.digests import digest
from samestep.ops import _impl
from samestep.ops.routing import KernelMode


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, device: str, setup, around=contextlib.nullcontext) -> tuple[float, str]:
    """One call of ``fn`` on ``setup()``'s arguments (a fresh destination, made outside the timing), inside
    ``around()`` (the routing mode, entered outside the timing too: a model enters it once, not per op)."""
    with around():
        args = setup()
        _sync(device)
        t0 = time.perf_counter()
        try:
            out = fn(*args)
        except RuntimeError as e:  # PyTorch has no deterministic kernel for this op
            if "does not have a deterministic implementation" not in str(e):
                raise
            return float("nan"), "none"
        _sync(device)
        return time.perf_counter() - t0, digest(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cases", default="", help="only the cases whose name holds this text (e.g. small_)")
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

    cols = torch.randint(0, V // 8, (N // 8,), generator=g).to(dev)  # x[:, cols]: (D, V/8) from (D, N/8)
    grad_t = grad[: N // 8].t().contiguous()
    flat = torch.randint(0, V * 64, (N * 64,), generator=g).to(dev)  # put_: into (V, 64), the backward of take
    flat_src = grad.reshape(-1)[: N * 64]
    idx2 = idx.view(-1, 1).expand(N, D).contiguous()  # scatter into (V, D) along dim 0
    experts = torch.randint(0, 64, (N * 16,), generator=g).to(dev)  # bincount: MoE router statistics
    expert_w = grad.reshape(-1)[: N * 16]

    small_i = torch.randint(0, 1000, (1_000_000,), generator=g).to(dev)
    small_g = torch.randn(1_000_000, 8, generator=g).to(dev)
    take_i = torch.randint(0, 100, (2_000_000,), generator=g).to(dev)
    take_g = torch.randn(2_000_000, generator=g).to(dev)

    def routed(torch_fn, *dest: int):
        """PyTorch's in-place op, routed or not, into a fresh zeros(*dest) made before the timer starts."""
        return {"samestep": torch_fn, "torch": torch_fn, "setup": lambda: (zeros(*dest),), "routed": True}

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
        "routed_index_put_slice": routed(lambda x: torch.ops.aten.index_put_(x, [None, cols], grad_t, True), D, V // 8),
        "routed_put": routed(lambda x: x.put_(flat[:N], flat_src[:N], accumulate=True), V, 64),
        "routed_index_add": routed(lambda x: x.index_add_(0, idx, grad), V, D),
        "routed_scatter_add": routed(lambda x: x.scatter_add_(0, idx2, grad), V, D),
        "routed_scatter_reduce_sum": routed(lambda x: x.scatter_reduce_(0, idx2, grad, "sum"), V, D),
        "routed_scatter_reduce_mean": routed(lambda x: x.scatter_reduce_(0, idx2, grad, "mean"), V, D),
        "routed_bincount": routed(lambda _: torch.bincount(experts[: 2 * N], expert_w[: 2 * N]), 0),
        # The control for the sub-millisecond rows: what the routing's Python dispatch costs an op it
        # passes through untouched (an add into one element)
        "routed_control_add": routed(lambda x: x.add_(1.0), 1),
        # Past one tile (65,536 sources) the later tiles are summed on their own first (docs/kernels.md):
        # work that PyTorch's serial CPU loops do not do. 4M sources into 3.2M slots; 1M into 64 bins.
        "routed_put_64_tiles": routed(lambda x: x.put_(flat, flat_src, accumulate=True), V, 64),
        "routed_bincount_16_tiles": routed(lambda _: torch.bincount(experts, expert_w), 0),
        # Small tables, where PyTorch's serial loops are fastest and the routing's fixed costs show: the backward
        # of table[i] (1M lookups of a 1000 x 8 table), of an embedding, of take (2M into 100 values), a
        # scatter_add of 2M into 50, and one tile of index_put (60k rows into 1000 x 8)
        "routed_small_lookup_backward": routed(lambda x: x.index_put_((small_i,), small_g, accumulate=True), 1000, 8),
        "routed_small_embedding_backward": routed(
            lambda _: torch.ops.aten.embedding_dense_backward(small_g, small_i, 1000, -1, False), 0
        ),
        "routed_small_take_backward": routed(lambda x: x.put_(take_i, take_g, accumulate=True), 100),
        "routed_small_scatter_add": routed(lambda x: x.scatter_add_(0, take_i % 50, take_g), 50),
        "routed_small_index_put_one_tile": routed(
            lambda x: x.index_put_((small_i[:60_000],), small_g[:60_000], accumulate=True), 1000, 8
        ),
        # The control of the small rows: PyTorch's own index_add_ (the CPU tile of samestep's fold, unrouted) in
        # samestep's column against PyTorch's index_put_, which adds the same sources in the same order
        # and the tile tree of take's backward alone (unrouted: no handler, no bounds check) against PyTorch's put_
        "control_small_take_tiles": {
            "samestep": lambda x: _impl.add_rows_into(x, take_i, take_g, checked=True),
            "torch": lambda x: x.put_(take_i, take_g, accumulate=True),
            "setup": lambda: (zeros(100),),
        },
        "control_small_index_add_tile": {
            "samestep": lambda x: x.index_add_(0, small_i[:60_000], small_g[:60_000]),
            "torch": lambda x: x.index_put_((small_i[:60_000],), small_g[:60_000], accumulate=True),
            "setup": lambda: (zeros(1000, 8),),
        },
    }
    cases = {name: case for name, case in cases.items() if args.cases in name}
    result = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "threads": args.threads}
    for name, variants in cases.items():
        runs = {"samestep": [], "torch_default": [], "torch_deterministic": []}
        for _ in range(args.repeats + 1):
            setup = variants.get("setup", tuple)
            torch.use_deterministic_algorithms(False)
            runs["torch_default"].append(_time(variants["torch"], dev, setup))
            torch.use_deterministic_algorithms(True)
            runs["torch_deterministic"].append(_time(variants["torch"], dev, setup))
            torch.use_deterministic_algorithms(True)  # as samestep.enable(kernels=True) runs the kernels
            around = KernelMode if variants.get("routed") else contextlib.nullcontext
            runs["samestep"].append(_time(variants["samestep"], dev, setup, around))
            torch.use_deterministic_algorithms(False)
        med = {k: statistics.median(t for t, _ in v[1:]) for k, v in runs.items()}  # the first round warms up
        det = med["torch_deterministic"]
        result[name] = {
            **{f"{k}_ms": None if v != v else round(1000 * v, 2) for k, v in med.items()},
            "vs_default": round(med["samestep"] / med["torch_default"], 3),
            "vs_deterministic": None if det != det else round(med["samestep"] / det, 3),
            "distinct_results": {k: len({d for _, d in v if d != "none"}) for k, v in runs.items()},
        }
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
