"""``diff_runs``: the first step whose metrics differ, and per rank the first op that diverged.

Metrics bits are compared first. Then, per rank, the two streams are walked in lockstep, in bounded
memory (fixed-size chunks compared with vectorised Arrow kernels). Each rank's first record whose
identity differs is a *structural* divergence (the code paths differ) and is reported before any
numeric claim; otherwise its first record whose outputs differ is the *origin* when all its inputs
matched, else a *receiver* of damage done outside the traced window. Sequence numbers are never
compared across ranks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from samestep.analysis.comparable import DiffError, check_comparable, ranks_to_compare, traced_alike
from samestep.analysis.divergence import (
    Divergence,
    absorbed_summary,
    first_seen_summary,
    identical_summary,
    lead,
    no_origin_summary,
    origin_summary,
    partial_verdict,
)
from samestep.analysis.layouts import rank_coordinates, steps_on_other_layouts
from samestep.analysis.rank_streams import RankResult, compare_rank
from samestep.analysis.receipt_diff import receipts_compared
from samestep.records.final import final_digest
from samestep.records.metrics import read_metrics
from samestep.records.rundir import RunDirError, layout_at, read_run
from samestep.tracing.selection import format_selection

__all__ = ["DiffError", "Divergence", "diff_runs", "load_metrics", "load_run"]


def load_run(path: Path) -> dict[str, Any]:
    """A run's run.json, or a DiffError saying why it cannot be read."""
    try:
        return read_run(path)
    except RunDirError as e:
        raise DiffError(str(e)) from None


def load_metrics(path: Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl rows, or a DiffError naming the damaged line."""
    try:
        return read_metrics(path)
    except RunDirError as e:
        raise DiffError(str(e)) from None


def _first_metric_difference(a: list[dict], b: list[dict], steps: set[int] | None, up_to: int) -> dict[str, Any] | None:
    """The first step, by step number, up to ``up_to`` (the last step both runs reached), whose loss or
    grad-norm bits differ, or that one run has and the other lacks (``fields`` ["missing"]: a gap)."""
    rows_a, rows_b = ({r["step"]: r for r in rows} for rows in (a, b))
    for step in sorted(set(rows_a) | set(rows_b)):
        if (steps is not None and step not in steps) or step > up_to:
            continue
        ra, rb = rows_a.get(step), rows_b.get(step)
        if ra is None or rb is None:
            return {
                "step": step,
                "fields": ["missing"],
                "a": {"has_step": ra is not None},
                "b": {"has_step": rb is not None},
            }
        fields = [f for f in ("loss_hex", "grad_norm_hex") if ra.get(f) != rb.get(f)]
        if fields:
            return {
                "step": step,
                "fields": fields,
                "a": {f: ra.get(f) for f in fields},
                "b": {f: rb.get(f) for f in fields},
            }
    return None


def diff_runs(
    run_a: str | Path,
    run_b: str | Path,
    *,
    ranks: set[int] | None = None,
    steps: set[int] | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Compares two runs: metrics bits, then traces. See the module docstring.

    Returns:
        A JSON-able report: ``identical``, ``first_divergent_step``, ``origin``, ``per_rank``,
        ``metrics``, ``summary`` and ``notes``.

    Raises:
        DiffError: a run directory is missing or malformed, or the runs' configs or environments
            differ (unless ``force``), or their traces have other schema versions.
    """
    compared = _compare(Path(run_a), Path(run_b), ranks, steps, force)
    return _render(compared, _decide(compared, steps))


@dataclass(slots=True)
class _Compared:
    """What two runs' records gave, before any verdict: each kind of record's first difference, and how much
    of each was compared."""

    doc_a: dict[str, Any]
    notes: list[str]
    metric_diff: dict[str, Any] | None
    metric_steps: int
    receipt_diff: dict[str, Any] | None
    receipt_steps: int
    receipt_states: bool
    receipted: set[int]  # the steps both runs hold receipts of
    gaps: list[str]  # receipts one run's files hold and the other's lack
    finals: list[str | None]
    final_compared: bool
    per_rank: dict[int, RankResult]
    held: tuple[set[int], ...]  # steps both runs hold, either holds, A's, B's


@dataclass(slots=True)
class _Verdict:
    """What a comparison means: one of "identical", "identical over steps ... of ...", "nothing compared" or
    "diverged", the summary that says it, and the records it names."""

    verdict: str
    identical: bool
    partial: bool
    summary: str
    first_step: int | None
    origin: Divergence | None
    first_seen: Divergence | None
    first: Divergence | None
    absorbed: bool  # only trace records differ: every step's state after them agrees (docs/design.md, words)


def _compare(run_a: Path, run_b: Path, ranks: set[int] | None, steps: set[int] | None, force: bool) -> _Compared:
    """Loads both runs once, refuses what cannot be compared, and compares metrics, receipts, final digests and
    each rank's trace on what both hold."""
    doc_a, doc_b = load_run(run_a), load_run(run_b)
    notes: list[str] = []
    check_comparable(doc_a, doc_b, force, notes)
    metrics_a, metrics_b = load_metrics(run_a), load_metrics(run_b)
    run_steps = {r.get("step") for r in metrics_a} | {r.get("step") for r in metrics_b}
    if steps is not None and run_steps and not steps & run_steps:
        raise DiffError(
            f"--steps {format_selection(steps)}: neither run has these steps (A: "
            f"{format_selection(r['step'] for r in metrics_a) or 'none'}, B: "
            f"{format_selection(r['step'] for r in metrics_b) or 'none'}); choose steps the runs have"
        )
    # steps one run holds past the other's last are not compared (the verdict names them), not a divergence
    last_both = min(max((r["step"] for r in metrics_a), default=0), max((r["step"] for r in metrics_b), default=0))
    metric_diff = _first_metric_difference(metrics_a, metrics_b, steps, last_both)
    try:
        receipt_diff, receipt_steps, receipt_states, receipted, gaps = receipts_compared(
            run_a, run_b, steps, lambda step: layout_at(doc_a, step) == layout_at(doc_b, step)
        )
    except ValueError as e:  # a damaged receipts file
        raise DiffError(str(e)) from None
    notes += [f"not compared: {gap}" for gap in gaps]
    both = {r["step"] for r in metrics_a} & {r["step"] for r in metrics_b}
    finals = [final_digest(run_a), final_digest(run_b)]
    final_compared = None not in finals and steps is None
    common = ranks_to_compare(run_a, run_b, ranks, notes)
    trace_steps, levels = traced_alike(doc_a, doc_b, steps, notes) if common else (steps, (None, None))
    written = run_steps | receipted[0] | receipted[1]  # a loop of one's own logs no metrics.jsonl: its receipts say
    other = (
        steps_on_other_layouts(
            doc_a, doc_b, written if trace_steps is None else trace_steps, notes, final=final_compared
        )
        if common
        else set()
    )
    if other:  # their records do not pair up
        trace_steps = (written if trace_steps is None else trace_steps) - other
        common = common if trace_steps else []
    per_rank = _compare_ranks(run_a, run_b, common, trace_steps, levels, notes)
    return _Compared(
        doc_a,
        notes,
        metric_diff,
        sum(1 for step in both if steps is None or step in steps),
        receipt_diff,
        receipt_steps,
        receipt_states,
        receipted[0] & receipted[1],
        gaps,
        finals,
        final_compared,
        per_rank,
        _held_steps(receipted, metrics_a, metrics_b, per_rank, steps),
    )


def _decide(c: _Compared, steps: set[int] | None) -> _Verdict:
    """The verdict and its summary: a structural difference before any numeric claim, then the origin, the
    record first seen to differ, the receipts, or what differed without an origin; agreement is "identical"
    only when both runs hold the same steps and something was compared."""
    divs = [res.divergence for res in c.per_rank.values() if res.divergence is not None]
    structural = [d for d in divs if d.kind == "structural"]
    origins = [d for d in divs if d.kind == "origin"]
    first = min(divs, key=lambda d: (d.kind != "structural", d.step, d.rank)) if divs else None
    origin = min(origins, key=lambda d: (d.step, d.microbatch, d.rank)) if origins and not structural else None
    # Without an origin, the earliest record without inputs that differs (step and module level) is where the
    # difference was first seen: on the rank where it began, if the others only received it
    seen = [d for d in divs if d.kind == "first_seen"]
    first_seen = min(seen, key=lambda d: (d.step, d.microbatch, d.rank)) if seen and not structural else None
    records = sum(r.records for r in c.per_rank.values())
    final_differs = c.final_compared and c.finals[0] != c.finals[1]
    same = c.metric_diff is None and c.receipt_diff is None and not divs and not final_differs
    # Nothing compared is no evidence of sameness: such a diff says so (exit 2), never "identical"
    nothing = same and not (c.metric_steps or records or c.final_compared or c.receipt_steps)
    # Steps that one run holds and the other does not make agreement partial: "identical over steps 1-6 of
    # 1-20", never plain "identical"; so do receipts that one run's files hold and the other's lack
    partial = same and not nothing and (c.held[0] != c.held[1] or bool(c.gaps))
    identical = same and not nothing and not partial
    verdict = (
        "nothing compared"
        if nothing
        else "identical"
        if identical
        else partial_verdict(c.held, c.gaps)
        if partial
        else "diverged"
    )
    if c.per_rank and not records and steps is not None:
        c.notes.append(
            f"no trace records fall in --steps {format_selection(steps)}: only those steps' metrics "
            "were compared (the runs' trace.steps selects which steps were traced)"
        )
    if nothing:
        summary = (
            "nothing compared: the runs have no metrics, final state or trace records in common"
            + (" (see the notes)" if c.notes else "")
            + "; this is no evidence that they are the same"
        )
    elif identical or partial:
        held = (
            ""
            if identical
            else (
                f" (A holds {format_selection(c.held[2]) or 'none'}, B "
                f"{format_selection(c.held[3]) or 'none'}" + "".join(f"; {g}" for g in c.gaps) + ")"
            )
        )
        summary = identical_summary(
            c.metric_steps,
            records,
            len(c.per_rank),
            c.final_compared,
            c.receipt_steps,
            c.receipt_states,
            verdict=verdict + held,
        )
    elif structural:
        d = structural[0]
        summary = (
            f"structural divergence on rank {d.rank} at step {d.step}: {d.note} "
            f"(A: {d.phase} {d.scope!r} {d.op}#{d.occurrence}; B: {d.other})"
        )
    elif origin is not None:
        summary = origin_summary(origin, origins, sorted(c.per_rank))
    elif first_seen is not None:
        summary = first_seen_summary(first_seen, sorted(d.rank for d in divs if d.kind == "receiver"))
    elif (
        c.receipt_diff is not None
        and (c.metric_diff is None or c.receipt_diff["step"] < c.metric_diff["step"])
        and (first is None or c.receipt_diff["step"] < first.step)
    ):
        summary = (
            f"diverged at step {c.receipt_diff['step']}: the receipts' {', '.join(c.receipt_diff['fields'])} "
            f"differ (rank {c.receipt_diff['rank']}); samestep bisect replays that step and names the op"
        )
    else:
        summary = no_origin_summary(first, c.metric_diff, c.finals, bool(c.per_rank))
    named = structural[0] if structural else origin or first_seen or first
    first_step = min(
        [d.step for d in divs]
        + ([c.metric_diff["step"]] if c.metric_diff else [])
        + ([c.receipt_diff["step"]] if c.receipt_diff else []),
        default=None,
    )
    if first_step is not None and not summary.startswith("diverged at step"):
        summary = lead(first_step, named, c.metric_diff, c.receipt_diff) + summary
    # a difference of trace records alone, with the state compared at or after its step and the same
    absorbed = (
        named is not None
        and not structural
        and named.phase != "step"
        and c.metric_diff is None
        and c.receipt_diff is None
        and not final_differs
        and ((c.receipt_states and max(c.receipted, default=0) >= named.step) or c.final_compared)
    )
    if absorbed:
        summary = summary.rstrip(".") + absorbed_summary(c.receipted if c.receipt_states else set(), c.final_compared)
    coords = rank_coordinates(layout_at(c.doc_a, named.step), named.rank) if named is not None else None
    if coords:
        c.notes.append(f"rank {named.rank} at step {named.step} is {coords} of the layout that wrote it")
    return _Verdict(verdict, identical, partial, summary, first_step, origin, first_seen, first, absorbed)


def _render(c: _Compared, v: _Verdict) -> dict[str, Any]:
    """The JSON-able report ``samestep diff --json`` prints and the text verdict is read from."""
    return {
        "identical": v.identical,
        "partial": v.partial,
        "verdict": v.verdict,
        "compared": {
            "metric_steps": c.metric_steps,
            "trace_records": sum(r.records for r in c.per_rank.values()),
            "ranks": len(c.per_rank),
            "final_state": c.final_compared,
            "receipt_steps": c.receipt_steps,
            "receipt_states": c.receipt_states,
            "steps": format_selection(c.held[0]),
            "steps_held": format_selection(c.held[1]),
        },
        "first_divergent_step": v.first_step,
        "absorbed": v.absorbed,
        "metrics": c.metric_diff,
        "receipts": c.receipt_diff,
        "final_state_digests": c.finals,
        "origin": asdict(v.origin) if v.origin is not None else None,
        "first_seen": asdict(v.first_seen) if v.first_seen is not None and v.origin is None else None,
        "first_difference": asdict(v.first) if v.first is not None else None,
        "per_rank": {
            str(r): {
                "records_compared": res.records,
                "notes": res.notes,
                "missing_steps": res.missing,
                "divergence": asdict(res.divergence) if res.divergence else None,
            }
            for r, res in c.per_rank.items()
        },
        "not_compared": c.gaps,
        "summary": v.summary,
        "notes": c.notes,
    }


def _compare_ranks(
    run_a: Path,
    run_b: Path,
    ranks: list[int],
    steps: set[int] | None,
    levels: tuple[str | None, str | None],
    notes: list[str],
) -> dict[int, RankResult]:
    """Each rank's streams compared (see ``compare_rank``), its notes (torn tails, records left out) in ``notes``."""
    per_rank: dict[int, RankResult] = {}
    for r in ranks:
        try:
            per_rank[r] = compare_rank(run_a, run_b, r, steps, levels)
        except ValueError as e:
            raise DiffError(str(e)) from None
        notes.extend(per_rank[r].notes)
        for name, lacking in (per_rank[r].missing or {}).items():
            if lacking:
                notes.append(
                    f"rank {r}: run {name}'s trace has no records of step(s) {format_selection(lacking)}, "
                    "which the other run's has (lost when the run was killed before they were written, "
                    "or not traced): compared on the steps both hold"
                )
    return per_rank


def _held_steps(
    receipted: list[set[int]],
    metrics_a: list[dict],
    metrics_b: list[dict],
    per_rank: dict[int, RankResult],
    steps: set[int] | None,
) -> tuple[set[int], ...]:
    """(steps both runs hold, steps either holds, A's, B's): from metrics, receipts and the traces."""
    held = [{r["step"] for r in metrics_a} | receipted[0], {r["step"] for r in metrics_b} | receipted[1]]
    for res in per_rank.values():
        held[0] |= res.held[0]
        held[1] |= res.held[1]
    if steps is not None:
        held = [h & steps for h in held]
    return held[0] & held[1], held[0] | held[1], held[0], held[1]
