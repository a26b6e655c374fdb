"""The ``samestep`` command: one small module per subcommand."""

from __future__ import annotations

import argparse
import sys

from samestep.version import __version__
from samestep.cli import checkpoint, demo, diff, env, report, trace, train

__all__ = ["main"]

_COMMANDS = (train, demo, diff, report, trace, checkpoint, env)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="samestep", description="Bitwise-deterministic PyTorch pretraining: same inputs, same bits.",
        epilog="examples:\n  samestep demo\n  samestep train --run-dir runs/a --set train.steps=50\n"
               "  samestep diff runs/a runs/b\n  samestep report runs/a runs/b --out report.html\n  samestep checkpoint verify runs/a/checkpoints\n  samestep env --json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"samestep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit code (0 ok, 1 found a difference, 2 usage or input error)."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.run(args, args.subparser) or 0)
