"""Accumulating through advanced indexing: ``index_put(accumulate=True)`` in every form PyTorch's indexing
takes (index tensors on any dimensions, slices and None between them, boolean masks of any rank,
broadcast index tensors, negative indices), and ``put(accumulate=True)``.

Both are the tile tree of ``_impl`` over rows: the indexed dimensions are moved to the front and each
position of the indexing result adds its row (the remaining dimensions) into the row it selects, in the
row-major order of the indexing result (docs/kernels.md). The result keeps the input's strides, as
PyTorch's does.
"""

from __future__ import annotations

import math

import torch

from samestep.ops._domain import counted_from_end, raise_as_torch
from samestep.ops._impl import HALF, TILE, add_rows_into, fold, on_cpu

_MASKS = (torch.bool, torch.uint8)
_INDICES = (torch.int64, torch.int32, *_MASKS)


def _like(input: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` (a fresh tensor of input's shape) with input's strides, as ``clone()`` would lay it out."""
    if values.stride() == input.stride():
        return values
    return torch.empty_like(input).copy_(values)


def _expand(input: torch.Tensor, indices) -> tuple[list[torch.Tensor], list[int]] | str:
    """Boolean masks replaced by the index tensors of their nonzero positions: ``(tensors, dims)`` with the
    input dimension each tensor indexes, or why the indices cannot index ``input``."""
    tensors, dims, d = [], [], 0
    for i in indices:
        if i is None:
            d += 1
            continue
        if not isinstance(i, torch.Tensor) or i.dtype not in _INDICES:
            return "tensors used as indices must be long, int, byte or bool tensors"
        if i.dtype in _MASKS:
            if i.dim() == 0:
                return "a 0-dim boolean index adds a dimension, which the kernel does not index"
            if tuple(i.shape) != tuple(input.shape[d : d + i.dim()]):
                return f"the shape of the mask {list(i.shape)} does not match the indexed tensor at dim {d}"
            for k, t in enumerate(i.nonzero().unbind(1)):
                tensors.append(t)
                dims.append(d + k)
            d += i.dim()
        else:
            tensors.append(i)
            dims.append(d)
            d += 1
    if d > input.dim():
        return f"too many indices for a tensor of dimension {input.dim()}"
    return tensors, dims


def index_put(
    input: torch.Tensor, indices, values: torch.Tensor, accumulate: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``torch.index_put(input, indices, values, accumulate)``; with ``accumulate=True``, deterministically,
    into a copy with input's strides, or into ``out`` (``input`` itself, for ``index_put_``).

    ``indices`` is PyTorch's list: a tensor (long, int, bool or byte) or None (a whole dimension) per
    leading dimension, as ``x[...]`` and ``torch.ops.aten.index_put`` take it.
    """
    indices = list(indices)
    if not accumulate:
        return torch.index_put(input, indices, values, accumulate=False)

    def torch_call():
        return torch.index_put(input, indices, values, accumulate=True)

    expanded = _expand(input, indices)
    if isinstance(expanded, str):
        raise_as_torch(torch_call, "index_put", expanded)
    tensors, dims = expanded
    if values.dtype != input.dtype:
        raise_as_torch(torch_call, "index_put", "values and input dtypes differ")
    if not tensors:  # every element once: no order to fix
        if torch.broadcast_shapes(values.shape, input.shape) != input.shape:
            raise_as_torch(torch_call, "index_put", "values do not broadcast to the input's shape")
        return _like(input, (input + values).contiguous()) if out is None else out.add_(values)
    try:
        b_shape = tensors[0].shape if len(tensors) == 1 else torch.broadcast_shapes(*[t.shape for t in tensors])
    except RuntimeError:
        raise_as_torch(torch_call, "index_put", "the index tensors do not broadcast together")
    counted = [counted_from_end(t, input.shape[d]) for t, d in zip(tensors, dims)]  # the bounds checked in one pass
    if any(t is None for t in counted):
        raise_as_torch(torch_call, "index_put", "an index is out of bounds")
    rest = [d for d in range(input.dim()) if d not in dims]
    adjacent = dims == list(range(dims[0], dims[-1] + 1))
    lead = list(input.shape[: dims[0]]) if adjacent else []
    trail = [input.shape[d] for d in rest[len(lead) :]]
    result_shape = torch.Size([*lead, *b_shape, *trail])
    if values.shape != result_shape and torch.broadcast_shapes(values.shape, result_shape) != result_shape:
        raise_as_torch(torch_call, "index_put", "values do not broadcast to the indexing result")
    if not result_shape.numel() or not input.numel():
        return input.clone() if out is None else out

    if len(tensors) == 1 and tensors[0].dim() == 1:
        # one index vector: the indexing result is index_add's source along that dim, in place, any layout
        d = dims[0]
        target = out if out is not None else input.clone()
        fold(target, d, counted[0].to(torch.int64), values.expand(result_shape), checked=True)
        return target
    row = counted[0].to(torch.int64).expand(b_shape)  # the row each selects
    for t, d in zip(counted[1:], dims[1:]):
        row = row * input.shape[d] + t.to(torch.int64)
    order = dims + rest
    moved = input.permute(order)
    in_place = out is not None and order == sorted(order) and out.is_contiguous()
    buffer = out if in_place else moved.clone(memory_format=torch.contiguous_format)
    vals = values.expand(result_shape)
    if lead:  # the indexing result has the broadcast index dims after the leading ones: move them first
        vals = vals.movedim(list(range(len(lead), len(lead) + len(b_shape))), list(range(len(b_shape))))
    n_rows = math.prod(input.shape[d] for d in dims)
    add_rows_into(buffer.view(n_rows, buffer.numel() // n_rows), row, vals.reshape(row.numel(), -1), checked=True)
    if in_place:
        return out
    if order != sorted(order):
        buffer = buffer.permute(sorted(range(len(order)), key=order.__getitem__))
    return _like(input, buffer) if out is None else out.copy_(buffer)


def _serial_loop_computes(input: torch.Tensor, sources: int) -> bool:
    """Whether PyTorch's own accumulating CPU loop computes the definition for ``sources`` sources into
    ``input``: one tile (the plain left fold), in input's own precision (not half), with deterministic
    algorithms on (otherwise PyTorch splits a float32 loop over threads with atomic adds)."""
    return (
        sources <= TILE and on_cpu(input) and input.dtype not in HALF and torch.are_deterministic_algorithms_enabled()
    )


def index_put_by_torch(input: torch.Tensor, indices) -> bool:
    """Whether PyTorch's own ``index_put_(accumulate=True)`` computes the definition here, so the routing leaves
    the op to it: one index vector of the first dimension (``x[idx]`` and its backward) where its serial loop
    does (``_serial_loop_computes``), adding each row's sources in order onto the input as ``fold``'s tile does
    (``tests/kernels/test_edges.py`` holds the two bit for bit)."""
    index = indices[0] if len(indices) == 1 else None
    return (
        isinstance(index, torch.Tensor)
        and index.dim() == 1
        and index.dtype in (torch.int64, torch.int32)
        and _serial_loop_computes(input, index.numel())
    )


def put_by_torch(input: torch.Tensor, index: torch.Tensor) -> bool:
    """Whether PyTorch's own ``put_(accumulate=True)`` computes the definition here, so the routing leaves the
    op to it (``put`` below is for every other case): where its serial loop does (``_serial_loop_computes``)."""
    return _serial_loop_computes(input, index.numel())


def put(
    input: torch.Tensor,
    index: torch.Tensor,
    source: torch.Tensor,
    accumulate: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``input.put(index, source, accumulate)`` (positions in input's row-major order); with
    ``accumulate=True``, deterministically, into a copy with input's strides or into ``out`` (for ``put_``)."""
    if not accumulate:
        return input.put(index, source, accumulate=False)
    counted = counted_from_end(index.reshape(-1), input.numel()) if index.dtype == torch.int64 else None
    if index.dtype != torch.int64 or source.dtype != input.dtype or source.numel() != index.numel() or counted is None:
        raise_as_torch(
            lambda: input.put(index, source, accumulate=True),
            "put",
            "index must be int64 and in bounds, one per element of source of input's dtype",
        )
    in_place = out is not None and out.is_contiguous()
    buffer = out if in_place else input.clone(memory_format=torch.contiguous_format)
    if index.numel():
        add_rows_into(buffer.view(-1), counted, source.reshape(-1), checked=True)
    if in_place:
        return out
    return out.copy_(buffer) if out is not None else _like(input, buffer)
