"""The gradient norm of a step, the same bits on any number of processes, sharded or not.

A norm sums every element's square, and the bits of that sum depend on its bracketing. The usual
total norm (a norm per tensor, then the norm of those) brackets by tensor, which a sharded tensor (FSDP2
holds a slice of dim 0 of each on each rank) cannot reproduce. Here the bracketing follows rows: each
dim-0 row of each gradient is summed alone (a row never straddles two shards), and the row sums, in
parameter and row order, are summed as one vector: the same vector, the same sum, whatever the sharding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = ["canonical_grad_norm", "row_squares"]


def row_squares(g: torch.Tensor) -> torch.Tensor:
    """The sum of squares of each dim-0 row of ``g`` (a scalar is one row), in ``g``'s dtype."""
    rows = g.reshape(1, 1) if g.dim() == 0 else g.reshape(g.shape[0], math.prod(g.shape[1:]))
    return (rows * rows).sum(dim=1)


def _gather_rows(local: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter's row sums over all ranks (its shards' rows, in rank order): every rank the same."""
    import torch.distributed as dist

    world = dist.get_world_size()
    device = local[0].device
    counts = torch.tensor([t.numel() for t in local], dtype=torch.int64, device=device)
    all_counts = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(all_counts, counts)
    flat = torch.cat(local)
    longest = max(int(c.sum()) for c in all_counts)
    padded = torch.zeros(longest, dtype=flat.dtype, device=device)
    padded[: flat.numel()] = flat
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    per_rank = [list(g[: int(c.sum())].split(c.tolist())) for g, c in zip(gathered, all_counts)]
    return [torch.cat([per_rank[r][i] for r in range(world)]) for i in range(len(local))]


def canonical_grad_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``grads`` together, bracketed by rows (see the module docstring). DTensor
    gradients (sharded) are gathered as row sums only, a few bytes per row: a collective then, which
    every rank calls with its shards of the same parameters."""
    from samestep.distributed.fsdp import iter_local

    grads = list(grads)
    sharded = any(type(g).__name__ == "DTensor" for g in grads)
    rows = [row_squares(g) for g in iter_local(grads)] if sharded else [row_squares(g) for g in grads]
    if sharded and rows:
        rows = _gather_rows(rows)
    return torch.cat(rows).sum().sqrt() if rows else torch.zeros(())
