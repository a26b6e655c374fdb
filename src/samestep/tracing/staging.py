"""Staging: what the capture levels hand over for digesting, until the recorder flushes it as a batch.

Each level records through this small API: ``stage`` a tensor (a copy packed into a reused chunk, or
the live tensor, checked unchanged later) to get a reference, then ``append`` a record of references.
A tensor version is staged once per batch (``cached``); the occurrence counts give each record its
identity (step, microbatch, phase, scope, op, occurrence). Once the staged bytes pass ``FLUSH_BYTES``,
``full`` (the recorder's flush) is called: the staging memory stays bounded.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import _disable_current_modes

from samestep.digests import ROW_BYTES, Packed, header, pack_into, rows_of
from samestep.tracing.batch import HASHED, NO_REF, Batch
from samestep.tracing.writer import plain

__all__ = ["CHUNK_BYTES", "FLUSH_BYTES", "RecorderView", "Staging"]

# Flush the staging area once it holds this many bytes (bounds the recorder's memory).
FLUSH_BYTES = 256 * 1024 * 1024
# Staged copies are packed into reused chunks of this size (a larger tensor gets its own copy).
CHUNK_BYTES = 32 * 1024 * 1024


def _nothing() -> None:
    pass


class RecorderView(Protocol):
    """What the levels (step_level, module_level, op_level, collectives) use of the recorder that owns them."""

    @property
    def active(self) -> bool: ...  # the current step is recorded

    @property
    def modules_on(self) -> bool: ...  # module records are taken now

    @property
    def reads_in_place(self) -> bool: ...  # the worker reads tensors where they lie (the process worker)

    @property
    def checksums(self) -> Any: ...  # the step's state checksum pass (``checksums.StepChecksums``)

    def record(
        self,
        op: str,
        outputs: Iterable[torch.Tensor],
        inputs: Iterable[torch.Tensor] = (),
        scope: str = "",
        phase: str = "step",
        copy: bool | str = True,
    ) -> None: ...


class Staging:
    """The batch being built, the identity of the records being made, and what makes staging cheap:
    the tensor-version cache, reused chunks, and headers made once per dtype and shape."""

    def __init__(self) -> None:
        self.batch = Batch(0)
        self.step, self.mb = 0, -1  # the identity of the records made now
        self.counts: dict[tuple, int] = {}  # (microbatch, phase, scope, op) -> records so far this step
        self.seq = 0  # records made, over all batches
        self.nbytes = 0  # bytes staged in this batch
        self.full: Callable[[], None] = _nothing  # called once nbytes passes FLUSH_BYTES
        self.in_dispatch = False  # inside the op recorder (its staging copies run under no mode)
        self.dtensor: type | None = None  # DTensor, if torch.distributed.tensor was imported (see shards)
        self.heads: dict[tuple, bytes] = {}  # (dtype, shape) -> digest header
        # id -> (tensor, version, ref, also at version + 1: see stage's fresh)
        self.cache: dict[int, tuple[weakref.ref, int, int, bool]] = {}
        self.memo: dict[tuple, int] = {}  # (view op, input refs, arguments) -> ref (see op_level)
        self._open: dict[torch.device, tuple[int, int]] = {}  # device -> (chunk being filled, bytes used)
        self._free: dict[torch.device, list[torch.Tensor]] = {}  # chunks digested and ready for reuse

    def new_step(self, step: int) -> None:
        self.step, self.mb = step, -1
        self.counts.clear()

    def take(self) -> Batch:
        """The batch built so far; staging starts a new one (the chunks stay open for reuse, see ``free``)."""
        batch, self.batch = self.batch, Batch(self.seq)
        self._open.clear()
        self.forget()
        self.nbytes = 0
        return batch

    def forget(self, written: list[torch.Tensor] = ()) -> None:
        """Trusts nothing staged before to hold its tensors' bytes any more: every later read stages anew.
        Except memory known uninitialised that shares no storage with ``written`` (what a collective writes
        from another thread): it still holds nothing, and digesting it would record whatever bytes lie there,
        another value in every run (a buffer made before a collective and filled after it)."""

        def storage(t: torch.Tensor) -> int | None:
            try:
                return t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # sparse, nested, or without storage
                return None

        targets = {storage(t) for t in written}
        kept = (
            {}
            if None in targets
            else {
                key: hit
                for key, hit in self.cache.items()
                if hit[2] == NO_REF
                and (t := hit[0]()) is not None
                and (ptr := storage(t)) is not None
                and ptr not in targets
            }
        )
        self.cache.clear()
        self.cache.update(kept)
        self.memo.clear()

    def free(self, packs: list[Packed]) -> None:
        """Chunks whose digests are done: reused by the next copies."""
        for pack in packs:
            self._free.setdefault(pack.buf.device, []).append(pack.buf)

    def drop_chunks(self) -> None:
        self._free.clear()

    def check_full(self) -> None:
        if self.nbytes > FLUSH_BYTES:
            self.full()

    def shards(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """DTensors (FSDP2's sharded parameters, their gradients and optimizer state; tensor parallel) as
        this rank's local shard, which its stream records (under the shard's own shape); other tensors
        as they are. The shard is the DTensor's storage: digested where it lies, checked or copied as
        the DTensor would be. Called where ``dtensor`` is set (at the recorder's ``step()``)."""
        dtensor = self.dtensor
        return [t._local_tensor if isinstance(t, dtensor) else t for t in tensors]

    def stage(
        self,
        t: torch.Tensor,
        uninit: bool = False,
        share: int | None = None,
        copy: bool | str = True,
        fresh: bool = False,
    ) -> int:
        """Stages a tensor for digesting (once per tensor version); returns its reference.

        A reference is (staged copy, header): ``share`` names a staged copy that already holds ``t``'s
        bytes (see ``op_level.same_bytes``), so only the header is new. ``uninit`` marks fresh uninitialised
        memory: no reference (its digest is ``UNINIT``), and so for every later read of that tensor
        version, e.g. as the destination of ``bernoulli_``. ``copy=False`` keeps the live tensor;
        ``copy="checked"`` too, and the recorder checks that it did not change before it was digested.
        ``fresh`` stages ``t`` anew even if this version was staged: an op wrote into it in place, and
        its version is bumped (by one) only after the op recorder returns, or never (C++ code such as
        DDP's reducer writes below the version counter). Later look-ups at this version and the next find
        the new reference, so the next op that reads it does not copy it again.
        An inference tensor (``torch.inference_mode``) has no version counter: it is never cached nor
        remembered, and copied even where ``copy="checked"`` (it could not be checked unchanged).
        """
        if self.dtensor is not None and isinstance(t, self.dtensor):
            t = t._local_tensor  # this rank's shard (see shards)
        try:
            version: int | None = t._version
        except RuntimeError:  # an inference tensor
            version = None
            if copy == "checked":
                copy = True
        ref = None if fresh or version is None else self.cached(t, version)
        if ref is not None:
            return ref
        if uninit:
            if version is not None:
                self.remember(t, NO_REF, version)
            return NO_REF
        if share is None:
            if copy == "checked":
                share = self.checked_slot(t, version)
            elif not copy:
                share = self.add_tensor(t.detach())
            elif self.in_dispatch or not torch._C._len_torch_dispatch_stack():
                share = self.copy(t)
            else:
                with _disable_current_modes():
                    share = self.copy(t)
        return self.reference(t, share, version, also_next=fresh)

    def cached(self, t: torch.Tensor, version: int) -> int | None:
        """The reference ``t`` was staged under at ``version`` in this batch, if it was."""
        hit = self.cache.get(id(t))
        if hit is None or hit[0]() is not t:
            return None
        return hit[2] if hit[1] == version or (hit[3] and hit[1] + 1 == version) else None

    def checked_slot(self, t: torch.Tensor, version: int, record: int | None = None) -> int:
        """A slot for live ``t``, which the recorder checks is still at ``version`` (for record index
        ``record``; by default the record made next)."""
        live = t.detach()  # shares t's version counter
        b = self.batch
        b.check_live.append(live)
        b.check_version.append(version)
        b.check_record.append(len(b.step) if record is None else record)
        self.nbytes += live.nbytes  # kept alive: counts to the bound
        return self.add_tensor(live)

    def reference(self, t: torch.Tensor, share: int, version: int | None, also_next: bool = False) -> int:
        """A new reference, slot ``share`` with ``t``'s header, remembered for ``t`` at ``version`` (and
        the next one, if ``also_next``; not at all for a tensor without a version)."""
        b = self.batch
        b.ref_slot.append(share)
        b.ref_head.append(self.head(t))
        ref = len(b.ref_slot) - 1
        if version is not None:
            self.remember(t, ref, version, also_next)
        return ref

    def head(self, t: torch.Tensor) -> bytes:
        """``t``'s digest header (dtype, shape, byte count), made once per dtype and shape."""
        try:
            key = (t.dtype, t.shape)
        except RuntimeError:  # a nested tensor has no single shape: the header of what plain digests
            return header(plain(t))
        head = self.heads.get(key)
        if head is None:
            head = self.heads[key] = header(t)
        return head

    def add_tensor(self, t: torch.Tensor) -> int:
        """A whole tensor to digest as it is (``add_tensors`` of one, without the lists)."""
        b = self.batch
        b.tensors.append(t)
        b.slot_chunk.append(-1)
        b.slot_entry.append(b.expanded)
        b.expanded += 1
        return len(b.slot_chunk) - 1

    def add_tensors(self, tensors: list[torch.Tensor]) -> range:
        """Whole tensors to digest as they are; returns their slots."""
        b, n = self.batch, len(tensors)
        first = len(b.slot_chunk)
        b.tensors.extend(tensors)
        b.slot_chunk.extend([-1] * n)
        b.slot_entry.extend(range(b.expanded, b.expanded + n))
        b.expanded += n
        return range(first, first + n)

    def add_hashed(self, tensors: list[torch.Tensor], checksums: Any) -> range:
        """State tensors to digest by their state checksum where they lie, in this step's pass of
        ``checksums`` (a ``checksums.StepChecksums``); returns their slots."""
        b, n = self.batch, len(tensors)
        first, at = len(b.slot_chunk), len(b.hashed)
        b.hashed.extend(tensors)
        b.state_pass = (checksums, self.step)
        b.slot_chunk.extend([HASHED] * n)
        b.slot_entry.extend(range(at, at + n))
        return range(first, first + n)

    def add_pieces(self, copy: torch.Tensor, sizes: list[int], keep: list[int]) -> list[int]:
        """Pieces ``keep`` of ``copy.split(sizes)`` to digest (split by the worker: one operation)."""
        b = self.batch
        b.tensors.append((copy, sizes, keep))
        first = len(b.slot_chunk)
        b.slot_chunk.extend([-1] * len(keep))
        b.slot_entry.extend(range(b.expanded, b.expanded + len(keep)))
        b.expanded += len(keep)
        return list(range(first, first + len(keep)))

    def copy(self, t: torch.Tensor) -> int:
        """Copies ``t`` into the open chunk of its device (a new or reused chunk when it is full)."""
        nbytes = t.numel() * t.element_size()
        size = rows_of(nbytes) * ROW_BYTES
        self.nbytes += size
        if size > CHUNK_BYTES or t.layout != torch.strided:
            return self.add_tensor(plain(t))
        device, b = t.device, self.batch
        chunk, used = self._open.get(device, (-1, CHUNK_BYTES))
        if used + size > CHUNK_BYTES:
            if device.type == "meta":  # no bytes to pack (a chunk there would hold none either)
                return self.add_tensor(plain(t))
            free = self._free.get(device)
            if free:
                buf = free.pop()
            else:
                with torch.inference_mode(False):  # the worker zeroes its padding outside inference mode
                    buf = torch.empty(CHUNK_BYTES, dtype=torch.uint8, device=device)
            b.packs.append(Packed(buf, []))
            chunk, used = len(b.packs) - 1, 0
        pack = b.packs[chunk]
        if nbytes:
            try:
                pack_into(pack.buf, used, t.detach())
            except (RuntimeError, NotImplementedError):  # quantized or nested: bytes PyTorch will not copy
                self._open[device] = (chunk, used)
                return self.add_tensor(plain(t))
        pack.nbytes.append(nbytes)
        self._open[device] = (chunk, used + size)
        b.slot_chunk.append(chunk)
        b.slot_entry.append(len(pack.nbytes) - 1)
        return len(b.slot_chunk) - 1

    def remember(self, t: torch.Tensor, ref: int, version: int | None = None, also_next: bool = False) -> None:
        """Caches ``ref`` as ``t``'s at ``version`` (default: its version now) for this batch."""
        try:
            self.cache[id(t)] = (weakref.ref(t), t._version if version is None else version, ref, also_next)
        except TypeError:  # a tensor subclass without weakref support: no caching
            pass
        except RuntimeError:  # an inference tensor: no version counter, no caching
            pass

    def occurrence(self, phase: str, scope: str, op: str) -> int:
        """How many records of this identity came before in this step (and counts this one)."""
        key = (self.mb, phase, scope, op)
        n = self.counts.get(key, 0)
        self.counts[key] = n + 1
        return n

    def append(
        self, phase: str, scope: str, op: str, occurrence: int, inputs: Iterable[int], outputs: list[int]
    ) -> None:
        """Makes a record of the references ``inputs`` and ``outputs``, with the current step and microbatch."""
        b = self.batch
        b.step.append(self.step)
        b.mb.append(self.mb)
        b.phase.append(phase)
        b.scope.append(scope)
        b.op.append(op)
        b.occ.append(occurrence)
        b.ins.extend(inputs)
        b.in_end.append(len(b.ins))
        b.outs.extend(outputs)
        b.out_end.append(len(b.outs))
        self.seq += 1
        if self.nbytes > FLUSH_BYTES:
            self.full()
