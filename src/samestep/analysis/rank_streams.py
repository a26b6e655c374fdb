"""One rank's two streams walked in lockstep, in bounded memory (fixed-size chunks compared with vectorised
Arrow kernels): the first record whose identity differs (a structural divergence) or whose outputs differ, an
origin when all its inputs matched, else a receiver. Sequence numbers are never compared across ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from samestep.analysis.divergence import (
    Divergence,
)
from samestep.analysis.records import chunks, records, state_left_out, steps_recorded
from samestep.tracing.stream import KEY

__all__ = ["COPY_LIKE", "RankResult", "compare_rank"]


# Ops that only move or reinterpret bytes: if one "diverges" with matching inputs, its input was
# changed by something the dispatcher never saw.
COPY_LIKE = (
    "aten.view",
    "aten._unsafe_view",
    "aten.reshape",
    "aten.clone",
    "aten.copy_",
    "aten._to_copy",
    "aten.contiguous",
    "aten.detach",
    "aten.alias",
    "aten.t.",
    "aten.transpose",
    "aten.permute",
    "aten.expand",
    "aten.slice",
    "aten.select",
    "aten.split",
    "aten.unsqueeze",
    "aten.squeeze",
    "aten.as_strided",
    "aten.lift_fresh",
)


@dataclass(slots=True)
class RankResult:
    rank: int
    records: int = 0
    divergence: Divergence | None = None
    notes: list[str] = field(default_factory=list)  # torn tails, records left out
    missing: dict[str, list[int]] | None = None  # run name -> steps its stream lacks and the other's holds
    held: tuple[set[int], set[int]] = (set(), set())  # the steps A's and B's streams hold


def _first_false(mask: pa.ChunkedArray | pa.Array) -> int | None:
    arr = mask.to_numpy(zero_copy_only=False) if hasattr(mask, "to_numpy") else np.asarray(mask)
    idx = np.flatnonzero(~arr.astype(bool))
    return int(idx[0]) if idx.size else None


def _row(table: pa.Table, i: int) -> dict[str, Any]:
    return {k: table.column(k)[i].as_py() for k in KEY}


def _classify(rank: int, a: pa.Table, b: pa.Table, i: int, differing: int) -> Divergence:
    """Record ``i``'s kind of difference; ``differing``: how many records of its step differ (at least)."""
    row = _row(a, i)
    inputs = a.column("inputs")[i].as_py()
    matched = inputs == b.column("inputs")[i].as_py()
    op = row["op"]
    note = ""
    if not inputs and (row["phase"] == "step" or op in ("output", "grad_output")):
        level = "step" if row["phase"] == "step" else "module"
        what = (
            f"the first {'module output' if op == 'output' else 'gradient at a module'} that differs, in the "
            "order the modules ran"
            if level == "module"
            else "the first differing record in parameter order"
        )
        return Divergence(
            rank=rank,
            kind="first_seen",
            inputs_matched=None,
            **row,
            note=(
                f"{level}-level records have no inputs, so this is {what}, not a proven origin; {differing} record(s) "
                f"differ at step {row['step']} on this rank. To find the op: samestep bisect replays that step at op "
                f"level (the runs of samestep train, samestep.Run and the HF and Lightning callbacks), or trace it so "
                f"(--set trace.level=op --set trace.steps={row['step']}, or samestep.Run(..., level='op', "
                f"trace_steps='{row['step']}'))"
            ),
        )
    if matched and row["scope"] == "collective":
        # Its output also depends on the other ranks' inputs, which this stream does not hold.
        return Divergence(
            rank=rank,
            kind="receiver",
            inputs_matched=True,
            **row,
            note="a collective whose local input matched: the difference came from another rank",
        )
    if matched and op.startswith(COPY_LIKE):
        note = (
            f"{op} only moves bytes, yet its output differs while its inputs matched: the input was "
            "probably written outside the dispatcher (a custom extension or raw-pointer kernel) in "
            f"scope {row['scope']!r}, after the digest of its last recorded version"
        )
    elif not matched:
        note = (
            "an input differs that no earlier traced record produced differently: it came from outside "
            "the traced window (an earlier step, untraced data) or from a kernel outside the dispatcher; "
            "widen trace.steps to earlier steps or use trace.level=op"
        )
    return Divergence(rank=rank, kind="origin" if matched else "receiver", inputs_matched=matched, note=note, **row)


def compare_rank(
    run_a: Path, run_b: Path, rank: int, steps: set[int] | None, levels: tuple[str | None, str | None] = (None, None)
) -> RankResult:
    """``levels``: the level to cut run A's and run B's records down to (None: all of them). Steps that
    one run's stream holds and the other's does not are reported as missing (``res.missing``), and the
    streams compared on the steps both hold: a lost step is not a difference of code paths."""
    res = RankResult(rank)
    have_a, have_b = (
        steps_recorded(run, rank, steps, level) for run, level in ((run_a, levels[0]), (run_b, levels[1]))
    )
    res.held = (have_a, have_b)
    if have_a != have_b:
        res.missing = {"A": sorted(have_b - have_a), "B": sorted(have_a - have_b)}
        steps = have_a & have_b
    res.notes += [left_out] if (left_out := state_left_out(run_a, run_b, rank)) else []
    chunks_a, chunks_b = (
        chunks(records(run, rank, steps, res.notes, level, state=left_out is None))
        for run, level in ((run_a, levels[0]), (run_b, levels[1]))
    )
    while True:
        a, b = next(chunks_a, None), next(chunks_b, None)
        if a is None or b is None:
            if a is not None or b is not None:
                longer, name = (a, "A") if a is not None else (b, "B")
                row = _row(longer, 0)
                res.divergence = Divergence(
                    rank=rank,
                    kind="structural",
                    inputs_matched=False,
                    note=f"run {name} has records the other run does not (its stream is longer)",
                    **row,
                )
            return res
        n = min(a.num_rows, b.num_rows)
        a_n, b_n = a.slice(0, n), b.slice(0, n)
        same_key = None
        for col in KEY:
            eq = pc.equal(a_n.column(col), b_n.column(col))
            same_key = eq if same_key is None else pc.and_(same_key, eq)
        first_key = _first_false(same_key)
        same_out = pc.equal(a_n.column("outputs"), b_n.column("outputs"))
        first_out = _first_false(same_out)
        if first_key is not None and (first_out is None or first_key <= first_out):
            res.records += first_key
            res.divergence = Divergence(
                rank=rank,
                kind="structural",
                inputs_matched=False,
                other=_row(b_n, first_key),
                note="the two runs recorded different ops here: their code paths differ",
                **_row(a_n, first_key),
            )
            return res
        if first_out is not None:
            res.records += first_out
            step = a_n.column("step")[first_out].as_py()
            differing = pc.sum(pc.and_(pc.invert(same_out), pc.equal(a_n.column("step"), step))).as_py()
            res.divergence = _classify(rank, a_n, b_n, first_out, differing)
            return res
        res.records += n
        if a.num_rows != b.num_rows:  # different chunk lengths only happen at the end of a stream
            rest = a.slice(n) if a.num_rows > n else b.slice(n)
            res.divergence = Divergence(
                rank=rank, kind="structural", inputs_matched=False, note="one run's stream is longer", **_row(rest, 0)
            )
            return res
