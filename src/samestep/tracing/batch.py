"""A batch: the records of one flush, as flat columns, and what they point at.

``Columns`` is what the stream gets (and what the process worker receives, in ``Columns.WIRE`` order);
``Batch`` adds what the training process stages for digesting. Flat lists of numbers and strings: no
container object per record, so a long step gives Python's garbage collector nothing new to traverse.

Record ``i`` has inputs ``ins[in_end[i-1]:in_end[i]]`` and outputs likewise: references, each a (slot,
digest header) pair in ``ref_slot``/``ref_head`` (``NO_REF``: uninitialised memory). A slot is an entry
of a chunk in ``packs`` (``slot_chunk`` >= 0, ``slot_entry``), a tensor (``slot_chunk`` -1, ``slot_entry``
counting the tensors that ``tensors`` expands to: each entry a tensor, or (copy, sizes, keep): the pieces
``keep`` of ``copy.split(sizes)``), or a state tensor (``slot_chunk`` ``HASHED``, ``slot_entry`` its index
in ``hashed``), whose digest is its state checksum (docs/formats.md, trace streams), not its lanes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

from samestep.digests import Packed

__all__ = ["HASHED", "NO_REF", "Batch", "Columns", "expand"]

_versions = operator.attrgetter("_version")

NO_REF = -1  # the reference of uninitialised memory: digest UNINIT
HASHED = -2  # the ``slot_chunk`` of a state tensor: digested by the step's state checksum pass


@dataclass(slots=True)
class Columns:
    """The record columns of a batch: the stream's columns, and the references they point at."""

    first_seq: int  # the sequence number of record 0
    step: list[int] = field(default_factory=list)
    mb: list[int] = field(default_factory=list)
    phase: list[str] = field(default_factory=list)
    scope: list[str] = field(default_factory=list)
    op: list[str] = field(default_factory=list)
    occ: list[int] = field(default_factory=list)
    ins: list[int] = field(default_factory=list)  # input references, record after record
    in_end: list[int] = field(default_factory=list)  # where each record's inputs end in ``ins``
    outs: list[int] = field(default_factory=list)
    out_end: list[int] = field(default_factory=list)
    ref_slot: list[int] = field(default_factory=list)  # per reference: the slot holding its bytes
    ref_head: list[bytes] = field(default_factory=list)  # per reference: its digest header
    slot_chunk: list[int] = field(default_factory=list)  # per slot: its chunk in ``packs``, -1: a tensor, or HASHED
    slot_entry: list[int] = field(default_factory=list)  # per slot: its entry in that chunk, or tensor index

    WIRE: ClassVar[tuple[str, ...]]  # the fields in the order they travel (see ``wire``)

    def wire(self) -> tuple:
        """The columns as a tuple of plain lists (``marshal`` writes it; ``Columns(*t)`` reads it back)."""
        return tuple(getattr(self, name) for name in Columns.WIRE)


Columns.WIRE = tuple(f.name for f in fields(Columns))


@dataclass(slots=True)
class Batch(Columns):
    """The columns, and the tensors staged for them."""

    packs: list[Packed] = field(default_factory=list)  # chunks of copies
    tensors: list[torch.Tensor | tuple] = field(default_factory=list)  # whole tensors, or (copy, sizes, keep)
    expanded: int = 0  # how many tensors ``tensors`` expands to
    # Live tensors digested without a copy that must not change before (``copy="checked"``): each one
    # (also in ``tensors``, or the buffer a (buffer, sizes, keep) entry there cuts), its version when
    # recorded and its record's index here. Flat lists: a tuple per tensor would give the garbage
    # collector hundreds of objects more per step to track.
    check_live: list[torch.Tensor] = field(default_factory=list)
    check_version: list[int] = field(default_factory=list)
    check_record: list[int] = field(default_factory=list)
    # Tensors the process worker need not describe again: index in ``tensors`` of the first -> the
    # descriptions of it and those after it (a state plan's: see step_level.StatePlan).
    described: dict[int, list[tuple]] = field(default_factory=dict)
    # State tensors (parameters, optimizer state) digested by their state checksum, where they lie: the
    # step's pass (``checksums.StepChecksums``, the step) that the receipts share; for the process worker,
    # (description, checksum header) of ``hashed`` from an index on (a state plan's), as ``described``.
    hashed: list[torch.Tensor] = field(default_factory=list)
    state_pass: tuple | None = None
    hashed_described: dict[int, list[tuple]] = field(default_factory=dict)

    def changed(self) -> list[int]:
        """The checks (indices) whose live tensor was changed in place since it was recorded."""
        now = list(map(_versions, self.check_live))
        if now == self.check_version:  # as usual: one comparison of two lists
            return []
        return [k for k, (a, b) in enumerate(zip(now, self.check_version)) if a != b]

    def devices(self) -> set[torch.device]:
        """The devices its staged tensors lie on."""
        return (
            {x.buf.device for x in self.packs}
            | {t.device for t in self.hashed}
            | {t.device if isinstance(t, torch.Tensor) else t[0].device for t in self.tensors}
        )


def expand(entries: list) -> list[torch.Tensor]:
    """The tensors a batch's ``tensors`` entries stand for: a tensor, or (copy, sizes, keep): the pieces
    ``keep`` of ``copy.split(sizes)`` (one operation for a whole gradient buffer)."""
    out: list[torch.Tensor] = []
    for t in entries:
        if isinstance(t, torch.Tensor):
            out.append(t)
        else:
            pieces = t[0].split(t[1])
            out.extend(pieces[k] for k in t[2])
    return out
