"""The deterministic reductions behind ``samestep.ops``: definitions and the CPU implementation.

Definition (docs/kernels.md), a fixed tile tree with tile size ``TILE``: sources are cut into tiles
of ``TILE`` consecutive source indices. For each output element, the contributions of tile 0 are
added to the input value one by one in ascending source order; the contributions of every later tile
are first summed the same way among themselves (starting from the tile's first contribution), and
those tile sums are added to the result in ascending tile order. With at most ``TILE`` sources this is
the plain left fold. float16 and bfloat16 outputs accumulate in float32 and are rounded once. The
result is a function of the inputs alone: no atomics, no dependence on thread count, timing or device.

Every op reduces to ``fold`` (add source slices into output slices along a dim), scatter to
``_scatter_fold`` (the same along each line of its index):
- CPU: PyTorch's CPU ``index_add_`` and ``scatter_add_`` visit the sources of each output element in
  ascending order and split work only across outputs (checked byte for byte at 1, 2 and 4 threads by
  tests/kernels), so tile 0 is PyTorch's own kernel, writing in place; later tiles are folded into a
  compact per-tile buffer first;
- CUDA: the Triton kernels in ``triton_kernels`` (sorted segments, or private slots per tile).

Inputs outside an op's domain get PyTorch's own error (``_domain``); indexing forms live in ``_indexing``.
"""

from __future__ import annotations

import torch

from samestep.ops._domain import INDEX_DTYPES, check_bounds, raise_as_torch

# "auto": Triton on CUDA tensors when Triton is installed, PyTorch's ordered CPU kernel otherwise.
# "triton" forces the Triton kernel (CPU tensors need TRITON_INTERPRET=1): tests compare the two.
BACKEND = "auto"


def _use_triton(t: torch.Tensor) -> bool:
    if BACKEND == "torch":
        return False
    if BACKEND == "triton":
        return True
    if not t.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# The tile size of the definition. A constant: changing it changes results (beyond TILE sources).
TILE = 1 << 16
# The CPU path keeps later tiles' sums in one buffer (tiles x output elements) up to this size.
SLOT_LIMIT = 1 << 22
# Accumulated in float32 and rounded once: a fixed-order sum in the storage precision would round at
# every addition (PyTorch's own kernels differ here: docs/kernels.md, "Half precision").
HALF = (torch.float16, torch.bfloat16)


def _serial_add(out: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, alpha, checked: bool):
    """``out.index_add_(dim, index, source, alpha=alpha)``: PyTorch's serial CPU loop, each row's sources added
    in order. Where the indices are ``checked`` (in bounds, none negative), along dim 0 with alpha 1 on rows
    of 2 to 63 elements under deterministic algorithms, PyTorch's ``index_put_`` with accumulate instead: the
    same order and bits (``tests/kernels/test_edges.py``), faster there (about 0.83x at 1 thread, a third at
    2 on rows of 8), where ``index_add_`` would also have checked the bounds, and a negative index wraps."""
    if (
        checked
        and dim == 0
        and alpha == 1
        and 2 * out.shape[0] <= out.numel() < 64 * out.shape[0]  # rows of 2 to 63 (PyTorch's 1-d loop is fast)
        and torch.are_deterministic_algorithms_enabled()
    ):
        return out.index_put_((index,), source, accumulate=True)
    return out.index_add_(dim, index, source, alpha=alpha)


def fold(
    out: torch.Tensor,
    dim: int,
    index: torch.Tensor,
    source: torch.Tensor,
    alpha: int | float = 1,
    checked: bool = False,
) -> torch.Tensor:
    """Adds ``alpha`` times ``source``'s slices along ``dim`` into ``out``'s (``index`` picks each one's slice)
    by the tile tree, in place; ``out`` may be any layout. On the CPU each tile is PyTorch's own ``index_add_``
    with ``alpha`` (its slices add ``alpha * source`` in one rounding, a fused multiply-add, as PyTorch's
    ``index_add`` of one tile does), which checks the bounds; the Triton path scales first and needs indices
    in bounds (its callers check). ``checked``: the caller checked the indices (``_serial_add``)."""
    index = index.reshape(-1)
    if not index.numel() or not out.numel():
        return out
    if out.dtype in HALF:
        wide = out.float()
        fold(wide, dim, index, source.float(), alpha, checked)
        return out.copy_(wide)
    if _use_triton(out):
        return _fold_triton(out, dim, index, _scaled(source, alpha), TILE)
    # one number a row: PyTorch's 1-d loop is the fast one (it scales and adds in two roundings: alpha 1 only)
    if out.dim() == 2 and out.shape[1] == 1 and dim == 0 and alpha == 1:
        fold(out.view(-1), 0, index, source.reshape(-1), checked=checked)
        return out
    n = index.numel()
    _serial_add(out, dim, index[:TILE], source.narrow(dim, 0, min(n, TILE)), alpha, checked)  # tile 0: onto the input
    if n <= TILE:
        return out
    rows, tiles = out.shape[dim], -(-(n - TILE) // TILE)
    if tiles * out.numel() <= SLOT_LIMIT:  # a small output: a slot per (later tile, row), no sorting
        shape = list(out.shape)
        shape[dim] = tiles * rows
        # -0.0 is the exact identity of addition: a slot starts its tile's sum at its first contribution,
        # and a slot that takes none adds nothing
        slots = torch.full(shape, -0.0, dtype=out.dtype, device=out.device)
        full = (n - TILE) // TILE  # whole later tiles, as rows of a (full, TILE) view, then the rest
        keys = index[TILE : TILE + full * TILE].view(full, TILE) + (
            torch.arange(full, device=index.device) * rows
        ).unsqueeze(1)
        _serial_add(slots, dim, keys.view(-1), source.narrow(dim, TILE, full * TILE), alpha, checked)
        if TILE + full * TILE < n:
            _serial_add(
                slots,
                dim,
                index[TILE + full * TILE :] + full * rows,
                source.narrow(dim, TILE + full * TILE, n - TILE - full * TILE),
                alpha,
                checked,
            )
        # each row takes its tile sums in tile order (index_add_ adds a row's sources in ascending order)
        return _serial_add(out, dim, torch.arange(rows, device=index.device).repeat(tiles), slots, 1, True)
    for a in range(TILE, n, TILE):  # later tiles: each row's tile sum, then one add per row
        rows_k, inverse = torch.unique(index[a : a + TILE], return_inverse=True)
        shape = list(out.shape)
        shape[dim] = rows_k.numel()
        # -0.0 is the exact identity of addition, so the first contribution starts the tile sum as is.
        tile_sum = torch.full(shape, -0.0, dtype=out.dtype, device=out.device)
        tile_sum.index_add_(dim, inverse, source.narrow(dim, a, min(TILE, n - a)), alpha=alpha)
        out.index_add_(dim, rows_k, tile_sum)
    return out


def _fold_triton(out: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, tile: int) -> torch.Tensor:
    from samestep.ops.triton_kernels import add_rows_into

    moved = out.movedim(dim, 0)
    work = moved if moved.is_contiguous() else moved.contiguous()
    width = work.numel() // work.shape[0]
    add_rows_into(work.view(work.shape[0], width), index, source.movedim(dim, 0).reshape(index.numel(), width), tile)
    if work is not moved:
        moved.copy_(work)
    return out


def add_rows_into(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, checked: bool = False) -> torch.Tensor:
    """Adds ``rows[i]`` into ``out[index[i]]`` by the tile tree, in place: ``fold`` along dim 0."""
    index = index.reshape(-1)
    return fold(out, 0, index, rows.reshape(index.numel(), *out.shape[1:]), checked=checked)


def _target(input: torch.Tensor, out: torch.Tensor | None, layout=torch.contiguous_format) -> torch.Tensor:
    """Where an op accumulates: ``out`` (an in-place op's self), or a copy of ``input``."""
    return input.clone(memory_format=layout) if out is None else out


def _scaled(source: torch.Tensor, alpha: int | float | bool) -> torch.Tensor:
    """``alpha * source`` as PyTorch's index_add scales it (an integral tensor takes alpha cast to its type)."""
    if alpha == 1:
        return source
    if source.dtype == torch.bool:
        return source & bool(alpha)
    return source * (alpha if source.is_floating_point() or source.is_complex() else int(alpha))


def _index_add_domain(input: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> str | None:
    """Why ``index_add`` cannot take these inputs, or None (index bounds: ``fold``'s own check on the CPU)."""
    nd = max(input.dim(), 1)
    if not -nd <= dim < nd:
        return f"dim {dim} is out of range for a {input.dim()}-d input"
    if index.dim() > 1 or index.dtype not in INDEX_DTYPES:
        return "the index must be a vector of int32 or int64"
    if source.dtype != input.dtype:
        return "source and input dtypes differ"
    in_shape, src_shape = list(input.shape) or [1], list(source.shape) or [1]
    d = dim % nd
    if (
        len(in_shape) != len(src_shape)
        or src_shape[d] != index.numel()
        or any(a != b for k, (a, b) in enumerate(zip(in_shape, src_shape)) if k != d)
    ):
        return "source's shape does not match input's outside dim, or index's length along dim"
    if not on_cpu(input) and not check_bounds(index, in_shape[d], negative=False):
        return "an index is out of bounds"
    return None


def on_cpu(t: torch.Tensor) -> bool:
    """Whether ``fold`` runs PyTorch's CPU kernel on ``t``, which checks index bounds as it goes."""
    return not _use_triton(t) and t.device.type == "cpu"


def index_add(
    input: torch.Tensor,
    dim: int,
    index: torch.Tensor,
    source: torch.Tensor,
    alpha: int | float | bool = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch.index_add(input, dim, index, source, alpha=alpha)``, deterministically: into a contiguous
    copy (PyTorch's layout), or into ``out`` (``input`` itself, for ``index_add_``)."""
    why = _index_add_domain(input, dim, index, source)
    if why:
        raise_as_torch(lambda: torch.index_add(input, dim, index, source, alpha=alpha), "index_add", why)
    target = _target(input, out)
    # alpha goes into each add, as PyTorch's kernel applies it (bool: scaled here, where add_ takes no alpha)
    src, alpha = (_scaled(source, alpha), 1) if source.dtype == torch.bool else (source, alpha)
    if target.dim() == 0:  # a 0-dim input takes one slice along a dim of its own
        fold(target.view(1), 0, index, src.reshape(1), alpha)
    else:
        fold(target, dim % target.dim(), index, src, alpha)
    return target


def _scatter_domain(input: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> str | None:
    """Why ``scatter_add`` cannot take these inputs, or None (PyTorch's scatter checks)."""
    nd = max(input.dim(), 1)
    if not -nd <= dim < nd:
        return f"dim {dim} is out of range for a {input.dim()}-d input"
    if src.dtype != input.dtype:
        return "src and input dtypes differ"
    if not index.numel():  # nothing scatters: PyTorch checks no more
        return None
    if index.dtype not in INDEX_DTYPES:
        return "the index must be int64 or int32"
    if max(index.dim(), 1) != nd or max(src.dim(), 1) != nd:
        return "index, src and input differ in their number of dimensions"
    d = dim % nd
    i_shape, in_shape, s_shape = list(index.shape) or [1], list(input.shape) or [1], list(src.shape) or [1]
    if any(i > s for i, s in zip(i_shape, s_shape)) or any(
        i > n for k, (i, n) in enumerate(zip(i_shape, in_shape)) if k != d
    ):
        return "index is larger than src, or than input outside dim"
    if not on_cpu(input) and not check_bounds(index, in_shape[d], negative=False):
        return "an index is out of bounds"
    return None


def _scatter_targets(shape: torch.Size, dim: int, index: torch.Tensor) -> torch.Tensor:
    """The row-major position in a tensor of ``shape`` that each element of ``index`` scatters to."""
    strides = torch.empty(shape, device="meta").stride() if len(shape) else ()
    if not strides:
        return index.reshape(-1)
    target = index.to(torch.int64) * strides[dim]
    for d, n in enumerate(index.shape):
        if d != dim and n > 1:
            view = [1] * index.dim()
            view[d] = n
            target = target + (torch.arange(n, device=index.device) * strides[d]).view(view)
    return target.reshape(-1)


def _scatter_fold(out: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> None:
    """Each output element's contributions, one line of ``index`` along ``dim``, by the tile tree over
    that line: tile 0 onto ``out``, each later tile's sum (from -0.0, the exact identity) added after."""
    if out.dtype in HALF:
        wide = out.float()
        _scatter_fold(wide, dim, index, src.float())
        out.copy_(wide)
        return
    n = index.shape[dim]
    for a in range(0, n, TILE):
        part, values = index.narrow(dim, a, min(TILE, n - a)), src.narrow(dim, a, min(TILE, n - a))
        acc = out if a == 0 else torch.full_like(out, -0.0)
        if _use_triton(out):  # one tile: every line's contributions in ascending position
            work = acc if acc.is_contiguous() else acc.contiguous()
            _fold_triton(
                work.view(-1, 1), 0, _scatter_targets(out.shape, dim, part), values.reshape(-1, 1), part.numel()
            )
            if work is not acc:
                acc.copy_(work)
        else:  # PyTorch's CPU kernel walks each line along dim in order
            acc.scatter_add_(dim, part, values)
        if a:
            out.add_(acc)


def scatter_add(
    input: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``torch.scatter_add(input, dim, index, src)``, deterministically (source order: position along
    ``dim``): into a contiguous copy (PyTorch's layout), or into ``out`` (``input``, for ``scatter_add_``)."""
    why = _scatter_domain(input, dim, index, src)
    if why:
        raise_as_torch(lambda: torch.scatter_add(input, dim, index, src), "scatter_add", why)
    target = _target(input, out)
    if not index.numel():
        return target
    if target.dim() == 0:
        _scatter_fold(target.view(1), 0, index.reshape(1), src.reshape(1))
        return target
    d = dim % target.dim()
    part = src[tuple(slice(0, s) for s in index.shape)]
    _scatter_fold(target, d, index, part)
    return target


def scatter_reduce(
    input: torch.Tensor,
    dim: int,
    index: torch.Tensor,
    src: torch.Tensor,
    reduce: str,
    include_self: bool = True,
    add=None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch.scatter_reduce`` for "sum" and "mean", as PyTorch defines them: the count of contributions is
    kept in input's dtype and an integral mean is floor-divided.

    With ``add`` (a differentiable scatter_add, for ``samestep.ops``) every step is out of place; without,
    the sums accumulate in place, into ``out`` (``scatter_reduce_``) or a copy of ``input``.
    """
    if reduce not in ("sum", "mean"):
        raise ValueError(
            f"samestep.ops.scatter_reduce(reduce={reduce!r}): only 'sum' and 'mean' reduce in an "
            "order-dependent way; use torch.scatter_reduce for 'amax', 'amin' and 'prod'"
        )
    # PyTorch's mean: a float divides, an integral floor-divides, by the count (1 where nothing scattered)
    rounding = None if input.is_floating_point() or input.is_complex() else "floor"
    if add is not None:
        base = input if include_self else input.scatter(dim, index, 0)
        total = add(base, dim, index, src)
        if reduce == "sum":
            return total
        count = add(
            torch.full_like(input, int(include_self), memory_format=torch.contiguous_format),
            dim,
            index,
            torch.ones_like(src),
        )
        return total.div(count.masked_fill(count == 0, 1), rounding_mode=rounding)
    total = _target(input, out)
    if not include_self:
        total.scatter_(dim, index, 0)
    scatter_add(total, dim, index, src, out=total)
    if reduce == "mean":
        count = torch.full_like(total, int(include_self), memory_format=torch.contiguous_format)
        scatter_add(count, dim, index, torch.ones_like(src), out=count)
        total.div_(count.masked_fill_(count == 0, 1), rounding_mode=rounding)
    return total


def embedding_backward(
    grad_output: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int = -1
) -> torch.Tensor:
    """The gradient of ``nn.Embedding`` weights: rows of ``grad_output`` summed by token, in token order.
    A padding token contributes nothing (a NaN in its gradient does not reach the padding row)."""
    idx = indices.reshape(-1)
    d = grad_output.shape[-1] if grad_output.dim() else 1
    grad = grad_output.reshape(idx.numel(), d)
    if idx.dtype not in INDEX_DTYPES or not check_bounds(idx, num_weights, negative=False):
        raise_as_torch(
            lambda: torch.ops.aten.embedding_dense_backward(grad_output, indices, num_weights, padding_idx, False),
            "embedding_backward",
            "indices must be int32 or int64 and within num_weights",
        )
    if padding_idx >= 0:
        grad = torch.where((idx != padding_idx).unsqueeze(1), grad, torch.zeros((), dtype=grad.dtype))
    return add_rows_into(grad.new_zeros(num_weights, d), idx, grad)


def segment_sum(data: torch.Tensor, segment_ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Sums rows of ``data`` by ``segment_ids`` (any order) into ``num_segments`` rows, in row order."""
    ids = segment_ids.reshape(-1)
    if (
        ids.dtype not in INDEX_DTYPES
        or not check_bounds(ids, num_segments, negative=False)
        or data.shape[:1] != ids.shape
    ):
        raise ValueError(
            f"samestep.ops.segment_sum: segment_ids must be {data.shape[0] if data.dim() else 0} "
            f"int32/int64 ids in [0, {num_segments}), one per row of data; got {ids.numel()} of "
            f"dtype {ids.dtype}"
        )
    return add_rows_into(data.new_zeros(num_segments, *data.shape[1:]), ids, data)


def bincount(input: torch.Tensor, weights: torch.Tensor, minlength: int, sum_rows=None) -> torch.Tensor:
    """``torch.bincount(input, weights, minlength)``: weights summed in input order, in float32 for float32
    weights and in float64 for every other dtype (PyTorch's result dtypes); through ``sum_rows`` (a
    differentiable segment_sum, for ``samestep.ops``) or straight into the bins."""
    if (
        input.dim() != 1
        or input.dtype.is_floating_point
        or input.dtype == torch.bool
        or minlength < 0
        or weights.shape != input.shape
        or not input.numel()
    ):
        return torch.bincount(input, weights, minlength)  # PyTorch's error, or its empty result: nothing to order
    if sum_rows is None and on_cpu(input):
        # PyTorch's CPU bincount is the serial left fold (and raises PyTorch's errors), so each tile is its
        # call from +0.0; adding a tile's sum from +0.0 rather than from its first contribution changes no
        # bit, since a bin that starts at +0.0 never holds -0.0
        tiles = [
            torch.bincount(input[a : a + TILE], weights[a : a + TILE], minlength) for a in range(0, input.numel(), TILE)
        ]
        total = tiles[0].new_zeros(max(t.numel() for t in tiles))  # +0.0 + tile 0's sum is that sum
        for t in tiles:
            total[: t.numel()].add_(t)
        return total
    low, high = torch.aminmax(input)
    if low < 0:
        return torch.bincount(input, weights, minlength)  # PyTorch's error
    bins = max(int(high) + 1, minlength)
    w = weights if weights.dtype == torch.float32 else weights.to(torch.float64)
    ids = input.to(torch.int64)
    return sum_rows(w, ids, bins) if sum_rows is not None else fold(w.new_zeros(bins), 0, ids, w)


def moe_combine(
    expert_out: torch.Tensor, token_index: torch.Tensor, weights: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Weights each routed row of ``expert_out`` (R, D) and sums it into its token (``token_index``, R).

    Rows are combined in ascending routed-row order, whatever order the experts finished in.
    """
    weighted = expert_out * weights.to(expert_out.dtype).unsqueeze(-1)
    return segment_sum(weighted, token_index, num_tokens)
