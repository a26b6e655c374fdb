"""The first step at which two runs' receipts differ: state digests where both are of the same state (the
whole state, or shards over the same layout), loss and grad-norm bits always; metrics.jsonl's rows stand
in for a run that wrote no receipts. What ``samestep verify`` compares a replay with, ``samestep bisect``
starts from and ``samestep diff`` reports as the first divergent step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from samestep.receipts import read_run_receipts
from samestep.rundir import read_metrics

__all__ = ["FIELDS", "compare_receipts", "first_receipt_difference", "receipts_compared"]

FIELDS = ("loss_hex", "grad_norm_hex", "state")  # what a receipt says of its step, in the order it arises


def first_receipt_difference(a: dict[str, list[dict]], b: dict[str, list[dict]], steps: range,
                             fields: tuple[str, ...] = FIELDS) -> dict[str, Any] | None:
    """The first step in ``steps`` (then the lowest rank) where two sets of receipts ({rank: receipts})
    differ in a field: ``{"step", "rank", "fields", "a", "b"}``; None if they agree on every step both hold."""
    by = {side: {rank: {r["step"]: r for r in rs} for rank, rs in recs.items()} for side, recs in (("a", a), ("b", b))}
    for step in steps:
        for rank in sorted(set(by["a"]) & set(by["b"]), key=int):
            ra, rb = by["a"][rank].get(step), by["b"][rank].get(step)
            if ra is None or rb is None:
                continue
            differ = [f for f in fields if ra[f] != rb[f]]
            if differ:
                return {"step": step, "rank": int(rank), "fields": differ, "a": {f: ra[f] for f in differ},
                        "b": {f: rb[f] for f in differ}}
    return None


def _records(run_dir: Path) -> tuple[dict[str, list[dict]], str]:
    """A run's receipts ({rank: receipts}) and what they are of: "run" (the whole state, or a rank's shards,
    "rank"), or metrics.jsonl's rows as receipts without a state ("metrics") where it wrote none."""
    files = read_run_receipts(run_dir)
    if files:
        return ({str(rank): receipts for rank, (_, receipts) in files.items()},
                files[max(files)][0].get("state_of", "run"))
    return {"0": [{"step": r["step"], "loss_hex": r.get("loss_hex"), "grad_norm_hex": r.get("grad_norm_hex")}
                  for r in read_metrics(run_dir)]}, "metrics"


def _compare(a: dict[str, list[dict]], of_a: str, b: dict[str, list[dict]],
             of_b: str) -> tuple[dict[str, Any] | None, int, bool]:
    states = of_a == of_b == "run" or (of_a == of_b == "rank" and set(a) == set(b))
    common = {r["step"] for r in a.get("0", [])} & {r["step"] for r in b.get("0", [])}
    if not common:
        return None, 0, False
    return (first_receipt_difference(a, b, range(1, max(common) + 1), FIELDS if states else FIELDS[:2]),
            len(common), states)


def compare_receipts(run_a: Path, run_b: Path) -> tuple[dict[str, Any] | None, int, bool]:
    """The first differing step of two runs by their receipts (see the module docstring), how many steps
    both hold, and whether their state digests were compared: where both are of the whole state, or both
    of shards over the same layout; loss and grad-norm bits always."""
    return _compare(*_records(run_a), *_records(run_b))


def receipts_compared(run_a: Path, run_b: Path,
                      steps: set[int] | None) -> tuple[dict[str, Any] | None, int, bool, list[set[int]]]:
    """What ``samestep diff`` takes from two runs' receipts files: the first step in ``steps`` (None: all) at
    which they differ, how many steps both receipted, whether their state digests were compared, and each
    run's receipted steps (rank 0's; none without a receipts file). Raises ValueError for a damaged one."""
    (a, of_a), (b, of_b) = _records(run_a), _records(run_b)
    held = [set() if of == "metrics" else {r["step"] for r in recs.get("0", [])} for recs, of in ((a, of_a), (b, of_b))]
    if not all(held):
        return None, 0, False, held
    difference, compared, states = _compare(a, of_a, b, of_b)
    if difference is not None and steps is not None and difference["step"] not in steps:
        difference = None  # outside the steps asked for
    return difference, compared, states, held
