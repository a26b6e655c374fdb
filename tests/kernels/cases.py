"""One set of inputs per samestep.ops kernel, shared by the CPU and Triton byte-for-byte tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import samestep.ops as ops


def make_cases(v: int, d: int, n: int, seed: int) -> dict[str, tuple[Callable[..., Any], tuple[torch.Tensor, ...]]]:
    """``{name: (fn, inputs)}``: ``n`` sources of width ``d`` into ``v`` rows, from a seeded generator.

    Values span many magnitudes, so any change of summation order changes bits.
    """
    g = torch.Generator().manual_seed(seed)

    def wide(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape, generator=g) * 4)

    idx = torch.randint(0, v, (n,), generator=g)
    src = wide(n, d)
    base = wide(v, d)
    idx2d = torch.randint(0, v, (n, d), generator=g)
    tokens = torch.randint(0, n // 2, (n,), generator=g)  # MoE: about 2 routed rows per token
    weights = torch.rand(n, generator=g)
    return {
        "index_add": (lambda b, i, s: ops.index_add(b, 0, i, s), (base, idx, src)),
        "scatter_add": (lambda b, i, s: ops.scatter_add(b, 0, i, s), (base, idx2d, src)),
        "scatter_reduce_mean": (lambda b, i, s: ops.scatter_reduce(b, 0, i, s, "mean"), (base, idx2d, src)),
        "index_put": (lambda b, i, s: ops.index_put(b, (i,), s, accumulate=True), (base, idx, src)),
        "embedding_backward": (lambda i, s: ops.embedding_backward(s, i, v), (idx, src)),
        "bincount": (lambda i, w: ops.bincount(i, w, minlength=v), (idx, src[:, 0].contiguous())),
        "segment_sum": (lambda s, i: ops.segment_sum(s, i, v), (src, idx)),
        "moe_combine": (lambda e, t, w: ops.moe_combine(e, t, w, n // 2), (src, tokens, weights)),
    }
