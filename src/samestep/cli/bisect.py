"""``samestep bisect RUN_A RUN_B``: the first differing step, replayed with op tracing, down to the origin op
(exit 0 identical, 1 diverged, 2 an input error or nothing to compare)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from samestep.cli.errors import InputError, verdict
from samestep.cli.trust import consent_of


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bisect",
        help="find where two runs diverged (samestep train's, or programs of samestep.Run or the HF or "
        "Lightning callbacks): step, then op, module, microbatch and rank",
        description="Finds the first step whose receipts differ, replays both runs from their newest common "
        "checkpoint before it with op-level tracing of that step, and diffs the replays. Exit 0 "
        "identical, 1 diverged, 2 usage or input error, or nothing in common to compare. Loops of "
        "one's own are replayed by the programs their run.json records: they are shown, and run only "
        "on your word (a yes at the prompt, or --yes).",
        epilog="examples:\n  samestep bisect runs/a runs/b\n  samestep bisect runs/a runs/b --json --retries 5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument(
        "--retries",
        type=int,
        default=3,
        help="replays again when a divergence does not reproduce (a race that did not fire); default 3",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="compare even if configs or environments differ, and replay a program of one's own changed since its run",
    )
    p.add_argument("--keep", metavar="DIR", help="leave the replays in DIR (a new directory)")
    p.add_argument(
        "--yes",
        action="store_true",
        help="run the programs the run directories record without asking "
        "(they are shown first); without a terminal, needed to run them",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run, subparser=p)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from samestep.replay.bisect import bisect_runs
    from samestep.replay.plan import ReplayError
    from samestep.replay.scratch import stopping

    if args.retries < 0:
        raise InputError(f"--retries {args.retries}: expected 0 or more")
    try:
        with stopping():
            report = bisect_runs(
                args.run_a,
                args.run_b,
                retries=args.retries,
                force=args.force,
                keep=Path(args.keep) if args.keep else None,
                consent=consent_of(args),
            )
    except (ValueError, ReplayError, FileExistsError) as e:  # a DiffError, BisectError, damaged file, failed replay
        raise InputError(str(e)) from None
    code = verdict(args, 0 if report["identical"] else 1)
    print(json.dumps(report) if args.json else report["summary"])
    return code
