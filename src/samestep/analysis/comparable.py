"""What two runs must share before their bits are compared, and what of them both recorded: the configs,
environments and deterministic modes (refused unless ``--force`` where they differ), the trace levels and
steps, and the ranks both traced. ``diff_runs`` asks these first; each difference it lets through is a note."""

from __future__ import annotations

from typing import Any

from samestep.determinism.env import compare_environments, numerics_differences
from samestep.hashing.state import dotted
from samestep.records.rundir import NUMERICS_NEUTRAL, determinism_diff, run_writer
from samestep.tracing.selection import LEVELS, format_selection, parse_selection
from samestep.tracing.stream import traced_ranks

__all__ = ["DiffError", "IGNORED_CONFIG", "check_comparable", "ranks_to_compare", "traced_alike"]

# Config fields not compared: those that change no bit of the steps (invariant 3 for trace.*; bookkeeping for
# the rest), and trace.perturb, since a planted perturbation is what a diff is run to find.
IGNORED_CONFIG = NUMERICS_NEUTRAL | {"trace.perturb"}


class DiffError(ValueError):
    """The runs cannot be compared (missing files, other schema, other config or environment)."""


def check_comparable(doc_a: dict[str, Any], doc_b: dict[str, Any], force: bool, notes: list[str]) -> None:
    """Refuses runs whose configs (less what changes no bit), environments or deterministic modes differ,
    unless ``force``; with ``force``, a note says what differs. A reference run beside a loop of one's own is
    refused in one line saying so: their configs have nothing in common."""
    writers = run_writer(doc_a), run_writer(doc_b)
    if writers[0] != writers[1]:
        if not force:
            raise DiffError(
                f"run A is {writers[0]} and run B {writers[1]}: their configs have nothing in common, "
                "so their bits are not expected to match. Fix: compare runs of one program (pass "
                "--force to compare their records anyway)"
            )
        notes.append(f"run A is {writers[0]}, run B {writers[1]} (compared with --force)")
        return
    cfg_diff = {
        k: v
        for k, v in compare_environments(dotted(doc_a.get("config", {})), dotted(doc_b.get("config", {}))).items()
        if k not in IGNORED_CONFIG
    }
    env_diff = numerics_differences(doc_a.get("environment", {}), doc_b.get("environment", {}))
    # deterministic mode first: the environment fingerprint records its knobs too, and its refusal says why
    for what, d in (("deterministic mode", _numerics(doc_a, doc_b)), ("config", cfg_diff), ("environment", env_diff)):
        if d:
            fields = ", ".join(f"{k} ({a!r} vs {b!r})" for k, (a, b) in d.items())
            if not force:
                raise DiffError(
                    f"the runs' {what}s differ: {fields}; bitwise comparison only holds for the same "
                    f"{what} (pass --force to compare anyway)" + _why_off(doc_a, doc_b, d)
                )
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
        return (
            f". Run {run} recorded no deterministic mode: its samestep.trace() started before "
            "samestep.enable() (or enable() was never called); call samestep.enable() first"
        )
    return f". Run {run} ran with determinism.enabled=false"


def ranks_to_compare(run_a, run_b, ranks: set[int] | None, notes: list[str]) -> list[int]:
    """The ranks both runs traced (within ``ranks``); a note if they traced different ones."""
    ranks_a, ranks_b = set(traced_ranks(run_a)), set(traced_ranks(run_b))
    if ranks_a != ranks_b:
        notes.append(
            f"traced ranks differ: A has {format_selection(ranks_a) or 'none'}, B has "
            f"{format_selection(ranks_b) or 'none'}; only the ranks both traced are compared"
        )
    if ranks is not None and ranks - ranks_a - ranks_b:
        raise DiffError(
            f"--ranks {format_selection(ranks)}: rank(s) {format_selection(ranks - ranks_a - ranks_b)} "
            f"have no trace in either run (A traced {format_selection(ranks_a) or 'no rank'}, B "
            f"{format_selection(ranks_b) or 'no rank'}); choose traced ranks or leave --ranks out"
        )
    return sorted((ranks_a & ranks_b) if ranks is None else (ranks_a & ranks_b & ranks))


def traced_alike(
    doc_a: dict, doc_b: dict, steps: set[int] | None, notes: list[str]
) -> tuple[set[int] | None, tuple[str | None, str | None]]:
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
        notes.append(
            f"A was traced at {la} level, B at {lb}: compared at {low} level (run "
            f"{'A' if la != low else 'B'}'s finer records are left out)"
        )
    try:
        sa, sb = (parse_selection(t.get("steps", "all"), "trace.steps") for t in (ta, tb))
    except ValueError as e:
        raise DiffError(f"run.json: {e}") from None
    if sa != sb:
        both = sb if sa is None else sa if sb is None else sa & sb
        notes.append(
            f"traced steps differ (A: {'all' if sa is None else format_selection(sa)}, B: "
            f"{'all' if sb is None else format_selection(sb)}): traces compared on the steps both "
            f"traced ({format_selection(both) or 'none'})"
        )
        steps = both if steps is None else steps & both
    return steps, levels
