"""``samestep report RUN_A [RUN_B ...] --out report.html``: pictures of runs and of where they diverged."""

from __future__ import annotations

import argparse
import json

from samestep.cli.errors import InputError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="draw runs' loss and grad-norm curves and where two of them diverged (HTML and PNG)",
        description="Draws each run's loss and grad norm per step, overlaid, with the first divergent step of the "
        "first two runs marked; for two traced runs, where each rank first differs (origin, first "
        "seen, receiver) and the origin op. Writes a self-contained HTML page and PNG files beside "
        "it. Exit 0 written, 2 usage or input error. Needs matplotlib (pip install 'samestep[report]').",
        epilog="examples:\n  samestep report runs/a runs/b --out report.html\n  samestep report runs/a --out a.html",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (the first two are compared)")
    p.add_argument("--out", required=True, help="the HTML file to write (PNGs go beside it)")
    p.add_argument("--force", action="store_true", help="compare even if configs or environments differ")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.set_defaults(run=run, subparser=p)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from samestep.analysis import DiffError
    from samestep.analysis.report import make_report

    try:
        result = make_report(args.runs, args.out, force=args.force)
    except DiffError as e:
        raise InputError(str(e)) from None
    if args.json:
        print(json.dumps(result))
    else:
        print(f"wrote {result['html']}" + "".join(f", {p}" for p in result["pngs"]))
        if result["diff_error"]:
            print(f"not compared: {result['diff_error']}")
    return 0
