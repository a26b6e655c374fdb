"""``samestep env``: print this machine's environment fingerprint."""

from __future__ import annotations

import argparse
import json

from samestep.determinism.env import environment


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "env",
        help="print the environment fingerprint",
        description="Prints everything the determinism contract depends on.",
        epilog="examples:\n  samestep env\n  samestep env --json > env.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run, subparser=p)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    fp = environment()
    if args.json:
        print(json.dumps(fp, indent=1, sort_keys=True))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table("field", "value", title="samestep environment fingerprint", show_lines=False)
    for key in sorted(fp):
        table.add_row(key, "-" if fp[key] is None else str(fp[key]))
    Console().print(table)
    return 0
