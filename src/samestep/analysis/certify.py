"""``certify_trace``: is a run's trace complete enough to diff?"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from samestep.analysis.diff import DiffError, load_metrics, load_run
from samestep.tracing.selection import format_selection, parse_selection
from samestep.tracing.stream import END, iter_stream, stream_segments

__all__ = ["certify_trace"]


def certify_trace(run: str | Path) -> dict[str, Any]:
    """Checks that every selected rank and step has records, each step finished (its ``step.end``
    record: a step that raised, or a run killed in it, has none), each stream's sequence is contiguous,
    no tail is torn, and deterministic mode was on throughout.

    Returns:
        ``{"complete": bool, "problems": [...], "ranks": {rank: {"records", "steps"}}}``.

    Raises:
        DiffError: ``run`` is not a run directory.
    """
    run = Path(run)
    doc = load_run(run)
    problems: list[str] = []
    cfg = doc.get("config", {})
    tcfg = cfg.get("trace", {})
    if doc.get("determinism") is None:
        problems.append(
            "deterministic mode is not recorded in run.json "
            + (
                "(samestep.enable() was not in force when samestep.trace() started)"
                if doc.get("written_by") == "samestep.trace"
                else "(the run had determinism.enabled=false)"
            )
        )
    changed = doc.get("determinism_changed")
    if changed is not None:
        problems.append(
            f"deterministic mode stopped holding at step {changed.get('step')} ("
            + ", ".join(f"{name}: {a!r} -> {b!r}" for name, (a, b) in changed.get("knobs", {}).items())
            + ")"
        )
    if tcfg.get("level", "off") == "off":
        problems.append("the run was not traced (trace.level=off)")
    world = max([doc.get("layout", {}).get("world_size", 1)] + [r.get("world_size", 1) for r in doc.get("resumes", [])])
    wanted_ranks = parse_selection(tcfg.get("ranks", "all"), "trace.ranks")
    ranks = [r for r in range(world) if wanted_ranks is None or r in wanted_ranks]
    # The steps that ran: from metrics.jsonl; a run of the user's own loop has none, so there every selected
    # step up to the last one any rank recorded must be there
    metrics = load_metrics(run)
    last_step = max((m["step"] for m in metrics), default=0)
    wanted_steps = parse_selection(tcfg.get("steps", "all"), "trace.steps")
    per_rank: dict[str, Any] = {}
    seen_by_rank: dict[int, set[int]] = {}
    for rank in ranks:
        segments = stream_segments(run, rank)
        if not segments:
            problems.append(f"rank {rank}: no trace stream ({run / 'trace'})")
            continue
        last_seen, ended, counts = _read_segments(segments, problems)
        records = sum(counts)
        seen = set(last_seen)
        seen_by_rank[rank] = seen
        unfinished = sorted(s for s, k in last_seen.items() if (k, s) not in ended)
        if unfinished:
            problems.append(
                f"rank {rank}: step(s) {format_selection(unfinished)} did not finish (no {END} record: "
                "the step raised, or the run was killed in it)"
            )
        per_rank[str(rank)] = {"records": records, "steps": format_selection(seen), "segments": len(segments)}
        if rank == 0 and doc.get("written_by") == "samestep.trace":
            problems.extend(_closes(doc, counts, ended))
    if not metrics:
        last_step = max((max(seen) for seen in seen_by_rank.values() if seen), default=0)
    steps = {s for s in range(1, last_step + 1) if wanted_steps is None or s in wanted_steps}
    for rank, seen in seen_by_rank.items():
        missing = steps - seen
        if missing:
            problems.append(f"rank {rank}: no records for step(s) {format_selection(missing)}")
    return {
        "complete": not problems,
        "problems": problems,
        "ranks": per_rank,
        "run": str(run),
        "selected_steps": format_selection(steps),
        "selected_ranks": ranks,
    }


def _read_segments(segments: list, problems: list[str]) -> tuple[dict[int, int], set[tuple[int, int]], list[int]]:
    """Reads a rank's stream segments in order: each step's last segment (a resume re-runs steps), the
    (segment, step) pairs closed by a step.end record, and each segment's record count; a sequence gap or a
    torn tail is added to ``problems``."""
    last_seen: dict[int, int] = {}
    ended: set[tuple[int, int]] = set()
    counts = []
    for k, seg in enumerate(segments):
        try:
            _, batches, torn = iter_stream(seg)
            expected = 0
            jumped = False
            for batch in batches:
                seq = batch.column(0).to_numpy()
                batch_steps = batch.column(1).to_numpy()
                for s in np.unique(batch_steps).tolist():
                    last_seen[s] = k
                ends = batch_steps[(batch.column(5).to_numpy(zero_copy_only=False) == END)]
                ended.update((k, int(s)) for s in ends)
                want = np.arange(expected, expected + seq.size)
                if not jumped and seq.size and not np.array_equal(seq, want):
                    bad = int(np.flatnonzero(seq != want)[0])
                    problems.append(f"{seg.name}: sequence jumps from {expected + bad - 1} to {int(seq[bad])}")
                    jumped = True
                expected += seq.size
            counts.append(expected)
            problems.extend(f"{seg.name}: {t}" for t in torn)
        except ValueError as e:
            raise DiffError(str(e)) from None
    return last_seen, ended, counts


def _closes(doc: dict[str, Any], counts: list[int], ended: set[tuple[int, int]]) -> list[str]:
    """A run of the user's own loop has no metrics to say which steps ran: rank 0's recorder records in
    run.json each segment it closed, the records it holds and the step whose context raised, if one did
    (not re-run and finished in a later segment). A segment that a kill ended and a resume followed needs no
    close (the later segments' steps are checked like any); the last one does."""
    closes = {c.get("segment"): c for c in doc.get("closes", [])}
    last = len(counts) - 1
    problems = (
        []
        if last in closes
        else [
            f"rank 0's trace segment {last} was not closed: the run was killed, or is still running, so steps after "
            "its last recorded one may be missing"
        ]
    )
    for k, close in sorted(closes.items()):
        if k is not None and 0 <= k <= last and "records" in close and close["records"] != counts[k]:
            problems.append(
                f"rank 0's trace segment {k} holds {counts[k]} records; its recorder closed it with "
                f"{close['records']}: the stream was cut or added to"
            )
        failed = close.get("failed_step")
        if failed is not None and not any((later, failed) in ended for later in range(k + 1, last + 1)):
            problems.append(f"step {failed} raised (segment {k}): the run did not finish it")
    return problems
