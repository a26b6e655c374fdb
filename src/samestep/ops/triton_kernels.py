"""Triton kernels for ``samestep.ops``: the tile tree of ``_impl`` (docs/kernels.md), bit for bit.

Two strategies, chosen by size (``add_rows_into``):
- **sorted segments**: the source indices are sorted stably, so each output row's contributions form
  one segment in ascending source order; one program per (segment, column tile) walks its segment:
  tile 0's contributions go onto the input value, each later tile's are summed among themselves and
  the sum is added when the tile ends. Scales with the number of output rows.
- **private slots** (small outputs: ``rows x columns x tiles <= SLOT_LIMIT``): one program per (source
  tile, column tile) adds its tile's rows, in order, into a private copy of the output (the input for
  tile 0, -0.0 elsewhere); the slots are then added in tile order. No two writers share memory, so no
  atomics, and adding -0.0 where a tile had no contribution is exact.
Both run on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["SLOT_LIMIT", "add_rows_into"]

BLOCK_D = 128
SLOT_LIMIT = 1 << 22  # elements of private slots (rows x columns x tiles) the slot strategy may use


@triton.jit
def _fold_segments(out_ptr, src_ptr, perm_ptr, rows_ptr, starts_ptr, D, TILE, BLOCK: tl.constexpr):
    seg = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    row = tl.load(rows_ptr + seg)
    start = tl.load(starts_ptr + seg)
    end = tl.load(starts_ptr + seg + 1)
    acc = tl.load(out_ptr + row * D + cols, mask=mask)
    part = tl.zeros([BLOCK], dtype=acc.dtype)
    # the tile whose sum is being built in `part` (0: none; tile 0 folds into acc directly); int64 like
    # `src_row // TILE` (the compiler refuses a loop-carried value whose type changes; the interpreter does not)
    cur = tl.full([], 0, tl.int64)
    for s in range(start, end):  # ascending source order
        src_row = tl.load(perm_ptr + s)
        v = tl.load(src_ptr + src_row * D + cols, mask=mask)
        t = src_row // TILE
        if t == 0:
            acc += v
        elif t == cur:
            part += v
        else:
            if cur != 0:
                acc += part  # the previous tile ended: its sum joins the result
            part = v
            cur = t
    if cur != 0:
        acc += part
    tl.store(out_ptr + row * D + cols, acc, mask=mask)


@triton.jit
def _fold_tile_into_slot(slots_ptr, src_ptr, index_ptr, N, R, D, TILE, BLOCK: tl.constexpr):
    tile = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    base = slots_ptr + tile * R * D
    for s in range(tile * TILE, tl.minimum(tile * TILE + TILE, N)):  # this writer's sources, in order
        row = tl.load(index_ptr + s)
        v = tl.load(src_ptr + s * D + cols, mask=mask)
        cur = tl.load(base + row * D + cols, mask=mask)
        tl.store(base + row * D + cols, cur + v, mask=mask)


def _block(d: int) -> int:
    return min(BLOCK_D, triton.next_power_of_2(d))


def add_rows_into(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, tile: int) -> torch.Tensor:
    """Adds ``rows[i]`` into ``out[index[i]]`` by the tile tree, in place (``out`` 2-D and contiguous)."""
    index = index.reshape(-1).to(torch.int64).contiguous()
    n = index.numel()
    if not n:
        return out
    src = rows.reshape(n, -1).to(out.dtype).contiguous()
    r, d = out.shape
    n_tiles = -(-n // tile)
    block = _block(d)
    if r * d * n_tiles <= SLOT_LIMIT:
        slots = torch.full((n_tiles, r, d), -0.0, dtype=out.dtype, device=out.device)
        slots[0] = out
        _fold_tile_into_slot[(n_tiles, triton.cdiv(d, block))](slots, src, index, n, r, d, tile, BLOCK=block)
        acc = slots[0]
        for k in range(1, n_tiles):  # fixed order: tile 1, 2, ...
            acc = acc + slots[k]
        out.copy_(acc)
        return out
    perm = torch.argsort(index, stable=True)
    seg_rows, counts = torch.unique_consecutive(index[perm], return_counts=True)
    starts = torch.zeros(seg_rows.numel() + 1, dtype=torch.int64, device=index.device)
    starts[1:] = counts.cumsum(0)
    _fold_segments[(seg_rows.numel(), triton.cdiv(d, block))](out, src, perm, seg_rows, starts, d, tile, BLOCK=block)
    return out
