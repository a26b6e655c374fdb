"""``samestep.digest`` and the batched lanes behind it: many tensors packed at whole rows, one matrix
product per level for all of them, and one device-to-host copy per device.

Each level is a universal linear hash with distinct weights per position, so a permutation, a
repeated value or a flipped bit changes the digest (collision chance about 2**-112 per level for
unrelated data); there is no XOR to cancel repeated pairs, unlike ``torch.hash_tensor``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from samestep.digests.rows import level, weights, words
from samestep.digests.spec import COLS, PRIMES, ROW_BYTES, finish, header, rows_of

__all__ = ["BIG_BYTES", "PACK_BYTES", "Packed", "digest", "digest_many", "lanes_many", "lanes_packed", "pack_into"]

# Tensors at least this large are hashed where they lie; smaller ones are packed into buffers of about
# PACK_BYTES first (one copy costs less than a dozen small operations per tensor, and a buffer this
# size is reused by the allocator and still in cache when it is hashed).
BIG_BYTES = 1 << 22
PACK_BYTES = 1 << 21


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
        h, rows = level(buf.view(-1), w, p), nxt


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
            w, p = weights(pk.buf.device)
            h = level(pk.buf[: sum(rows) * ROW_BYTES].view(torch.int16), w, p)
            by_device.setdefault(pk.buf.device, []).append((list(range(index, index + len(rows))), h, rows))
        index += len(rows)
    small: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() * t.element_size() >= BIG_BYTES:
            w, p = weights(t.device)
            h = level(words(t), w, p)
            by_device.setdefault(t.device, []).append(([index + i], h, [h.shape[0]]))
        else:
            small.setdefault((t.device, t.dtype), []).append(i)
    for (device, _), idx in small.items():
        w, p = weights(device)
        group: list[int] = []
        size = 0
        for k, i in enumerate(idx):
            group.append(i)
            size += tensors[i].numel() * tensors[i].element_size()
            if size >= PACK_BYTES or k == len(idx) - 1:  # packed and hashed while the bytes are in cache
                buf, rows = _pack([tensors[j] for j in group])
                by_device.setdefault(device, []).append(
                    ([index + j for j in group], level(buf.view(torch.int16), w, p), rows)
                )
                group, size = [], 0
    host: list[list[int]] = [[] for _ in range(index + len(tensors))]
    for device, blocks in by_device.items():
        w, p = weights(device)
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
    return [finish(header(t), lanes).hex() for t, lanes in zip(tensors, lanes_many(tensors))]


def digest(t: torch.Tensor) -> str:
    """samestep's hash of a tensor's dtype, shape and every bit of its data (32 hex digits).

    Handles every dense dtype (float8, bf16, fp16, bool, complex, ints), non-contiguous, 0-dim and
    empty tensors. The same bytes give the same digest on CPU and GPU, at any thread count.
    """
    return digest_many([t])[0]
