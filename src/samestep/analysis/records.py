"""A rank's trace records as ``samestep diff`` reads them: over all its stream segments (a resume's
re-run steps from the later one), cut to steps and a level (and without the state records where two
runs' streams digest them otherwise: ``state_left_out``), and re-cut into tables of ``CHUNK`` rows for
vectorised comparison in bounded memory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from samestep.tracing.stream import SCHEMA, iter_stream, state_records, stream_segments

__all__ = ["CHUNK", "chunks", "level_mask", "records", "state_left_out", "steps_recorded"]

CHUNK = 65_536

# The records a stream traced at a higher level holds beyond a lower level's: kept are step records (phase
# "step") at step level, and module records too at module level.
_MODULE_OPS = pa.array(["output", "grad_output"])


def level_mask(batch: pa.RecordBatch, level: str) -> pa.Array:
    """The records of ``batch`` that a run traced at ``level`` (step or module) has too."""
    at_step = pc.equal(batch.column("phase"), "step")
    return at_step if level == "step" else pc.or_(at_step, pc.is_in(batch.column("op"), value_set=_MODULE_OPS))


def state_left_out(run_a: Path, run_b: Path, rank: int) -> str | None:
    """Why a rank's state records (ops "param" and "optim.<key>") cannot be compared between two runs, or
    None: each run's segments must digest them one way, the same (``stream.state_records``)."""
    kinds = [{state_records(iter_stream(seg)[0]) for seg in stream_segments(run, rank)} for run in (run_a, run_b)]
    if len(kinds[0] | kinds[1]) <= 1:
        return None
    said = ["both" if len(k) > 1 else next(iter(k), "none") for k in kinds]
    return (
        f"rank {rank}: the state records (param, optim.*) are left out: A's trace digests them by {said[0]}, "
        f"B's by {said[1]} (traces of other samestep versions); the receipts and final states compare the state"
    )


def records(
    run: Path, rank: int, steps: set[int] | None, torn: list[str], level: str | None = None, state: bool = True
) -> Iterator[pa.RecordBatch]:
    """A rank's records over all its segments; steps re-run after a resume come from the later segment.
    ``level``: only the records a run traced at that (lower) level has. ``state`` False: without the state
    records (see ``state_left_out``)."""
    segments = stream_segments(run, rank)
    firsts: list[int | None] = []
    for seg in segments:
        _, batches, _ = iter_stream(seg)
        first = next(batches, None)
        firsts.append(int(first.column(1)[0].as_py()) if first is not None and first.num_rows else None)
    for i, seg in enumerate(segments):
        later = [f for f in firsts[i + 1 :] if f is not None]
        cutoff = min(later) if later else None
        _, batches, seg_torn = iter_stream(seg)
        for batch in batches:
            mask = None
            if cutoff is not None:
                mask = pc.less(batch.column(1), cutoff)
            if steps is not None:
                sel = pc.is_in(batch.column(1), value_set=pa.array(sorted(steps), pa.int32()))
                mask = sel if mask is None else pc.and_(mask, sel)
            if level is not None:
                sel = level_mask(batch, level)
                mask = sel if mask is None else pc.and_(mask, sel)
            if not state:
                ops = batch.column("op")
                sel = pc.invert(pc.or_(pc.equal(ops, "param"), pc.starts_with(ops, "optim.")))
                mask = sel if mask is None else pc.and_(mask, sel)
            yield batch if mask is None else batch.filter(mask)
        torn.extend(f"{seg}: {t}" for t in seg_torn)


def chunks(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.Table]:
    """Re-cuts a batch stream into tables of CHUNK rows (the last may be shorter)."""
    pending: list[pa.RecordBatch] = []
    n = 0
    for b in batches:
        if not b.num_rows:
            continue
        pending.append(b)
        n += b.num_rows
        while n >= CHUNK:
            table = pa.Table.from_batches(pending, schema=SCHEMA).combine_chunks()
            yield table.slice(0, CHUNK)
            rest = table.slice(CHUNK)
            pending, n = (rest.to_batches() if rest.num_rows else []), rest.num_rows
    if n:
        yield pa.Table.from_batches(pending, schema=SCHEMA).combine_chunks()


def steps_recorded(run: Path, rank: int, steps: set[int] | None, level: str | None) -> set[int]:
    """The steps of which a rank's stream holds records (within ``steps``, at ``level``)."""
    found: set[int] = set()
    for batch in records(run, rank, steps, [], level):
        found.update(pc.unique(batch.column(1)).to_pylist())
    return found
