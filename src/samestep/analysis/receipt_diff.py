"""The first step at which two runs' receipts differ: state checksums where both are of the same state (the
whole state, or shards over the same layout) by the same hash, loss and grad-norm bits always;
metrics.jsonl's rows stand in for a run that wrote no receipts. What ``samestep verify`` compares a replay
with, ``samestep bisect`` starts from and ``samestep diff`` reports as the first divergent step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from samestep.records.metrics import read_metrics
from samestep.records.receipts import read_run_receipts, receipt_state_of, state_hash_of
from samestep.tracing.selection import format_selection

__all__ = [
    "FIELDS",
    "by_rank",
    "compare_receipts",
    "first_receipt_difference",
    "receipt_gaps",
    "receipts_compared",
    "states_comparable",
]

FIELDS = ("loss_hex", "grad_norm_hex", "state")  # what a receipt says of its step, in the order it arises


def by_rank(files: dict[int, tuple[dict, list[dict]]]) -> dict[str, list[dict]]:
    """``read_run_receipts``'s files as ``{rank: receipts}``, each receipt with what its state is of
    (``state_of``) and by which hash (``state_hash``): what ``first_receipt_difference`` compares."""
    return {
        str(rank): [
            {**r, "state_of": receipt_state_of(header, r), "state_hash": state_hash_of(header)} for r in receipts
        ]
        for rank, (header, receipts) in files.items()
    }


def states_comparable(ra: dict, rb: dict, same_ranks: bool) -> bool:
    """Whether two receipts' states are of one thing by one hash: both of the whole state, or both of shards
    over one set of ranks; a receipt without a state (a metrics row) is comparable with none."""
    of = ra.get("state_of")
    return (
        of is not None
        and of == rb.get("state_of")
        and ra.get("state_hash") == rb.get("state_hash")
        and (of == "run" or same_ranks)
    )


def first_receipt_difference(
    a: dict[str, list[dict]], b: dict[str, list[dict]], steps: range, alike: Callable[[int], bool] = lambda step: True
) -> tuple[dict[str, Any] | None, int, int]:
    """The first step in ``steps`` (then the lowest rank) where two sets of receipts (``by_rank``) differ in a
    field, ``{"step", "rank", "fields", "a", "b"}`` (None if they agree on every step both hold); how many
    (step, rank) pairs up to it were compared, and at how many of them their states were
    (``states_comparable``, shards only at steps both wrote on one layout, ``alike``; loss and grad-norm bits
    always are)."""
    by = {side: {rank: {r["step"]: r for r in rs} for rank, rs in recs.items()} for side, recs in (("a", a), ("b", b))}
    same_ranks, pairs, states = set(a) == set(b), 0, 0
    for step in steps:
        for rank in sorted(set(by["a"]) & set(by["b"]), key=int):
            ra, rb = by["a"][rank].get(step), by["b"][rank].get(step)
            if ra is None or rb is None:
                continue
            fields = FIELDS if states_comparable(ra, rb, same_ranks and alike(step)) else FIELDS[:2]
            pairs, states = pairs + 1, states + (len(fields) == len(FIELDS))
            differ = [f for f in fields if ra[f] != rb[f]]
            if differ:
                return (
                    {
                        "step": step,
                        "rank": int(rank),
                        "fields": differ,
                        "a": {f: ra[f] for f in differ},
                        "b": {f: rb[f] for f in differ},
                    },
                    pairs,
                    states,
                )
    return None, pairs, states


def _records(run_dir: Path) -> tuple[dict[str, list[dict]], bool]:
    """A run's receipts (``by_rank``), or metrics.jsonl's rows as receipts without a state where it wrote
    none; and whether they are receipts."""
    files = read_run_receipts(run_dir)
    if files:
        return by_rank(files), True
    return {
        "0": [
            {"step": r["step"], "loss_hex": r.get("loss_hex"), "grad_norm_hex": r.get("grad_norm_hex")}
            for r in read_metrics(run_dir)
        ]
    }, False


def _compare(
    a: dict[str, list[dict]], b: dict[str, list[dict]], alike: Callable[[int], bool] = lambda step: True
) -> tuple[dict[str, Any] | None, int, bool]:
    common = {r["step"] for r in a.get("0", [])} & {r["step"] for r in b.get("0", [])}
    if not common:
        return None, 0, False
    difference, pairs, states = first_receipt_difference(a, b, range(1, max(common) + 1), alike)
    return difference, len(common), 0 < states == pairs


def compare_receipts(run_a: Path, run_b: Path) -> tuple[dict[str, Any] | None, int, bool]:
    """The first differing step of two runs by their receipts (see the module docstring), how many steps
    both hold, and whether their state checksums were compared at every one: where both are of the whole
    state, or both of shards over the same layout, by one hash; loss and grad-norm bits always."""
    return _compare(_records(run_a)[0], _records(run_b)[0])


def receipts_compared(
    run_a: Path, run_b: Path, steps: set[int] | None, alike: Callable[[int], bool] = lambda step: True
) -> tuple[dict[str, Any] | None, int, bool, list[set[int]], list[str]]:
    """What ``samestep diff`` takes from two runs' receipts files: the first step in ``steps`` (None: all) at
    which they differ, how many steps both receipted, whether their state checksums were compared, each run's
    receipted steps (rank 0's; none without a receipts file), and what one run's receipts hold and the
    other's lack (``receipt_gaps``; ``alike(step)``: both runs wrote that step on one layout). Raises
    ValueError for a damaged one."""
    (a, has_a), (b, has_b) = _records(run_a), _records(run_b)
    held = [{r["step"] for r in recs.get("0", [])} if has else set() for recs, has in ((a, has_a), (b, has_b))]
    if not all(held):
        return None, 0, False, held, []
    difference, compared, states = _compare(a, b, alike)
    if difference is not None and steps is not None and difference["step"] not in steps:
        difference = None  # outside the steps asked for
    return difference, compared, states, held, receipt_gaps(a, b, steps, alike)


def receipt_gaps(
    a: dict[str, list[dict]], b: dict[str, list[dict]], steps: set[int] | None, alike: Callable[[int], bool]
) -> list[str]:
    """The receipts one run holds and the other lacks, on the steps up to the last both receipted (within
    ``steps``) that both wrote on one layout (``alike``; on others ranks keep other files): a rank's file
    missing or cut short, or a receipt deleted. Steps past one run's end are not gaps: the verdict names them."""
    last = min(max((r["step"] for rs in recs.values() for r in rs), default=0) for recs in (a, b))
    both = {s for s in range(1, last + 1) if (steps is None or s in steps) and alike(s)}
    gaps = []
    for rank in sorted(set(a) | set(b), key=int):
        mine = [{r["step"] for r in recs.get(rank, [])} & both for recs in (a, b)]
        if rank not in a or rank not in b:
            lacking, other = ("A", mine[1]) if rank not in a else ("B", mine[0])
            if other:
                gaps.append(
                    f"run {lacking} has no receipts of rank {rank} (the other's hold steps {format_selection(other)})"
                )
            continue
        for name, lacks in (("A", mine[1] - mine[0]), ("B", mine[0] - mine[1])):
            if lacks:
                gaps.append(
                    f"rank {rank}: run {name}'s receipts lack step(s) {format_selection(lacks)}, which the "
                    "other run's hold"
                )
    return gaps
