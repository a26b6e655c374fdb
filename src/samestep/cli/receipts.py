"""``samestep receipts verify RUN``: check a run's receipt chain, and its files against it."""

from __future__ import annotations

import argparse
import json

from samestep.cli.errors import InputError, verdict


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "receipts",
        help="check a run's per-step receipts",
        description="Receipt tools. Every step of samestep train appends a receipt (the state checksum "
        "after the update, loss and grad-norm bits) chained by hash.",
        epilog="examples:\n  samestep receipts verify runs/a\n  samestep receipts verify runs/a --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    v = verbs.add_parser(
        "verify",
        help="check the chain, metrics, final.json and the newest checkpoint against it "
        "(exit 0 all hold, 1 a break or mismatch, 2 missing or malformed input)",
    )
    v.add_argument("run_dir")
    v.add_argument("--json", action="store_true", help="print JSON")
    v.set_defaults(run=run, subparser=v)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from samestep.analysis.receipt_check import check_receipts

    try:
        report = check_receipts(args.run_dir)
    except ValueError as e:  # RunDirError, ReceiptError, a config run.json cannot build
        raise InputError(str(e)) from None
    code = verdict(args, 0 if report["ok"] else 1)
    if args.json:
        print(json.dumps(report))
    else:
        for line in report["problems"]:
            print(f"BROKEN: {line}")
        ranks = ", ".join(f"rank {r}: steps {v['steps']}" for r, v in report["ranks"].items())
        print(
            ("receipts hold: " if report["ok"] else "receipts do not hold: ")
            + ranks
            + "; checked "
            + "; ".join(report["checked"])
        )
    return code
