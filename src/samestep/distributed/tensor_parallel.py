"""Tensor-parallel linear layers whose bits do not depend on the tensor-parallel degree
(docs/layouts.md, "Tensor parallelism").

A linear layer ``y = x W^T + b`` split over T ranks sums over the split dimension somewhere: a row-parallel
layer (W split along K) in its forward, a column-parallel one (W split along N) in its input gradient.
PyTorch's parallel styles leave that sum to an all-reduce whose order the collective picks, and each rank
calls one matmul over its whole shard, whose blocking (and so its bits) follows the shard's width.

Here the split dimension is cut into ``chunks`` fixed chunks whatever the degree (T must divide ``chunks``,
both powers of two), and every matmul runs chunk by chunk, so each has the same shapes unsplit and on any
number of ranks (``chunk_products``: as one batched matmul where that keeps each chunk's bits). The chunks that a
reduction sums are summed along the canonical tree over chunk index
(``tree.BinaryCounter``): a rank holds an aligned run of ``chunks / T`` chunks, a subtree, sums it, and the
ranks combine their subtree sums in rank order with ``reduce.combine_across_ranks``, the bytes of a ring
all-reduce. Unsplit (no group) the same function runs the whole tree in one process.

The styles that route a module's forward here (``tp_styles``) shard its parameters by PyTorch's own
partition (``ColwiseParallel``: weight and bias ``Shard(0)``; ``RowwiseParallel``: weight ``Shard(1)``, bias
``Replicate``), so state dicts, FSDP2 and checkpoints see ordinary DTensors; only the layer's forward and
backward are samestep's. A DTensor parameter enters the layer's autograd function as it is: its shard is taken
inside and its gradient placed back as a DTensor in the backward, with no autograd node of their own a call
(``to_local``'s would cost about 5 ms of a 150 ms reference step, docs/performance.md).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from samestep.distributed.chunk_products import (
    column_forward,
    column_grad_bias,
    column_grad_input_parts,
    column_grad_weight,
    row_forward,
    row_grad_input,
    row_grad_weight,
)
from samestep.distributed.reduce import tree_across_ranks
from samestep.distributed.sequence_parallel import SequenceShard, all_gather_blocks, tree_to_block
from samestep.distributed.shards import local_shard, placed, spec_of

__all__ = ["column_linear", "row_linear", "sequence_shard", "validate_tp"]


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def validate_tp(degree: int, chunks: int, dims: dict[str, int]) -> None:
    """Refuses a tensor-parallel degree that does not cut every split dimension into whole chunks.

    ``dims`` names each split dimension (e.g. ``{"n_embd": 64, "n_head": 4}``); each must be divisible by
    ``chunks``, except head counts, which only ``degree`` must divide.

    Raises:
        ValueError: names the value and the degrees or chunk counts that would do.
    """
    if not _is_pow2(chunks):
        raise ValueError(f"parallel.tp_chunks={chunks} is not a power of two. Fix: 1, 2, 4, 8 or 16")
    if not _is_pow2(degree) or chunks % degree:
        ok = ", ".join(str(1 << i) for i in range(chunks.bit_length()))
        raise ValueError(
            f"parallel.tp={degree} does not divide parallel.tp_chunks={chunks} into a power of two "
            f"chunks per rank. Fix: parallel.tp in {ok}, or a larger parallel.tp_chunks"
        )
    for name, size in dims.items():
        need, key = (degree, "parallel.tp") if "head" in name else (chunks, "parallel.tp_chunks")
        if size % need:
            raise ValueError(
                f"{name}={size} is not divisible by {key}={need}: tensor parallelism cuts it into "
                f"whole pieces. Fix: a multiple of {need}"
            )


def _degree(group: Any) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _dtypes(x: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(the dtype the layer computes in: autocast's where it is on, else the input's; the dtype its products
    accumulate in: float32 for a half type). A chunk's product rounds its operands to the first and
    accumulates in the second, as a half-precision matmul does; the sums over chunks run in the first, the
    bytes of a half-precision all-reduce."""
    kind = x.device.type
    cd = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    return cd, torch.float32 if cd in (torch.float16, torch.bfloat16) else cd


def _own(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` shaped ``shape`` as a tensor of its own to autograd, not a view of the buffer the layer summed
    into (which nothing else holds): FSDP2 warns of a module that returns a view on every call, since an
    in-place op on one would drop its pre-backward hook. The bytes are ``t``'s, uncopied (what
    ``torch.matmul`` returns a folded product as)."""
    return torch.ops.aten._unsafe_view(t, shape)


def _as(t: torch.Tensor | None, cd: torch.dtype, acc: torch.dtype) -> torch.Tensor | None:
    """``t`` rounded to ``cd``, held in ``acc`` (``t`` itself where it is held in ``acc`` already and ``cd`` is
    ``acc``: float32, where both are no-ops)."""
    if t is None or t.dtype is acc is cd:
        return t
    return t.to(cd).to(acc)


_NOTHING = contextlib.nullcontext()


def _without_autocast(x: torch.Tensor) -> Any:
    """Autocast off on ``x``'s device where it is on (the products round as the layer says, ``_dtypes``)."""
    kind = x.device.type
    return torch.autocast(kind, enabled=False) if torch.is_autocast_enabled(kind) else _NOTHING


class _Column(torch.autograd.Function):
    """y = x W^T + b with W this rank's rows: ``parts`` fused projections (q, k, v), each this rank's
    ``local_chunks`` chunks of its rows, part after part; y laid out the same way."""

    @staticmethod
    def forward(ctx, x, placed_weight, placed_bias, local_chunks, parts, group, sequence):
        weight, bias = local_shard(placed_weight), local_shard(placed_bias)
        ctx.placed = (spec_of(placed_weight), spec_of(placed_bias))
        if sequence is not None:  # x is this rank's block of the sequence: the layer takes the whole
            x = all_gather_blocks(x, sequence)
        cd, acc = _dtypes(x)
        with _without_autocast(x):
            y = column_forward(
                _as(_rows(x), cd, acc), _as(weight, cd, acc), _as(bias, cd, acc), parts * local_chunks
            ).to(cd)  # part p's chunk c at p * local_chunks + c
        ctx.save_for_backward(x, weight)
        ctx.local_chunks, ctx.parts, ctx.group, ctx.has_bias = local_chunks, parts, group, bias is not None
        ctx.dtypes, ctx.sequence = (cd, acc), sequence
        return _own(y, (*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        k, parts, (cd, acc) = ctx.local_chunks, ctx.parts, ctx.dtypes
        x2, g2 = _as(_rows(x), cd, acc), _as(_rows(grad_y), cd, acc).contiguous()
        # chunk c: its parts' products summed in part order, all on the rank that holds chunk c
        leaves = [leaf.to(cd) for leaf in column_grad_input_parts(g2, _as(weight, cd, acc), k, parts)]
        if ctx.sequence is None:
            grad_x = tree_across_ranks(leaves, ctx.group).view(x.shape).to(x.dtype)
        else:  # the input's gradient of this rank's block only
            grad_x = tree_to_block([leaf.view(x.shape) for leaf in leaves], ctx.sequence).to(x.dtype)
        grad_w = column_grad_weight(g2, x2, parts * k).to(cd).to(weight.dtype)
        grad_b = column_grad_bias(g2, parts * k).to(cd).to(weight.dtype) if ctx.has_bias else None
        return grad_x, placed(grad_w, ctx.placed[0]), placed(grad_b, ctx.placed[1]), None, None, None, None


class _Row(torch.autograd.Function):
    """y = sum over K chunks of x_c W_c^T, + b once: x this rank's ``local_chunks`` chunks of the input's last
    dimension, W the matching columns; y whole (and the same bits) on every rank, or with ``sequence`` this
    rank's block of it."""

    @staticmethod
    def forward(ctx, x, placed_weight, placed_bias, local_chunks, group, sequence):
        weight, bias = local_shard(placed_weight), local_shard(placed_bias)
        ctx.placed = (spec_of(placed_weight), spec_of(placed_bias))
        cd, acc = _dtypes(x)
        shape = (*x.shape[:-1], weight.shape[0])
        with _without_autocast(x):
            leaves = [leaf.to(cd) for leaf in row_forward(_as(_rows(x), cd, acc), _as(weight, cd, acc), local_chunks)]
            if sequence is None:
                y = _own(tree_across_ranks(leaves, group), shape)
            else:  # this rank's block of the sum only
                y = tree_to_block([leaf.view(shape) for leaf in leaves], sequence)
                y = _own(y, tuple(y.shape))
            if bias is not None:
                y = y + bias.to(cd)
        ctx.save_for_backward(x, weight)
        ctx.local_chunks, ctx.has_bias, ctx.dtypes, ctx.sequence = local_chunks, bias is not None, (cd, acc), sequence
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        cd, acc = ctx.dtypes
        if ctx.sequence is not None:  # this rank's block of the output's gradient: the layer needs the whole
            grad_y = all_gather_blocks(grad_y, ctx.sequence)
        x2, g2 = _as(_rows(x), cd, acc), _as(_rows(grad_y), cd, acc).contiguous()
        grad_x = row_grad_input(g2, _as(weight, cd, acc), ctx.local_chunks).view(x.shape).to(cd).to(x.dtype)
        grad_w = row_grad_weight(g2, x2, ctx.local_chunks).to(cd).to(weight.dtype)
        grad_b = g2.sum(0).to(cd).to(weight.dtype) if ctx.has_bias else None
        return grad_x, placed(grad_w, ctx.placed[0]), placed(grad_b, ctx.placed[1]), None, None, None


def column_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    chunks: int,
    group: Any = None,
    parts: int = 1,
    sequence: SequenceShard | None = None,
) -> torch.Tensor:
    """Column-parallel ``x W^T + b``: ``x`` whole on every rank (with ``sequence``: this rank's block of the
    sequence, gathered whole first), ``weight``/``bias`` this rank's rows (or DTensors sharded ``Shard(0)``;
    of ``parts`` fused projections, this rank's rows of each, part after part), the output this rank's slice
    of the last dimension (of each part). The input's gradient sums the ``chunks`` chunks along the canonical
    tree across the group, a chunk's parts in part order (with ``sequence``: this rank's block of it)."""
    local_chunks = chunks // _degree(group)
    return _Column.apply(x, weight, bias, local_chunks, parts, group, sequence)


def row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    chunks: int,
    group: Any = None,
    sequence: SequenceShard | None = None,
) -> torch.Tensor:
    """Row-parallel ``x W^T + b``: ``x`` this rank's slice of the last dimension, ``weight`` the matching
    columns (or a DTensor sharded ``Shard(1)``), ``bias`` whole; the output whole on every rank (with
    ``sequence``: this rank's block of the sequence), the ``chunks`` partial products summed along the
    canonical tree across the group."""
    local_chunks = chunks // _degree(group)
    return _Row.apply(x, weight, bias, local_chunks, group, sequence)


def sequence_shard(device_mesh: Any) -> SequenceShard:
    """This rank's place among the ranks of a one-dimensional ``device_mesh`` that split sequences."""
    size = device_mesh.size()
    return SequenceShard(device_mesh.get_local_rank(), size, device_mesh.get_group() if size > 1 else None)
