"""``samestep verify RUN [--steps A-B] [--yes | -- python train.py ARGS]``: replay a run and check every receipt
(exit 0 all reproduce, 1 the first step that does not, 2 cannot replay, or the run's program not agreed to)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from samestep.cli.errors import InputError, verdict
from samestep.cli.trust import consent_of


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="replay a run (samestep train's, or the program of a samestep.Run or HF or Lightning "
        "callback run again) and compare every receipt, bit for bit",
        description="Replays steps A-B of a run from its newest checkpoint before A (from scratch if none) in a "
        "scratch directory and compares each replayed receipt with the recorded one. Exit 0 all "
        "reproduce, 1 names the first step that does not (or a broken receipt chain), 2 cannot replay. A "
        "loop of one's own is replayed by the program its run.json records: it is shown, and runs only "
        "on your word (a yes at the prompt, --yes, or the program given after --).",
        epilog="examples:\n  samestep verify runs/a\n  samestep verify runs/a --steps 40-50 --json --yes\n"
        "  samestep verify runs/a --steps 40-50 -- python train.py runs/a",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir")
    p.add_argument("--steps", metavar="A-B", help="the steps to check (default: every receipted step)")
    p.add_argument(
        "--force",
        action="store_true",
        help="verify even if this machine's environment differs, or a program of one's own changed since its run",
    )
    p.add_argument("--keep", metavar="DIR", help="leave the replay in DIR (a new directory) instead of removing it")
    p.add_argument(
        "--yes",
        action="store_true",
        help="run the program the run directory records without asking "
        "(it is shown first); without a terminal, needed to run it",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run, subparser=p)


def steps_arg(text: str | None, parser: argparse.ArgumentParser, name: str) -> tuple[int, int] | None:
    """``A-B`` (or one step ``A``) as (A, B); exits 2 naming the option for anything else."""
    if text is None:
        return None
    first, _, second = text.partition("-")
    try:
        a, b = int(first), int(second or first)
    except ValueError:
        parser.exit(2, f"samestep {name}: error: --steps {text!r}: expected A-B, e.g. --steps 3-7\n")
    return a, b


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from samestep.replay.consent import code_line
    from samestep.replay.plan import ReplayError
    from samestep.replay.scratch import stopping
    from samestep.replay.verify import verify_run

    steps = steps_arg(args.steps, parser, "verify")
    try:
        with stopping():
            report = verify_run(
                args.run_dir,
                steps,
                force=args.force,
                keep=Path(args.keep) if args.keep else None,
                consent=consent_of(args),
                given=args.program,
            )
    except (ValueError, ReplayError, FileExistsError) as e:  # cannot replay: not a verdict
        raise InputError(str(e)) from None
    code = verdict(args, 0 if report["reproduced"] else 1)
    if args.json:
        print(json.dumps(report))
        return code
    m = report["first_mismatch"]
    for note in report["notes"]:
        print(f"note: {note}")
    broken = {k: v for k, v in report["chain"].items() if v != "holds"}
    if m is not None and m["fields"] == ["checkpoint"]:
        print(
            f"NOT THE RUN'S: the checkpoint of step {m['step']} is not the state its receipt records "
            f"({m['b']['checkpoint']}); nothing was replayed from it"
        )
    elif m is not None:
        print(
            f"NOT REPRODUCED: step {m['step']} (rank {m['rank']}): {', '.join(m['fields'])} differ "
            f"(recorded {m['a']}, replayed {m['b']})"
        )
    for name, why in broken.items():
        print(f"BROKEN: receipts/{name}: {why}")
    if report["program_differs"] and m is None:
        print(
            f"NOT THE RUN'S PROGRAM: the replay ran other code than the run records "
            f"({'; '.join(report['program_differs'][:3])}): its receipts prove nothing of the run"
        )
    if report["reproduced"]:
        by = f" by {code_line(report['by'])}" if report["by"] else ""
        print(
            f"reproduced{by}: steps {report['steps']}, replayed from "
            f"{'step ' + str(report['replayed_from']) if report['replayed_from'] else 'scratch'}, "
            f"{report['compared']} receipt(s) equal bit for bit"
        )
    elif m is None and not broken and not report["program_differs"]:
        print(f"not reproduced: no receipt compared (steps {report['steps']})")
    return code
