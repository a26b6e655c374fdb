"""The ``samestep`` command: one small module per subcommand."""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from samestep.cli import bisect, checkpoint, demo, diff, env, receipts, report, trace, train, verify
from samestep.cli.errors import (
    EXIT_PEER_LOST,
    INPUT_ERROR,
    INTERNAL_ERROR,
    INTERRUPTED,
    OK,
    input_error_of,
    peer_lost,
    quiet_stdout,
)
from samestep.cli.errors import report as report_error
from samestep.version import __version__

__all__ = ["main"]

_COMMANDS = (train, demo, diff, bisect, report, trace, checkpoint, receipts, verify, env)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="samestep",
        description="Bitwise-deterministic PyTorch pretraining: same inputs, same bits.",
        epilog="examples:\n  samestep demo\n  samestep train --run-dir runs/a --set train.steps=50\n"
        "  samestep diff runs/a runs/b\n  samestep report runs/a runs/b --out report.html\n"
        "  samestep checkpoint verify runs/a/checkpoints\n  samestep env --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"samestep {__version__}")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an unexpected error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit code: 0 ok, 1 found a difference (diverged, incomplete, corrupt), 2
    usage or input error, 3 an unexpected error (one line; ``--debug`` or ``SAMESTEP_DEBUG=1`` prints the
    traceback), 130 interrupted."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    program = argv[argv.index("--") + 1 :] if "--" in argv else None  # verify's program, given by the verifier
    args = parser.parse_args(argv[: argv.index("--")] if program is not None else argv)
    if program is not None and args.command != "verify":
        parser.error(f"-- {' '.join(program)}: only samestep verify takes a program after -- (python SCRIPT ARGS)")
    if program == []:
        parser.error("samestep verify: -- with no program after it; give one, as -- python SCRIPT ARGS")
    args.program = program
    try:
        code = int(args.run(args, args.subparser) or 0)
        sys.stdout.flush()  # a reader that left shows here, in the handler below, not as a traceback at exit
        return code
    except KeyboardInterrupt:
        return report_error(args, "interrupted", INTERRUPTED)
    except BrokenPipeError:  # the reader of stdout left (| head): nothing more to say to it, the verdict stands
        quiet_stdout()
        return getattr(args, "verdict", OK)
    except Exception as e:  # not a verdict: bad input (2) or a crash (3) must not read as "diverged" (exit 1)
        if args.debug or os.environ.get("SAMESTEP_DEBUG"):
            traceback.print_exc()
        if peer_lost(e):  # another process of the job ended: it, or the launcher, says why
            return report_error(
                args,
                f"rank {os.environ.get('RANK', '?')} stopped: another process of the job "
                "ended, and a collective lost it",
                EXIT_PEER_LOST,
            )
        if isinstance(getattr(e, "exit_code", None), int):  # a refusal, with its code (2; 7: a resume that diverged)
            return report_error(args, f"error: {e}", e.exit_code)
        line = input_error_of(e)
        if line is not None:
            return report_error(args, f"error: {line}", INPUT_ERROR)
        where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        at = f" (at {os.path.basename(where.filename)}:{where.lineno})" if where else ""
        return report_error(
            args,
            f"unexpected error: {type(e).__name__}: {e}{at}; --debug (or SAMESTEP_DEBUG=1) prints the traceback",
            INTERNAL_ERROR,
        )
