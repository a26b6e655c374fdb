"""The digest's specification (docs/digest.md): its constants, weights, header and final hash.

The tensor's bytes (row-major, little-endian) are read as signed 16-bit words, cut into rows of 256,
and each row is hashed in 4 lanes: ``sum_j word_j * W[j, lane] mod p_lane``, with fixed pseudo-random
weights ``W`` and four primes below 2**28. The row hashes (4 lanes of 28 bits) are split into 14-bit
words and hashed again the same way, until one row is left. BLAKE2b of the dtype, shape, byte count
and the 4 final lanes is the digest. Everything here is plain Python: the paths that compute the lanes
(``rows``, ``triton_rows``, ``lanes``) all build on it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

__all__ = ["COLS", "PRIMES", "ROW_BYTES", "VERSION", "finish", "header", "rows_of", "weight_table"]

VERSION = 1
PRIMES = (268435399, 268435367, 268435361, 268435337)
COLS = 256
ROW_BYTES = 2 * COLS  # one row of words, in bytes


def weight_table() -> list[list[int]]:
    """``W``: (COLS, 4) integers, each below its lane's prime, drawn from BLAKE2b (docs/digest.md)."""
    table = []
    for j in range(COLS):
        row = []
        for lane, p in enumerate(PRIMES):
            h = hashlib.blake2b(f"{lane}:{j}".encode(), digest_size=8, person=b"samestep.dgst.w1").digest()
            row.append(int.from_bytes(h, "little") % p)
        table.append(row)
    return table


def header(t: torch.Tensor) -> bytes:
    """The part of the digest that is not the bytes: dtype, shape and byte count."""
    return (
        f"{str(t.dtype).removeprefix('torch.')}|{','.join(map(str, t.shape))}|{t.numel() * t.element_size()}|".encode()
    )


def finish(head: bytes, lanes: Sequence[int]) -> bytes:
    """The 16-byte digest from a ``header`` and the 4 final lanes of the tensor's bytes."""
    h = hashlib.blake2b(digest_size=16, person=b"samestep.dgst.v1")
    h.update(head)
    h.update(struct.pack("<4I", *lanes))
    return h.digest()


def rows_of(nbytes: int) -> int:
    """The rows a tensor of ``nbytes`` bytes takes at the first level (an empty one takes one zero row)."""
    return max(1, -(-nbytes // ROW_BYTES))
