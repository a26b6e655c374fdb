"""What a diff found, in words: ``Divergence`` (the first differing record of one rank) and the summaries
``samestep diff`` prints, each naming the first step anything differs at, what was compared, and what was
not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from samestep.tracing.selection import format_selection

__all__ = [
    "Divergence",
    "absorbed_summary",
    "first_seen_summary",
    "identical_summary",
    "lead",
    "no_origin_summary",
    "origin_summary",
    "partial_verdict",
]


@dataclass(slots=True)
class Divergence:
    """The first differing record of one rank."""

    rank: int
    # "origin" (all inputs matched), "receiver" (an input differed), "first_seen" (a record with no inputs,
    # as at step and module level: where the difference was first seen, not what made it) or "structural"
    kind: str
    step: int
    microbatch: int
    phase: str
    scope: str
    op: str
    occurrence: int
    inputs_matched: bool | None  # None: the record has no inputs to match
    other: dict[str, Any] | None = None  # run B's record at that position (structural only)
    note: str = ""


def first_seen_summary(first_seen: Divergence, receivers: list[int]) -> str:
    """Where a difference was first seen by a level without inputs, and the ranks that received it."""
    return (
        f"first difference seen: step {first_seen.step}, rank {first_seen.rank}, microbatch "
        f"{first_seen.microbatch}, `{first_seen.op}` of `{first_seen.scope or '<root>'}` ({first_seen.phase})"
        + (f"; rank(s) {format_selection(receivers)} received it through a collective" if receivers else "")
        + f". {first_seen.note}"
    )


def identical_summary(
    metric_steps: int,
    records: int,
    ranks: int,
    final_compared: bool,
    receipt_steps: int = 0,
    receipt_states: bool = True,
    verdict: str = "identical",
) -> str:
    """What was compared and matched (a run of the user's own loop has its trace only: no metrics.jsonl), after
    the ``verdict`` ("identical", or identical over some of the steps)."""
    parts = []
    if metric_steps:
        parts.append(f"the metric bits of {metric_steps} step(s)")
    if receipt_steps:
        what = (
            "state checksums"
            if receipt_states
            else "loss and grad-norm bits; their states are of other shards or hashes"
        )
        parts.append(f"the receipts ({what}) of {receipt_steps} step(s)")
    if records:
        parts.append(f"{records} trace records on {ranks} rank(s)")
    if final_compared:
        parts.append("the final state digest")
    return (
        f"{verdict}: "
        + ", ".join(parts[:-1])
        + (" and " if len(parts) > 1 else "")
        + parts[-1]
        + " match"
        + ("" if metric_steps else " (no metrics.jsonl)")
    )


def origin_summary(origin: Divergence, origins: list[Divergence], compared: list[int]) -> str:
    """Names the origin op, and whether every compared rank has it (a kernel) or only some (a reduction)."""
    o_ranks = sorted(d.rank for d in origins if (d.op, d.scope, d.phase) == (origin.op, origin.scope, origin.phase))
    where = f"`{origin.op}` in `{origin.scope or '<root>'}` {origin.phase}"
    summary = (
        f"first divergence: step {origin.step}, rank {origin.rank}, microbatch {origin.microbatch}, {where}"
        " — all inputs matched, output differs: this op is the origin"
    )
    if len(compared) > 1:
        if o_ranks == compared:
            summary += f"; the same origin on all {len(o_ranks)} ranks: a nondeterministic kernel"
        else:
            summary += (
                f"; origin on rank(s) {format_selection(o_ranks)} only, of {len(compared)} "
                f"({format_selection(compared)}): look at reduction order or topology rather than a kernel"
            )
    if origin.note:
        summary += f". {origin.note}"
    return summary


def no_origin_summary(
    first: Divergence | None, metric_diff: dict[str, Any] | None, finals: list[str | None], traced: bool
) -> str:
    """What differs when no record is an origin, and how to find it."""
    if first is not None:
        return (
            f"no origin found: the first differing record (rank {first.rank}, step {first.step}, `{first.op}` "
            f"in `{first.scope}`) already had a differing input; {first.note}"
        )
    if metric_diff is None:
        return (
            "no origin found: every metric bit matches but the final state digests differ "
            f"({finals[0][:16]} vs {finals[1][:16]}); rerun both with --set trace.level=op to find the op"
        )
    return (
        f"no origin found: metrics first differ at step {metric_diff['step']} "
        f"({', '.join(metric_diff['fields'])}) but "
        + (
            f"no trace was recorded; rerun both with --set trace.level=op --set trace.steps=1-{metric_diff['step']}"
            if not traced
            else f"the traced records match; trace steps up to {metric_diff['step']} "
            f"(--set trace.steps=1-{metric_diff['step']}) or a finer trace.level"
        )
    )


def lead(
    step: int, named: Divergence | None, metric_diff: dict[str, Any] | None, receipt_diff: dict[str, Any] | None
) -> str:
    """How a diverged summary begins: the first step anything differs at, what differs there when the traces
    first differ later (or not at all: a receipt of the state after the update differs a step before the next
    forward sees it), so the text names the step the JSON's ``first_divergent_step`` and the report do."""
    if named is not None and named.step == step:
        return f"diverged at step {step}: "
    what = []
    if receipt_diff is not None and receipt_diff["step"] == step:
        what.append(f"the receipts' {', '.join(receipt_diff['fields'])} differ (rank {receipt_diff['rank']})")
    if metric_diff is not None and metric_diff["step"] == step:
        what.append(f"the metrics' {', '.join(metric_diff['fields'])} differ")
    later = f"; the traces first differ at step {named.step}: " if named is not None else "; "
    return f"diverged at step {step}: {' and '.join(what)}{later}"


def absorbed_summary(receipted: set[int], final_compared: bool) -> str:
    """What a divergence of trace records alone adds: rounding absorbed it before any step's state, so the
    training's bits agree this time while its ops' do not (docs/design.md, words: divergence)."""
    what = [f"the receipts of all {len(receipted)} step(s)"] if receipted else []
    what += ["the final state digest"] if final_compared else []
    return (
        f". Rounding absorbed it: {' and '.join(what)} agree, so the training's bits are the same this time and "
        "only its op records differ; an op that differs may not be absorbed in the next run"
    )


def partial_verdict(held: tuple[set[int], ...], gaps: list[str]) -> str:
    """The verdict of runs that agree on what both hold: over which steps of which, and less which receipts."""
    return f"identical over steps {format_selection(held[0])} of {format_selection(held[1])}" + (
        ", less the receipts one run lacks" if gaps else ""
    )
