"""``samestep verify RUN [--steps A-B]``: replay a run's steps and compare every receipt, bit for bit.

The replay starts from the run's newest checkpoint before step A (from scratch if it has none), runs to
B in a scratch directory, and every receipt it writes (state checksum, loss and grad-norm bits, each rank's
where the state is sharded) must equal the one the run recorded. That lets anyone with the run
directory check what it claims: that these checkpoints and metrics came from this config and data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from samestep.analysis.receipt_check import checkpoint_mismatches
from samestep.analysis.receipt_diff import by_rank, first_receipt_difference
from samestep.checkpoint import step_dir_name
from samestep.records.receipts import chain_break, read_run_receipts, receipts_path, state_hash_of
from samestep.records.rundir import checkpoints_dir, read_run
from samestep.replay.consent import Consent, code_line
from samestep.replay.plan import (
    ReplayRefused,
    check_replayable,
    environment_differences,
    framework_run,
    plan,
    replay,
    replay_start,
    unrecorded_sources,
)
from samestep.replay.scratch import scratch_root

__all__ = ["VerifyError", "verify_run"]


class VerifyError(ValueError):
    """The run cannot be replayed as asked (no receipts, steps it does not hold, another environment)."""


def _foreign_checkpoint(
    run_dir: Path, doc: dict[str, Any], files: dict[int, tuple[dict, list[dict]]], start: int
) -> dict[str, Any] | None:
    """The checkpoint a replay starts from, against the run's receipts of its step: None if it is the run's,
    else a mismatch naming it. A framework's checkpoint is checked by its callback as the replay resumes
    (``ReplayRefused``)."""
    if not start or framework_run(doc):
        return None
    step_dir = checkpoints_dir(run_dir) / step_dir_name(start)
    try:
        problems = checkpoint_mismatches(run_dir, step_dir, files, doc.get("written_by"))
    except ValueError as e:  # damaged
        problems = [f"{step_dir}: {e}"]
    if not problems:
        return None
    return _not_the_runs(start, problems[0])


def _not_the_runs(step: int, why: str) -> dict[str, Any]:
    """The first mismatch of a run whose checkpoint of ``step`` is not the state its receipt records."""
    return {
        "step": step,
        "rank": 0,
        "fields": ["checkpoint"],
        "a": {"state": "the receipt's"},
        "b": {"checkpoint": why},
    }


def verify_run(
    run_dir: str | Path,
    steps: tuple[int, int] | None = None,
    force: bool = False,
    keep: Path | None = None,
    consent: Consent | None = None,
    given: list[str] | None = None,
) -> dict[str, Any]:
    """Replays steps A-B of a run (``samestep train``'s, or the loop of a ``samestep.Run`` or framework callback:
    its program run again; default: all it receipted) and compares receipts.

    Returns ``{"reproduced", "steps", "replayed_from", "compared", "first_mismatch", "chain", "notes", "by",
    "program_differs"}``: ``by``, what ran (``program.identity``; None for ``samestep train``);
    ``program_differs``, why the program that ran is not the run's (changed since, replayed with ``force``; or
    files the replay ran that the run's record does not hash), which no reproduction can be. ``keep``: where
    to leave the replay (default: a temporary directory, removed). ``consent``: the verifier's word for a
    program the run names (default: none, and such a run is refused); ``given``: the verifier's own command
    line for it (``python train.py ARGS``), their word.

    Raises:
        VerifyError, RunDirError, ReceiptError: it cannot replay (no receipts, steps beyond them, a replay
            in another environment without ``force``); ConsentError: the run's program would run without the
            verifier's word; ReplayError: the replay failed, or the program of a loop of one's own changed
            (without ``force``); ProgramError: that program cannot run again.
    """
    run_dir = Path(run_dir)
    doc = read_run(run_dir)
    check_replayable(run_dir, doc)
    files = read_run_receipts(run_dir)
    recorded = by_rank(files)
    if not recorded:
        raise VerifyError(
            f"{run_dir / 'receipts'}: no receipts; the run wrote none (train.receipts=false), so "
            "there is nothing to verify against"
        )
    last = min(rs[-1]["step"] if rs else 0 for rs in recorded.values())
    a, b = steps if steps is not None else (1, last)
    if not 1 <= a <= b <= last:
        raise VerifyError(f"--steps {a}-{b}: the run receipted steps 1-{last}; choose steps within them")
    start = replay_start(run_dir, a - 1, doc)
    foreign = _foreign_checkpoint(run_dir, doc, files, start)
    report: dict[str, Any] = {"steps": f"{a}-{b}", "replayed_from": start, "by": None, "program_differs": []}
    if foreign is not None:  # a replay from it would verify nothing of this run
        return {**report, "reproduced": False, "compared": 0, "first_mismatch": foreign, "chain": {}, "notes": []}
    planned = plan(run_dir, start, b, force=force, given=given, doc=doc)
    (consent or Consent()).grant([planned.launch], "samestep verify")
    report["by"] = planned.launch.identity
    differs = list(planned.changed)
    with scratch_root("verify", keep) as root:
        scratch = root if keep is not None else root / "replay"
        # receipts on (a resume may have turned them off), by the run's own state hash
        try:
            notes = replay(
                planned, scratch, ("train.receipts=true", f"train.receipt_hash={state_hash_of(files[min(files)][0])}")
            )
        except ReplayRefused as e:  # the framework's checkpoint is not the run's: a verdict
            return {
                **report,
                "reproduced": False,
                "compared": 0,
                "first_mismatch": _not_the_runs(start, str(e)),
                "chain": {},
                "notes": list(planned.notes),
            }
        env = environment_differences(doc, scratch)
        if env and not force:
            raise VerifyError(
                f"the replay ran in another environment than the run ({', '.join(sorted(env)[:4])}"
                f"{' ...' if len(env) > 4 else ''}): its bits need not match; run it where the run ran, or "
                "pass --force"
            )
        if env:
            notes.append(f"environment differs (verified with --force): {', '.join(sorted(env))}")
        differs += unrecorded_sources(planned, scratch)
        replayed = by_rank(read_run_receipts(scratch))
    mismatch, compared, states = first_receipt_difference(recorded, replayed, range(start + 1, b + 1))
    if states < compared:
        notes.append(
            f"the state was compared in {states} of {compared} receipts (the others are of another layout "
            "or hash): not reproduced in full"
        )
    if planned.launch.identity is not None:
        notes.append(f"replayed by {code_line(planned.launch.identity)}")
    chain = {
        receipts_path(run_dir, rank).name: chain_break(header, receipts) or "holds"
        for rank, (header, receipts) in files.items()
    }
    holds = all(v == "holds" for v in chain.values())
    return {
        **report,
        "reproduced": mismatch is None and 0 < states == compared and holds and not differs,
        "compared": compared,
        "first_mismatch": mismatch,
        "chain": chain,
        "notes": notes,
        "program_differs": differs,
    }
