"""``diff_runs``: the first step whose metrics differ, and per rank the first op that diverged.

Metrics bits are compared first. Then, per rank, the two streams are walked in lockstep, in bounded
memory (fixed-size chunks compared with vectorised Arrow kernels). Each rank's first record whose
identity differs is a *structural* divergence (the code paths differ) and is reported before any
numeric claim; otherwise its first record whose outputs differ is the *origin* when all its inputs
matched, else a *receiver* of damage done outside the traced window. Sequence numbers are never
compared across ranks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from samestep.analysis.divergence import (
    Divergence,
    first_seen_summary,
    identical_summary,
    lead,
    no_origin_summary,
    origin_summary,
    partial_verdict,
)
from samestep.analysis.layouts import rank_coordinates, steps_on_other_layouts
from samestep.analysis.receipt_diff import receipts_compared
from samestep.analysis.records import chunks, records, state_left_out, steps_recorded
from samestep.determinism.env import compare_environments, numerics_differences
from samestep.hashing.state import dotted
from samestep.records.rundir import (
    NUMERICS_NEUTRAL,
    RunDirError,
    determinism_diff,
    final_digest,
    layout_at,
    read_metrics,
    read_run,
    run_writer,
)
from samestep.tracing.selection import LEVELS, format_selection, parse_selection
from samestep.tracing.stream import KEY, traced_ranks

__all__ = ["DiffError", "Divergence", "diff_runs", "load_metrics", "load_run"]

# Config fields not compared: those that change no bit of the steps (invariant 3 for trace.*; bookkeeping for
# the rest), and trace.perturb, since a planted perturbation is what a diff is run to find.
IGNORED_CONFIG = NUMERICS_NEUTRAL | {"trace.perturb"}
# Ops that only move or reinterpret bytes: if one "diverges" with matching inputs, its input was
# changed by something the dispatcher never saw.
COPY_LIKE = ("aten.view", "aten._unsafe_view", "aten.reshape", "aten.clone", "aten.copy_", "aten._to_copy",
             "aten.contiguous", "aten.detach", "aten.alias", "aten.t.", "aten.transpose", "aten.permute",
             "aten.expand", "aten.slice", "aten.select", "aten.split", "aten.unsqueeze", "aten.squeeze",
             "aten.as_strided", "aten.lift_fresh")


class DiffError(ValueError):
    """The runs cannot be compared (missing files, other schema, other config or environment)."""


@dataclass(slots=True)
class _RankResult:
    rank: int
    records: int = 0
    divergence: Divergence | None = None
    notes: list[str] = field(default_factory=list)  # torn tails, records left out
    missing: dict[str, list[int]] | None = None  # run name -> steps its stream lacks and the other's holds
    held: tuple[set[int], set[int]] = (set(), set())  # the steps A's and B's streams hold


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


def _first_metric_difference(a: list[dict], b: list[dict], steps: set[int] | None,
                             up_to: int) -> dict[str, Any] | None:
    """The first step, by step number, up to ``up_to`` (the last step both runs reached), whose loss or
    grad-norm bits differ, or that one run has and the other lacks (``fields`` ["missing"]: a gap)."""
    rows_a, rows_b = ({r["step"]: r for r in rows} for rows in (a, b))
    for step in sorted(set(rows_a) | set(rows_b)):
        if (steps is not None and step not in steps) or step > up_to:
            continue
        ra, rb = rows_a.get(step), rows_b.get(step)
        if ra is None or rb is None:
            return {"step": step, "fields": ["missing"], "a": {"has_step": ra is not None},
                    "b": {"has_step": rb is not None}}
        fields = [f for f in ("loss_hex", "grad_norm_hex") if ra.get(f) != rb.get(f)]
        if fields:
            return {"step": step, "fields": fields, "a": {f: ra.get(f) for f in fields},
                    "b": {f: rb.get(f) for f in fields}}
    return None


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
        what = (f"the first {'module output' if op == 'output' else 'gradient at a module'} that differs, in the "
                "order the modules ran" if level == "module" else "the first differing record in parameter order")
        return Divergence(rank=rank, kind="first_seen", inputs_matched=None, **row, note=(
            f"{level}-level records have no inputs, so this is {what}, not a proven origin; {differing} record(s) "
            f"differ at step {row['step']} on this rank. To find the op: samestep bisect replays that step at op "
            f"level (the runs of samestep train, samestep.Run and the HF and Lightning callbacks), or trace it so "
            f"(--set trace.level=op --set trace.steps={row['step']}, or samestep.Run(..., level='op', "
            f"trace_steps='{row['step']}'))"))
    if matched and row["scope"] == "collective":
        # Its output also depends on the other ranks' inputs, which this stream does not hold.
        return Divergence(rank=rank, kind="receiver", inputs_matched=True, **row,
                          note="a collective whose local input matched: the difference came from another rank")
    if matched and op.startswith(COPY_LIKE):
        note = (f"{op} only moves bytes, yet its output differs while its inputs matched: the input was "
                "probably written outside the dispatcher (a custom extension or raw-pointer kernel) in "
                f"scope {row['scope']!r}, after the digest of its last recorded version")
    elif not matched:
        note = ("an input differs that no earlier traced record produced differently: it came from outside "
                "the traced window (an earlier step, untraced data) or from a kernel outside the dispatcher; "
                "widen trace.steps to earlier steps or use trace.level=op")
    return Divergence(rank=rank, kind="origin" if matched else "receiver", inputs_matched=matched, note=note, **row)


def _compare_rank(run_a: Path, run_b: Path, rank: int, steps: set[int] | None,
                  levels: tuple[str | None, str | None] = (None, None)) -> _RankResult:
    """``levels``: the level to cut run A's and run B's records down to (None: all of them). Steps that
    one run's stream holds and the other's does not are reported as missing (``res.missing``), and the
    streams compared on the steps both hold: a lost step is not a difference of code paths."""
    res = _RankResult(rank)
    have_a, have_b = (steps_recorded(run, rank, steps, level)
                      for run, level in ((run_a, levels[0]), (run_b, levels[1])))
    res.held = (have_a, have_b)
    if have_a != have_b:
        res.missing = {"A": sorted(have_b - have_a), "B": sorted(have_a - have_b)}
        steps = have_a & have_b
    res.notes += [left_out] if (left_out := state_left_out(run_a, run_b, rank)) else []
    chunks_a, chunks_b = (chunks(records(run, rank, steps, res.notes, level, state=left_out is None))
                          for run, level in ((run_a, levels[0]), (run_b, levels[1])))
    while True:
        a, b = next(chunks_a, None), next(chunks_b, None)
        if a is None or b is None:
            if a is not None or b is not None:
                longer, name = (a, "A") if a is not None else (b, "B")
                row = _row(longer, 0)
                res.divergence = Divergence(
                    rank=rank, kind="structural", inputs_matched=False,
                    note=f"run {name} has records the other run does not (its stream is longer)", **row)
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
            res.divergence = Divergence(rank=rank, kind="structural", inputs_matched=False,
                                        other=_row(b_n, first_key),
                                        note="the two runs recorded different ops here: their code paths differ",
                                        **_row(a_n, first_key))
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
            res.divergence = Divergence(rank=rank, kind="structural", inputs_matched=False,
                                        note="one run's stream is longer", **_row(rest, 0))
            return res


def _traced_alike(doc_a: dict, doc_b: dict, steps: set[int] | None,
                  notes: list[str]) -> tuple[set[int] | None, tuple[str | None, str | None]]:
    """Two runs traced at other levels or on other steps are compared on what both recorded (not
    reported as code paths that differ): the steps both traced (within ``steps``), at the lower level.

    Returns:
        The steps to compare traces on, and the level to cut run A's and run B's records down to.
    """
    ta, tb = (doc.get("config", {}).get("trace", {}) for doc in (doc_a, doc_b))
    levels: tuple[str | None, str | None] = (None, None)
    la, lb = ta.get("level"), tb.get("level")
    if la != lb and {la, lb} <= set(LEVELS) - {"off"}:
        low = min(la, lb, key=LEVELS.index)
        levels = (low if la != low else None, low if lb != low else None)
        notes.append(f"A was traced at {la} level, B at {lb}: compared at {low} level (run "
                     f"{'A' if la != low else 'B'}'s finer records are left out)")
    try:
        sa, sb = (parse_selection(t.get("steps", "all"), "trace.steps") for t in (ta, tb))
    except ValueError as e:
        raise DiffError(f"run.json: {e}") from None
    if sa != sb:
        both = sb if sa is None else sa if sb is None else sa & sb
        notes.append(f"traced steps differ (A: {'all' if sa is None else format_selection(sa)}, B: "
                     f"{'all' if sb is None else format_selection(sb)}): traces compared on the steps both "
                     f"traced ({format_selection(both) or 'none'})")
        steps = both if steps is None else steps & both
    return steps, levels


def diff_runs(run_a: str | Path, run_b: str | Path, *, ranks: set[int] | None = None, steps: set[int] | None = None,
              force: bool = False) -> dict[str, Any]:
    """Compares two runs: metrics bits, then traces. See the module docstring.

    Returns:
        A JSON-able report: ``identical``, ``first_divergent_step``, ``origin``, ``per_rank``,
        ``metrics``, ``summary`` and ``notes``.

    Raises:
        DiffError: a run directory is missing or malformed, or the runs' configs or environments
            differ (unless ``force``), or their traces have other schema versions.
    """
    run_a, run_b = Path(run_a), Path(run_b)
    doc_a, doc_b = load_run(run_a), load_run(run_b)
    notes: list[str] = []
    _check_comparable(doc_a, doc_b, force, notes)
    metrics_a, metrics_b = load_metrics(run_a), load_metrics(run_b)
    run_steps = {r.get("step") for r in metrics_a} | {r.get("step") for r in metrics_b}
    if steps is not None and run_steps and not steps & run_steps:
        raise DiffError(f"--steps {format_selection(steps)}: neither run has these steps (A: "
                        f"{format_selection(r['step'] for r in metrics_a) or 'none'}, B: "
                        f"{format_selection(r['step'] for r in metrics_b) or 'none'}); choose steps the runs have")
    # steps one run holds past the other's last are not compared (the verdict names them), not a divergence
    last_both = min(max((r["step"] for r in metrics_a), default=0), max((r["step"] for r in metrics_b), default=0))
    metric_diff = _first_metric_difference(metrics_a, metrics_b, steps, last_both)
    try:
        receipt_diff, receipt_steps, receipt_states, held, gaps = receipts_compared(
            run_a, run_b, steps, lambda step: layout_at(doc_a, step) == layout_at(doc_b, step))
    except ValueError as e:  # a damaged receipts file
        raise DiffError(str(e)) from None
    notes += [f"not compared: {gap}" for gap in gaps]
    both = {r["step"] for r in metrics_a} & {r["step"] for r in metrics_b}
    metric_steps = sum(1 for step in both if steps is None or step in steps)
    finals = [final_digest(run_a), final_digest(run_b)]
    final_compared = None not in finals and steps is None
    final_differs = final_compared and finals[0] != finals[1]
    common = _ranks_to_compare(run_a, run_b, ranks, notes)
    trace_steps, levels = _traced_alike(doc_a, doc_b, steps, notes) if common else (steps, (None, None))
    written = run_steps | held[0] | held[1]  # a loop of one's own logs no metrics.jsonl: its receipts say
    other = steps_on_other_layouts(doc_a, doc_b, written if trace_steps is None else trace_steps, notes,
                                   final=final_compared) if common else set()
    if other:  # their records do not pair up
        trace_steps = (written if trace_steps is None else trace_steps) - other
        common = common if trace_steps else []
    per_rank = _compare_ranks(run_a, run_b, common, trace_steps, levels, notes)
    divs = [res.divergence for res in per_rank.values() if res.divergence is not None]
    structural = [d for d in divs if d.kind == "structural"]
    origins = [d for d in divs if d.kind == "origin"]
    first = min(divs, key=lambda d: (d.kind != "structural", d.step, d.rank)) if divs else None
    origin = min(origins, key=lambda d: (d.step, d.microbatch, d.rank)) if origins and not structural else None
    # Without an origin, the earliest record without inputs that differs (step and module level) is where the
    # difference was first seen: on the rank where it began, if the others only received it
    seen = [d for d in divs if d.kind == "first_seen"]
    first_seen = min(seen, key=lambda d: (d.step, d.microbatch, d.rank)) if seen and not structural else None
    records = sum(r.records for r in per_rank.values())
    same = metric_diff is None and receipt_diff is None and not divs and not final_differs
    # Nothing compared is no evidence of sameness: such a diff says so (exit 2), never "identical"
    nothing = same and not (metric_steps or records or final_compared or receipt_steps)
    # Steps that one run holds and the other does not make agreement partial: "identical over steps 1-6 of
    # 1-20", never plain "identical"
    held = _held_steps(held, metrics_a, metrics_b, per_rank, steps)
    # so do receipts that one run's files hold and the other's lack (a rank's file lost, cut short, a line deleted)
    partial = same and not nothing and (held[0] != held[1] or bool(gaps))
    identical = same and not nothing and not partial
    if per_rank and not records and steps is not None:
        notes.append(f"no trace records fall in --steps {format_selection(steps)}: only those steps' metrics were "
                     "compared (the runs' trace.steps selects which steps were traced)")
    if nothing:
        summary = ("nothing compared: the runs have no metrics, final state or trace records in common"
                   + (" (see the notes)" if notes else "") + "; this is no evidence that they are the same")
    elif identical or partial:
        summary = identical_summary(metric_steps, records, len(per_rank), final_compared, receipt_steps,
                                     receipt_states)
        if partial:
            summary = summary.replace("identical:", f"{partial_verdict(held, gaps)} (A holds "
                                                    f"{format_selection(held[2]) or 'none'}, B "
                                                    f"{format_selection(held[3]) or 'none'}"
                                                    + "".join(f"; {gap}" for gap in gaps) + "):", 1)
    elif structural:
        d = structural[0]
        summary = (f"structural divergence on rank {d.rank} at step {d.step}: {d.note} "
                   f"(A: {d.phase} {d.scope!r} {d.op}#{d.occurrence}; B: {d.other})")
    elif origin is not None:
        summary = origin_summary(origin, origins, sorted(per_rank))
    elif first_seen is not None:
        summary = first_seen_summary(first_seen, sorted(d.rank for d in divs if d.kind == "receiver"))
    elif receipt_diff is not None and (metric_diff is None or receipt_diff["step"] < metric_diff["step"]) and \
            (first is None or receipt_diff["step"] < first.step):
        summary = (f"diverged at step {receipt_diff['step']}: the receipts' {', '.join(receipt_diff['fields'])} differ "
                   f"(rank {receipt_diff['rank']}); samestep bisect replays that step and names the op")
    else:
        summary = no_origin_summary(first, metric_diff, finals, bool(per_rank))
    named = structural[0] if structural else origin or first_seen or first
    first_step = min([d.step for d in divs] + ([metric_diff["step"]] if metric_diff else [])
                     + ([receipt_diff["step"]] if receipt_diff else []), default=None)
    if first_step is not None and not summary.startswith("diverged at step"):
        summary = lead(first_step, named, metric_diff, receipt_diff) + summary
    coords = rank_coordinates(layout_at(doc_a, named.step), named.rank) if named is not None else None
    if coords:
        notes.append(f"rank {named.rank} at step {named.step} is {coords} of the layout that wrote it")
    verdict = "nothing compared" if nothing else "identical" if identical else \
        partial_verdict(held, gaps) if partial else "diverged"
    return {
        "identical": identical,
        "partial": partial,
        "verdict": verdict,
        "compared": {"metric_steps": metric_steps, "trace_records": records, "ranks": len(per_rank),
                     "final_state": final_compared, "receipt_steps": receipt_steps,
                     "receipt_states": receipt_states,
                     "steps": format_selection(held[0]), "steps_held": format_selection(held[1])},
        "first_divergent_step": first_step,
        "metrics": metric_diff,
        "receipts": receipt_diff,
        "final_state_digests": finals,
        "origin": asdict(origin) if origin is not None else None,
        "first_seen": asdict(first_seen) if first_seen is not None and origin is None else None,
        "first_difference": asdict(first) if first is not None else None,
        "per_rank": {str(r): {"records_compared": res.records, "notes": res.notes, "missing_steps": res.missing,
                              "divergence": asdict(res.divergence) if res.divergence else None}
                     for r, res in per_rank.items()},
        "not_compared": gaps,
        "summary": summary,
        "notes": notes,
    }


def _compare_ranks(run_a: Path, run_b: Path, ranks: list[int], steps: set[int] | None,
                   levels: tuple[str | None, str | None], notes: list[str]) -> dict[int, _RankResult]:
    """Each rank's streams compared (see ``_compare_rank``), its notes (torn tails, records left out) in ``notes``."""
    per_rank: dict[int, _RankResult] = {}
    for r in ranks:
        try:
            per_rank[r] = _compare_rank(run_a, run_b, r, steps, levels)
        except ValueError as e:
            raise DiffError(str(e)) from None
        notes.extend(per_rank[r].notes)
        for name, lacking in (per_rank[r].missing or {}).items():
            if lacking:
                notes.append(f"rank {r}: run {name}'s trace has no records of step(s) {format_selection(lacking)}, "
                             "which the other run's has (lost when the run was killed before they were written, "
                             "or not traced): compared on the steps both hold")
    return per_rank


def _check_comparable(doc_a: dict[str, Any], doc_b: dict[str, Any], force: bool, notes: list[str]) -> None:
    """Refuses runs whose configs (less what changes no bit), environments or deterministic modes differ,
    unless ``force``; with ``force``, a note says what differs. A reference run beside a loop of one's own is
    refused in one line saying so: their configs have nothing in common."""
    writers = run_writer(doc_a), run_writer(doc_b)
    if writers[0] != writers[1]:
        if not force:
            raise DiffError(f"run A is {writers[0]} and run B {writers[1]}: their configs have nothing in common, "
                            "so their bits are not expected to match. Fix: compare runs of one program (pass "
                            "--force to compare their records anyway)")
        notes.append(f"run A is {writers[0]}, run B {writers[1]} (compared with --force)")
        return
    cfg_diff = {k: v for k, v in compare_environments(dotted(doc_a.get("config", {})),
                                                      dotted(doc_b.get("config", {}))).items()
                if k not in IGNORED_CONFIG}
    env_diff = numerics_differences(doc_a.get("environment", {}), doc_b.get("environment", {}))
    # deterministic mode first: the environment fingerprint records its knobs too, and its refusal says why
    for what, d in (("deterministic mode", _numerics(doc_a, doc_b)), ("config", cfg_diff), ("environment", env_diff)):
        if d:
            fields = ", ".join(f"{k} ({a!r} vs {b!r})" for k, (a, b) in d.items())
            if not force:
                raise DiffError(f"the runs' {what}s differ: {fields}; bitwise comparison only holds for the same "
                                f"{what} (pass --force to compare anyway)" + _why_off(doc_a, doc_b, d))
            notes.append(f"{what} differs (compared with --force): {fields}")


def _numerics(doc_a: dict[str, Any], doc_b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """What the runs' deterministic modes set differently (each knob's value after ``enable()``), or changed
    during the run (``determinism_changed``); "on" if one run had none."""
    out = determinism_diff(doc_a.get("determinism"), doc_b.get("determinism"))
    if "on" in out:
        return out
    changed = (doc_a.get("determinism_changed"), doc_b.get("determinism_changed"))
    if changed[0] != changed[1]:
        out["changed during the run"] = changed
    return out


def _why_off(doc_a: dict[str, Any], doc_b: dict[str, Any], diff: dict[str, tuple[Any, Any]]) -> str:
    """For a run without deterministic mode recorded: why, in plain words, and the fix."""
    if "on" not in diff:
        return ""
    run, doc = ("A", doc_a) if doc_a.get("determinism") is None else ("B", doc_b)
    if doc.get("written_by") == "samestep.trace":
        return (f". Run {run} recorded no deterministic mode: its samestep.trace() started before "
                "samestep.enable() (or enable() was never called); call samestep.enable() first")
    return f". Run {run} ran with determinism.enabled=false"


def _ranks_to_compare(run_a: Path, run_b: Path, ranks: set[int] | None, notes: list[str]) -> list[int]:
    """The ranks both runs traced (within ``ranks``); a note if they traced different ones."""
    ranks_a, ranks_b = set(traced_ranks(run_a)), set(traced_ranks(run_b))
    if ranks_a != ranks_b:
        notes.append(f"traced ranks differ: A has {format_selection(ranks_a) or 'none'}, B has "
                     f"{format_selection(ranks_b) or 'none'}; only the ranks both traced are compared")
    if ranks is not None and ranks - ranks_a - ranks_b:
        raise DiffError(f"--ranks {format_selection(ranks)}: rank(s) {format_selection(ranks - ranks_a - ranks_b)} "
                        f"have no trace in either run (A traced {format_selection(ranks_a) or 'no rank'}, B "
                        f"{format_selection(ranks_b) or 'no rank'}); choose traced ranks or leave --ranks out")
    return sorted((ranks_a & ranks_b) if ranks is None else (ranks_a & ranks_b & ranks))


def _held_steps(receipted: list[set[int]], metrics_a: list[dict], metrics_b: list[dict],
                per_rank: dict[int, _RankResult], steps: set[int] | None) -> tuple[set[int], ...]:
    """(steps both runs hold, steps either holds, A's, B's): from metrics, receipts and the traces."""
    held = [{r["step"] for r in metrics_a} | receipted[0], {r["step"] for r in metrics_b} | receipted[1]]
    for res in per_rank.values():
        held[0] |= res.held[0]
        held[1] |= res.held[1]
    if steps is not None:
        held = [h & steps for h in held]
    return held[0] & held[1], held[0] | held[1], held[0], held[1]


