"""``samestep trace certify RUN``: is a run's trace complete (exit 0) or not (exit 1)?"""

from __future__ import annotations

import argparse
import json

from samestep.cli.errors import InputError, verdict


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace",
        help="inspect trace streams",
        description="Trace tools.",
        epilog="examples:\n  samestep trace certify runs/a\n  samestep trace certify runs/a --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    c = verbs.add_parser("certify", help="check every selected rank and step is traced, contiguously")
    c.add_argument("run_dir", metavar="RUN", help="a run directory")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(run=run, subparser=c)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from samestep.analysis import DiffError, certify_trace

    try:
        report = certify_trace(args.run_dir)
    except DiffError as e:
        raise InputError(str(e)) from None
    code = verdict(args, 0 if report["complete"] else 1)
    if args.json:
        print(json.dumps(report))
    elif report["complete"]:
        ranks = ", ".join(f"rank {r}: {v['records']} records, steps {v['steps']}" for r, v in report["ranks"].items())
        print(f"complete: {ranks}")
    else:
        print("incomplete:\n" + "\n".join(f"  - {p}" for p in report["problems"]))
    return code
