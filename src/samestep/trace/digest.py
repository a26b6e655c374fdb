"""``samestep.digest``: an order-sensitive tensor fingerprint whose bits do not depend on the device,
the thread count or the reduction order. Specified in docs/digest.md (with test vectors).

The tensor's bytes (row-major, little-endian) are read as signed 16-bit words, cut into rows of 256,
and each row is hashed in 4 lanes: ``sum_j word_j * W[j, lane] mod p_lane``, with fixed pseudo-random
weights ``W`` and four primes below 2**28. Every partial sum is an integer below 2**51, so computing
the rows with a float64 matrix product is exact whatever order BLAS (or cuBLAS) adds in. The row
hashes (4 lanes of 28 bits) are split into 14-bit words and hashed again the same way, until one row
is left. BLAKE2b of the dtype, shape, byte count and the 4 final lanes is the digest.

Each level is a universal linear hash with distinct weights per position, so a permutation, a
repeated value or a flipped bit changes the digest (collision chance about 2**-112 per level for
unrelated data); there is no XOR to cancel repeated pairs, unlike ``torch.hash_tensor``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

__all__ = ["digest", "digest_many", "finish", "header", "lanes_many"]

VERSION = 1
PRIMES = (268435399, 268435367, 268435361, 268435337)
COLS = 256
# Rows converted to float64 at a time: keeps the converted block in cache (about copy speed).
BLOCK_ROWS = 4096
# Sequences at least this long get their first level alone, without the batch's concatenation
# (below it, one call per sequence would cost more than copying it into the batch).
BIG_WORDS = 16 * COLS
_weights_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _weight_table() -> list[list[int]]:
    table = []
    for j in range(COLS):
        row = []
        for lane, p in enumerate(PRIMES):
            h = hashlib.blake2b(f"{lane}:{j}".encode(), digest_size=8, person=b"samestep.dgst.w1").digest()
            row.append(int.from_bytes(h, "little") % p)
        table.append(row)
    return table


def _weights(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if device not in _weights_cache:
        w = torch.tensor(_weight_table(), dtype=torch.float64, device=device)  # (256, 4)
        p = torch.tensor(PRIMES, dtype=torch.int64, device=device)
        _weights_cache[device] = (w, p)
    return _weights_cache[device]


# The int8 form of the same product, for torch._int_mm: a word x (int16) is stored as the bytes
# (lo, hi); flipping bit 7 of lo makes both bytes signed int8 with x = 256*hi + lo' + 128. Modulo p, byte
# column 2j carries weight W[j] and column 2j+1 weight 256*W[j] mod p (both below 2**28); each weight is cut
# into 4 base-128 digits, so every int8 x int8 product sum stays below 2**23 in int32. A float64 product
# with the digit scales (every partial sum an integer below 2**46, so exact) recombines the digits.
_DIGITS = 4
_int_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = {}


def _int_weights(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    if device not in _int_cache:
        table = _weight_table()
        lanes = len(PRIMES)
        digits = torch.zeros(2 * COLS, lanes * _DIGITS, dtype=torch.int8)
        for j in range(COLS):
            for lane, p in enumerate(PRIMES):
                for row, value in ((2 * j, table[j][lane]), (2 * j + 1, (table[j][lane] << 8) % p)):
                    for q in range(_DIGITS):
                        digits[row, lane * _DIGITS + q] = (value >> (7 * q)) & 0x7F
        scale = torch.tensor([float(1 << (7 * q)) for q in range(_DIGITS)], dtype=torch.float64)
        const = torch.tensor([128 * sum(table[j][lane] for j in range(COLS)) % p for lane, p in enumerate(PRIMES)],
                             dtype=torch.int64)
        entry = (digits.to(device), scale.to(device), const.to(device))
        try:  # the int8 matrix product is missing on some builds and devices: then float64 does it
            probe = torch._int_mm(torch.zeros(32, 2 * COLS, dtype=torch.int8, device=device), entry[0])
            entry = entry if probe.dtype == torch.int32 else None
        except (RuntimeError, AttributeError, NotImplementedError):
            entry = None
        _int_cache[device] = entry
    return _int_cache[device]


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 1-D signed 16-bit words (a zero byte pads an odd count)."""
    flat = t.detach().reshape(-1).contiguous()
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    b = flat.view(torch.uint8)
    if b.numel() % 2:
        b = torch.cat([b, b.new_zeros(1)])
    return b.view(torch.int16)


def _level(words: torch.Tensor, w: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Hashes rows of 256 words into (rows, 4) int64 lane values below 2**28 (a short last row is zero-padded)."""
    n = words.numel()
    full, rem = divmod(n, COLS)
    rows = full + (1 if rem or not n else 0)
    out = torch.empty(rows, len(PRIMES), dtype=torch.int64, device=words.device)
    if full:
        x = words[: full * COLS].view(full, COLS)
        fast = _int_weights(words.device) if full >= 32 else None
        if fast is not None:
            digits, scale, const = fast
            x = x.to(torch.int16)
            lanes = torch.empty(full * len(PRIMES), dtype=torch.float64, device=words.device)
            for a in range(0, full, BLOCK_ROWS):  # blocks stay in cache between the three passes
                b = min(a + BLOCK_ROWS, full)
                signed = (x[a:b] ^ 0x80).view(torch.int8)  # (rows, 512): lo', hi per word
                if b - a < 32:  # torch._int_mm wants at least 32 rows: pad with zero words
                    signed = torch.cat([signed, torch.full((32 - (b - a), 2 * COLS), 0, dtype=torch.int8,
                                                           device=signed.device)])[: max(32, b - a)]
                acc = torch._int_mm(signed, digits)[: b - a]  # (rows, 16) int32, exact
                torch.mv(acc.to(torch.float64).view(-1, _DIGITS), scale, out=lanes[a * len(PRIMES): b * len(PRIMES)])
            torch.add(lanes.view(full, len(PRIMES)).to(torch.int64), const, out=out[:full])
        else:
            block = min(full, BLOCK_ROWS)
            buf = torch.empty(block, COLS, dtype=torch.float64, device=words.device)
            res = torch.empty(block, len(PRIMES), dtype=torch.float64, device=words.device)
            for a in range(0, full, block):
                b = min(a + block, full)
                buf[: b - a].copy_(x[a:b])
                torch.mm(buf[: b - a], w, out=res[: b - a])
                out[a:b] = res[: b - a].to(torch.int64)
    if rows > full:
        tail = torch.zeros(1, COLS, dtype=torch.float64, device=words.device)
        tail[0, :rem].copy_(words[full * COLS:])
        out[full:] = torch.mm(tail, w).to(torch.int64)
    return torch.remainder(out, p)


def _lanes(t: torch.Tensor) -> torch.Tensor:
    w, p = _weights(t.device)
    h = _level(_words(t), w, p)
    while h.shape[0] > 1:
        h = _level(torch.stack((h & 0x3FFF, h >> 14), dim=-1).reshape(-1), w, p)
    return h[0]


def header(t: torch.Tensor) -> bytes:
    """The part of the digest that is not the bytes: dtype, shape and byte count."""
    return f"{str(t.dtype).removeprefix('torch.')}|{','.join(map(str, t.shape))}|{t.numel() * t.element_size()}|" \
        .encode()


def finish(head: bytes, lanes: Sequence[int]) -> bytes:
    """The 16-byte digest from a ``header`` and the 4 final lanes of the tensor's bytes."""
    h = hashlib.blake2b(digest_size=16, person=b"samestep.dgst.v1")
    h.update(head)
    h.update(struct.pack("<4I", *lanes))
    return h.digest()


def _finish(t: torch.Tensor, lanes: Sequence[int]) -> str:
    return finish(header(t), lanes).hex()


def _lanes_batched(words: list[torch.Tensor], w: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The final lanes of many word sequences on one device: (len(words), 4) int64.

    Same result as ``_lanes`` for each, with one concatenation and one matrix product per level for
    all of them: each sequence is zero-padded to whole rows and the rows of all sequences are stacked,
    so a sequence's rows are a contiguous block, and so are its next-level words.
    """
    device = words[0].device
    result = torch.empty(len(words), len(PRIMES), dtype=torch.int64, device=device)
    active, level_words = [], []
    for i, x in enumerate(words):
        if x.numel() >= BIG_WORDS:  # hashed where it lies: concatenating would copy it once more
            h = _level(x, w, p)
            x = torch.stack((h & 0x3FFF, h >> 14), dim=-1).reshape(-1)
        active.append(i)
        level_words.append(x)
    while active:
        sizes = [x.numel() for x in level_words]
        rows = [max(1, -(-n // COLS)) for n in sizes]
        zeros = torch.zeros(COLS * 2, dtype=level_words[0].dtype, device=device)
        pieces = []
        for x, n, r in zip(level_words, sizes, rows):
            pieces.append(x)
            pad = r * COLS - n
            while pad:  # at most two pieces: a pad is shorter than a row, except for an empty sequence
                pieces.append(zeros[: min(pad, zeros.numel())])
                pad -= pieces[-1].numel()
        h = _level(torch.cat(pieces), w, p)  # (total rows, 4)
        starts = torch.tensor(rows).cumsum(0).sub_(torch.tensor(rows)).tolist()
        done_i, done_rows, next_active, next_words = [], [], [], []
        split = None
        for i, r, a in zip(active, rows, starts):
            if r == 1:
                done_i.append(i)
                done_rows.append(a)
            else:
                if split is None:
                    split = torch.stack((h & 0x3FFF, h >> 14), dim=-1).reshape(-1, 2 * len(PRIMES))
                next_active.append(i)
                next_words.append(split[a: a + r].reshape(-1))
        if done_i:
            result[torch.tensor(done_i, device=device)] = h[torch.tensor(done_rows, device=device)]
        active, level_words = next_active, next_words
    return result


@torch.no_grad()
def lanes_many(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """The 4 final lanes of each tensor's bytes: one matrix product per level, one host copy per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.is_sparse or t.layout != torch.strided:
            raise ValueError(f"digest: tensor {i} has layout {t.layout}; digest its dense form (.to_dense())")
        by_device.setdefault(t.device, []).append(i)
    host: dict[int, list[int]] = {}
    for device, idx in by_device.items():
        w, p = _weights(device)
        lanes = _lanes_batched([_words(tensors[i]) for i in idx], w, p).cpu().tolist()
        host.update(zip(idx, lanes))
    return [host[i] for i in range(len(tensors))]


def digest_many(tensors: Sequence[torch.Tensor]) -> list[str]:
    """Digests of several tensors: one matrix product per level and one device-to-host copy per device."""
    return [_finish(t, lanes) for t, lanes in zip(tensors, lanes_many(tensors))]


def digest(t: torch.Tensor) -> str:
    """samestep's fingerprint of a tensor's dtype, shape and every bit of its data (32 hex digits).

    Handles every dense dtype (float8, bf16, fp16, bool, complex, ints), non-contiguous, 0-dim and
    empty tensors. The same bytes give the same digest on CPU and GPU, at any thread count.
    """
    return digest_many([t])[0]
