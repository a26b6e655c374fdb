"""``samestep.digest``: an order-sensitive tensor fingerprint whose bits do not depend on the device,
the thread count or the reduction order. Specified in docs/digest.md (with test vectors).

The tensor's bytes (row-major, little-endian) are read as signed 16-bit words, cut into rows of 256,
and each row is hashed in 4 lanes: ``sum_j word_j * W[j, lane] mod p_lane``, with fixed pseudo-random
weights ``W`` and four primes below 2**28. Every partial sum is an integer below 2**51, so computing
the rows with a float64 matrix product is exact whatever order BLAS (or cuBLAS) adds in; where the
device has an int8 matrix product (``torch._int_mm``), the same sums are computed from 7-bit digits of
the weights in int32, exactly too, and faster. The row
hashes (4 lanes of 28 bits) are split into 14-bit words and hashed again the same way, until one row
is left. BLAKE2b of the dtype, shape, byte count and the 4 final lanes is the digest.

Each level is a universal linear hash with distinct weights per position, so a permutation, a
repeated value or a flipped bit changes the digest (collision chance about 2**-112 per level for
unrelated data); there is no XOR to cancel repeated pairs, unlike ``torch.hash_tensor``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import struct
import threading
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Packed", "digest", "digest_many", "finish", "header", "lanes_many", "lanes_packed", "pack_into", "rows_of"]

VERSION = 1
PRIMES = (268435399, 268435367, 268435361, 268435337)
COLS = 256
# Rows hashed at a time. On CPU a block stays in cache between its passes (about copy speed); on a GPU
# each pass is a kernel launch, so blocks are large (an H200, 1 GiB: 33 ms in blocks of 4096 rows, 4.8 ms
# in blocks of 65536). The digest does not depend on the block size.
BLOCK_ROWS = 4096
GPU_BLOCK_ROWS = 65536
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
        digits = torch.tensor([[(value >> (7 * q)) & 0x7F for value in values for q in range(_DIGITS)]
                               for j in range(COLS)
                               for values in ([table[j][lane] for lane in range(lanes)],  # low byte of word j
                                              [(table[j][lane] << 8) % p for lane, p in enumerate(PRIMES)])],
                              dtype=torch.int8)  # (512, 16): row 2j low byte, row 2j+1 high byte
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


# "auto": the fused Triton kernel (digest_triton) hashes the rows of CUDA tensors when Triton is
# installed; "off" never; "on" always (CPU tensors then need TRITON_INTERPRET=1: tests compare the paths).
# Every path gives the same lanes, so a device where the kernel fails falls back with a warning.
TRITON = "auto"
_HAVE_TRITON = importlib.util.find_spec("triton") is not None
_TRITON_DEVICE_TYPES = ("cuda",)  # where "auto" uses it (a test adds "cpu", with the kernel replaced)
_triton_failed: set[torch.device] = set()


def _use_triton(device: torch.device) -> bool:
    if TRITON == "auto":
        return device.type in _TRITON_DEVICE_TYPES and _HAVE_TRITON and device not in _triton_failed
    return TRITON == "on"


def _triton_rows(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> bool:
    """The fused kernel's lanes of the full rows ``x`` into ``out``; False (and a warning, once per
    device) if it cannot run there, in "auto" mode."""
    try:
        from samestep.trace.digest_triton import level_rows

        level_rows(x, w, out)
        return True
    except Exception as e:  # a Triton or driver that cannot build or run it: the other paths give the same lanes
        if TRITON != "auto":
            raise
        _triton_failed.add(x.device)
        warnings.warn(f"samestep.digest: the Triton kernel failed on {x.device} ({type(e).__name__}: "
                      f"{str(e).strip()[:300]}); using the PyTorch path there (same digests)",
                      RuntimeWarning, stacklevel=2)
        return False


_local = threading.local()


def _scratch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-thread buffers for one block of the int8 path (reused: a fresh multi-MB buffer per block
    costs its page faults every time)."""
    cache = _local.__dict__.setdefault("scratch", {})
    rows = _block_rows(device)
    if (device, rows) not in cache:
        cache[(device, rows)] = (torch.empty(rows, COLS, dtype=torch.int16, device=device),
                                 torch.empty(rows, len(PRIMES) * _DIGITS, dtype=torch.int32, device=device),
                                 torch.empty(rows, len(PRIMES) * _DIGITS, dtype=torch.float64, device=device))
    return cache[(device, rows)]


def _block_rows(device: torch.device) -> int:
    return BLOCK_ROWS if device.type == "cpu" else GPU_BLOCK_ROWS


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 1-D signed 16-bit words (a zero byte pads an odd count)."""
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1).contiguous()  # a conjugate view's values
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
        if not (_use_triton(words.device) and _triton_rows(x, w, out[:full])):  # the kernel reduces mod p itself
            _torch_rows(x, w, out[:full])
    if rows > full:
        tail = torch.zeros(1, COLS, dtype=torch.float64, device=words.device)
        tail[0, :rem].copy_(words[full * COLS:])
        out[full:] = torch.mm(tail, w).to(torch.int64)
    return torch.remainder(out, p)


def _torch_rows(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """The lanes (before the remainder) of the full rows ``x`` ((rows, 256) int16) into ``out``, by the
    int8 product where the device has one, else by float64 products."""
    full = x.shape[0]
    fast = _int_weights(x.device) if full >= 32 else None
    if fast is not None:
        digits, scale, const = fast
        lanes = torch.empty(full * len(PRIMES), dtype=torch.float64, device=x.device)
        signed, acc, accf = _scratch(x.device)
        step = _block_rows(x.device)
        for a in range(0, full, step):  # on CPU, blocks stay in cache between the three passes
            b = min(a + step, full)
            m = max(32, b - a)  # torch._int_mm wants at least 32 rows: zero words pad the rest
            if b - a < 32:
                signed[b - a: 32].zero_()
            torch.bitwise_xor(x[a:b], 0x80, out=signed[: b - a])  # lo', hi per word: 512 int8 per row
            torch._int_mm(signed[:m].view(torch.int8), digits, out=acc[:m])  # (rows, 16) int32, exact
            accf[: b - a].copy_(acc[: b - a])
            torch.mv(accf[: b - a].view(-1, _DIGITS), scale, out=lanes[a * len(PRIMES): b * len(PRIMES)])
        torch.add(lanes.view(full, len(PRIMES)).to(torch.int64), const, out=out)
    else:
        block = min(full, _block_rows(x.device))
        buf = torch.empty(block, COLS, dtype=torch.float64, device=x.device)
        res = torch.empty(block, len(PRIMES), dtype=torch.float64, device=x.device)
        for a in range(0, full, block):
            b = min(a + block, full)
            buf[: b - a].copy_(x[a:b])
            torch.mm(buf[: b - a], w, out=res[: b - a])
            out[a:b] = res[: b - a].to(torch.int64)


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


ROW_BYTES = 2 * COLS  # one row of words, in bytes
# Tensors at least this large are hashed where they lie; smaller ones are packed into buffers of about
# PACK_BYTES first (one copy costs less than a dozen small operations per tensor, and a buffer this
# size is reused by the allocator and still in cache when it is hashed).
BIG_BYTES = 1 << 22
PACK_BYTES = 1 << 21


def rows_of(nbytes: int) -> int:
    """The rows a tensor of ``nbytes`` bytes takes at the first level (an empty one takes one zero row)."""
    return max(1, -(-nbytes // ROW_BYTES))


@dataclass(slots=True)
class Packed:
    """Tensors' bytes laid out one after another at whole rows: entry ``i`` starts at the row after the
    previous entry's last one, holds its ``nbytes[i]`` bytes, and the rest of its last row is padding
    (zeroed before hashing). ``buf`` is 1-D uint8 with room for all the rows."""

    buf: torch.Tensor
    nbytes: list[int]


def pack_into(buf: torch.Tensor, offset: int, t: torch.Tensor) -> None:
    """Copies ``t``'s elements (row-major, from any layout) into ``buf`` (uint8) at byte ``offset`` (a
    multiple of ``ROW_BYTES``): one strided copy, no intermediate."""
    typed = buf.view(t.dtype) if t.dtype != torch.uint8 else buf
    stride, acc = [], 1
    for n in reversed(t.shape):
        stride.append(acc)
        acc *= n
    typed.as_strided(t.shape, stride[::-1], offset // t.element_size()).copy_(t)


_pads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}


def _pack(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Packs tensors of one device and dtype at whole rows: one concatenation of each tensor followed by
    zeros up to its row end (one operation, whatever the number of tensors). Returns the bytes (uint8)
    and each tensor's rows."""
    dtype, device = tensors[0].dtype, tensors[0].device
    size = ROW_BYTES // dtype.itemsize  # elements per row
    pads = _pads.get((device, dtype))
    if pads is None:  # zero pads of every length below a row, and a whole zero row (an empty tensor's)
        zeros = torch.zeros(size, dtype=dtype, device=device)
        pads = _pads[(device, dtype)] = [zeros[:n] for n in range(size + 1)]
    parts, rows = [], []
    for t in tensors:
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        r = rows_of(t.numel() * dtype.itemsize)
        parts.append(t)
        if r * size - t.numel():
            parts.append(pads[r * size - t.numel()])
        rows.append(r)
    return torch._C._nn.flatten_dense_tensors(parts).view(torch.uint8), rows


def _zero_pads(buf: torch.Tensor, nbytes: list[int], rows: list[int]) -> None:
    """Zeroes every entry's padding (the bytes between its data and the end of its last row)."""
    n = torch.tensor(nbytes, dtype=torch.int64)
    r = torch.tensor(rows, dtype=torch.int64)
    pad = r * ROW_BYTES - n
    total = int(pad.sum())
    if not total:
        return
    starts = (r.cumsum(0) - r) * ROW_BYTES + n  # first padding byte of each entry
    idx = torch.repeat_interleave(starts - (pad.cumsum(0) - pad), pad, output_size=total) + torch.arange(total)
    buf.index_fill_(0, idx.to(buf.device), 0)


def _reduce_segments(h: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The final lanes of consecutive segments of first-level row hashes: ``h`` is (sum(rows), 4), segment
    i holds ``rows[i]`` (>= 1; a CPU int64 tensor) rows. Returns (len(rows), 4) int64 on h's device.

    Each level is computed for all segments at once: a segment's next-level words (8 per row: each lane's
    low and high 14 bits) go to a zero-padded run of whole rows, so the number of operations depends on
    the depth (log base 32 of the longest segment), not on the number of segments.
    """
    device = h.device
    result = torch.empty(rows.numel(), len(PRIMES), dtype=torch.int64, device=device)
    ids = torch.arange(rows.numel())
    per_row = 2 * len(PRIMES)  # next-level words per row
    group = COLS // per_row  # rows whose words fill one next-level row
    while True:
        starts = rows.cumsum(0) - rows
        done = rows == 1
        if bool(done.any()):
            result[ids[done].to(device)] = h[starts[done].to(device)]
            keep = ~done
            ids, rows, starts = ids[keep], rows[keep], starts[keep]
            if not ids.numel():
                return result
            total = int(rows.sum())
            local = torch.arange(total) - torch.repeat_interleave(rows.cumsum(0) - rows, rows, output_size=total)
            h = h.index_select(0, (torch.repeat_interleave(starts, rows, output_size=total) + local).to(device))
        else:  # every row of h is in a segment still to reduce, in order
            total = h.shape[0]
            local = torch.arange(total) - torch.repeat_interleave(starts, rows, output_size=total)
        nxt = (rows + group - 1) // group
        dst = torch.repeat_interleave((nxt.cumsum(0) - nxt) * group, rows, output_size=total) + local
        words = torch.empty(total, len(PRIMES), 2, dtype=torch.int16, device=device)
        words[:, :, 0] = h & 0x3FFF
        words[:, :, 1] = h >> 14
        buf = torch.zeros(int(nxt.sum()) * group, per_row, dtype=torch.int16, device=device)
        buf.index_copy_(0, dst.to(device), words.view(total, per_row))
        h, rows = _level(buf.view(-1), w, p), nxt


@torch.no_grad()
def lanes_packed(packs: Iterable[Packed], tensors: Sequence[torch.Tensor] = ()) -> list[list[int]]:
    """The 4 final lanes of every entry of ``packs`` (in order), then of every tensor in ``tensors``.

    Each pack's first level is hashed before the next pack is taken, so ``packs`` may be an iterator
    that reuses one buffer for all of them (the process worker's reads do).

    Tensors below ``BIG_BYTES`` are packed per device and dtype first (``_pack``); larger ones are
    hashed where they lie. Each level is then one matrix product per buffer, plus one for all segments
    together, and the lanes reach the host in one copy per device. The padding of ``packs`` is zeroed here, in place.
    """
    for i, t in enumerate(tensors):
        if t.is_sparse or t.layout != torch.strided:
            raise ValueError(f"digest: tensor {i} has layout {t.layout}; digest its dense form (.to_dense())")
    # device -> blocks of (result indices, first-level hashes of their segments, rows per segment)
    by_device: dict[torch.device, list[tuple[list[int], torch.Tensor, list[int]]]] = {}
    index = 0
    for pk in packs:
        rows = [rows_of(n) for n in pk.nbytes]
        if rows:
            _zero_pads(pk.buf, pk.nbytes, rows)
            w, p = _weights(pk.buf.device)
            h = _level(pk.buf[: sum(rows) * ROW_BYTES].view(torch.int16), w, p)
            by_device.setdefault(pk.buf.device, []).append((list(range(index, index + len(rows))), h, rows))
        index += len(rows)
    small: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() * t.element_size() >= BIG_BYTES:
            w, p = _weights(t.device)
            h = _level(_words(t), w, p)
            by_device.setdefault(t.device, []).append(([index + i], h, [h.shape[0]]))
        else:
            small.setdefault((t.device, t.dtype), []).append(i)
    for (device, _), idx in small.items():
        w, p = _weights(device)
        group: list[int] = []
        size = 0
        for k, i in enumerate(idx):
            group.append(i)
            size += tensors[i].numel() * tensors[i].element_size()
            if size >= PACK_BYTES or k == len(idx) - 1:  # packed and hashed while the bytes are in cache
                buf, rows = _pack([tensors[j] for j in group])
                by_device.setdefault(device, []).append(([index + j for j in group],
                                                         _level(buf.view(torch.int16), w, p), rows))
                group, size = [], 0
    host: list[list[int]] = [[] for _ in range(index + len(tensors))]
    for device, blocks in by_device.items():
        w, p = _weights(device)
        h = torch.cat([b[1] for b in blocks]) if len(blocks) > 1 else blocks[0][1]
        rows = torch.tensor([r for _, _, rs in blocks for r in rs], dtype=torch.int64)
        order = [i for ids, _, _ in blocks for i in ids]
        for i, lanes in zip(order, _reduce_segments(h, rows, w, p).cpu().tolist()):
            host[i] = lanes
    return host


def lanes_many(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """The 4 final lanes of each tensor's bytes (see ``lanes_packed``)."""
    return lanes_packed((), tensors)


def digest_many(tensors: Sequence[torch.Tensor]) -> list[str]:
    """Digests of several tensors: one matrix product per level and one device-to-host copy per device."""
    return [_finish(t, lanes) for t, lanes in zip(tensors, lanes_many(tensors))]


def digest(t: torch.Tensor) -> str:
    """samestep's fingerprint of a tensor's dtype, shape and every bit of its data (32 hex digits).

    Handles every dense dtype (float8, bf16, fp16, bool, complex, ints), non-contiguous, 0-dim and
    empty tensors. The same bytes give the same digest on CPU and GPU, at any thread count.
    """
    return digest_many([t])[0]
