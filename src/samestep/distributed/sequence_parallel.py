"""Sequence parallelism with the bits of one process at every tensor-parallel degree (docs/layouts.md,
"Sequence parallelism").

Between the tensor-parallel layers, the residual stream is split by sequence position over the tensor ranks:
rank r of T holds positions ``[r L/T, (r+1) L/T)`` of every sequence, and the norms, the residual adds and
dropout run on that block only. A column-parallel layer gathers its input whole (``all_gather_blocks``: exact)
and hands back only the rank's block of the input gradient, and a row-parallel layer keeps only the rank's
block of its output, so their sums across ranks reduce to blocks (``tree_to_block``: a reduce-scatter whose
order is the canonical tree's), the bytes of the all-reduce they replace (tensor_parallel.py).

What sequence parallelism splits that is a sum: the gradient of a norm's scale and shift, summed over every
token. ``sequence_affine`` computes it in ``chunks`` fixed chunks of the sequence, each the sum over its
tokens, and sums the chunks along the canonical tree across the group (``reduce.tree_across_ranks``), so the
parameters' gradients have one bracketing at every degree. The rest of a norm is per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from samestep.distributed.reduce import tree_across_ranks
from samestep.distributed.tree import BinaryCounter

__all__ = [
    "SequenceShard",
    "all_gather_blocks",
    "gather_sequence",
    "parallelize_norm",
    "scatter_sequence",
    "sequence_affine",
    "tree_to_block",
]


@dataclass(frozen=True)
class SequenceShard:
    """Rank ``rank`` of ``degree`` tensor ranks, which split sequences (``group``: theirs; None for one)."""

    rank: int
    degree: int
    group: Any = None


def _all_gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def all_gather_blocks(x: torch.Tensor, shard: SequenceShard, dim: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's block along ``dim`` (no autograd; ``x`` itself without a group)."""
    return x if shard.group is None else _all_gather(x, dim, shard.group)


def tree_to_block(leaves: list[torch.Tensor], shard: SequenceShard, dim: int = 1) -> torch.Tensor:
    """This rank's block along ``dim`` of the canonical-tree sum of leaves laid out over ranks (as
    ``reduce.tree_across_ranks``: the rank's leaves are its aligned run, summed locally): an all-to-all hands
    rank j the j-th block of every rank's sum, which it adds in rank order along the tree. Each element has
    the bits of ``tree_across_ranks``'s, at half its bytes. Consumes ``leaves``."""
    counter = BinaryCounter()
    for leaf in leaves:
        counter.push(leaf)
    local = counter.result()
    if shard.group is None:
        return local
    import torch.distributed as dist

    blocks = [b.contiguous() for b in local.chunk(shard.degree, dim)]
    received = [torch.empty_like(blocks[shard.rank]) for _ in range(shard.degree)]
    dist.all_to_all(received, blocks, group=shard.group)
    counter = BinaryCounter()
    for block in received:
        counter.push(block)
    return counter.result()


def _own(x: torch.Tensor, dim: int, shard: SequenceShard) -> torch.Tensor:
    return x.chunk(shard.degree, dim=dim)[shard.rank].contiguous()


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, shard):
        ctx.dim, ctx.shard = dim, shard
        return x if shard.group is None else _all_gather(x, dim, shard.group)

    @staticmethod
    def backward(ctx, grad):
        # the layers the whole output fed sum their input gradient across the ranks: whole, the same on each
        return (grad if ctx.shard.group is None else _own(grad, ctx.dim, ctx.shard)), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, shard):
        ctx.dim, ctx.shard = dim, shard
        return x if shard.group is None else _own(x, dim, shard)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.shard.group is None else _all_gather(grad, ctx.dim, ctx.shard.group)), None, None


def gather_sequence(x: torch.Tensor, shard: SequenceShard, dim: int = 1) -> torch.Tensor:
    """The whole sequence from each rank's block along ``dim`` (its gradient: the rank's block of a gradient
    that is whole and the same on every rank, as a column-parallel layer's input gradient is)."""
    return _Gather.apply(x, dim, shard)


def scatter_sequence(x: torch.Tensor, shard: SequenceShard, dim: int = 1) -> torch.Tensor:
    """This rank's block along ``dim`` of ``x``, whole and the same on every rank (its gradient: the blocks
    gathered whole)."""
    return _Scatter.apply(x, dim, shard)


class _Affine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weight, bias, local_chunks, group):
        out = y * weight
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(y, weight)
        ctx.local_chunks, ctx.group, ctx.has_bias = local_chunks, group, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        y, weight = ctx.saved_tensors
        grad_y = (grad * weight).to(y.dtype)
        k, dims = ctx.local_chunks, tuple(range(grad.dim() - 1))

        def per_chunk(t: torch.Tensor) -> torch.Tensor:  # each chunk's sum over its tokens, one shape anywhere
            return tree_across_ranks([c.contiguous().sum(dims) for c in t.chunk(k, dim=1)], ctx.group)

        grad_w = per_chunk(grad * y).to(weight.dtype)
        grad_b = per_chunk(grad).to(weight.dtype) if ctx.has_bias else None
        return grad_y, grad_w, grad_b, None, None


def sequence_affine(
    y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunks: int, shard: SequenceShard
) -> torch.Tensor:
    """``y * weight + bias`` on this rank's block of the sequence (``y``: (batch, positions, features), the
    norm before it applied), with the gradients of ``weight`` and ``bias`` summed over the whole sequence in
    ``chunks`` fixed chunks along the canonical tree: the same bits on every rank and at every degree.

    Raises:
        ValueError: the rank's block does not cut into ``chunks / degree`` whole chunks.
    """
    if chunks % shard.degree or y.shape[1] % (chunks // shard.degree):
        raise ValueError(
            f"sequence_affine: {y.shape[1]} positions a rank at degree {shard.degree} do not cut into "
            f"{chunks} chunks of the sequence. Fix: a sequence length divisible by {chunks}"
        )
    return _Affine.apply(y, weight, bias, chunks // shard.degree, shard.group)


def parallelize_norm(
    norm: torch.nn.Module, normalize: Callable[[torch.Tensor], torch.Tensor], chunks: int, shard: SequenceShard
) -> torch.nn.Module:
    """Routes a norm's forward (its parameters ``weight`` and, if it has one, ``bias``, left as they are) through
    ``normalize`` on this rank's block of the sequence and ``sequence_affine``: its input and output blocks
    (the column-parallel layers after it gather their input)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        return sequence_affine(normalize(x), norm.weight, getattr(norm, "bias", None), chunks, shard)

    norm.forward = forward
    return norm
