"""An embedding and a cross-entropy split by vocabulary across tensor-parallel ranks, with the bits of one
process at every degree (docs/layouts.md, "Tensor parallelism").

A vocabulary-parallel embedding holds rows ``[r V/T, (r+1) V/T)`` on rank r. Each rank looks up the tokens
it holds and puts -0.0 (the exact identity of addition) for the others, and an all-reduce sums the ranks'
outputs: each element is one rank's value plus -0.0s, exact in any order. Its weight gradient folds every
token's output gradient into the rank's rows, the tokens it does not hold into a spare row that is dropped,
so each row takes its tokens at the same positions of the same fold (``samestep.ops.index_add``'s tiles) as
unsplit.

A column-parallel output layer leaves each rank the logits of its slice of the vocabulary. The loss of a
token is ``log(sum_v exp(l_v - m)) - (l_target - m)`` with ``m`` the largest logit: the maximum is exact in
any order, the target's logit comes from the one rank that holds it (the others add exact zeros), and
the sum over the vocabulary is the one reduction whose order matters. It runs in ``chunks`` fixed chunks
of the vocabulary summed along the canonical tree across the group (``reduce.tree_across_ranks``), unsplit
as on any number of ranks. The gradient, ``softmax - onehot``, is elementwise on each rank's slice.
"""

from __future__ import annotations

from typing import Any

import torch

from samestep.distributed.reduce import tree_across_ranks

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_embedding"]


def _world(group: Any) -> tuple[int, int]:
    if group is None:
        return 1, 0
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, chunks, group):
        world, rank = _world(group)
        v_local = logits.shape[-1]
        l2 = logits.reshape(-1, v_local)
        t = targets.reshape(-1)
        top = l2.max(dim=1).values
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)  # a maximum: exact in any order
        shifted = l2 - top[:, None]
        e = shifted.exp()
        s = tree_across_ranks([c.sum(dim=1) for c in e.chunk(chunks // world, dim=1)], group)
        start = rank * v_local
        mine = (t >= start) & (t < start + v_local)
        local_t = torch.where(mine, t - start, torch.zeros_like(t))
        picked = torch.where(mine, shifted.gather(1, local_t[:, None]).squeeze(1), torch.full_like(s, -0.0))
        picked = tree_across_ranks([picked], group)  # one rank's value and -0.0s: exact
        ctx.save_for_backward(e, s, mine, local_t)
        ctx.shape = logits.shape
        return (s.log() - picked).view(targets.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        e, s, mine, local_t = ctx.saved_tensors
        g = grad_loss.reshape(-1)
        grad = e / s[:, None] * g[:, None]
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows[mine], local_t[mine]] -= g[mine]
        return grad.view(ctx.shape), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, chunks: int, group: Any = None
) -> torch.Tensor:
    """Each token's cross-entropy (no reduction over tokens) from ``logits`` (``(..., V / T)``: this rank's
    even slice of the vocabulary, rank r holding ids ``[r V/T, (r+1) V/T)``; a DTensor sharded on its last
    dimension is taken locally) and ``targets`` (``(...)``, global ids, the same on every rank); the same
    bits on every rank and at every degree T that divides ``chunks``. Unsplit: ``group`` None.

    Raises:
        ValueError: ``chunks`` is not a multiple of the degree, or does not cut the slice evenly.
    """
    if hasattr(logits, "to_local"):
        logits = logits.to_local()
    world, _ = _world(group)
    if chunks % world or logits.shape[-1] % (chunks // world):
        raise ValueError(
            f"vocab_parallel_cross_entropy: chunks={chunks} does not cut {world} rank(s)' slices of "
            f"{logits.shape[-1]} logits into whole chunks. Fix: a vocabulary divisible by chunks, and "
            "a degree that divides chunks"
        )
    return _CrossEntropy.apply(logits, targets, chunks, group)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, idx, weight, group):
        world, rank = _world(group)
        rows = weight.shape[0]
        start = rank * rows
        mine = (idx >= start) & (idx < start + rows)
        local = torch.where(mine, idx - start, rows)  # row ``rows``: the spare one, for the tokens of other ranks
        out = weight[local.clamp(max=rows - 1)].masked_fill_(~mine.unsqueeze(-1), -0.0)
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(out, group=group)  # each element one rank's value and -0.0s: exact in any order
        ctx.save_for_backward(local)
        ctx.shape = weight.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from samestep import ops

        (local,) = ctx.saved_tensors
        rows, dim = ctx.shape
        g = grad_out.reshape(-1, dim)
        grad = ops.index_add(torch.zeros(rows + 1, dim, dtype=g.dtype, device=g.device), 0, local.reshape(-1), g)
        return None, grad[:rows], None


def vocab_parallel_embedding(idx: torch.Tensor, weight: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``weight[idx]`` with ``weight`` this rank's even slice of the vocabulary's rows (rank r holding ids
    ``[r V/T, (r+1) V/T)``; a DTensor sharded ``Shard(0)`` is taken locally) and ``idx`` global ids, the same
    on every rank: the output whole, with the same bits on every rank and at every degree, and the weight's
    gradient this rank's rows of the unsplit one's. Unsplit: ``group`` None."""
    if hasattr(weight, "to_local"):
        weight = weight.to_local()
    return _Embedding.apply(idx, weight, group)
