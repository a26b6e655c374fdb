"""Triton kernels for ``samestep.ops``: the same left fold as the CPU path, bit for bit.

Strategy "stable sort, then segmented reduce": the source indices are sorted stably, so each output
row's contributions form one segment in ascending source order; one program per (segment, column
tile) loads the row's input value and adds the segment's rows one at a time, in order. No atomics, no
dependence on scheduling. Runs on CUDA devices, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["add_rows_into"]

BLOCK_D = 128


@triton.jit
def _fold_rows(out_ptr, src_ptr, perm_ptr, rows_ptr, starts_ptr, D, BLOCK: tl.constexpr):
    seg = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    row = tl.load(rows_ptr + seg)
    start = tl.load(starts_ptr + seg)
    end = tl.load(starts_ptr + seg + 1)
    acc = tl.load(out_ptr + row * D + cols, mask=mask)
    for s in range(start, end):  # ascending source order: the definition's left fold
        src_row = tl.load(perm_ptr + s)
        acc += tl.load(src_ptr + src_row * D + cols, mask=mask)
    tl.store(out_ptr + row * D + cols, acc, mask=mask)


def add_rows_into(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Adds ``rows[i]`` into ``out[index[i]]`` in ascending i, in place (``out`` 2-D and contiguous)."""
    index = index.reshape(-1).to(torch.int64)
    if not index.numel():
        return out
    src = rows.reshape(index.numel(), -1).to(out.dtype).contiguous()
    d = out.shape[1]
    perm = torch.argsort(index, stable=True)
    seg_rows, counts = torch.unique_consecutive(index[perm], return_counts=True)
    starts = torch.zeros(seg_rows.numel() + 1, dtype=torch.int64, device=index.device)
    starts[1:] = counts.cumsum(0)
    grid = (seg_rows.numel(), triton.cdiv(d, min(BLOCK_D, triton.next_power_of_2(d))))
    _fold_rows[grid](out, src, perm, seg_rows, starts, d, BLOCK=min(BLOCK_D, triton.next_power_of_2(d)))
    return out
