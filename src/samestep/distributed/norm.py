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

__all__ = ["canonical_grad_norm", "clip_grad_norm_", "row_squares"]


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


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, *,
                    out_of_place: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` by the canonical norm: the same scale (``max_norm / (norm + 1e-6)``,
    at most 1) on the same bits of the norm on any number of processes, sharded (DTensor gradients: every
    rank calls it with its shards of the same parameters) or not. Returns the norm before clipping.

    ``out_of_place``: each ``p.grad`` becomes a new tensor, leaving the old one as it was (a recorder that
    kept the reduced gradients sees them unclipped); otherwise the gradients are scaled in place.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total_norm = canonical_grad_norm([p.grad for p in params if p.grad is not None])
    coef = float(torch.clamp(max_norm / (total_norm + 1e-6), max=1.0))  # an fp32 value: the same products
    for p in params:
        if p.grad is not None:
            if out_of_place:
                p.grad = p.grad * coef
            else:
                p.grad.mul_(coef)
    return total_norm
