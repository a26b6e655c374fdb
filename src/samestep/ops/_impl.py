"""The deterministic reductions behind ``samestep.ops``: definitions and the CPU implementation.

Definition (docs/kernels.md), a fixed tile tree with tile size ``TILE``: sources are cut into tiles
of ``TILE`` consecutive source indices. For each output element, the contributions of tile 0 are
added to the input value one by one in ascending source order; the contributions of every later tile
are first summed the same way among themselves (starting from the tile's first contribution), and
those tile sums are added to the result in ascending tile order. With at most ``TILE`` sources this is
the plain left fold. The result is a function of the inputs alone: no atomics, no dependence on thread
count, timing or device.

Every op reduces to ``_add_rows_into`` (add source rows into output rows) on a flattened view:
- CPU: PyTorch's CPU ``index_add_`` visits the sources of each output row in ascending order and
  splits work only across rows (checked byte for byte at 1, 2 and 4 threads by tests/kernels); later
  tiles are folded into a compact per-tile buffer first;
- CUDA: the Triton kernels in ``triton_kernels`` (sorted segments, or private slots per tile).
"""

from __future__ import annotations

import torch

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


def _add_rows_into(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Adds ``rows[i]`` into ``out[index[i]]`` by the tile tree, in place on a contiguous buffer the caller owns."""
    flat = out.view(out.shape[0], -1)
    src = rows.reshape(rows.shape[0], -1)
    index = index.reshape(-1)
    if _use_triton(out):
        from samestep.ops.triton_kernels import add_rows_into

        add_rows_into(flat, index, src, TILE)
        return out
    flat.index_add_(0, index[:TILE], src[:TILE])  # tile 0: folded onto the input
    for a in range(TILE, index.numel(), TILE):  # later tiles: each row's tile sum, then one add per row
        rows_k, inverse = torch.unique(index[a:a + TILE], return_inverse=True)
        # -0.0 is the exact identity of addition, so the first contribution starts the tile sum as is.
        tile_sum = torch.full((rows_k.numel(), flat.shape[1]), -0.0, dtype=flat.dtype, device=flat.device)
        tile_sum.index_add_(0, inverse, src[a:a + TILE])
        flat.index_add_(0, rows_k, tile_sum)
    return out


def index_add(input: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor,
              alpha: float = 1) -> torch.Tensor:
    """``input.index_add(dim, index, source, alpha=alpha)``, deterministically."""
    dim = dim % max(input.dim(), 1)
    if alpha != 1:
        source = source * alpha
    moved_in = input.movedim(dim, 0)
    moved_src = source.movedim(dim, 0)
    out = moved_in.reshape(moved_in.shape[0], -1).clone()
    _add_rows_into(out, index, moved_src.reshape(moved_src.shape[0], -1))
    return out.view(moved_in.shape).movedim(0, dim).contiguous()


def scatter_add(input: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``input.scatter_add(dim, index, src)``, deterministically (source order: row-major over ``index``)."""
    dim = dim % max(input.dim(), 1)
    # Each element of src goes to the input element with its coordinates, except along dim.
    coords = torch.meshgrid(*[torch.arange(s, device=index.device) for s in index.shape], indexing="ij")
    target = list(coords)
    target[dim] = index
    flat_target = torch.zeros_like(index)
    for d, c in enumerate(target):
        flat_target = flat_target * input.shape[d] + c
    src_part = src[tuple(slice(0, s) for s in index.shape)]
    out = input.reshape(-1, 1).clone()
    _add_rows_into(out, flat_target.reshape(-1), src_part.reshape(-1, 1))
    return out.view(input.shape)


def index_put(input: torch.Tensor, indices: tuple[torch.Tensor | None, ...] | list, values: torch.Tensor,
              accumulate: bool = False) -> torch.Tensor:
    """``input.index_put(indices, values, accumulate)``; with ``accumulate=True``, deterministically.

    Supports index tensors on the leading dimensions (the form ``x[idx]`` and ``x[i, j]`` produce).
    """
    if not accumulate:
        return input.index_put(tuple(indices), values, accumulate=False)
    idx = list(indices)
    if any(i is None for i in idx) or not idx:
        raise ValueError("samestep.ops.index_put(accumulate=True) takes index tensors for the leading dimensions "
                         "only (no None/slices between them); index with x[idx] or x[i, j]")
    idx = [i.nonzero().unbind(1)[0] if i.dtype == torch.bool else i for i in idx]
    idx = list(torch.broadcast_tensors(*idx))
    k = len(idx)
    lead = input.shape[:k]
    flat = torch.zeros_like(idx[0])
    for d in range(k):
        flat = flat * lead[d] + idx[d].remainder(lead[d])  # negative indices count from the end
    rows = input.reshape(-1, *input.shape[k:])
    vals = values.expand(*idx[0].shape, *input.shape[k:]).reshape(-1, *input.shape[k:]).to(input.dtype)
    return index_add(rows, 0, flat.reshape(-1), vals).view(input.shape)


def embedding_backward(grad_output: torch.Tensor, indices: torch.Tensor, num_weights: int,
                       padding_idx: int = -1) -> torch.Tensor:
    """The gradient of ``nn.Embedding`` weights: rows of ``grad_output`` summed by token, in token order."""
    d = grad_output.shape[-1]
    grad = grad_output.reshape(-1, d)
    idx = indices.reshape(-1)
    if padding_idx >= 0:
        grad = grad * (idx != padding_idx).unsqueeze(1).to(grad.dtype)
    return _add_rows_into(grad.new_zeros(num_weights, d), idx, grad)


def segment_sum(data: torch.Tensor, segment_ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Sums rows of ``data`` by ``segment_ids`` (any order) into ``num_segments`` rows, in row order."""
    return _add_rows_into(data.new_zeros(num_segments, *data.shape[1:]), segment_ids, data)


def moe_combine(expert_out: torch.Tensor, token_index: torch.Tensor, weights: torch.Tensor,
                num_tokens: int) -> torch.Tensor:
    """Weights each routed row of ``expert_out`` (R, D) and sums it into its token (``token_index``, R).

    Rows are combined in ascending routed-row order, whatever order the experts finished in.
    """
    weighted = expert_out * weights.to(expert_out.dtype).unsqueeze(-1)
    return _add_rows_into(expert_out.new_zeros(num_tokens, expert_out.shape[-1]), token_index, weighted)
