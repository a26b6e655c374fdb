"""``samestep diff RUN_A RUN_B``: name the first op that diverged (exit 0 identical, 1 diverged, 2 an input
error or nothing to compare)."""

from __future__ import annotations

import argparse
import json
import os

from samestep.cli.errors import InputError, console, verdict


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diff",
        help="compare two runs: first differing step, then the op that diverged, per rank",
        description="Compares metrics bits and receipts (the state after each step), then per-rank trace streams. "
        "Exit 0 identical (or identical over the steps both runs hold, which the verdict names), 1 "
        "diverged (or, with --strict, a run holds steps the other does not), 2 usage or input error, "
        "or nothing in common to compare.",
        epilog="examples:\n  samestep diff runs/a runs/b\n  samestep diff runs/a runs/b --json --ranks 0,1 --steps 1-5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument("--ranks", help="ranks to compare, e.g. 0,2-3 (default: all traced)")
    p.add_argument("--steps", help="steps to compare, e.g. 1-5 (default: all)")
    p.add_argument("--force", action="store_true", help="compare even if configs or environments differ")
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 unless every step of both runs was compared (a run that stopped earlier fails)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run, subparser=p)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from samestep.analysis import diff_runs
    from samestep.tracing.selection import parse_selection

    try:
        ranks = parse_selection(args.ranks, "--ranks")
        steps = parse_selection(args.steps, "--steps")
        report = diff_runs(args.run_a, args.run_b, ranks=ranks, steps=steps, force=args.force)
    except ValueError as e:  # a DiffError, a damaged run file (RunDirError), a bad --ranks or --steps
        raise InputError(str(e)) from None
    code = verdict(args, _exit_code(report, args.strict))
    if args.json:
        print(json.dumps(report))
    else:
        _print(report)
    return code


def _exit_code(report: dict, strict: bool) -> int:
    """0 identical, 1 diverged, 2 nothing compared; identical over a part: 0, or 1 with ``--strict``."""
    if report["verdict"] == "nothing compared":
        return 2
    if report["partial"]:
        return 1 if strict else 0
    return 0 if report["identical"] else 1


def _print(report: dict) -> None:
    from rich.table import Column, Table

    from samestep.tracing.selection import format_selection

    out = console()
    if not out.is_terminal and not os.environ.get("COLUMNS"):  # a log or a pipe: rich would assume 80 columns
        out.width = 160
    out.print(report["summary"], soft_wrap=True)
    if report["metrics"]:
        m = report["metrics"]
        out.print(
            f"metrics first differ at step {m['step']}: {', '.join(m['fields'])} (A {m['a']} vs B {m['b']})",
            soft_wrap=True,
        )
    if report["per_rank"]:
        # Scopes and op names are what the reader looks for: wrapped in a narrow terminal, never cut short
        table = Table(
            "rank",
            "matched",
            "first difference",
            "step",
            "mb",
            Column("where", overflow="fold"),
            Column("op #occurrence", overflow="fold"),
        )
        # A run of consecutive ranks with no difference is one row (a 1,024-rank diff is a few rows, not 1,024)
        same: list[tuple[int, int]] = []

        def flush_same() -> None:
            if same:
                ranks = format_selection(rank for rank, _ in same)
                table.add_row(
                    ranks,
                    f"{sum(n for _, n in same)}" + (f" ({len(same)} ranks)" if len(same) > 1 else ""),
                    "none",
                    "",
                    "",
                    "",
                    "",
                )
                same.clear()

        for rank, r in sorted(report["per_rank"].items(), key=lambda kv: int(kv[0])):
            d = r["divergence"]
            if d is None:
                if same and same[-1][0] != int(rank) - 1:
                    flush_same()
                same.append((int(rank), r["records_compared"]))
                continue
            flush_same()
            table.add_row(
                rank,
                str(r["records_compared"]),
                d["kind"],
                str(d["step"]),
                str(d["microbatch"]),
                f"{d['scope'] or '<root>'} ({d['phase']})",
                f"{d['op']} #{d['occurrence']}",
            )
        flush_same()
        out.print(table)
    for note in report["notes"]:
        out.print(f"note: {note}", soft_wrap=True)
