"""``samestep bisect RUN_A RUN_B``: from "they differ" to the op that diverged, with no trace chosen before.

1. The first step whose receipts differ (loss, grad norm, then state checksum; metrics.jsonl's bits where
   a run has no receipts) is the step S where the runs' paths part.
2. Both runs are replayed from their newest common checkpoint before S (from scratch if none), each on
   its own layout, into scratch directories, with every rank traced at op level on step S only.
3. ``samestep diff`` of the two replays names the origin: op, module, microbatch and rank, inputs matched.

A divergence that a race caused may not fire again in a replay: then the replays agree, and bisect tries
again, up to ``retries`` times, and says that it did not reproduce.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from samestep.analysis.diff import DiffError, diff_runs
from samestep.analysis.layouts import rank_coordinates
from samestep.analysis.receipt_diff import compare_receipts
from samestep.records.final import final_digest
from samestep.records.rundir import layout_at, read_run
from samestep.replay.consent import Consent
from samestep.replay.plan import check_replayable, checkpoint_steps, plan, replay
from samestep.replay.scratch import kill_children, scratch_root

__all__ = ["BisectError", "bisect_runs"]


class BisectError(ValueError):
    """The runs cannot be bisected (nothing in common to compare, or runs that are not samestep train's)."""


def bisect_runs(
    run_a: str | Path,
    run_b: str | Path,
    *,
    retries: int = 3,
    force: bool = False,
    keep: Path | None = None,
    consent: Consent | None = None,
) -> dict[str, Any]:
    """Bisects two runs (``samestep train``'s, or ``samestep.Run`` loops', whose programs run again); returns
    ``{"identical", "first_divergent_step", "origin", "reproduced", "attempts", "replayed_from", "steps_compared",
    "difference", "diff", "notes", "summary"}``, where ``origin`` has ``samestep diff --json``'s fields (None if
    no replay reproduced the divergence). ``consent``: the verifier's word for the programs the runs name, asked
    once for both before either runs (default: none, and runs of programs of one's own are refused).

    Raises:
        BisectError, RunDirError, ReceiptError: nothing to compare, or a damaged run file; DiffError: the
            runs' configs or environments differ (without ``force``); ReplayError: a replay failed;
            ConsentError: a run's program would run without the verifier's word.
    """
    run_a, run_b = Path(run_a), Path(run_b)
    docs = read_run(run_a), read_run(run_b)  # read once, passed down
    difference, compared, states = compare_receipts(run_a, run_b)
    if compared == 0:
        raise BisectError(f"{run_a} and {run_b} hold no step in common (no receipts or metrics): nothing to compare")
    if difference is None:
        finals = [final_digest(run_a), final_digest(run_b)]
        same = states or None in finals or finals[0] == finals[1]
        agree = (
            f"{compared} step(s) agree in the receipts' loss and grad-norm bits, whose state checksums were not "
            "compared (of other shards or hashes, or none)"
        )
        if states:
            summary = f"identical: {compared} step(s) agree in every receipt"
        elif not same:
            summary = (
                f"diverged: {agree}, but the final state digests differ ({finals[0][:16]} vs "
                f"{finals[1][:16]}): replay both on one layout to find the step"
            )
        else:
            summary = f"identical: {agree}" + ("" if None in finals else ", and the final state digests match")
        traced, notes = _own_traces(run_a, run_b, force) if same else (None, [])
        if traced is not None and traced["first_difference"] is not None:
            # one definition of divergence with diff's: the runs' own op records differ, whatever the receipts say
            return {
                "identical": False,
                "first_divergent_step": traced["first_divergent_step"],
                "origin": traced["origin"],
                "reproduced": None,
                "attempts": 0,
                "replayed_from": None,
                "steps_compared": compared,
                "difference": None,
                "diff": traced["summary"],
                "per_rank": traced["per_rank"],
                "notes": ["the runs' own traces name the difference: nothing was replayed"],
                "summary": traced["summary"],
            }
        if traced is not None and (records := traced["compared"]["trace_records"]):
            summary += f", and their {records} trace records agree"
        return {
            "identical": same,
            "first_divergent_step": None,
            "origin": None,
            "reproduced": None,
            "attempts": 0,
            "replayed_from": None,
            "steps_compared": compared,
            "difference": None,
            "diff": None,
            "per_rank": None,
            "notes": notes,
            "summary": summary,
        }
    step = difference["step"]
    starts = [{s for s in checkpoint_steps(run, doc) if s < step} for run, doc in zip((run_a, run_b), docs)]
    start = max(starts[0] & starts[1], default=0)  # the newest common checkpoint before the step
    for run, doc in zip((run_a, run_b), docs):
        check_replayable(run, doc)
    plans = [plan(run, start, step, force=force, doc=doc) for run, doc in zip((run_a, run_b), docs)]
    (consent or Consent()).grant([p.launch for p in plans], "samestep bisect")
    settings = ("trace.level=op", f"trace.steps={step}", "trace.ranks=all", "train.checkpoint_every=0")
    report, attempt, notes = None, 0, []
    with scratch_root("bisect", keep) as root:
        for attempt in range(1, retries + 2):
            dirs = [root / f"a{attempt}", root / f"b{attempt}"]
            with ThreadPoolExecutor(2) as pool:  # two processes: the replays run side by side
                futures = [pool.submit(replay, p, d, settings) for p, d in zip(plans, dirs)]
                try:
                    for f in futures:
                        notes += [n for n in f.result() if n not in notes]
                except BaseException:  # Ctrl-C, SIGTERM, the other replay failed: the pool waits on its threads
                    kill_children()
                    raise
            report = diff_runs(*dirs, steps={step}, force=force)
            if not report["identical"]:
                break
    reproduced = not report["identical"]
    origin = report.get("origin") if reproduced else None
    where = f"from step {start}" if start else "from scratch"
    resumed = [name for name, doc in zip("AB", docs) if any(r.get("step") == step - 1 for r in doc.get("resumes", []))]
    if not reproduced and resumed:
        summary = (
            f"diverged at step {step} ({', '.join(difference['fields'])} differ), the first step after run "
            f"{' and '.join(resumed)}'s resume from step {step - 1}, and {attempt} replay(s) {where} agreed: "
            "the resume lost state its checkpoint does not hold (a scheduler, a data loader or a batch fetched "
            "ahead kept outside samestep.Run), not a race"
        )
    elif not reproduced:
        summary = (
            f"diverged at step {step} ({', '.join(difference['fields'])} differ), but {attempt} replay(s) "
            f"{where} agreed: the divergence did not reproduce (a race that did not fire again)"
        )
    elif origin is None:
        summary = f"diverged at step {step}; the replays {where} differ, but no origin was named: {report['summary']}"
    else:
        coords = rank_coordinates(layout_at(docs[1], step), origin["rank"])
        summary = (
            f"diverged at step {step}: origin {origin['op']} in {origin['scope'] or '(root)'} ({origin['phase']}), "
            f"microbatch {origin['microbatch']}, rank {origin['rank']}{f' ({coords})' if coords else ''}, "
            f"inputs matched; replayed {where}, attempt {attempt}"
        )
    return {
        "identical": False,
        "first_divergent_step": step,
        "origin": origin,
        "reproduced": reproduced,
        "attempts": attempt,
        "replayed_from": start,
        "steps_compared": compared,
        "difference": difference,
        "diff": report["summary"],
        "per_rank": report.get("per_rank"),
        "notes": notes,
        "summary": summary,
    }


def _own_traces(run_a: Path, run_b: Path, force: bool) -> tuple[dict[str, Any] | None, list[str]]:
    """``samestep diff``'s report of the two runs, whose own trace records may differ while every receipt
    agrees (a difference that rounding absorbed, docs/design.md, words: divergence), and the notes of a
    comparison refused: receipts alone would call such runs identical, where diff says diverged."""
    try:
        return diff_runs(run_a, run_b, force=force), []
    except DiffError as e:
        return None, [f"the runs' own trace records were not compared: {e}"]
