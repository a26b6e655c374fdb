"""One fused Triton kernel for the digest's row hashes on a GPU (``rows.level``'s full rows).

The PyTorch path hashes a block of rows in four passes (xor, int8 product, conversion, product), each a
kernel launch that reads and writes the block. This kernel reads each row's 256 words once and keeps
the four lane sums in registers: ``sum_j u_j * W[j, lane]`` with ``u_j = word_j + 32768`` in
[0, 65535], so every sum is a non-negative integer below 2**52 and exact in int64 whatever order the
reduction takes. The signed sum is ``S - 32768 * sum_j W[j, lane]``; modulo p it is
``(S mod p + p - C) mod p`` with ``C = 32768 * sum_j W[j, lane] mod p``. Every operand of ``%`` is
non-negative, where a truncating remainder (C's, on the GPU) and a floor remainder (Python's, in the
interpreter) agree. Same lanes as the other paths, bit for bit (tests/kernels/test_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from samestep.digests.spec import COLS, PRIMES

__all__ = ["PROGRAM_ROWS", "level_rows"]

PROGRAM_ROWS = 16  # rows per program: 16 x 256 int64 values in registers across 4 warps
LANES = len(PRIMES)


@triton.jit
def _level_rows(
    words_ptr, w_ptr, p_ptr, c_ptr, out_ptr, rows, BLOCK: tl.constexpr, COLS_: tl.constexpr, LANES_: tl.constexpr
):
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, COLS_)
    mask = r < rows
    x = tl.load(words_ptr + r[:, None] * COLS_ + j[None, :], mask=mask[:, None], other=0)
    u = x.to(tl.int64) + 32768  # in [0, 65535]
    for lane in tl.static_range(LANES_):
        w = tl.load(w_ptr + j * LANES_ + lane)  # (COLS,) int64, each below 2**28
        s = tl.sum(u * w[None, :], axis=1)  # below 2**52: exact, any order
        p = tl.load(p_ptr + lane)
        c = tl.load(c_ptr + lane)
        tl.store(out_ptr + r * LANES_ + lane, (s % p + p - c) % p, mask=mask)


_consts: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def level_rows(x: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
    """Writes the lanes of the full rows ``x`` ((rows, COLS) int16, contiguous) into ``out`` ((rows, LANES)
    int64), reduced modulo ``PRIMES``; ``weights`` is the digest's (COLS, LANES) table (any dtype holding
    the integers)."""
    device = x.device
    if device not in _consts:
        w = weights.to(device=device, dtype=torch.int64).contiguous()
        p = torch.tensor(PRIMES, dtype=torch.int64, device=device)
        table = weights.to(torch.int64).cpu().sum(0).tolist()
        c = torch.tensor([32768 * s % q for s, q in zip(table, PRIMES)], dtype=torch.int64, device=device)
        _consts[device] = (w, p, c)
    w, p, c = _consts[device]
    rows = x.shape[0]
    if rows:
        _level_rows[(triton.cdiv(rows, PROGRAM_ROWS),)](
            x, w, p, c, out, rows, BLOCK=PROGRAM_ROWS, COLS_=COLS, LANES_=LANES
        )
