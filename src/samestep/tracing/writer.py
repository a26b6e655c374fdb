"""The stream writer's half of a batch: its staged tensors digested (``batch_lanes``), its state tensors
checksummed (``state_digests``), its records appended as one Arrow record batch (``write_lanes``)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from samestep.digests import Packed, finish, lanes_packed
from samestep.hashing.checksums import state_hash_for
from samestep.tracing.batch import HASHED, Batch, Columns
from samestep.tracing.stream import StreamWriter

__all__ = ["UNINIT", "batch_lanes", "plain", "readable", "state_digests", "write_lanes"]

UNINIT = bytes(16)  # the digest recorded for uninitialised memory (torch.empty and friends)


def plain(t: torch.Tensor) -> torch.Tensor:
    """A dense, strided tensor whose bytes stand for ``t``'s value, for tensors whose bytes cannot be
    copied or read as they are: sparse (its dense form), quantized (its integer values), nested (its
    components, flattened and joined), meta (no data: empty, under the meta tensor's own header), and a
    conjugate or negative view (resolved). A copy: ``t`` may change afterwards."""
    t = t.detach()
    if t.is_meta:
        return torch.empty(0, dtype=t.dtype)
    if t.is_quantized:
        return t.int_repr()
    if t.is_nested:
        return torch.cat([c.reshape(-1) for c in t.unbind()])
    out = t.to_dense() if t.layout != torch.strided else t.clone()
    return out.resolve_conj().resolve_neg()


def readable(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be hashed (or read by the child) as they are, with ``t``'s meaning."""
    return t.layout == torch.strided and not (t.is_quantized or t.is_nested or t.is_meta)


def batch_lanes(packs: list[Packed], tensors: list[torch.Tensor]) -> list[list[int]]:
    """The lanes of a batch's staged tensors: its packs' entries, then ``tensors`` (see ``write_lanes``)."""
    try:
        return lanes_packed(packs, tensors)
    except (ValueError, RuntimeError, NotImplementedError):
        # A live tensor whose bytes cannot be hashed as they are (sparse, quantized, nested): its plain form,
        # taken now. A change since it was recorded is still caught by its version. Tried only after a
        # failure: the usual batch pays no check per tensor.
        return lanes_packed(packs, [t if readable(t) else plain(t) for t in tensors])


def state_digests(b: Batch) -> list[bytes]:
    """The state checksums of a batch's state tensors (``b.hashed``), raw: each by the state hash of where it
    lies (``checksums.state_hash_for``), from the step's pass that the receipts share."""
    if not b.hashed:
        return []
    shared, step = b.state_pass
    by_hash: dict[str, list[int]] = {}
    for i, t in enumerate(b.hashed):
        by_hash.setdefault(state_hash_for(t.device), []).append(i)
    out = [b""] * len(b.hashed)
    for hash_, at in by_hash.items():
        tensors = [b.hashed[i] for i in at]
        try:
            sums = shared.of_step(step, hash_).of(tensors)
        except (ValueError, RuntimeError, NotImplementedError, TypeError):
            # a tensor whose bytes cannot be read as they are (sparse, quantized, nested, meta): its plain form
            sums = shared.of_step(step, hash_).of([t if readable(t) else plain(t) for t in tensors])
        for i, s in zip(at, sums):
            out[i] = bytes.fromhex(s)
    return out


def write_lanes(
    writer: StreamWriter, b: Columns, pack_sizes: list[int], lanes: list[list[int]], hashed: list[bytes]
) -> None:
    """Appends a batch's records, given the lanes of its packs' entries (``pack_sizes`` of them per
    pack), then of its tensors, and the digests of its state tensors (``hashed``)."""
    first, in_packs = [], 0  # lanes come packs' entries first, then the tensors
    for size in pack_sizes:
        first.append(in_packs)
        in_packs += size
    at = [first[c] + e if c >= 0 else in_packs + e if c != HASHED else ~e for c, e in zip(b.slot_chunk, b.slot_entry)]
    # One row per reference, then a zero row: NO_REF (-1) picks it (UNINIT).
    digests = np.frombuffer(
        b"".join(
            [
                finish(head, lanes[i]) if (i := at[slot]) >= 0 else hashed[~i]
                for slot, head in zip(b.ref_slot, b.ref_head)
            ]
        )
        + UNINIT,
        dtype=np.uint8,
    ).reshape(-1, 16)
    n = len(b.step)
    cols = {
        "seq": pa.array(np.arange(b.first_seq, b.first_seq + n, dtype=np.int64)),
        "step": b.step,
        "microbatch": b.mb,
        "phase": b.phase,
        "scope": b.scope,
        "op": b.op,
        "occurrence": b.occ,
    }
    for name, refs, ends in (("inputs", b.ins, b.in_end), ("outputs", b.outs, b.out_end)):
        data = digests[np.asarray(refs, dtype=np.int64)].tobytes() if refs else b""
        offsets = np.zeros(n + 1, dtype=np.int32)
        offsets[1:] = np.asarray(ends, dtype=np.int32) * 16
        cols[name] = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    writer.write(cols)
